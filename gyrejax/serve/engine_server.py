"""Serves one `Engine` over HTTP, so a proxy on another host can use it (`HttpEngine`).

  GYREJAX_ENGINE_TOKEN=$TOKEN python -m gyrejax.serve.engine_server --hf_dir=/ckpt/step_12 \
      --port=8100 --name=e3 --weights_dir=/runs/r1/published

loads the HF checkpoint into a `JaxEngine` and prints `serving engine e3 at http://...`
once it accepts requests (`--engine=scripted` serves a model-free `ScriptedEngine` for
smoke tests). In code: `url = await EngineServer(engine, token=token).start(host, port)`.

Security (every engine endpoint controls a device and its weights):
  * A shared token (`--token`, or the environment variable GYREJAX_ENGINE_TOKEN, which
    `ps` does not show) is required as `Authorization: Bearer <token>` on every endpoint
    but /health, else 401; `HttpEngine` sends it. Without one the server refuses to
    start unless `--insecure_no_auth` is given, and then it listens on loopback only.
  * `update_weights` loads only directories under `--weights_dir` (symlinks resolved):
    anything else is a 403 naming the path; without `--weights_dir`, no path is loaded.
  * Bodies, headers and connections are limited as `gyrejax.serve.http` describes.

Endpoints (JSON bodies; token arrays as lists of ints; errors use the OpenAI envelope
`{"error": {"message", "type", "param"}}` naming the field):

  POST /v1/engine/submit   {"request": {request_id, prompt_ids, sampling}}
  POST /v1/engine/import   {"live": {request, output_ids, logprobs, versions, engines}}
      Long-poll: the answer comes when the request ends: {"completion": {...}} or, if it
      was exported meanwhile, {"migrated": <live>}. 400 bad request, 409 duplicate id,
      503 the engine failed. A client that hangs up cancels the request.
  POST /v1/engine/export   {"request_id"}  -> <live> (404 if not held). The KV cache
      stays behind: the importer re-computes it from prompt + tokens so far.
  POST /v1/engine/cancel   {"request_id"}
  POST /v1/engine/update_weights {"path": HF checkpoint dir under --weights_dir, "version"}
  POST /v1/engine/release_memory, /v1/engine/resume
  GET  /v1/engine/status   {name, capacity, load, version, request_ids, heartbeat_age_s}
  GET  /health             {"ok": true} (no token: liveness only)
"""

from __future__ import annotations

import asyncio
import os
import re
import time

from absl import app, flags, logging
from aiohttp import web

from gyrejax.rollout.engine import Engine
from gyrejax.rollout.types import EngineError, RequestMigrated
from gyrejax.serve import wire
from gyrejax.serve.http import (
    ENGINE_TOKEN_ENV,
    HttpError,
    Limits,
    Site,
    bearer_token,
    check_secret,
    define_limit_flags,
    limits_from_flags,
    matches_digest,
    no_auth,
    secret_from_flags,
    token_digest,
)
from gyrejax.serve.wire import ENGINE_PREFIX as PREFIX


