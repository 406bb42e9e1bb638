"""Role switches of the RL loop, one at a time, every phase timed.

A policy's transition is requested through the driver (`Driver.request_transition`: the
View shows the target role at once; switches run serially, in request order). A cell
returning to rollout leaves the trainer when its switch is requested, so it never starts
a new step while it waits behind other switches; it leaves at the step boundary.

  rollout -> training: the proxy drains the cell's engine (in-flight requests migrate,
    with their KV cache where both engines can), its memory is freed, and the cell joins
    the trainer (mid-step if a step runs);
  training -> rollout: once the running step (and its update, which donates the
    weights) has ended, the engine gets its memory back, pulls the newest weights (no
    step starts during the copy) and accepts requests again.

What a cell frees and takes back. A cell's JAX engine (the default) and the trainer
share JAX's one allocator per device, so what one frees the other reuses at once:

  rollout -> training (`JaxEngine.release_memory`): the engine's KV cache (K and V of
    every layer, max_slots x max_seq_len, and the lengths) and its copy of the weights
    in the rollout layout (on the core, where that layout equals the trainer's, the
    copy may share the trainer's buffers: then only the cache goes). Its compiled
    executables (cache, prefill and decode per bucket, KV export/import) stay, so the
    return compiles nothing; they hold code, no arrays. A satellite then holds nothing
    of the trainer until a step runs on it: the step's frozen weights pulled from the
    core (train layout), a float32 gradient accumulator, each micro-step's rows and
    temporaries; all of it dropped at the step's end. The core always holds the
    trainer's weights, float32 masters and AdamW moments (its optimizer state), and the
    micro-step executables of every cell stay compiled.
  training -> rollout: once the step is over (the satellite's step buffers gone), the
    engine allocates a new KV cache (`resume`) and copies the newest weights
    (`update_weights`). Across processes (`distributed/transport.py`), the collective
    weight pull keeps a model-sized placeholder of zeros on each satellite per set of
    cells it pulled with (`CrossCellBroadcast`): those are not dropped.

Each switch records the bytes in use on the cell's devices (`outputs.device_memory`:
the allocator's `bytes_in_use` where the backend gives it, else the live JAX arrays on
them, e.g. on CPU; none for a cell another process holds): before it, after the free
(to training), and after it.

A vLLM engine is another process with its own allocator: it frees its memory by sleep
mode on GPU; on CPU (no sleep mode) it stops its engine core and starts again from the
newest export at the weight pull (`rollout/vllm_engine.py`). On GPU its memory comes back
at the wake only if JAX gave it back meanwhile: `preflight.memory_handoff_problem` says
which JAX allocators do, and launch refuses the others (UNTESTED on GPU: no GPU here;
JAX's figures here do not see vLLM's memory).

Each phase is logged in `transitions.jsonl` (drain, migrations, free, weight pull, ...,
and `memory`).
"""

from __future__ import annotations

import asyncio
import time

from gyrejax.cells import Cell
from gyrejax.logs import mark
from gyrejax.loop.context import RunContext
from gyrejax.loop.engines import Rollout
from gyrejax.loop.outputs import device_memory, log_transition
from gyrejax.scheduler.policies import Role


