"""The rollout side of the RL loop: an engine per cell, the external engines, the proxy
in front of them, the weights each engine gets, and the publication at a burst's end.

Every cell gets an engine (`rollout.factory.make_engine`, precompiled so that no role
switch waits for a compile; a multi-process run passes its own `CellEngines`, reaching
another process's cells by URL; `rollout.engine=vllm` starts each from the published
export of the start version). External engines (`rollout.vllm_servers`,
`rollout.engine_servers`) always roll out, beside the policy's cells. An engine whose
`weights_by_path` is set gets an HF export of each version (`PublishedWeights`:
`workdir/published/version_<v>`, written by this run, never an earlier run's); the
others get the trainer's arrays. An external engine that fails a publication is
declared failed in the proxy and the run goes on without it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import ConfigError
from gyrejax.logs import mark
from gyrejax.loop.context import RunContext
from gyrejax.loop.outputs import log_transition
from gyrejax.model.hf_io import export_hf
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.factory import make_engine
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.types import EngineError
from gyrejax.scheduler.policies import Role
from gyrejax.serve.http_engine import HttpEngine
from gyrejax.serve.vllm_server_engine import VllmServerEngine

# A cell's engine for the run: (cell, starting model, its version) -> engine.
CellEngines = Callable[[Cell, Transformer, int], Awaitable[Engine]]


class PublishedWeights:
    """HF exports of the policy for engines that load weights by path,
    `directory/version_<v>`: read by the engines' hosts (shared storage), written once per
    version by this run.

    An export an earlier run of the same workdir left is never reused: a run resumed
    from an older checkpoint trains the later versions again, so their old exports hold
    other weights.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self._written: set[int] = set()
        self._lock = asyncio.Lock()

    async def path(self, version: int, model: Callable[[], Transformer]) -> Path:
        """The export of `version` (`model()` builds it; called only when not written)."""
        path = self.directory / f"version_{version}"
        async with self._lock:
            if version not in self._written:
                shutil.rmtree(path, ignore_errors=True)  # an earlier run's, or a partial one
                await asyncio.get_running_loop().run_in_executor(None, export_hf, model(), path)
                self._written.add(version)
                # Keep this version and the one before (an engine may still be loading it).
                for old in self.directory.glob("version_*"):
                    if old.name not in (path.name, f"version_{version - 1}"):
                        shutil.rmtree(old, ignore_errors=True)
        return path


