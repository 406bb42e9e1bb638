"""The proxy: the only door between the harness and the rollout engines.

`await proxy.generate(execution_id, agent_id, role, prompt_ids, sampling)` routes a call
to an engine (sticky per execution for prefix reuse, else the least loaded), awaits it
through migrations and engine failures, and records a `ModelCall` (token-in/token-out,
behaviour log-probs, policy versions, engines used). The caller sees one uninterrupted
result whatever happened underneath:

  * `drain(engine)`: the engine stops taking new requests; each in-flight request gets a
    destination with reserved capacity and is exported (KV cache copied device to device
    when both engines can, otherwise re-submitted with prompt + tokens so far); the
    awaiting `generate` continues it at the destination.
  * Engine failure (raises, dies, or makes no progress for `hang_timeout_s` while it
    holds work): its requests are retried elsewhere from the start, counted and logged;
    no execution is lost while any engine lives.
  * While live engines exist but none accepts requests (every cell is switching roles,
    e.g. all of them trained and the next burst's cells are coming back), a call waits
    up to `engine_wait_s` for one to accept instead of failing.

Counters for the scheduler: executions dispatched, started and finished (DESIGN.md's
d(t), p(t), f(t)), and requests in flight per engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np
from absl import logging

from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.types import (
    Completion,
    EngineError,
    LiveRequest,
    Request,
    RequestMigrated,
    SamplingParams,
)
from gyrejax.trajectory import ModelCall


class NoEngineError(RuntimeError):
    """No live, accepting engine is left to serve a request."""


@dataclasses.dataclass(frozen=True)
class Counters:
    """What the scheduler watches (DESIGN.md, waterlevel trigger)."""

    dispatched: int  # executions handed to the harness
    started: int  # executions that made their first model call
    finished: int  # executions whose records were collected
    retries: int  # requests re-run after an engine failure
    migrations: int  # requests moved by a drain
    in_flight: dict[str, int]  # engine -> requests it holds for the proxy

    @property
    def outstanding(self) -> int:
        """w(t) = d(t) - f(t)."""
        return self.dispatched - self.finished


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """What a drain did, and how long each phase took."""

    engine: str
    migrated: int
    kv_copies: int  # moved with their KV cache
    resubmits: int  # moved by re-submitting prompt + tokens so far
    export_s: float  # taking the requests out of the engine
    drain_s: float  # from the call until the engine held nothing


@dataclasses.dataclass
class _EngineState:
    engine: Engine
    accepting: bool = True
    failed: bool = False
    reserved: int = 0
    in_flight: set[str] = dataclasses.field(default_factory=set)
    failure: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def occupancy(self) -> float:
        return (len(self.in_flight) + self.reserved) / max(self.engine.capacity, 1)


class Proxy:
    """Routes, records, migrates and retries model calls (see module docstring).

    Args:
      engines: the engines to start with.
      hang_timeout_s: an engine that holds requests but shows no progress (its
        `heartbeat`) for this long is declared failed.
      max_attempts: tries per request across engine failures.
      engine_wait_s: how long a call waits for an engine to accept while every live
        engine refuses (switching roles) before `NoEngineError`.
    """

    def __init__(
        self,
        engines: Iterable[Engine] = (),
        *,
        hang_timeout_s: float = 120.0,
        max_attempts: int = 3,
        engine_wait_s: float = 600.0,
    ):
        self.hang_timeout_s = hang_timeout_s
        self.max_attempts = max_attempts
        self.engine_wait_s = engine_wait_s
        self._accepting_changed = asyncio.Event()  # an engine was added or accepts again
        self._engines: dict[str, _EngineState] = {}
        self._home: dict[str, str] = {}  # execution -> engine (sticky routing)
        self._calls: dict[str, list[ModelCall]] = collections.defaultdict(list)
        self._next_call_id: dict[str, int] = collections.defaultdict(int)
        self._requests: dict[str, str] = {}  # request -> engine holding it
        self._destination: dict[str, str] = {}  # request -> reserved drain destination
        self._started: set[str] = set()
        self._dispatched = self._finished = self._retries = self._migrations = 0
        self._watchdog: asyncio.Task | None = None
        for engine in engines:
            self.add_engine(engine)

    # --- engines ------------------------------------------------------------------------

    def add_engine(self, engine: Engine) -> None:
        if engine.name in self._engines:
            raise ValueError(f"engine {engine.name!r} is already registered")
        self._engines[engine.name] = _EngineState(engine)
        self._accepting_changed.set()

    def remove_engine(self, name: str) -> Engine:
        state = self._engines[name]
        if state.in_flight:
            raise RuntimeError(f"engine {name!r} still holds {len(state.in_flight)} requests")
        del self._engines[name]
        return state.engine

    def set_accepting(self, name: str, accepting: bool) -> None:
        self._engines[name].accepting = accepting
        if accepting:
            self._accepting_changed.set()

    def engines(self) -> list[Engine]:
        return [s.engine for s in self._engines.values()]

    def failed(self, name: str) -> bool:
        return self._engines[name].failed

    def mark_failed(self, name: str, reason: str) -> None:
        """Declares an engine failed (e.g. a weight update to it failed): it gets no new
        requests and its requests in flight move, as after a crash."""
        self._mark_failed(self._engines[name], reason)

    def counters(self) -> Counters:
        return Counters(
            dispatched=self._dispatched,
            started=len(self._started),
            finished=self._finished,
            retries=self._retries,
            migrations=self._migrations,
            in_flight={name: len(s.in_flight) for name, s in self._engines.items()},
        )

    # --- executions ---------------------------------------------------------------------

    def dispatch(self, execution_id: str) -> None:
        """Counts an execution handed to the harness (d(t))."""
        self._dispatched += 1

    def finish(self, execution_id: str) -> list[ModelCall]:
        """Counts an execution as finished (f(t)) and hands over its recorded calls."""
        self._finished += 1
        self._home.pop(execution_id, None)
        self._next_call_id.pop(execution_id, None)
        return self._calls.pop(execution_id, [])

    def calls(self, execution_id: str) -> list[ModelCall]:
        return list(self._calls.get(execution_id, ()))

    def cancel_execution(self, execution_id: str) -> None:
        """Ends every in-flight request of an execution (e.g. on its timeout): its own
        only, matched exactly (execution "team" is not "team/worker")."""
        for request_id, name in list(self._requests.items()):
            if request_id.rsplit("/", 1)[0] == execution_id and name in self._engines:
                self._engines[name].engine.cancel(request_id)

    async def generate(
        self,
        execution_id: str,
        agent_id: str,
        role: str,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """One model call of one execution; recorded as a `ModelCall` when it completes."""
        self._ensure_watchdog()
        self._started.add(execution_id)
        call_id = self._next_call_id[execution_id]
        self._next_call_id[execution_id] += 1
        request = Request(
            f"{execution_id}/{call_id}",
            np.asarray(prompt_ids, np.int32),
            sampling or SamplingParams(),
        )
        started_at = time.time()
        completion = await self._run(execution_id, request)
        self._calls[execution_id].append(
            ModelCall(
                execution_id=execution_id,
                call_id=call_id,
                agent_id=agent_id,
                role=role,
                prompt_ids=request.prompt_ids,
                output_ids=completion.output_ids,
                logprobs=completion.logprobs,
                versions=completion.versions,
                finish_reason=completion.finish_reason,
                engines=completion.engines,
                started_at=started_at,
                finished_at=time.time(),
                temperature=request.sampling.temperature,
                top_p=request.sampling.top_p,
                top_k=request.sampling.top_k,
            )
        )
        return completion

    async def _run(self, execution_id: str, request: Request) -> Completion:
        live: LiveRequest | None = None
        attempts = 0
        while True:
            destination = self._destination.pop(request.request_id, None)
            state = self._engines.get(destination) if destination else None
            if state is not None:
                state.reserved -= 1
            if state is None or state.failed:
                state = await self._route(execution_id)
            engine = state.engine
            if live is not None and live.kv is not None and not engine.exports_kv:
                live = dataclasses.replace(live, kv=None)  # vLLM: re-submit instead
            state.in_flight.add(request.request_id)
            self._requests[request.request_id] = engine.name
            try:
                future = engine.import_request(live) if live is not None else engine.submit(request)
                failed = asyncio.ensure_future(state.failure.wait())
                try:
                    done, _ = await asyncio.wait(
                        {future, failed}, return_when=asyncio.FIRST_COMPLETED
                    )
                except asyncio.CancelledError:
                    # The caller gave up (an execution's timeout): the engine must not keep
                    # running the request, nor hold it when its cell is freed for training.
                    engine.cancel(request.request_id)
                    raise
                finally:
                    failed.cancel()
                if future not in done:
                    future.cancel()
                    raise EngineError(f"engine {engine.name} declared failed")
                return future.result()
            except RequestMigrated as migrated:
                live = migrated.live
                self._migrations += 1
            except asyncio.CancelledError:
                # The caller gave up (an execution's timeout). The engine must stop the
                # request too: the `finally` below forgets it, so left running it would
                # hold a slot nobody counts, and a drain would return while the engine
                # still decodes it (its release_memory then refuses).
                engine.cancel(request.request_id)
                raise
            except EngineError as error:
                attempts += 1
                self._retries += 1
                self._mark_failed(state, str(error))
                logging.warning(
                    "request %s failed on %s (%s); attempt %d of %d",
                    request.request_id,
                    engine.name,
                    error,
                    attempts,
                    self.max_attempts,
                )
                if attempts >= self.max_attempts:
                    raise
                live = None  # start again from the prompt on another engine
            finally:
                state.in_flight.discard(request.request_id)
                self._requests.pop(request.request_id, None)

    async def _route(self, execution_id: str) -> _EngineState:
        deadline = time.monotonic() + self.engine_wait_s
        while True:
            candidates = [s for s in self._engines.values() if s.accepting and not s.failed]
            if candidates:
                break
            if all(s.failed for s in self._engines.values()):
                raise NoEngineError("no live engine accepts requests")
            # Live engines all refuse for now (switching roles): wait for one to accept.
            self._accepting_changed.clear()
            try:
                await asyncio.wait_for(
                    self._accepting_changed.wait(), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                raise NoEngineError(
                    f"no engine accepted requests for engine_wait_s={self.engine_wait_s} s"
                ) from None
        home = self._engines.get(self._home.get(execution_id, ""))
        if home is not None and home in candidates and home.occupancy < 1:
            return home
        best = min(candidates, key=lambda s: s.occupancy)
        self._home[execution_id] = best.engine.name
        return best

    def _mark_failed(self, state: _EngineState, reason: str) -> None:
        if not state.failed:
            state.failed = True
            state.accepting = False
            state.failure.set()
            self._accepting_changed.set()  # waiting calls re-check: maybe none is left
            logging.error("engine %s failed (%s); its requests move", state.engine.name, reason)

    # --- hang detection -------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        period = max(0.05, min(1.0, self.hang_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for state in list(self._engines.values()):
                heartbeat = getattr(state.engine, "heartbeat", None)
                if state.failed or heartbeat is None or not state.in_flight:
                    continue
                if now - heartbeat > self.hang_timeout_s:
                    self._mark_failed(state, f"no progress for {now - heartbeat:.1f} s")

    # --- drain and weights ----------------------------------------------------------------

    async def drain(self, name: str) -> DrainReport:
        """Moves every request off engine `name`; returns once it holds none."""
        start = time.perf_counter()
        source = self._engines[name]
        source.accepting = False
        kv_copies = resubmits = 0
        export_s = 0.0
        while source.in_flight:
            targets = {}
            for request_id in list(source.in_flight):
                if request_id in self._destination:
                    continue
                target = self._route_for_migration(exclude=name)
                target.reserved += 1
                self._destination[request_id] = target.engine.name
                targets[request_id] = target
            # All exports at once: the engine takes them in one pass between two decode
            # calls, instead of one request per engine iteration.
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(source.engine.export(request_id) for request_id in targets),
                return_exceptions=True,
            )
            export_s += time.perf_counter() - t0
            error = None
            for (request_id, target), result in zip(targets.items(), results, strict=True):
                if isinstance(result, BaseException):  # KeyError: it finished meanwhile
                    target.reserved -= 1
                    self._destination.pop(request_id, None)
                    if not isinstance(result, KeyError):
                        error = error or result
                elif source.engine.exports_kv and target.engine.exports_kv:
                    kv_copies += 1
                else:
                    resubmits += 1
            if error is not None:
                raise error
            await asyncio.sleep(0)  # let the awaiting calls pick up their live state
        return DrainReport(
            engine=name,
            migrated=kv_copies + resubmits,
            kv_copies=kv_copies,
            resubmits=resubmits,
            export_s=export_s,
            drain_s=time.perf_counter() - start,
        )

    def _route_for_migration(self, exclude: str) -> _EngineState:
        candidates = [
            s for n, s in self._engines.items() if n != exclude and s.accepting and not s.failed
        ]
        if not candidates:
            raise NoEngineError(f"no engine can take the requests of {exclude!r}")
        return min(candidates, key=lambda s: s.occupancy)

    async def update_weights(
        self, weights: Weights, version: int, names: Iterable[str] | None = None
    ) -> None:
        """Publishes new weights to the given (default: all live) engines concurrently."""
        targets = [
            s.engine
            for n, s in self._engines.items()
            if (names is None or n in names) and not s.failed
        ]
        await asyncio.gather(*(e.update_weights(weights, version) for e in targets))
