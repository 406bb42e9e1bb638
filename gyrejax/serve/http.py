"""aiohttp plumbing shared by the engine server and the OpenAI server.

One place decides how failures become HTTP answers, so both servers answer every bad
request with a 4xx naming the field and keep serving: `HttpError` carries a status,
`FieldError` is a 400, anything unexpected is a logged 500 (never a dead server).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from absl import logging
from aiohttp import web

from gyrejax.serve.wire import FieldError, error_body

# A million-token prompt is ~7 MB of JSON; leave room for that and the live state.
MAX_BODY_BYTES = 256 * 1024 * 1024


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
    body = {**error_body(message, kind, field), **(extra or {})}
    return web.json_response(body, status=status)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Turns exceptions into JSON error answers; the server always keeps serving."""
    try:
        return await handler(request)
    except FieldError as e:
        return error_response(400, str(e), "invalid_request_error", e.field)
    except HttpError as e:
        return error_response(e.status, str(e), e.kind, e.field, e.extra)
    except web.HTTPException as e:  # aiohttp's own (404 route, 405 method, 413 size)
        return error_response(e.status, e.reason, "invalid_request_error")
    except Exception as e:  # a bug: log it with its traceback, answer, keep serving
        logging.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object (FieldError "body" otherwise)."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FieldError("body", f"invalid JSON: {e}") from None
    if not isinstance(body, Mapping):
        raise FieldError("body", f"expected a JSON object, got {type(body).__name__}")
    return dict(body)


def make_app() -> web.Application:
    return web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves `app` on host:port (port 0 picks a free one); returns the runner and port.

    Handler cancellation is on: when a client hangs up on a long-poll (a proxy that gave
    up on this engine), the handler is cancelled and cancels the engine request with it.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the port actually bound
    return runner, int(bound)


class Site:
    """An aiohttp app with start/stop on the running event loop (the servers' base)."""

    def __init__(self):
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self.app = make_app()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts serving; returns the base URL (port 0 picks a free port)."""
        self._runner, bound = await start_site(self.app, host, port)
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        """Stops serving (long-polls in progress are cut)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
