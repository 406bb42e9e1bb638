"""An OpenAI-compatible HTTP door to the proxy, so black-box harnesses can be trained.

Every request goes through `Proxy.generate(execution_id, agent_id, role, prompt_ids,
sampling)` with exactly the arguments the in-process harness would pass, so the
recorded `ModelCall`s (token-in/token-out, behaviour log-probs, versions, engines) are
the same as if the harness ran in process.

Authentication (`gyrejax.serve.http` adds the body, header and connection limits):
  * an admin key (`--api_key`, or the environment variable GYREJAX_API_KEY) is needed to
    create executions: `Authorization: Bearer <admin key>`. Without one the server
    refuses to start unless `--insecure_no_auth` is given, and then anyone reaching it
    may create executions, so it listens on loopback only;
  * each execution gets its own key (`secrets.token_urlsafe`), returned once when it is
    created and separate from its id; every call, status and finish of that execution
    needs it (`Authorization: Bearer <execution key>`, what an OpenAI client sends as
    its api_key), else 401. /v1/models takes either key; /health none.
  * at most `max_open_executions` are open at once (429 past it).
  * a call's prompt is at most `max_prompt_tokens` tokens (400 naming the field); the
    completions' body limit follows from it (`prompt_body_bytes`: 413 by its
    Content-Length, before a byte is read or parsed).

Lifecycle of an execution (explicit, so the scheduler's counters stay true and a stray
client cannot create executions nobody will collect):

  POST /v1/executions {"execution_id"?, "task_id"?, "group_id"?}   (admin key)
      -> {"execution_id", "api_key"}: counts it dispatched. 409 if the id is running or
      already stored: a stored record is never replaced through the network.
  ... the harness calls /v1/chat/completions or /v1/completions with the execution key.
      Optional headers: `X-Gyrejax-Agent` (default "main"), `X-Gyrejax-Role` (default
      "main"; a registered role such as "sub_agent"), `X-Gyrejax-Execution` (if sent, it
      must name the key's execution: a cross-check, never an identification).
  POST /v1/executions/{id}/finish {"status"?, "reward"?, "eval_attempts"?}
      -> the `Execution` record as JSON (calls with token ids); requests still in
      flight are cancelled first, and the record is put in the `ExecutionStore` if the
      server has one, never over a stored record: if one appeared meanwhile, the answer
      is a 409 carrying this record under "execution" (nothing is lost or replaced).
      If the store cannot write it (a full disk), the answer is a 507 carrying it, and
      the execution stays open with that record: the same finish, sent again, retries
      the write. Once stored, the key is void (401). An execution the run opened for its own
      agent (`open_execution(owned=True)`, `rl.agent = command`) is the run's: its
      finish only ends the agent's requests and answers {"ended": true}; the run
      scores and stores the record, whatever status or reward the agent sent.
  GET /v1/executions/{id} -> {"execution_id", "calls", "in_flight"}.

Chat prompts come from a `ChatTemplate` (the byte layout by default). Assistant turns
the policy generated are spliced back in as its exact output ids, found by tool-call
id or canonical form (`generated.GeneratedTurns`), so a harness that re-serialises
them does not fork the trajectory tree.

Sampling fields: temperature, top_p, top_k (extension), max_tokens or
max_completion_tokens, seed (default: crc32("<execution id>/<request index>"), so
retries of the same prompt sample afresh yet a rerun is reproducible), stop (strings
that are one token each), stop_token_ids (extension), logprobs (the sampled token's
behaviour log-prob only), stream (the whole answer in one chunk, then [DONE]).
Unsupported values (n > 1, penalties, logit_bias, top_logprobs > 0, batched prompts)
are refused with a 400 naming the field rather than silently ignored, because
sampling that differs from what was asked would corrupt the training data's meaning.
Extension `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to a choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import time
import uuid
import zlib
from typing import Any

from absl import app, flags, logging
from aiohttp import web

from gyrejax.rollout.proxy import NoEngineError, Proxy
from gyrejax.rollout.types import EngineError, SamplingParams
from gyrejax.serve import wire
from gyrejax.serve.chat import (
    ByteChatTemplate,
    ChatTemplate,
    ToolCall,
    parse_messages,
    parse_tools,
    split_tool_calls,
)
from gyrejax.serve.generated import GeneratedTurns
from gyrejax.serve.http import (
    API_KEY_ENV,
    ENGINE_TOKEN_ENV,
    HttpError,
    Limits,
    Site,
    bearer_token,
    check_secret,
    define_limit_flags,
    limits_from_flags,
    no_auth,
    same_token,
    secret_from_flags,
)
from gyrejax.serve.wire import FieldError, as_float, as_int, get
from gyrejax.trajectory import STATUSES, Execution, ExecutionStore, role_priority

EXECUTION_HEADER = "X-Gyrejax-Execution"
AGENT_HEADER = "X-Gyrejax-Agent"
ROLE_HEADER = "X-Gyrejax-Role"


DEFAULT_MAX_PROMPT_TOKENS = 1 << 20  # a million-token context, the longest we train


def prompt_body_bytes(max_prompt_tokens: int) -> int:
    """The body limit of a completions request whose prompt may be `max_prompt_tokens`
    long: 16 bytes a token (a token id with its JSON separator is at most 8; text a
    token at most a few bytes, escaped at most 6 times) plus 1 MiB for the rest (tool
    schemas, sampling fields)."""
    return 16 * max_prompt_tokens + (1 << 20)


class StoredMeanwhile(FileExistsError):
    """A record with this execution's id was stored while it ran: the stored one is
    kept; `execution` is this one, not stored."""

    def __init__(self, execution: Execution):
        super().__init__(f"execution {execution.execution_id!r} was stored meanwhile")
        self.execution = execution


class NotStored(OSError):
    """The store could not write a finished execution's record (`execution`, kept: the
    execution stays open and a finish tries again)."""

    def __init__(self, execution: Execution, error: OSError):
        super().__init__(error.errno, f"execution {execution.execution_id!r} not stored: {error}")
        self.execution = execution


@dataclasses.dataclass
class _Execution:
    """Server-side state of one execution."""

    execution_id: str
    key: str  # the execution's own secret (never logged)
    task_id: str
    group_id: str
    turns: GeneratedTurns = dataclasses.field(default_factory=GeneratedTurns)
    requests: int = 0  # requests made (seeds the default sampling seed)
    in_flight: int = 0
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    owned: bool = False  # the run's own (open_execution(owned=True)): the run closes it
    ended: bool = False  # finished: a request authenticated before is refused, not served
    record: Execution | None = None  # made at the first finish; kept until stored
    closing: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    socket: asyncio.AbstractServer | None = None  # its own door (serve_execution_socket)


# The owner of a socket whose execution has closed: no key is its execution's.
_CLOSED_SOCKET = object()


def _digest(key: str) -> bytes:
    """Where a key is looked up: its hash, so the dict lookup's timing says nothing
    about the key itself; the key is then compared in constant time."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class OpenAIServer(Site):
    """Serves the OpenAI API in front of a proxy (see module docstring).

    Args:
      proxy: records and routes every call.
      template: prompt layout and tokenizer; `ByteChatTemplate()` by default.
      api_key: the admin key that creates executions (None only with `insecure_no_auth`).
      store: where finished executions are persisted (None: only returned).
      model_name: the model id reported by /v1/models and in answers.
      default_max_tokens: max_tokens when a request gives none.
      finish_timeout_s: how long finish waits for cancelled requests to end.
      max_open_executions: executions open at once (429 past it).
      max_prompt_tokens: the longest prompt one call may have, in tokens (400 past it,
        naming the field). The completions' body limit follows from it
        (`prompt_body_bytes`), so an oversized request is refused before it is read,
        never parsed or tokenized on the event loop.
      limits: connection, header and body limits.
      insecure_no_auth: anyone may create executions (loopback only); execution keys
        are still required for everything else.

    Raises:
      ValueError: no admin key (and not `insecure_no_auth`), or one too short.
    """

    def __init__(
        self,
        proxy: Proxy,
        template: ChatTemplate | None = None,
        *,
        api_key: str | None,
        store: ExecutionStore | None = None,
        model_name: str = "gyrejax",
        default_max_tokens: int = 256,
        finish_timeout_s: float = 30.0,
        max_open_executions: int = 256,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        limits: Limits | None = None,
        insecure_no_auth: bool = False,
    ):
        # start() returns the base URL; <url>/v1 is the OpenAI base_url.
        super().__init__(limits, insecure_no_auth=insecure_no_auth)
        if api_key is None and not insecure_no_auth:
            raise ValueError(
                f"no admin key: give --api_key or set {API_KEY_ENV} (or insecure_no_auth, "
                "on loopback only)"
            )
        if max_open_executions < 1:
            raise ValueError(f"max_open_executions={max_open_executions}: expected >= 1")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: expected >= 1")
        self.max_prompt_tokens = max_prompt_tokens
        self._api_key = None if api_key is None else check_secret(api_key, "admin key")
        self.proxy = proxy
        self.template = template if template is not None else ByteChatTemplate()
        self.store = store
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.finish_timeout_s = finish_timeout_s
        self.max_open_executions = max_open_executions
        self._executions: dict[str, _Execution] = {}  # by id
        self._by_key: dict[bytes, _Execution] = {}  # by _digest(key)
        self._by_socket: dict[str, _Execution] = {}  # an execution's own door, by path
        control = self.limits.control_body_bytes
        data = min(self.limits.data_body_bytes, prompt_body_bytes(max_prompt_tokens))
        routes = [
            ("GET", "/health", self._health, no_auth, None),
            ("GET", "/v1/models", self._models, self._any_key, None),
            ("POST", "/v1/executions", self._start_execution, self._admin, control),
            ("GET", "/v1/executions/{execution_id}", self._execution_status, self._owner, None),
            (
                "POST",
                "/v1/executions/{execution_id}/finish",
                self._finish_execution,
                self._owner,
                control,
            ),
            ("POST", "/v1/chat/completions", self._chat, self._caller, data),
            ("POST", "/v1/completions", self._completions, self._caller, data),
        ]
        for method, path, handler, auth, max_body_bytes in routes:
            self.add_endpoint(method, path, handler, auth=auth, max_body_bytes=max_body_bytes)

    # --- authentication (headers only: runs before the body is read) ----------------------

    def _socket_owner(self, request: web.Request) -> _Execution | object | None:
        """The execution whose own socket the request came through (None: the TCP door).
        A socket's owner may be closed already: its socket then serves nobody."""
        transport = request.transport
        path = None if transport is None else transport.get_extra_info("sockname")
        if not (isinstance(path, str) and path):
            return None
        return self._by_socket.get(path, _CLOSED_SOCKET)

    def _admin(self, request: web.Request) -> None:
        if self._socket_owner(request) is not None:
            raise HttpError(
                401,
                "Authorization: an execution's own socket serves that execution only",
                "authentication_error",
                "Authorization",
            )
        if self._api_key is None:  # insecure_no_auth, on loopback
            return
        if not same_token(bearer_token(request), self._api_key):
            raise HttpError(
                401,
                "Authorization: creating executions needs the admin key: send "
                f"'Authorization: Bearer <admin key>' (the server's --api_key or {API_KEY_ENV})",
                "authentication_error",
                "Authorization",
            )

    def _execution_of(self, request: web.Request) -> _Execution:
        """The open execution whose key the request carries (401 otherwise)."""
        key = bearer_token(request)
        state = None if key is None else self._by_key.get(_digest(key))
        if state is None or not same_token(key, state.key):
            what = "no execution key" if key is None else "unknown or finished execution key"
            raise HttpError(
                401,
                f"Authorization: {what}; send 'Authorization: Bearer <execution key>' "
                "(the api_key POST /v1/executions returned)",
                "authentication_error",
                "Authorization",
            )
        owner = self._socket_owner(request)
        if owner is not None and owner is not state:  # a key stolen from another execution
            raise HttpError(
                401,
                "Authorization: this socket serves its own execution only, and the key "
                "sent is another's",
                "authentication_error",
                "Authorization",
            )
        return state

    def _caller(self, request: web.Request) -> tuple[_Execution, str, str]:
        """(execution, agent id, role) of a completions call."""
        state = self._execution_of(request)
        named = request.headers.get(EXECUTION_HEADER)
        if named is not None and named != state.execution_id:
            raise FieldError(
                EXECUTION_HEADER,
                f"{named!r} is not the execution of the key sent (an execution key "
                "identifies its execution; drop the header or send the matching key)",
            )
        agent_id = request.headers.get(AGENT_HEADER, "main")
        role = request.headers.get(ROLE_HEADER, "main")
        try:
            role_priority(role)
        except ValueError as e:
            raise FieldError(ROLE_HEADER, str(e)) from None
        return state, agent_id, role

    def _owner(self, request: web.Request) -> _Execution:
        """The execution named in the path, if the key is its own (401 otherwise)."""
        state = self._execution_of(request)
        if request.match_info["execution_id"] != state.execution_id:
            raise HttpError(
                401,
                f"Authorization: the key sent is not execution "
                f"{request.match_info['execution_id']!r}'s",
                "authentication_error",
                "Authorization",
            )
        return state

    def _any_key(self, request: web.Request) -> None:
        key = bearer_token(request)
        if self._socket_owner(request) is None and (
            self._api_key is None or same_token(key, self._api_key)
        ):
            return
        self._execution_of(request)

    # --- executions in process (the RL loop's external agents; the handlers too) -------------

    def open_execution(
        self, execution_id: str, task_id: str = "", group_id: str = "", owned: bool = False
    ) -> str:
        """Opens an execution and returns its key (counted dispatched in the proxy).

        `owned`: the caller (the run) closes it with `close_execution`. Its agent's
        finish over HTTP then only ends its requests (the key is void from then on); its
        record, status and reward stay the caller's, whatever the agent sends.

        Raises:
          HttpError: 409 if the id is open or already stored; 429 past
            `max_open_executions`.
        """
        group_id = group_id or execution_id
        if execution_id in self._executions:
            raise HttpError(
                409,
                f"execution_id: {execution_id!r} is already running",
                "conflict",
                "execution_id",
            )
        if self.store is not None and execution_id in self.store:
            # Finishing it would have to replace the stored record: refuse now, not then.
            raise HttpError(
                409,
                f"execution_id: {execution_id!r} is already stored; pick a new id",
                "conflict",
                "execution_id",
            )
        if len(self._executions) >= self.max_open_executions:
            raise HttpError(
                429,
                f"{len(self._executions)} executions are open, the server's limit "
                "(--max_open_executions); finish some first",
                "rate_limit_error",
            )
        key = secrets.token_urlsafe(32)
        state = _Execution(execution_id, key, task_id=task_id, group_id=group_id, owned=owned)
        state.idle.set()
        self._executions[execution_id] = state
        self._by_key[_digest(key)] = state
        self.proxy.dispatch(execution_id)
        return key

    async def serve_execution_socket(self, execution_id: str, path: str | os.PathLike) -> None:
        """Serves the open execution `execution_id` alone on a new unix socket at `path`
        (a sandboxed agent's only way out: harness/agent_sandbox.py). Requests through it
        must carry that execution's key: another's, even if stolen, or the admin key is
        refused. The socket closes, and its file goes, with the execution.

        Raises:
          KeyError: no open execution has this id.
        """
        state = self._executions[execution_id]
        if state.socket is not None:
            raise ValueError(f"execution {execution_id!r} already has its socket")
        path = os.fspath(path)
        state.socket = await self.serve_unix(path)
        self._by_socket[path] = state

    async def close_execution(
        self,
        execution_id: str,
        status: str = "finished",
        reward: float | None = None,
        eval_attempts: int = 0,
        error: str = "",
    ) -> Execution:
        """Ends an open execution: cancels its requests in flight, stores its record (if
        the server has a store; never over a stored one), then voids its key and
        returns the record.

        A store write that fails (a full disk) keeps the execution open with its record
        as first made: its key stays valid for another finish, which tries the write
        again (model calls stay refused). So nothing is lost and the client is told.

        Raises:
          KeyError: no open execution has this id.
          StoredMeanwhile: a record with this id was stored meanwhile (kept; this one
            is not stored, it is on the error).
          NotStored: the store write failed (the record is on the error, and kept).
        """
        state = self._executions[execution_id]
        async with state.closing:  # one finish at a time; a retry reuses the record
            if self._executions.get(execution_id) is not state:
                raise KeyError(execution_id)  # finished by the finish we waited for
            if state.record is None:
                state.ended = True  # no new model calls; the key still finishes
                self.proxy.cancel_execution(execution_id)
                try:
                    await asyncio.wait_for(state.idle.wait(), self.finish_timeout_s)
                except TimeoutError:
                    logging.warning(
                        "execution %s: %d requests still in flight at finish",
                        execution_id,
                        state.in_flight,
                    )
                state.record = Execution(
                    execution_id=execution_id,
                    task_id=state.task_id,
                    group_id=state.group_id,
                    calls=self.proxy.finish(execution_id),
                    status=status,
                    reward=reward,
                    eval_attempts=eval_attempts,
                    error=error,
                )
            execution = state.record
            if self.store is not None:  # durable before we answer: a crash loses nothing
                try:  # never over a stored record (put refuses atomically)
                    await asyncio.to_thread(self.store.put, execution)
                except FileExistsError:
                    self._forget(state)
                    raise StoredMeanwhile(execution) from None
                except OSError as e:
                    logging.error("execution %s: not stored (%s); kept open", execution_id, e)
                    raise NotStored(execution, e) from e
            self._forget(state)
            return execution

    def _forget(self, state: _Execution) -> None:
        """The execution is closed (its calls already ended): out of the open ones, its
        key void."""
        self._executions.pop(state.execution_id, None)
        self._by_key.pop(_digest(state.key), None)
        if state.socket is not None:
            for path, owner in list(self._by_socket.items()):
                if owner is state:
                    del self._by_socket[path]
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            state.socket.close()
            state.socket = None

    def _end_requests(self, state: _Execution) -> None:
        """Voids the execution's key (no new requests) and cancels those in flight."""
        state.ended = True
        self._by_key.pop(_digest(state.key), None)
        self.proxy.cancel_execution(state.execution_id)

    # --- executions over HTTP -------------------------------------------------------------

    async def _health(self, *_) -> web.Response:
        return web.json_response({"ok": True})

    async def _models(self, *_) -> web.Response:
        model = {"id": self.model_name, "object": "model", "owned_by": "gyrejax", "created": 0}
        return web.json_response({"object": "list", "data": [model]})

    async def _start_execution(self, _, body: dict, __) -> web.Response:
        execution_id = wire.as_str(
            get(body, "execution_id", default=f"x-{uuid.uuid4().hex[:16]}"), "execution_id"
        )
        if not execution_id:
            raise FieldError("execution_id", "empty")
        task_id = wire.as_str(get(body, "task_id", default=""), "task_id")
        group_id = wire.as_str(get(body, "group_id", default=execution_id), "group_id")
        key = self.open_execution(execution_id, task_id, group_id)
        return web.json_response({"execution_id": execution_id, "api_key": key})

    async def _execution_status(self, _, __, state: _Execution) -> web.Response:
        return web.json_response(
            {
                "execution_id": state.execution_id,
                "calls": len(self.proxy.calls(state.execution_id)),
                "in_flight": state.in_flight,
            }
        )

    async def _finish_execution(self, _, body: dict, state: _Execution) -> web.Response:
        status = wire.as_str(get(body, "status", default="finished"), "status")
        if status not in STATUSES:
            raise FieldError("status", f"{status!r} is not one of {STATUSES}")
        reward = get(body, "reward", default=None)
        reward = None if reward is None else as_float(reward, "reward")
        attempts = as_int(get(body, "eval_attempts", default=0), "eval_attempts", lo=0, hi=2**31)
        if self._executions.get(state.execution_id) is not state:  # finished meanwhile
            raise _finished_key()
        if state.owned:  # the run's execution: the agent ends its turn, the run keeps the rest
            self._end_requests(state)
            return web.json_response(
                {"execution_id": state.execution_id, "ended": True, "scored_by": "the run"}
            )
        try:
            execution = await self.close_execution(state.execution_id, status, reward, attempts)
        except KeyError:  # another finish of it ended it while this one waited
            raise _finished_key() from None
        except NotStored as e:
            raise HttpError(
                507,
                f"the record of execution {state.execution_id!r} could not be stored "
                f"({e.strerror or e}); it is kept and the execution stays open: send "
                "finish again (same key) once the store has room",
                "server_error",
                extra={"execution": wire.execution_to_json(e.execution)},
            ) from None
        except StoredMeanwhile as e:
            logging.error(
                "execution %s: a record with this id was stored while it ran; the "
                "stored one is kept, this one is returned to the client only",
                state.execution_id,
            )
            raise HttpError(
                409,
                f"execution_id: {state.execution_id!r} was stored by another writer "
                "while it ran; the stored record is kept and this one is NOT stored "
                "(it is in this answer under 'execution')",
                "conflict",
                "execution_id",
                extra={"execution": wire.execution_to_json(e.execution)},
            ) from None
        record = wire.execution_to_json(execution)
        return web.json_response(record)

    # --- completions ----------------------------------------------------------------------

    async def _chat(self, request: web.Request, body: dict, caller) -> web.StreamResponse:
        state, agent_id, role = caller
        messages = parse_messages(get(body, "messages"))
        tools = parse_tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise FieldError("tool_choice", f"{choice!r}; only 'auto' or 'none' are supported")
        want_logprobs = bool(body.get("logprobs") or False)
        sampling = self._sampling(body, state)
        generated = [state.turns.lookup(m) for m in messages]
        prompt = self._within_limit(self.template.render(messages, tools, generated), "messages")
        completion = await self._generate(state, agent_id, role, prompt, sampling)

        text = self.template.decode(completion.output_ids)
        parse = tools and choice != "none"
        content, found = split_tool_calls(text) if parse else (text, [])
        calls = [ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, args) for name, args in found]
        state.turns.remember(completion.output_ids, content, calls)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        elif content == "":
            message["content"] = ""
        choice_out: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": _finish_reason(completion.finish_reason, bool(calls)),
            "logprobs": {"content": self._token_logprobs(completion)} if want_logprobs else None,
        }
        if body.get("return_token_ids"):
            choice_out["prompt_token_ids"] = list(prompt)
            choice_out["token_ids"] = completion.output_ids.tolist()
        answer = self._envelope("chatcmpl", "chat.completion", choice_out, prompt, completion)
        if body.get("stream"):
            delta = {k: v for k, v in message.items() if v is not None}
            if calls:
                delta["tool_calls"] = [
                    {"index": i, **c} for i, c in enumerate(message["tool_calls"])
                ]
            return await self._stream(
                request, answer, "chat.completion.chunk", {"delta": delta}, {"delta": {}}
            )
        return web.json_response(answer)

    async def _completions(self, request: web.Request, body: dict, caller) -> web.StreamResponse:
        state, agent_id, role = caller
        prompt = self._prompt_ids(get(body, "prompt"))
        logprobs = get(body, "logprobs", default=None)
        if logprobs is not None:
            as_int(logprobs, "logprobs", lo=0, hi=2)
        sampling = self._sampling(body, state, stop_base=())
        completion = await self._generate(state, agent_id, role, prompt, sampling)
        text = self.template.decode(completion.output_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "finish_reason": _finish_reason(completion.finish_reason, False),
            "logprobs": None,
        }
        if logprobs is not None:
            tokens = [self.template.decode([t]) for t in completion.output_ids.tolist()]
            offsets = [0]
            for t in tokens[:-1]:
                offsets.append(offsets[-1] + len(t))
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": completion.logprobs.tolist(),
                "top_logprobs": None,
                "text_offset": offsets[: len(tokens)],
            }
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = list(prompt)
            choice["token_ids"] = completion.output_ids.tolist()
        answer = self._envelope("cmpl", "text_completion", choice, prompt, completion)
        if body.get("stream"):
            return await self._stream(
                request, answer, "text_completion", {"text": text}, {"text": ""}
            )
        return web.json_response(answer)

    def _prompt_ids(self, value: Any) -> list[int]:
        """A completions prompt: text, token ids, or a batch of exactly one of those."""
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise FieldError(
                    "prompt",
                    f"a batch of {len(value)} prompts; send one per "
                    "request (each is one recorded call)",
                )
            value = value[0]
        if isinstance(value, str):
            ids = self.template.encode(value)
        else:
            ids = wire.token_ids(value, "prompt", self.template.vocab_size).tolist()
        if not ids:
            raise FieldError("prompt", "empty; expected at least one token")
        return self._within_limit(ids, "prompt")

    def _within_limit(self, ids: list[int], field: str) -> list[int]:
        """`ids` if at most `max_prompt_tokens` long (FieldError naming `field` if not)."""
        if len(ids) > self.max_prompt_tokens:
            raise FieldError(
                field,
                f"the prompt is {len(ids)} tokens; this server takes at most "
                f"{self.max_prompt_tokens} per call (--max_prompt_tokens)",
            )
        return ids

    def _sampling(
        self, body: dict, state: _Execution, stop_base: tuple[int, ...] | None = None
    ) -> SamplingParams:
        """SamplingParams from the OpenAI fields; refuses what the engines cannot honour."""
        if as_int(get(body, "n", default=1), "n", lo=1) != 1:
            raise FieldError("n", f"{body['n']}; only n=1 (each choice is a recorded call)")
        for name in ("presence_penalty", "frequency_penalty"):
            if as_float(get(body, name, default=0.0), name) != 0.0:
                raise FieldError(name, f"{body[name]}; penalties are not supported (use 0)")
        if get(body, "logit_bias", default={}):
            raise FieldError("logit_bias", "not supported")
        if as_int(get(body, "top_logprobs", default=0), "top_logprobs", lo=0) != 0:
            raise FieldError(
                "top_logprobs",
                f"{body['top_logprobs']}; only the sampled token's log-prob is available (use 0)",
            )
        temperature = as_float(get(body, "temperature", default=1.0), "temperature")
        if temperature < 0:
            raise FieldError("temperature", f"{temperature} is negative; expected >= 0")
        top_p = as_float(get(body, "top_p", default=1.0), "top_p")
        if not 0 < top_p <= 1:
            raise FieldError("top_p", f"{top_p} is not in (0, 1]")
        top_k = as_int(get(body, "top_k", default=0), "top_k", lo=-1, hi=2**31)
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = as_int(get(body, key, default=self.default_max_tokens), key, lo=1, hi=2**31)
        default_seed = zlib.crc32(f"{state.execution_id}/{state.requests}".encode()) % 2**31
        seed = as_int(get(body, "seed", default=default_seed), "seed", lo=0, hi=2**31)
        stops = list(self.template.stop_ids if stop_base is None else stop_base)
        raw_stop = get(body, "stop", default=[])
        for i, text in enumerate(
            [raw_stop] if isinstance(raw_stop, str) else wire.as_list(raw_stop, "stop")
        ):
            ids = self.template.encode(wire.as_str(text, f"stop[{i}]"))
            if len(ids) != 1:
                raise FieldError(
                    f"stop[{i}]",
                    f"{text!r} is {len(ids)} tokens; engines stop on "
                    "single tokens (or use stop_token_ids)",
                )
            stops += ids
        extra = wire.token_ids(
            get(body, "stop_token_ids", default=[]), "stop_token_ids", self.template.vocab_size
        )
        stops += [t for t in extra.tolist() if t not in stops]
        state.requests += 1  # only valid requests advance the default seed
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            max_new_tokens=max_tokens,
            stop_ids=tuple(dict.fromkeys(stops)),
            seed=seed,
        )

    async def _generate(self, state: _Execution, agent_id: str, role: str, prompt, sampling):
        """One recorded call; engine trouble is a 503 (the proxy already retried)."""
        if state.ended:  # authenticated before its execution finished, its body read after
            raise HttpError(
                401,
                "Authorization: the execution finished (or is finishing) while this "
                "request was read; it is not served",
                "authentication_error",
                "Authorization",
            )
        state.in_flight += 1
        state.idle.clear()
        try:
            return await self.proxy.generate(state.execution_id, agent_id, role, prompt, sampling)
        except (EngineError, NoEngineError) as e:
            raise HttpError(503, f"no engine could serve the request: {e}", "server_error") from e
        except ValueError as e:  # an engine refused the prompt (too long, bad token)
            raise HttpError(400, f"prompt: {e}", "invalid_request_error", "prompt") from None
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.idle.set()

    def _token_logprobs(self, completion) -> list[dict]:
        out = []
        for token, logprob in zip(
            completion.output_ids.tolist(), completion.logprobs.tolist(), strict=True
        ):
            text = self.template.decode([token])
            out.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [],
                }
            )
        return out

    def _envelope(self, prefix: str, kind: str, choice: dict, prompt, completion) -> dict:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion.output_ids),
                "total_tokens": len(prompt) + len(completion.output_ids),
            },
        }

    async def _stream(
        self, request: web.Request, answer: dict, kind: str, first: dict, last: dict
    ) -> web.StreamResponse:
        """Server-sent events: the whole answer in one chunk, the finish reason in a
        second, then [DONE] (generation is not incremental behind the proxy)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        choice = answer["choices"][0]
        base = {k: answer[k] for k in ("id", "created", "model")} | {"object": kind}
        chunks = [
            {
                **base,
                "choices": [
                    {"index": 0, **first, "finish_reason": None, "logprobs": choice.get("logprobs")}
                ],
            },
            {
                **base,
                "choices": [{"index": 0, **last, "finish_reason": choice["finish_reason"]}],
                "usage": answer["usage"],
            },
        ]
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _finished_key() -> HttpError:
    return HttpError(
        401,
        "Authorization: execution key of a finished execution",
        "authentication_error",
        "Authorization",
    )


def _finish_reason(reason: str, tool_calls: bool) -> str:
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return reason  # stop | length | cancelled (the execution was finished meanwhile)


# --- command line -------------------------------------------------------------------------

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of the command line (only when run as a program)."""
    flags.DEFINE_multi_string(
        "engine_url",
        [],
        f"An EngineServer URL (repeat for several); its token comes from ${ENGINE_TOKEN_ENV}.",
    )
    flags.DEFINE_multi_string(
        "vllm_url", [], "A vLLM server URL (repeat for several; see serve/vllm_server_engine.py)."
    )
    flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on.")
    flags.DEFINE_integer("port", 8000, "Port (0 picks a free one; the banner says which).")
    flags.DEFINE_string("executions_dir", None, "ExecutionStore directory for records.")
    flags.DEFINE_string("hf_tokenizer", None, "HF tokenizer directory (default: bytes).")
    flags.DEFINE_integer("default_max_tokens", 256, "max_tokens when a request gives none.")
    flags.DEFINE_string(
        "api_key",
        None,
        f"Admin key that creates executions (default: ${API_KEY_ENV}; prefer the "
        "environment: flags are visible in ps).",
    )
    flags.DEFINE_bool(
        "insecure_no_auth",
        False,
        "Anyone may create executions (no admin key; loopback --host only). Execution "
        "keys are still required.",
    )
    flags.DEFINE_integer("max_open_executions", 256, "Executions open at once (429 past it).")
    flags.DEFINE_integer(
        "max_prompt_tokens",
        DEFAULT_MAX_PROMPT_TOKENS,
        "Longest prompt of one call, in tokens (400 past it; the body limit follows).",
    )
    define_limit_flags()


