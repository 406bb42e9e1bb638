"""Elastic training across processes: the `Transport` of an `ElasticTrainer` whose
satellites live in several processes.

Process 0 holds the core and drives the trainer (`train_step`, `join`, `release`,
`stop`); every other process builds the same trainer with this transport and calls
`follow()` in a loop until it returns None. The step itself is the trainer's
(gyrejax/train/trainer.py); this module only carries it:

1. Process 0 publishes the step (its number, the training cells, the micro-step count,
   the version) and the packed rows with where each micro-step lies in them (their
   offsets and row lengths: with row buckets, micro-steps differ in shape) (`Decisions`).
2. Weight pull: one collective over the step's cells copies the core's weights onto
   every satellite, device to device across processes (`CrossCellBroadcast`); or, as
   the fallback (`weight_pull="snapshot"`), process 0 writes an Orbax weights-only
   snapshot of the version once and every other process restores it with its own
   satellites' sharding.
3. Each process runs a worker per training cell it holds; all workers claim micro-steps
   from one counter in the key-value store, so claiming is greedy across processes.
   A satellite of an idle process may join the running step (`join` from
   `on_micro_step`): process 0 publishes the join, the satellite restores the step's
   weights from the snapshot (process 0 is busy, so no collective) and claims too.
4. Followers publish their cells' results (micro-step counts, metrics, the first
   non-finite micro-step, the join timings); process 0 publishes the cells that took
   part.
5. Every process holding one of those cells calls the reduction onto the core; process
   0 updates the weights (or skips a non-finite step).

Not yet: a mid-step join of a satellite held by process 0 (one process does that with
`InProcessTransport`), or of a second cell of a process already in the step (it joins
at the next boundary).

The initial model must be identical in every process (same seed or checkpoint): the
KL reference, if any, is the initial weights, kept on each process's host.
"""

from __future__ import annotations

import io
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from absl import logging

from gyrejax.cells import Cell
from gyrejax.distributed.runtime import Decisions, owner
from gyrejax.train.checkpoint import restore_weights, save_weights
from gyrejax.train.reduction import CrossCellBroadcast
from gyrejax.train.transport import (
    CellResult,
    JoinReport,
    StepExchange,
    StepPlan,
    Transport,
)
from gyrejax.trajectory import PackedBatch
from gyrejax.trajectory.rows import MICRO_STEP_FIELDS, micro_step_cut, training_rows

WEIGHT_PULLS = ("collective", "snapshot")


# Besides the rows: where each micro-step lies in them (`rows.micro_step_cut`).
_LAYOUT_FIELDS = ("micro_step_offsets", "row_lengths")


def _pack_rows(batch: PackedBatch) -> dict[str, np.ndarray]:
    """The rows of `batch` a step trains, and the layout of its micro-steps."""
    rows = training_rows(lambda f: getattr(batch, f))
    return rows | {f: np.asarray(getattr(batch, f)) for f in _LAYOUT_FIELDS}


def _to_bytes(rows: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **rows)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as rows:
        return {f: rows[f] for f in (*MICRO_STEP_FIELDS, *_LAYOUT_FIELDS)}


class _Step(StepExchange):
    """One step as this process sees it: the shared counter, the rows, the pulled weights."""

    def __init__(self, transport, plan: StepPlan, rows, weight_pull: str, joined_mid_step: bool):
        self.plan = plan
        self.weight_pull = weight_pull
        self.joined_mid_step = joined_mid_step
        self._transport = transport
        self._rows = rows
        self.params = None  # process 0: the core's weights, frozen for the step
        self.pulled: dict[int, tuple[object, float]] = {}
        # Process 0: satellites of other processes told to join while it runs.
        self.joined: list[int] = []
        self.done = False
        self.lock = threading.Lock()

    def claim(self) -> int | None:
        m = self._transport.decisions.claim(f"step/{self.plan.step}/claimed")
        return m if m < self.plan.num_micro_steps else None

    def rows(self, m: int) -> dict[str, np.ndarray]:
        cut = micro_step_cut(self._rows["micro_step_offsets"], self._rows["row_lengths"], m)
        return {f: self._rows[f][cut] for f in MICRO_STEP_FIELDS}

    def weights(self, cell: Cell) -> tuple[object, float]:
        if cell.index == self._transport.core.index:
            return self.params, 0.0
        return self.pulled[cell.index]


