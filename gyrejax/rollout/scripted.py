"""A model-free engine whose answers come from a function: drives the harness in tests.

It implements the whole `Engine` interface so that the real proxy records its calls
exactly as it records a model's; only the token generation is replaced by
`respond(prompt_ids, request) -> token ids`. Every answer token gets a fixed behaviour
log-prob and the engine's version. It is a test double for a policy, not a stand-in for
the JAX or vLLM engine's batching, migration or sampling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated

Respond = Callable[[np.ndarray, Request], Sequence[int]]


class ScriptedEngine(Engine):
    """Answers each request with `respond(prompt_ids, request)` after `delay_s` seconds.

    The answer is cut to the request's `max_new_tokens` (finish_reason "length"); it
    ends with "stop" when its last token is one of the request's stop ids.
    """

    def __init__(
        self,
        name: str,
        respond: Respond,
        *,
        capacity: int = 1024,
        version: int = 0,
        logprob: float = -1.0,
        delay_s: float = 0.0,
    ):
        self.name = name
        self._respond = respond
        self._capacity = capacity
        self._version = version
        self._logprob = logprob
        self.delay_s = delay_s
        self._pending: dict[str, tuple[asyncio.Future, asyncio.TimerHandle, LiveRequest]] = {}
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def load(self) -> int:
        return len(self._pending)

    @property
    def version(self) -> int:
        return self._version

    def request_ids(self) -> list[str]:
        return list(self._pending)

    def submit(self, request: Request) -> asyncio.Future[Completion]:
        empty = np.zeros(0, np.int32)
        return self.import_request(
            LiveRequest(request, empty, empty.astype(np.float32), empty, None, ())
        )

    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        if self._closed:
            raise EngineError(f"engine {self.name} is shut down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = live.request.request_id
        handle = loop.call_later(self.delay_s, self._complete, request_id)
        self._pending[request_id] = (future, handle, live)
        return future

    def _complete(self, request_id: str, reason: str | None = None) -> None:
        future, _, live = self._pending.pop(request_id)
        if future.done():
            return
        request = live.request
        answer = np.asarray(self._respond(request.prompt_ids, request), np.int32)
        budget = live.remaining_tokens
        if reason is None:
            truncated = len(answer) > budget
            answer = answer[:budget]
            stopped = len(answer) and int(answer[-1]) in request.sampling.stop_ids
            reason = "length" if truncated or not stopped else "stop"
        else:
            answer = answer[:0]
        future.set_result(
            Completion(
                request_id=request_id,
                output_ids=np.concatenate([live.output_ids, answer]).astype(np.int32),
                logprobs=np.concatenate(
                    [live.logprobs, np.full(len(answer), self._logprob, np.float32)]
                ),
                versions=np.concatenate(
                    [live.versions, np.full(len(answer), self._version, np.int32)]
                ),
                finish_reason=reason,
                engines=(*live.engines, self.name),
            )
        )

    async def export(self, request_id: str) -> LiveRequest:
        if request_id not in self._pending:
            raise KeyError(f"engine {self.name} holds no request {request_id!r}")
        future, handle, live = self._pending.pop(request_id)
        handle.cancel()
        future.set_exception(RequestMigrated(live))
        return live

    def cancel(self, request_id: str) -> None:
        if request_id in self._pending:
            self._pending[request_id][1].cancel()
            self._complete(request_id, "cancelled")

    async def update_weights(self, weights: Weights, version: int) -> None:
        self._version = version

    async def release_memory(self) -> None:
        if self._pending:
            raise RuntimeError(f"engine {self.name}: release_memory with requests in flight")

    async def resume(self) -> None:
        return None

    async def shutdown(self) -> None:
        self._closed = True
        for future, handle, _ in self._pending.values():
            handle.cancel()
            if not future.done():
                future.set_exception(EngineError(f"engine {self.name} shut down"))
        self._pending.clear()