class Transitions:
    """Requests and carries out role switches (module docstring)."""

    def __init__(self, ctx: RunContext, rollout: Rollout):
        self.ctx = ctx
        self.rollout = rollout
        self._wake = asyncio.Event()

    def request(self, index: int, role: Role) -> None:
        """A policy's transition of cell `index` to `role` (nothing if it switches
        already or has that role)."""
        ctx = self.ctx
        if not ctx.driver.request_transition(index, role):
            return
        ctx.phase[index] = "queued"
        cell = ctx.cells[index]
        if role is Role.ROLLOUT and not cell.is_core:
            # Released now, not when the (serial) worker reaches it: a cell queued to return
            # must not start a new step and hold its switch for a whole step.
            ctx.trainer.release(cell)
        self._wake.set()

    async def worker(self) -> None:
        """Carries out the queued transitions, one at a time, in request order."""
        ctx = self.ctx
        while True:
            pending = ctx.driver.next_transition()
            if pending is None:
                await self._wake.wait()
                self._wake.clear()
                continue
            index, role, burst = pending  # the burst that decided it
            mark("transition")  # for benchmarks/chaos.py; "... done" with its log record
            start = time.perf_counter()
            cell = ctx.cells[index]
            ctx.timeline.append((ctx.now(), index, "switching"))
            ctx.phase[index] = "switch" if role is Role.TRAINING else "wait_boundary"
            if role is Role.TRAINING:
                phases = await self._to_training(cell)
            else:
                phases = await self._to_rollout(cell)
            ctx.driver.finish_transition(index)
            ctx.phase.pop(index, None)
            ctx.timeline.append((ctx.now(), index, role.value))
            phases["total_s"] = time.perf_counter() - start
            log_transition(ctx, index, f"to_{role.value}", phases, burst)
            ctx.notify()

    async def _to_training(self, cell: Cell) -> dict:
        proxy, engine = self.rollout.proxy, self.rollout.engines[cell.index]
        source, before = device_memory(cell.devices)
        t0 = time.perf_counter()
        report = await proxy.drain(engine.name)
        t1 = time.perf_counter()
        await engine.release_memory()
        t2 = time.perf_counter()
        freed = device_memory(cell.devices)[1]
        if not cell.is_core:  # off the loop: a join may write a weights snapshot
            await asyncio.get_running_loop().run_in_executor(None, self.ctx.trainer.join, cell)
        phases = {"drain_s": t1 - t0, "migrated": report.migrated}
        phases.update(kv_copies=report.kv_copies, resubmits=report.resubmits, free_s=t2 - t1)
        phases["memory"] = _memory(cell, source, before, freed)
        return phases

    async def _to_rollout(self, cell: Cell) -> dict:
        # Released when requested (`request`); it leaves at the step boundary.
        ctx = self.ctx
        t0 = time.perf_counter()
        # Wait for the step to end, update included: the update donates the weights'
        # buffers, so they are copied only while no step runs (and none may start).
        while (step := ctx.step_task) is not None:  # no new step starts meanwhile
            await asyncio.wait({step})  # (a failed step fails the run elsewhere)
        ctx.phase[cell.index] = "switch"
        t1 = time.perf_counter()
        # Measured before the engine takes memory back: a satellite's step buffers are gone.
        source, before = device_memory(cell.devices)
        engine = self.rollout.engines[cell.index]
        ctx.weight_pulls += 1
        try:
            await engine.resume()
            t2 = time.perf_counter()
            weights = await self.rollout.weights_for(engine)
            # A vLLM engine stopped to free CPU memory starts again here, from `weights`.
            await engine.update_weights(weights, ctx.trainer.version)
        finally:
            ctx.weight_pulls -= 1
            ctx.notify()
        t3 = time.perf_counter()
        self.rollout.proxy.set_accepting(engine.name, True)
        phases = {"wait_boundary_s": t1 - t0, "wake_s": t2 - t1, "weight_pull_s": t3 - t2}
        phases["memory"] = _memory(cell, source, before)
        return phases


def _memory(cell: Cell, source: str, before: list, freed: list | None = None) -> dict:
    """A switch's `memory` record: bytes in use on each of the cell's devices before it,
    after the engine freed its memory (to training only), and now, after it."""
    record = {"source": source, "devices": [d.id for d in cell.devices], "before": before}
    if freed is not None:
        record["after_free"] = freed
    now_source, record["after"] = device_memory(cell.devices)
    if now_source != source:  # the backend's statistics appeared or vanished meanwhile
        record["source"] = f"{source} then {now_source}"
    return record