class MultiProcessTransport(Transport):
    """A step shared by the cells of every process (see the module docstring).

    Args:
      cells: all cells of all processes, in the fixed order; cell 0 (the core) must be
        held by process 0.
      decisions: the channel from process 0 to the others.
      weight_pull: how satellites get the core's weights at a step's start,
        "collective" (device to device) or "snapshot" (Orbax, via `snapshot_dir`).
      snapshot_dir: a directory every process can read (process 0 writes it); needed
        for the snapshot pull and for mid-step joins.
    """

    reports_every_pull = True

    def __init__(
        self,
        cells: Sequence[Cell],
        decisions: Decisions,
        *,
        weight_pull: str = "collective",
        snapshot_dir: str | Path | None = None,
    ):
        if weight_pull not in WEIGHT_PULLS:
            raise ValueError(f"weight_pull={weight_pull!r}: expected one of {WEIGHT_PULLS}")
        if weight_pull == "snapshot" and snapshot_dir is None:
            raise ValueError('weight_pull="snapshot" needs a snapshot_dir')
        self.cells = list(cells)
        self.decisions = decisions
        self.weight_pull = weight_pull
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir).absolute()
        self.process = jax.process_index()
        self._owners = [owner(c) for c in self.cells]
        if self._owners[0] != 0:
            raise ValueError(f"the core cell must be held by process 0, not {self._owners[0]}")
        self._snapshots: set[int] = set()  # versions whose snapshot this run wrote
        self._broadcasts: dict[tuple[int, ...], CrossCellBroadcast] = {}
        self._stopped = False
        self.compile_count = 0

    @property
    def is_driver(self) -> bool:
        return self.process == 0

    def holds(self, cell: Cell) -> bool:
        return self._owners[cell.index] == self.process

    # --- process 0 ------------------------------------------------------------------------

    def open(self, plan: StepPlan, batch: PackedBatch, params) -> StepExchange:
        cells = [c.index for c in plan.cells]
        snapshot = None
        if self.weight_pull == "snapshot" and any(self._owners[i] != 0 for i in cells):
            snapshot = str(self._snapshot(params, plan.version))
        rows = _pack_rows(batch)
        # Every follower has read the previous step's keys (its reduction needed them).
        self.decisions.delete(f"step/{plan.step - 1}")
        self.decisions.put_bytes(f"step/{plan.step}/rows", _to_bytes(rows))
        self.decisions.publish(
            "step",
            step=plan.step,
            cells=cells,
            num_micro_steps=plan.num_micro_steps,
            rows_per_micro_step=plan.rows_per_micro_step,
            version=plan.version,
            weight_pull=self.weight_pull,
            snapshot=snapshot,
        )
        step = _Step(self, plan, rows, self.weight_pull, joined_mid_step=False)
        step.params = params
        step.pulled = self._pull(cells, params, self.weight_pull, snapshot)
        return step

    def join_running(self, exchange: StepExchange, cell: Cell) -> bool:
        """A satellite of another process that has no cell in the step yet joins it,
        pulling the step's weights from an Orbax snapshot (the core's process is busy
        training, so it cannot take part in a collective); any other joins at the next
        step boundary. Never a worker of this process: False."""
        step: _Step = exchange
        with step.lock:
            process = self._owners[cell.index]
            busy = {self._owners[c.index] for c in step.plan.cells}
            busy |= {self._owners[i] for i in step.joined}
            if process in busy or self.snapshot_dir is None or step.done:
                logging.info("cell %d joins at the next step boundary", cell.index)
                return False
            snapshot = self._snapshot(step.params, step.plan.version)
            self.decisions.publish(
                "join",
                step=step.plan.step,
                cell=cell.index,
                num_micro_steps=step.plan.num_micro_steps,
                rows_per_micro_step=step.plan.rows_per_micro_step,
                version=step.plan.version,
                snapshot=str(snapshot),
            )
            step.joined.append(cell.index)
        return False

    def close(self, exchange: StepExchange) -> None:
        with exchange.lock:
            exchange.done = True

    def collect(
        self, exchange: StepExchange, results: dict[int, CellResult]
    ) -> dict[int, CellResult]:
        step: _Step = exchange
        results = dict(results)
        for index in [c.index for c in step.plan.cells] + step.joined:
            if self._owners[index] == self.process:
                continue
            summary = self.decisions.get_json(f"step/{step.plan.step}/result/{index}")
            join = summary["join"]
            results[index] = CellResult(
                self.cells[index],
                metrics=summary["metrics"],
                micro_steps=summary["micro_steps"],
                first_bad_micro_step=summary["first_bad_micro_step"],
                join=None if join is None else JoinReport(**join),
            )
        return results

    def announce(self, exchange: StepExchange, took_part: list[Cell]) -> None:
        self.decisions.put_json(f"step/{exchange.plan.step}/reduce", [c.index for c in took_part])

    def stop(self) -> None:
        if self.is_driver and not self._stopped:  # once, however many cleanups call it
            self.decisions.publish("stop")
            self._stopped = True

    def _snapshot(self, params, version: int) -> Path:
        """Process 0: the weights-only snapshot of `version`, written once.

        Older versions' snapshots are deleted: a snapshot is read only during steps on
        its version, and every such step has ended (its reduction waited for every
        process) before the version goes up.
        """
        path = self.snapshot_dir / f"version_{version}"
        # Written by this run: one an earlier run left (a resume from an older checkpoint
        # trains this version again) holds other weights.
        if version not in self._snapshots:
            save_weights(path, params)  # replaces any earlier one
            self._snapshots.add(version)
        for old in self.snapshot_dir.glob("version_*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return path

    # --- the other processes ------------------------------------------------------------

    def next(self) -> StepExchange | None:
        decision = self.decisions.next()
        if decision.kind == "stop":
            return None
        payload = decision.payload
        if decision.kind == "step":
            cells, weight_pull = payload["cells"], payload["weight_pull"]
        elif decision.kind == "join":  # one of this process's cells, mid-step
            cells, weight_pull = [payload["cell"]], "snapshot"
        else:
            raise ValueError(f"unknown decision {decision.kind!r} (seq {decision.seq})")
        number = payload["step"]
        plan = StepPlan(
            number,
            payload["version"],
            tuple(self.cells[i] for i in cells),
            payload["num_micro_steps"],
            payload["rows_per_micro_step"],
        )
        rows = None
        if any(self._owners[i] == self.process for i in cells):
            rows = _from_bytes(self.decisions.get_bytes(f"step/{number}/rows"))
        step = _Step(self, plan, rows, weight_pull, joined_mid_step=decision.kind == "join")
        if rows is not None:
            step.pulled = self._pull(cells, None, weight_pull, payload["snapshot"])
        return step

    def report(self, exchange: StepExchange, results: dict[int, CellResult]) -> None:
        for index, result in results.items():
            summary = {
                "metrics": result.metrics,
                "micro_steps": result.micro_steps,
                "first_bad_micro_step": result.first_bad_micro_step,
                "join": None if result.join is None else vars(result.join),
            }
            self.decisions.put_json(f"step/{exchange.plan.step}/result/{index}", summary)

    def took_part(self, exchange: StepExchange) -> list[Cell]:
        indices = self.decisions.get_json(f"step/{exchange.plan.step}/reduce")
        return [self.cells[i] for i in indices]

    # --- the weight pull, in every process holding a cell of the step -------------------

    def _pull(
        self, cells: list[int], params, weight_pull: str, snapshot: str | None
    ) -> dict[int, tuple[object, float]]:
        """The core's weights on every satellite among `cells` held here:
        {cell: (params, seconds)}."""
        if weight_pull == "snapshot":
            return self._pull_snapshot(cells, params, snapshot)
        if len(cells) < 2 or not any(self._owners[i] == self.process for i in cells):
            return {}
        key = tuple(cells)
        if key not in self._broadcasts:
            self.compile_count += 1
            self._broadcasts[key] = CrossCellBroadcast(
                [self.cells[i] for i in cells], self.layout.specs, self.layout.abstract
            )
        start = time.perf_counter()  # one collective over `cells`, device to device
        pulled = jax.block_until_ready(self._broadcasts[key](params))
        seconds = time.perf_counter() - start
        return {i: (p, seconds) for i, p in pulled.items()}

    def _pull_snapshot(self, cells: list[int], params, snapshot: str | None):
        """Satellites held by process 0 copy from the core device to device; the others
        restore the snapshot onto their own sharding."""
        pulled = {}
        for index in cells:
            if index == self.core.index or self._owners[index] != self.process:
                continue
            start = time.perf_counter()
            cell = self.cells[index]
            if self.is_driver:
                weights = jax.device_put(params, self.layout.shardings(cell))
            else:
                weights = restore_weights(snapshot, self.layout.on(cell))
            pulled[index] = (jax.block_until_ready(weights), time.perf_counter() - start)
        return pulled