class EngineServer(Site):
    """HTTP front of one engine (see module docstring for the endpoints).

    Args:
      engine: the engine to serve; the server never shuts it down (its owner does).
      token: the shared secret every client must send (None only with
        `insecure_no_auth` or `token_sha256`).
      token_sha256: instead of `token`, its `token_digest`: the server then never holds
        the token itself (a multi-process run's followers, which learn it over the
        coordinator's unauthenticated key-value store).
      weights_dir: the only directory `update_weights` loads from (subdirectories
        included, symlinks resolved); None refuses every path.
      limits: connection, header and body limits.
      insecure_no_auth: serve without a token, on loopback only (local experiments).

    Raises:
      ValueError: no token or digest (and not `insecure_no_auth`), both, or a token too
        short to be secret.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        token: str | None,
        token_sha256: str | None = None,
        weights_dir: str | os.PathLike | None = None,
        limits: Limits | None = None,
        insecure_no_auth: bool = False,
    ):
        super().__init__(limits, insecure_no_auth=insecure_no_auth)
        if token is not None and token_sha256 is not None:
            raise ValueError(f"engine server {engine.name}: give a token or its digest, not both")
        if token is None and token_sha256 is None and not insecure_no_auth:
            raise ValueError(
                f"engine server {engine.name}: no token; give --token or set "
                f"{ENGINE_TOKEN_ENV} (or insecure_no_auth, on loopback only)"
            )
        if token is not None:
            token_sha256 = token_digest(check_secret(token, "engine token"))
        elif token_sha256 is not None and not re.fullmatch("[0-9a-f]{64}", token_sha256):
            raise ValueError(f"engine server {engine.name}: token_sha256 is not a SHA-256 hex")
        self._token_sha256 = token_sha256  # only the digest is kept
        self.engine = engine
        # Resolved once: a path is confined by its real location, never by its spelling.
        self.weights_dir = None if weights_dir is None else os.path.realpath(weights_dir)
        control, data = self.limits.control_body_bytes, self.limits.data_body_bytes
        auth = self._authenticate
        routes = [
            ("GET", "/health", self._health, no_auth, None),
            ("GET", f"{PREFIX}/status", self._status, auth, None),
            ("POST", f"{PREFIX}/submit", self._submit, auth, data),
            ("POST", f"{PREFIX}/import", self._submit, auth, data),
            ("POST", f"{PREFIX}/export", self._export, auth, control),
            ("POST", f"{PREFIX}/cancel", self._cancel, auth, control),
            ("POST", f"{PREFIX}/update_weights", self._update_weights, auth, control),
            ("POST", f"{PREFIX}/release_memory", self._release_memory, auth, control),
            ("POST", f"{PREFIX}/resume", self._resume, auth, control),
        ]
        for method, path, handler, check, max_body_bytes in routes:
            self.add_endpoint(method, path, handler, auth=check, max_body_bytes=max_body_bytes)

    def _authenticate(self, request: web.Request) -> None:
        if self._token_sha256 is None:  # insecure_no_auth, on loopback
            return
        if not matches_digest(bearer_token(request), self._token_sha256):
            raise HttpError(
                401,
                f"Authorization: missing or wrong token for engine {self.engine.name}; send "
                f"'Authorization: Bearer <token>' (the server's --token or {ENGINE_TOKEN_ENV})",
                "authentication_error",
                "Authorization",
            )

    # --- handlers -------------------------------------------------------------------------

    async def _health(self, *_) -> web.Response:
        return web.json_response({"ok": True})

    async def _status(self, *_) -> web.Response:
        heartbeat = getattr(self.engine, "heartbeat", None)
        return web.json_response(
            {
                "name": self.engine.name,
                "capacity": self.engine.capacity,
                "load": self.engine.load,
                "version": self.engine.version,
                "request_ids": self.engine.request_ids(),
                "heartbeat_age_s": None if heartbeat is None else time.monotonic() - heartbeat,
            }
        )

    async def _submit(self, http_request: web.Request, body: dict, _) -> web.Response:
        importing = http_request.path.endswith("/import")
        if importing:
            live = wire.live_from_json(wire.get(body, "live"), "live.")
            request = live.request
        else:
            request = wire.request_from_json(wire.get(body, "request"), "request.")
        if request.request_id in self.engine.request_ids():
            raise HttpError(
                409,
                f"request {request.request_id!r} is already held by engine {self.engine.name}",
                "conflict",
                "request_id",
            )
        try:
            future = self.engine.import_request(live) if importing else self.engine.submit(request)
        except EngineError as e:
            raise HttpError(503, str(e), "engine_error") from None
        except ValueError as e:  # the engine refused it (vocabulary, context length, ...)
            raise HttpError(400, str(e), "invalid_request_error", "request") from None
        try:
            completion = await future
        except asyncio.CancelledError:  # the client hung up: free the slot
            self.engine.cancel(request.request_id)
            raise
        except RequestMigrated as migrated:
            return web.json_response({"migrated": wire.live_to_json(migrated.live)})
        except EngineError as e:
            raise HttpError(503, str(e), "engine_error") from None
        except ValueError as e:
            raise HttpError(400, str(e), "invalid_request_error", "request") from None
        return web.json_response({"completion": wire.completion_to_json(completion)})

    async def _export(self, _, body: dict, __) -> web.Response:
        request_id = wire.as_str(wire.get(body, "request_id"), "request_id")
        try:
            live = await self.engine.export(request_id)
        except KeyError as e:  # finished meanwhile, or never here
            raise HttpError(
                404, str(e.args[0] if e.args else e), "not_found", "request_id"
            ) from None
        except EngineError as e:
            raise HttpError(503, str(e), "engine_error") from None
        return web.json_response(wire.live_to_json(live))

    async def _cancel(self, _, body: dict, __) -> web.Response:
        self.engine.cancel(wire.as_str(wire.get(body, "request_id"), "request_id"))
        return web.json_response({"ok": True})

    async def _update_weights(self, _, body: dict, __) -> web.Response:
        """Loads an HF checkpoint directory visible on this host (the mixed-fleet path:
        the trainer exports once, every JAX or vLLM engine reloads the same files)."""
        path = wire.as_str(wire.get(body, "path"), "path")
        version = wire.as_int(wire.get(body, "version"), "version", lo=0, hi=2**31)
        self._confine(path)
        if not os.path.isdir(path):
            raise HttpError(
                400,
                f"path: {path!r} is not a directory on engine {self.engine.name}'s host",
                "invalid_request_error",
                "path",
            )
        try:
            await self.engine.update_weights(path, version)
        except EngineError as e:
            raise HttpError(503, str(e), "engine_error") from None
        except (ValueError, TypeError) as e:  # CheckpointError is a ValueError
            raise HttpError(400, f"path: {e}", "invalid_request_error", "path") from None
        return web.json_response({"ok": True, "version": self.engine.version})

    def _confine(self, path: str) -> None:
        """403 unless `path`, symlinks resolved, lies under `weights_dir`: a token holder
        may swap in the run's published weights, not load any directory of this host."""
        if self.weights_dir is None:
            raise HttpError(
                403,
                f"path: {path!r} refused: engine {self.engine.name} was started without "
                "--weights_dir, so it loads no weights over HTTP",
                "permission_error",
                "path",
            )
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.weights_dir]) != self.weights_dir:
            raise HttpError(
                403,
                f"path: {path!r} (resolved {real!r}) is outside engine {self.engine.name}'s "
                f"weights directory {self.weights_dir!r}",
                "permission_error",
                "path",
            )

    async def _release_memory(self, *_) -> web.Response:
        try:
            await self.engine.release_memory()
        except RuntimeError as e:  # requests still in flight
            raise HttpError(409, str(e), "conflict") from None
        return web.json_response({"ok": True})

    async def _resume(self, *_) -> web.Response:
        await self.engine.resume()
        return web.json_response({"ok": True})


