"""`HttpEngine`: an `Engine` on another host, reached through its `EngineServer` by URL.

The proxy cannot tell it from a local engine: requests resolve as `Completion`s, an
export makes the awaiting future raise `RequestMigrated(live)` (prompt + tokens so far
+ sampling state; the KV cache stays on the remote host, so `exports_kv` is False and a
destination re-computes it), and anything that goes wrong with the host (refused or
reset connection, a 5xx, an unreadable answer) raises `EngineError`, which makes the
proxy retry the request on another engine. A 4xx is the caller's mistake and raises
`ValueError` (`KeyError` for an export of a request the host no longer holds, as local
engines do).

Hang detection: while it holds requests, the client polls the server's status every
`poll_interval_s`; `heartbeat` is the remote engine's own heartbeat as of the last
answer, so the proxy's watchdog declares a frozen host (or a frozen engine behind a
live server) failed after its `hang_timeout_s`, exactly as for a local engine.

`load`, `version` and `capacity` are properties in the interface, so they cannot wait
for the network: `load` counts the requests this client holds there, `version` and
`capacity` are the values the server last reported (each status poll refreshes them).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
from absl import logging

from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated
from gyrejax.serve import wire
from gyrejax.serve.http import ENGINE_TOKEN_ENV
from gyrejax.serve.wire import ENGINE_PREFIX as PREFIX

_NETWORK_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class HttpEngine(Engine):
    """Client of one `EngineServer` (see module docstring).

    Build it with `await HttpEngine.connect(url)`, which asks the server for its name,
    capacity and version.

    Args:
      url: the server's base URL, e.g. "http://10.0.0.7:8100".
      name: the engine name the proxy knows it by; records name the remote engine as
        the server reports it, so use the remote name (the `connect` default).
      capacity: requests the remote engine runs concurrently.
      version: policy version it samples with.
      token: the server's shared token, sent as `Authorization: Bearer` on every
        request; None reads the environment variable GYREJAX_ENGINE_TOKEN (a server
        without a token, `--insecure_no_auth`, needs none).
      poll_interval_s: status poll period while requests are held (the heartbeat).
      connect_timeout_s: time to open a connection before the host counts as down.
      status_timeout_s: time for a status/control answer before it counts as failed.
      reload_timeout_s: time for a weight update or resume (a host loading an export
        of a large model from shared storage) before the engine counts as failed.
    """

    exports_kv = False
    weights_by_path = True  # arrays do not travel over HTTP: the host reads an HF export
    # A pooled connection idle this long is closed by us, never reused: it must be shorter
    # than the server's own keep-alive, or a request sent on a connection the server is
    # closing at that moment fails with ServerDisconnectedError (and the engine with it).
    # `EngineServer` keeps connections 75 s (`http.Limits.keepalive_timeout_s`).
    client_keepalive_s = 15.0

    def __init__(
        self,
        url: str,
        *,
        name: str,
        capacity: int,
        version: int = 0,
        token: str | None = None,
        poll_interval_s: float = 1.0,
        connect_timeout_s: float = 10.0,
        status_timeout_s: float = 30.0,
        reload_timeout_s: float = 600.0,
    ):
        self.url = url.rstrip("/")
        self.name = name
        self._capacity = capacity
        self._version = version
        # Never logged or put in an error message.
        self._token = token if token is not None else os.environ.get(ENGINE_TOKEN_ENV) or None
        self.poll_interval_s = poll_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.status_timeout_s = status_timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.heartbeat = time.monotonic()
        self._held: dict[str, tuple[asyncio.Future, asyncio.Task]] = {}
        self._background: set[asyncio.Task] = set()  # fire-and-forget cancels
        self._poller: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @classmethod
    async def connect(cls, url: str, *, name: str | None = None, **kwargs) -> HttpEngine:
        """Asks the server at `url` for its name, capacity and version (`kwargs`: the
        constructor's, e.g. `token`).

        Raises:
          EngineError: the server cannot be reached or does not answer as an engine.
          ValueError: the server refused the request (a 4xx: e.g. a missing or wrong
            token is a 401).
        """
        engine = cls(url, name=name or "?", capacity=1, **kwargs)
        status = await engine.status()
        engine.name = name or status["name"]
        return engine

    # --- interface ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def load(self) -> int:
        return len(self._held)

    @property
    def version(self) -> int:
        return self._version

    def request_ids(self) -> list[str]:
        return list(self._held)

    def submit(self, request: Request) -> asyncio.Future[Completion]:
        return self._start(request.request_id, "submit", {"request": wire.request_to_json(request)})

    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        """Re-submits prompt + tokens so far on the remote engine (no KV cache)."""
        payload = {"live": wire.live_to_json(live)}
        return self._start(live.request.request_id, "import", payload)

    async def export(self, request_id: str) -> LiveRequest:
        """Takes the request out of the remote engine (`kv=None`).

        Raises:
          KeyError: the remote engine no longer holds it (it finished meanwhile).
        """
        body = await self._control("export", {"request_id": request_id})
        return wire.live_from_json(body)

    def cancel(self, request_id: str) -> None:
        """Asks the remote engine to end the request; its future then resolves with
        finish_reason "cancelled", as a local engine's does."""
        if self._closed or request_id not in self._held:
            return
        self._in_background(self._cancel(request_id))

    def _in_background(self, coroutine) -> None:
        """Runs `coroutine` without waiting for it (shutdown cancels what is left)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def update_weights(self, weights: Weights, version: int) -> None:
        """Loads weights from an HF checkpoint directory, by path.

        Args:
          weights: a directory the *server's* host can read (shared storage); arrays do
            not travel over HTTP.
          version: the policy version of those weights.

        Raises:
          TypeError: `weights` is not a path.
          ValueError: the server refused the path (not a directory, bad checkpoint).
          EngineError: the host failed.
        """
        if not isinstance(weights, str | os.PathLike):
            raise TypeError(
                f"engine {self.name}: update_weights over HTTP takes an HF checkpoint "
                f"directory path, got {type(weights).__name__}"
            )
        body = await self._control(
            "update_weights",
            {"path": os.fspath(weights), "version": int(version)},
            timeout_s=self.reload_timeout_s,
        )
        self._version = int(body.get("version", version))

    async def release_memory(self) -> None:
        await self._control("release_memory", {})

    async def resume(self) -> None:
        await self._control("resume", {}, timeout_s=self.reload_timeout_s)

    async def status(self) -> dict[str, Any]:
        """The server's status (name, capacity, load, version, ...); refreshes the cache.

        Raises:
          EngineError: no answer within `status_timeout_s`.
        """
        body = await self._request("GET", "status", None, timeout_s=self.status_timeout_s)
        self._capacity = int(body["capacity"])
        self._version = int(body["version"])
        age = body.get("heartbeat_age_s")
        self.heartbeat = time.monotonic() - (float(age) if age is not None else 0.0)
        return body

    async def shutdown(self) -> None:
        """Stops using the server (which keeps running): requests this client still
        holds fail with `EngineError`, as a local engine's would."""
        self._closed = True
        for future, task in list(self._held.values()):
            task.cancel()
            if not future.done():
                future.set_exception(EngineError(f"engine {self.name} client shut down"))
        self._held.clear()
        for task in [self._poller, *self._background]:
            if task is not None:
                task.cancel()
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None

    # --- plumbing -----------------------------------------------------------------------

    def _start(self, request_id: str, endpoint: str, payload: dict) -> asyncio.Future:
        if self._closed:
            raise EngineError(f"engine {self.name} client is shut down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        task = loop.create_task(self._long_poll(endpoint, payload))
        self._held[request_id] = (future, task)
        self.heartbeat = time.monotonic()  # submitting is no sign of a hang

        def settle(done: asyncio.Task) -> None:
            if self._held.get(request_id, (None, None))[1] is done:
                del self._held[request_id]
            if future.done():
                return
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(done.result())

        task.add_done_callback(settle)
        # The proxy cancels the future when it gives up on this engine: hang up, so the
        # server cancels the request and frees its slot.
        future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll())
        return future

    async def _long_poll(self, endpoint: str, payload: dict) -> Completion:
        body = await self._request("POST", endpoint, payload, timeout_s=None)
        self.heartbeat = time.monotonic()
        if "migrated" in body:
            raise RequestMigrated(wire.live_from_json(body["migrated"], "migrated."))
        return wire.completion_from_json(body["completion"])

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._control("cancel", {"request_id": request_id})
        except (EngineError, ValueError) as e:  # the long-poll reports the failure itself
            logging.warning("engine %s: cancel of %s failed: %s", self.name, request_id, e)

    async def _poll(self) -> None:
        """Refreshes heartbeat/version/capacity while requests are held."""
        while self._held and not self._closed:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.status()
            except EngineError as e:  # no heartbeat: the proxy's watchdog decides
                logging.warning("engine %s: status poll failed: %s", self.name, e)

    async def _control(self, endpoint: str, payload: dict, timeout_s: float | None = None) -> dict:
        timeout_s = self.status_timeout_s if timeout_s is None else timeout_s
        return await self._request("POST", endpoint, payload, timeout_s=timeout_s)

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            # No connection limit: each request in flight holds one long-poll.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.client_keepalive_s)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
            self._session_loop = loop
        return self._session

    async def _request(
        self, method: str, endpoint: str, payload: dict | None, timeout_s: float | None
    ) -> dict:
        """One HTTP exchange; errors mapped as the module docstring says."""
        path = f"{PREFIX}/{endpoint}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            async with self._client().request(
                method, self.url + path, json=payload, timeout=timeout, headers=headers
            ) as response:
                status = response.status
                try:
                    body = await response.json(content_type=None)
                except ValueError:
                    body = None
        except _NETWORK_ERRORS as e:
            raise EngineError(f"engine {self.name} at {self.url}: {path}: {e!r}") from e
        if status == 200 and isinstance(body, dict):
            return body
        message = _message(body) or f"HTTP {status}"
        where = f"engine {self.name} at {self.url}{path}"
        if status == 404 and endpoint == "export":
            raise KeyError(message)
        if status == 409 and endpoint in ("release_memory", "resume"):
            raise RuntimeError(f"{where}: {message}")
        if 400 <= status < 500:
            raise ValueError(f"{where}: {message}")
        raise EngineError(f"{where}: HTTP {status}: {message}")


def _message(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("message")
    return None
