"""aiohttp plumbing shared by the engine server and the OpenAI server.

Both servers listen on a network and must assume a hostile peer, so every guard lives
here, once:

  * Authentication before the body. A route is added with `Site.add_endpoint`, which
    runs the endpoint's `auth` check on the headers alone and only then reads the body:
    a client without a key never makes the server buffer or parse a byte of it.
  * Per-endpoint body limits (413): from Content-Length before reading, or as soon as a
    chunked body passes the limit; a body read timeout (408). Compressed bodies are
    refused (415): a small gzip body could expand far past any limit.
  * Strict JSON (400 naming "body"): invalid JSON or encoding, NaN/Infinity, nesting
    deeper than `MAX_JSON_DEPTH`, integers past Python's int-from-str digit limit, a
    body that is not an object. Fields are then checked by `wire` (400 naming them).
  * Connections: a new connection, or one that starts sending a request, must deliver
    the whole request head within `Limits.header_timeout_s` or it is closed (slowloris);
    idle keep-alive connections close after `keepalive_timeout_s`; past
    `max_connections` a new connection gets a 503 and is closed. A connection counts as
    unauthenticated until a request on it passes an endpoint's credential check (not
    /health): each peer address may hold at most `max_unauthenticated_per_client` of
    those (past it, a 503 and close), and one goes idle for at most
    `unauthenticated_idle_s` after a request before it is closed, so keyless clients
    cannot sit on every slot. Header size is bounded
    by aiohttp's parser limits (`max_line_size`, `max_field_size`, `max_headers`).
  * Failures become JSON answers in the OpenAI error envelope: `HttpError` carries a
    status, `FieldError` is a 400, anything unexpected is a logged 500 (never a dead
    server).

Tokens are compared with `hmac.compare_digest`; `MIN_TOKEN_CHARS` refuses guessable ones.
A server may hold only a token's SHA-256 digest (`token_digest`): one that learns its
token over a channel others can read (a multi-process run's key-value store) learns the
digest alone, which lets nobody in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from absl import logging
from aiohttp import hdrs, web

from gyrejax.serve.wire import FieldError, error_body

# Environment variables that carry secrets (flags show up in `ps`; the environment does not).
ENGINE_TOKEN_ENV = "GYREJAX_ENGINE_TOKEN"  # shared token of engine servers and their clients
API_KEY_ENV = "GYREJAX_API_KEY"  # admin key of the OpenAI door (creates executions)

MIN_TOKEN_CHARS = 16  # secrets.token_urlsafe(32) gives 43
MAX_JSON_DEPTH = 64  # requests are a few levels deep; tool schemas a few more

# Body limits. Control requests are a few fields. A million-token prompt is ~7 MB of
# JSON; an engine import also carries a float log-prob per generated token.
CONTROL_BODY_BYTES = 64 * 1024
DATA_BODY_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may cost a server (see the module docstring).

    Attributes:
      header_timeout_s: from a new connection, or the first byte of a request on a
        kept-alive one, until its request head is complete; then the connection closes.
      body_timeout_s: from the start of the body read until the whole body (408).
      keepalive_timeout_s: idle time before a kept-alive connection closes; longer than
        aiohttp's client pool timeout (15 s), so clients close first and never reuse a
        connection the server is closing.
      lingering_s: how long a refused request's unread body is drained (and discarded)
        before the connection closes, so the client reads the answer rather than a reset.
      max_connections: open connections at once; past it new ones get a 503 and close.
      max_unauthenticated_per_client: connections one peer address may hold before any
        request on them authenticated; past it new ones get a 503 and close.
      unauthenticated_idle_s: how long such a connection may idle after a request.
      control_body_bytes, data_body_bytes: the two body limits endpoints choose from.
      max_line_size, max_field_size, max_headers: aiohttp's request head limits.
      backlog: the listen queue (connections the kernel holds before accept).
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    keepalive_timeout_s: float = 75.0
    lingering_s: float = 2.0
    max_connections: int = 512
    max_unauthenticated_per_client: int = 256  # half the connection limit
    unauthenticated_idle_s: float = 2.0
    control_body_bytes: int = CONTROL_BODY_BYTES
    data_body_bytes: int = DATA_BODY_BYTES
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64
    backlog: int = 128

    def __post_init__(self):
        for name in (
            "header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "unauthenticated_idle_s"
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r}: expected > 0")
        for name in (
            "max_connections", "max_unauthenticated_per_client", "control_body_bytes",
            "data_body_bytes", "backlog",
        ):  # fmt: skip
            if not getattr(self, name) >= 1:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r}: expected >= 1")


class HttpError(Exception):
    """An error with the HTTP status to answer it with (`extra`: more top-level fields
    of the answer, e.g. a record the request produced but could not store)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        field: str | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.field = field
        self.extra = extra or {}