# --- command line -------------------------------------------------------------------------


def scripted_answer(prompt_ids, request) -> list[int]:
    """The `--engine=scripted` policy: the last four prompt tokens, reversed.

    Deterministic in the prompt, so a test can tell which prompt an answer belongs to.
    """
    return [int(t) for t in prompt_ids[-4:][::-1]]


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so importing this
    module next to another CLI defines nothing)."""
    flags.DEFINE_enum("engine", "jax", ["jax", "scripted"], "What to serve.")
    flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (--engine=jax).")
    flags.DEFINE_string("name", "remote", "Engine name (appears in every record it serves).")
    flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on.")
    flags.DEFINE_integer("port", 8100, "Port (0 picks a free one; the banner says which).")
    flags.DEFINE_integer("max_slots", 8, "Concurrent requests (--engine=jax).")
    flags.DEFINE_integer("max_seq_len", 2048, "Prompt + output tokens per request.")
    flags.DEFINE_integer("decode_steps", 8, "Decode steps per compiled call.")
    flags.DEFINE_bool("narrow", True, "Decode only as wide as the busy slots (--engine=jax).")
    flags.DEFINE_integer("version", 0, "Policy version of the served weights.")
    flags.DEFINE_float("scripted_delay_s", 0.0, "Answer delay of --engine=scripted.")
    flags.DEFINE_string(
        "token",
        None,
        f"Shared token clients must send (default: ${ENGINE_TOKEN_ENV}; prefer the "
        "environment: flags are visible in ps).",
    )
    flags.DEFINE_string(
        "weights_dir",
        None,
        "The only directory update_weights loads from (an RL run's WORKDIR/published); "
        "unset: no weight updates over HTTP.",
    )
    flags.DEFINE_bool("insecure_no_auth", False, "Serve without a token (loopback --host only).")
    flags.DEFINE_string(
        "compilation_cache_dir",
        "",
        "Directory of JAX's persistent compilation cache (a restarted server loads its "
        "programs); empty: none. $JAX_COMPILATION_CACHE_DIR wins.",
    )
    define_limit_flags()


def build_engine() -> Engine:
    """The engine the flags describe (JAX is imported only for --engine=jax)."""
    if FLAGS.engine == "scripted":
        from gyrejax.rollout.scripted import ScriptedEngine

        return ScriptedEngine(
            FLAGS.name, scripted_answer, version=FLAGS.version, delay_s=FLAGS.scripted_delay_s
        )
    if not FLAGS.hf_dir:
        raise app.UsageError("--engine=jax needs --hf_dir")
    from gyrejax import compilation_cache
    from gyrejax.config import ConfigError

    try:  # before the engine compiles
        compilation_cache.enable(FLAGS.compilation_cache_dir, None, field="--compilation_cache_dir")
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
    from gyrejax.model.hf_io import load_hf
    from gyrejax.rollout.jax_engine import JaxEngine

    return JaxEngine(
        FLAGS.name,
        load_hf(FLAGS.hf_dir),
        max_slots=FLAGS.max_slots,
        max_seq_len=FLAGS.max_seq_len,
        decode_steps=FLAGS.decode_steps,
        version=FLAGS.version,
        narrow=FLAGS.narrow,
    )


def token_from_flags() -> str | None:
    """--token, else $GYREJAX_ENGINE_TOKEN, else None with --insecure_no_auth on loopback
    (app.UsageError otherwise, before any model is loaded)."""
    try:
        return secret_from_flags(
            FLAGS.token, ENGINE_TOKEN_ENV, "--token", "token", FLAGS.host, FLAGS.insecure_no_auth
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None


async def serve_forever(engine: Engine, host: str, port: int, token: str | None) -> None:
    """Serves `engine` until cancelled; prints the URL once it accepts requests."""
    server = EngineServer(
        engine,
        token=token,
        weights_dir=FLAGS.weights_dir,
        limits=limits_from_flags(),
        insecure_no_auth=token is None,
    )
    url = await server.start(host, port)
    print(f"serving engine {engine.name} at {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
        await engine.shutdown()


def main(argv) -> None:
    del argv
    token = token_from_flags()

    async def run():
        await serve_forever(build_engine(), FLAGS.host, FLAGS.port, token)

    logging.info("starting %s engine %s", FLAGS.engine, FLAGS.name)
    asyncio.run(run())


if __name__ == "__main__":
    define_flags()
    app.run(main)