class Rollout:
    """The run's engines and proxy (module docstring).

    Args:
      ctx: the run.
      cell_engines: builds each cell's engine (default: `make_engine` in this process).
    """

    def __init__(self, ctx: RunContext, cell_engines: CellEngines | None = None):
        self.ctx = ctx
        self._cell_engines = cell_engines or self._local_engine
        self.engines: dict[int, Engine] = {}  # one per cell
        self.external: list[Engine] = []  # config.rollout.vllm_servers, engine_servers
        self.proxy: Proxy | None = None
        self.published = PublishedWeights(ctx.workdir / "published")

    async def start(self) -> Proxy:
        """Starts every engine, concurrently where they start in threads (vLLM's; those
        started are shut down by `shutdown` even if another fails) and the proxy in front
        of them."""
        trainer = self.ctx.trainer
        cells = self.ctx.cells
        starts = [self._cell_engines(c, trainer.model(), trainer.version) for c in cells]
        started = await asyncio.gather(*starts, return_exceptions=True)
        for cell, engine in zip(cells, started, strict=True):
            if not isinstance(engine, BaseException):
                self.engines[cell.index] = engine
        for engine in started:
            if isinstance(engine, BaseException):
                raise engine
        for engine in self.engines.values():
            if engine.version != trainer.version:  # e.g. a remote one, in a resumed run
                await engine.update_weights(await self.weights_for(engine), trainer.version)
        self.ctx.spawn(self._precompile_training())
        await self._connect_external()
        self.proxy = Proxy([*self.engines.values(), *self.external])
        return self.proxy

    async def _local_engine(self, cell: Cell, model: Transformer, version: int) -> Engine:
        rollout = self.ctx.config.rollout
        if rollout.engine != "vllm":
            return make_engine(cell, model, rollout, version=version, precompile=True)
        # vLLM: from this version's export, shared by all cells; in a thread, so that the
        # cells' engines start together (each takes long: it spawns processes).
        checkpoint = await self.published.path(version, lambda: model)
        return await asyncio.to_thread(
            make_engine, cell, model, rollout, version=version, checkpoint=checkpoint
        )

    async def _precompile_training(self) -> None:
        """Compiles every cell's micro-step once the engines compiled what they first
        needed (not to slow the first rollouts), so that a cell's first join does not
        compile inside a step."""
        await asyncio.gather(*(e.precompiled() for e in self.engines.values()))
        for cell in self.ctx.cells:
            await asyncio.to_thread(self.ctx.trainer.precompile, cell)

    async def weights_for(self, engine: Engine) -> Weights:
        """What `engine.update_weights` gets for the trainer's current weights (called
        only while no step runs: a step's update donates the weights' buffers): the
        arrays, or the path of an HF export of them (`engine.weights_by_path`)."""
        trainer = self.ctx.trainer
        if not engine.weights_by_path:
            return trainer.params
        return str(await self.published.path(trainer.version, trainer.model))

    async def _connect_external(self) -> None:
        """Engines outside the cells (always rolling out); each gets the current
        weights first, whatever the server started with."""
        r = self.ctx.config.rollout
        servers = [("vllm_servers", i, url) for i, url in enumerate(r.vllm_servers)]
        servers += [("engine_servers", i, url) for i, url in enumerate(r.engine_servers)]
        for field, i, url in servers:
            try:
                if field == "vllm_servers":
                    engine = await VllmServerEngine.connect(url, name=f"vllm{i}")
                else:
                    engine = await HttpEngine.connect(url)
                self.external.append(engine)  # shut down with the others from here on
                names = [e.name for e in [*self.engines.values(), *self.external]]
                if names.count(engine.name) > 1:  # records and routing go by name
                    raise ValueError(
                        f"its engine is named {engine.name!r} like another engine of this "
                        "run; give each server its own name (engine_server --name)"
                    )
                version = self.ctx.trainer.version
                await engine.update_weights(await self.weights_for(engine), version)
            except (EngineError, ValueError) as e:  # unreachable, or not usable as set up
                raise ConfigError(f"config.rollout.{field}[{i}]={url!r}: {e}") from e
            logging.info("external engine %s at %s", engine.name, url)

    async def publish(self) -> None:
        """Ends a burst: the rollout engines get the newest weights. An external engine
        that fails its update is dropped like one that crashed; the run goes on."""
        mark("publish")  # for benchmarks/chaos.py, like "transition"
        start = time.perf_counter()
        ctx, driver = self.ctx, self.ctx.driver
        version = ctx.trainer.version
        live = [
            e
            for i, e in self.engines.items()
            if driver.roles[i] is Role.ROLLOUT and not driver.switching[i]
        ]
        live += [e for e in self.external if not self.proxy.failed(e.name)]
        weights = [await self.weights_for(e) for e in live]
        updates = [e.update_weights(w, version) for e, w in zip(live, weights, strict=True)]
        results = await asyncio.gather(*updates, return_exceptions=True)
        failed = []
        for engine, result in zip(live, results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if engine in self.external and isinstance(result, EngineError):
                self.proxy.mark_failed(engine.name, f"weight update failed: {result}")
                failed.append(engine.name)
            else:  # a cell's engine: the run cannot go on without it
                raise result
        c = self.proxy.counters()
        driver.begin_burst((c.dispatched, c.started, c.finished), version)
        phases = {"publish_s": time.perf_counter() - start, "version": version}
        phases.update(engines=len(live) - len(failed), failed=failed)
        log_transition(ctx, None, "publish", phases)

    async def shutdown(self) -> None:
        for engine in [*self.engines.values(), *self.external]:
            await engine.shutdown()