def api_key_from_flags() -> str | None:
    """--api_key, else $GYREJAX_API_KEY, else None with --insecure_no_auth on loopback
    (app.UsageError otherwise, before any engine is contacted)."""
    try:
        return secret_from_flags(
            FLAGS.api_key, API_KEY_ENV, "--api_key", "admin key", FLAGS.host, FLAGS.insecure_no_auth
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None


async def serve_forever(api_key: str | None) -> None:
    """`python -m gyrejax.serve.openai_server --engine_url=http://host:8100 ...`."""
    from gyrejax.serve.http_engine import HttpEngine
    from gyrejax.serve.vllm_server_engine import VllmServerEngine

    if not FLAGS.engine_url and not FLAGS.vllm_url:
        raise app.UsageError("give at least one --engine_url or --vllm_url")
    template = None
    if FLAGS.hf_tokenizer:
        from transformers import AutoTokenizer

        from gyrejax.serve.chat import HfChatTemplate

        template = HfChatTemplate(AutoTokenizer.from_pretrained(FLAGS.hf_tokenizer))
    engines = [await HttpEngine.connect(url) for url in FLAGS.engine_url]
    for i, url in enumerate(FLAGS.vllm_url):
        engines.append(await VllmServerEngine.connect(url, name=f"vllm{i}"))
    store = ExecutionStore(FLAGS.executions_dir) if FLAGS.executions_dir else None
    server = OpenAIServer(
        Proxy(engines),
        template,
        api_key=api_key,
        store=store,
        default_max_tokens=FLAGS.default_max_tokens,
        max_open_executions=FLAGS.max_open_executions,
        max_prompt_tokens=FLAGS.max_prompt_tokens,
        limits=limits_from_flags(),
        insecure_no_auth=api_key is None,
    )
    url = await server.start(FLAGS.host, FLAGS.port)
    print(f"serving the OpenAI API at {url}/v1 over {len(engines)} engines", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
        for engine in engines:
            await engine.shutdown()


def main(argv) -> None:
    del argv
    asyncio.run(serve_forever(api_key_from_flags()))


if __name__ == "__main__":
    define_flags()
    app.run(main)