def error_response(status: int, message: str, kind: str, field: str | None = None, extra=None):
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {**error_body(message, kind, field), **(extra or {})}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Turns exceptions into JSON error answers; the server always keeps serving."""
    try:
        return await handler(request)
    except FieldError as e:
        return error_response(400, str(e), "invalid_request_error", e.field)
    except HttpError as e:
        return error_response(e.status, str(e), e.kind, e.field, e.extra)
    except web.HTTPException as e:  # aiohttp's own (404 route, 405 method)
        return error_response(e.status, e.reason, "invalid_request_error")
    except Exception as e:  # a bug: log it with its traceback, answer, keep serving
        logging.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# --- authentication ---------------------------------------------------------------------


def bearer_token(request: web.Request) -> str | None:
    """The token of `Authorization: Bearer <token>` (what OpenAI clients send as their
    api_key), or None."""
    scheme, _, token = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def same_token(given: str | None, expected: str) -> bool:
    """Constant-time comparison (no timing leak of how much of a guess was right)."""
    if given is None:
        return False
    # Header values may carry surrogate escapes of non-UTF-8 bytes; compare bytes.
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


def token_digest(token: str) -> str:
    """The SHA-256 of a token (hex): what a server that checks the token needs to hold.
    The tokens are 256 random bits (`check_secret` refuses short ones), so the digest
    cannot be turned back into a token."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def matches_digest(given: str | None, digest: str) -> bool:
    """Whether `given` is the token whose `token_digest` is `digest` (constant time)."""
    return given is not None and hmac.compare_digest(token_digest(given), digest)


def check_secret(value: str, what: str) -> str:
    """`value` if it is long enough to be a secret (ValueError naming `what` otherwise)."""
    if not isinstance(value, str) or len(value) < MIN_TOKEN_CHARS:
        got = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ValueError(
            f"{what}: {got}; use at least {MIN_TOKEN_CHARS} random characters, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (where an unauthenticated server is allowed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secret_from_flags(
    given: str, env: str, flag: str, what: str, host: str, insecure_no_auth: bool
) -> str | None:
    """A server's secret: the flag's value, else $env, else None when `insecure_no_auth`
    on a loopback `host` (ValueError with one line otherwise, before anything starts)."""
    secret = given or os.environ.get(env) or None
    if secret is None and not insecure_no_auth:
        raise ValueError(
            f"no {what}: give {flag} or set {env} (or --insecure_no_auth with a loopback --host)"
        )
    if secret is None and not is_loopback(host):
        raise ValueError(f"--insecure_no_auth: --host={host!r} is not loopback")
    return None if secret is None else check_secret(secret, flag)


# --- bodies -----------------------------------------------------------------------------


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body, at most `max_bytes` (413), within `timeout_s` (408)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise HttpError(
            415,
            f"Content-Encoding: {encoding!r} is not accepted; send the body uncompressed",
            "invalid_request_error",
            "Content-Encoding",
        )
    declared = request.content_length
    if declared is not None and declared > max_bytes:  # refused before reading a byte
        raise _too_large(request, declared, max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > max_bytes:  # chunked, or longer than declared
                    raise _too_large(request, size, max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(
            408,
            f"body: not received within {timeout_s:g} s ({size} bytes so far)",
            "invalid_request_error",
            "body",
        ) from None
    return b"".join(chunks)


def _too_large(request: web.Request, size: int, max_bytes: int) -> HttpError:
    return HttpError(
        413,
        f"body: {size} bytes or more; {request.method} {request.path} takes at most "
        f"{max_bytes} bytes",
        "invalid_request_error",
        "body",
    )


def _no_constants(name: str):
    raise FieldError("body", f"invalid JSON: {name} is not a JSON value")


# Bodies up to this size are parsed on the event loop (well under a millisecond); larger
# ones (a long prompt's ids: up to 16 bytes a token) in a worker thread, so that one big
# request does not hold up every other connection, /health included.
INLINE_JSON_BYTES = 64 << 10


async def decode_json(raw: bytes) -> dict:
    """`parse_json(raw)`, off the event loop when `raw` is large."""
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json(raw)
    return await asyncio.to_thread(parse_json, raw)


def parse_json(raw: bytes) -> dict:
    """A JSON object from `raw`; FieldError "body" for anything else (see module docstring)."""
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:  # the C scanner refuses nesting past the recursion limit
        raise FieldError("body", f"invalid JSON: nested deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        if isinstance(e, FieldError):
            raise
        raise FieldError("body", f"invalid JSON: {e}") from None
    if not isinstance(body, Mapping):
        raise FieldError("body", f"expected a JSON object, got {type(body).__name__}")
    if _depth(body) > MAX_JSON_DEPTH:  # downstream code (templates, repr) may recurse
        raise FieldError("body", f"invalid JSON: nested deeper than {MAX_JSON_DEPTH}")
    return dict(body)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


# --- connections ------------------------------------------------------------------------

_REFUSED = json.dumps(error_body("too many connections; retry later", "server_error")).encode()
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED), _REFUSED)
)


class ConnectionStats:
    """Counters of a site's connections (tests and logs read them)."""

    def __init__(self):
        self.open = 0
        self.refused = 0
        self.header_timeouts = 0
        self.unauthenticated: collections.Counter = collections.Counter()  # by peer address
        self.idle_closed = 0  # unauthenticated connections closed for idling


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's per-connection protocol behind a connection limit and a header timeout.

    aiohttp has no request-head timeout (its keep-alive timer only closes a connection
    that is idle *between* requests, by default after an hour, and a request head that
    trickles in counts as idle). This wrapper arms a timer when a connection opens and
    when bytes arrive while no request is being handled; `_requests_middleware` disarms
    it once a request head is complete (its handler starts).
    """

    def __init__(self, inner: asyncio.Protocol, limits: Limits, stats: ConnectionStats):
        self._inner = inner
        self._limits = limits
        self._stats = stats
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self.busy = False  # a request's handler is running
        self.authenticated = False  # a request on it passed a credential check
        self._peer: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if not peer:  # a unix socket: its clients are told apart by the socket they use
            peer = transport.get_extra_info("sockname")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if (
            self._stats.open >= self._limits.max_connections
            or self._stats.unauthenticated[self._peer]
            >= self._limits.max_unauthenticated_per_client
        ):
            self._refused = True
            self._stats.refused += 1
            transport.write(_REFUSAL)
            transport.close()
            return
        self._stats.open += 1
        self._stats.unauthenticated[self._peer] += 1
        self._transport = transport
        self._inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._timer is None and not self.busy:  # a new request head starts
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._refused else self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._stats.open -= 1
        if not self.authenticated:
            self._drop_unauthenticated()
        self.disarm()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()

    def request_started(self) -> None:
        self.busy = True
        self.disarm()

    def request_finished(self) -> None:
        self.busy = False
        if not self.authenticated and self._transport is not None:  # no keep-alive for it
            self.disarm()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._limits.unauthenticated_idle_s, self._idle_out)

    def mark_authenticated(self) -> None:
        if not self.authenticated:
            self.authenticated = True
            self._drop_unauthenticated()

    def _drop_unauthenticated(self) -> None:
        self._stats.unauthenticated[self._peer] -= 1
        if self._stats.unauthenticated[self._peer] <= 0:
            del self._stats.unauthenticated[self._peer]

    def _idle_out(self) -> None:
        self._timer = None
        if self.busy or self._transport is None or self.authenticated:
            return
        self._stats.idle_closed += 1
        self._transport.close()

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.busy or self._transport is None:
            return
        self._stats.header_timeouts += 1
        self._transport.close()  # aiohttp sees connection_lost and cleans up


def _guard_of(request: web.Request) -> _GuardedProtocol | None:
    """The guard of the request's connection (None on a site without guards)."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    return guard if isinstance(guard, _GuardedProtocol) else None


@web.middleware
async def _requests_middleware(request: web.Request, handler):
    """Tells the connection's guard that a request head arrived and its handler runs."""
    guard = _guard_of(request)
    if guard is None:
        return await handler(request)
    guard.request_started()
    try:
        return await handler(request)
    finally:
        guard.request_finished()


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections go through `_GuardedProtocol`."""

    def __init__(self, runner, host: str, port: int, limits: Limits, stats: ConnectionStats):
        super().__init__(runner, backlog=limits.backlog)
        self._host, self._port = host, port
        self._limits, self._stats = limits, stats
        self.bound_port: int | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server  # aiohttp's protocol factory
        limits, stats = self._limits, self._stats
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _GuardedProtocol(server(), limits, stats),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )
        self.bound_port = int(self._server.sockets[0].getsockname()[1])


# --- sites ------------------------------------------------------------------------------

Handler = Callable[[web.Request, dict, Any], Awaitable[web.StreamResponse]]
Auth = Callable[[web.Request], Any]


def no_auth(_: web.Request) -> None:
    """The `auth` of a public endpoint (/health): it authenticates nobody."""


class Site:
    """An aiohttp app with the guards above, started on the running event loop (the
    servers' base).

    Args:
      limits: connection, header and body limits.
      insecure_no_auth: the subclass serves without its admin credential; `start` then
        refuses any interface but loopback.
    """

    def __init__(self, limits: Limits | None = None, *, insecure_no_auth: bool = False):
        self.url: str | None = None
        self.limits = limits or Limits()
        self.insecure_no_auth = insecure_no_auth
        self.connections = ConnectionStats()
        self._runner: web.AppRunner | None = None
        self.app = web.Application(middlewares=[_requests_middleware, errors_middleware])

    def add_endpoint(
        self,
        method: str,
        path: str,
        handler: Handler,
        *,
        auth: Auth,
        max_body_bytes: int | None = None,
    ) -> None:
        """Routes `method path` to `handler(request, body, caller)`.

        `auth(request)` runs first, on the headers only: it raises `HttpError(401)` or
        returns `caller` (whatever the handler needs to know about who called). Then the
        body is read (at most `max_body_bytes`; None: no body, nothing read) and parsed
        as a JSON object.
        """

        async def endpoint(request: web.Request) -> web.StreamResponse:
            caller = auth(request)
            guard = _guard_of(request)
            if guard is not None and auth is not no_auth:  # its credential passed
                guard.mark_authenticated()
            body = {}
            if max_body_bytes is not None:
                raw = await read_body(request, max_body_bytes, self.limits.body_timeout_s)
                body = await decode_json(raw)
            return await handler(request, body, caller)

        self.app.router.add_route(method, path, endpoint)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts serving; returns the base URL (port 0 picks a free port).

        Handler cancellation is on: when a client hangs up on a long-poll (a proxy that
        gave up on this engine), the handler is cancelled and cancels the engine request.

        Raises:
          ValueError: serving without authentication on an interface other than loopback.
        """
        if self.insecure_no_auth and not is_loopback(host):
            raise ValueError(
                f"host={host!r}: a server without authentication (insecure_no_auth) "
                "listens on loopback only (127.0.0.1, ::1, localhost)"
            )
        limits = self.limits
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=limits.keepalive_timeout_s,
            lingering_time=limits.lingering_s,
            auto_decompress=False,  # see read_body: compressed bodies are refused
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
        )
        await self._runner.setup()
        site = _GuardedSite(self._runner, host, port, limits, self.connections)
        await site.start()
        self.url = f"http://{host}:{site.bound_port}"
        return self.url

    async def serve_unix(self, path: str | os.PathLike) -> asyncio.AbstractServer:
        """Also serves the (started) site on a new unix socket at `path`, with the same
        guards; its clients count as one peer, the socket. Anyone who can reach the path
        may connect (mode 0666): what it is bound into decides who can. Close the
        returned server to stop; the socket file is the caller's to remove."""
        if self._runner is None:
            raise RuntimeError("serve_unix: start() the site first")
        server, limits, stats = self._runner.server, self.limits, self.connections
        unix = await asyncio.get_running_loop().create_unix_server(
            lambda: _GuardedProtocol(server(), limits, stats), os.fspath(path)
        )
        os.chmod(path, 0o666)
        return unix

    async def stop(self) -> None:
        """Stops serving (long-polls in progress are cut)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# --- command lines ----------------------------------------------------------------------


def define_limit_flags() -> None:
    """The `Limits` a server's command line may change (call from its define_flags)."""
    from absl import flags

    default = Limits()
    flags.DEFINE_float(
        "header_timeout_s",
        default.header_timeout_s,
        "Close a connection whose request head is not complete within this time "
        "(slow or silent clients).",
    )
    flags.DEFINE_float(
        "body_timeout_s", default.body_timeout_s, "A request body must arrive within this time."
    )
    flags.DEFINE_integer(
        "max_connections", default.max_connections, "Open connections at once (503 past it)."
    )
    flags.DEFINE_integer(
        "max_unauthenticated_per_client",
        default.max_unauthenticated_per_client,
        "Connections one address may hold before one of its requests authenticated.",
    )


def limits_from_flags() -> Limits:
    from absl import flags

    f = flags.FLAGS
    return Limits(
        header_timeout_s=f.header_timeout_s,
        body_timeout_s=f.body_timeout_s,
        max_connections=f.max_connections,
        max_unauthenticated_per_client=f.max_unauthenticated_per_client,
    )
