"""Elastic training across processes: process 0 holds the core; satellites in any
process join at a step boundary or while a step runs, pull the core's weights and share
the step's micro-step queue; their gradients are reduced onto the core exactly as on
one host.

One step, as every process sees it:

1. Process 0 publishes the step (its number, the training cells, the micro-step count)
   and the packed rows (`Decisions`).
2. Weight pull: one collective over the training cells copies the core's weights onto
   every satellite, device to device across processes (`CrossCellBroadcast`); or, as
   the fallback (`weight_pull="snapshot"`), process 0 writes an Orbax weights-only
   snapshot of the version once and every other process restores it with its own
   satellites' sharding.
3. Each process runs a worker thread per training cell it holds; all workers claim
   micro-steps from one counter in the key-value store, so claiming is greedy across
   processes, and accumulate gradients with the cell's compiled micro-step
   (`ElasticTrainer`'s, compiled once per cell).
   A satellite of an idle process may join the running step (`join` from
   `on_micro_step`): process 0 publishes the join, the satellite restores the step's
   weights from the snapshot (process 0 is busy, so no collective) and claims too.
4. Followers publish their cells' results (micro-step counts, metrics, the first
   non-finite micro-step); process 0 publishes the cells that took part.
5. Those cells' gradient sums are reduced onto the core over a mesh of exactly those
   cells (`CrossCellReducer`, called by every process holding one); process 0 updates
   the weights (or skips a non-finite step) and the version goes up.

Not yet: a mid-step join of a satellite held by process 0 (`ElasticTrainer` does that
within one process), or of a second cell of a process already in the step (it joins at
the next boundary); leaves take effect at step boundaries.

The initial model must be identical in every process (same seed or checkpoint): the
KL reference, if any, is the initial weights, kept on each process's host.
"""

from __future__ import annotations

import io
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import RLConfig, TrainConfig
from gyrejax.distributed.runtime import Decisions, owner
from gyrejax.model.transformer import Transformer
from gyrejax.rl.objective import MICRO_STEP_FIELDS
from gyrejax.train.checkpoint import restore_weights, save_weights
from gyrejax.train.reduction import CrossCellBroadcast
from gyrejax.train.trainer import (
    _FIELD_DTYPES,
    ElasticTrainer,
    JoinReport,
    StepReport,
    _accumulate,
    _CellResult,
    _combine_metrics,
)
from gyrejax.trajectory import PackedBatch


def _pack_rows(batch: PackedBatch) -> bytes:
    buffer = io.BytesIO()
    np.savez(
        buffer, **{f: np.asarray(getattr(batch, f), _FIELD_DTYPES[f]) for f in MICRO_STEP_FIELDS}
    )
    return buffer.getvalue()


def _unpack_rows(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as rows:
        return {f: rows[f] for f in MICRO_STEP_FIELDS}


WEIGHT_PULLS = ("collective", "snapshot")


class DistributedTrainer:
    """The elastic trainer over the cells of every process.

    Process 0 drives it (`join`, `release`, `train_step`, `stop`); every other process
    calls `follow` in a loop until it returns None.

    Args:
      model: the initial policy, identical in every process.
      cells: all cells of all processes, in the fixed order; cell 0 (the core) must be
        held by process 0.
      rl, train: as for `ElasticTrainer`.
      decisions: the channel from process 0 to the others.
      weight_pull: how satellites get the core's weights by default, "collective"
        (device to device) or "snapshot" (Orbax, via `snapshot_dir`).
      snapshot_dir: a directory every process can read (process 0 writes it); needed
        for the snapshot pull.
    """

    def __init__(
        self,
        model: Transformer,
        cells: Sequence[Cell],
        *,
        rl: RLConfig,
        train: TrainConfig,
        decisions: Decisions,
        weight_pull: str = "collective",
        snapshot_dir: str | Path | None = None,
    ):
        if weight_pull not in WEIGHT_PULLS:
            raise ValueError(f"weight_pull={weight_pull!r}: expected one of {WEIGHT_PULLS}")
        if weight_pull == "snapshot" and snapshot_dir is None:
            raise ValueError('weight_pull="snapshot" needs a snapshot_dir')
        self.weight_pull = weight_pull
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir).absolute()
        self._snapshots: set[int] = set()  # versions whose snapshot this run wrote
        self.cells = list(cells)
        self.process = jax.process_index()
        self._owners = [owner(c) for c in self.cells]
        if self._owners[0] != 0:
            raise ValueError(f"the core cell must be held by process 0, not {self._owners[0]}")
        self.is_leader = self.process == 0
        self.local = {
            c.index: c for c, p in zip(self.cells, self._owners, strict=True) if p == self.process
        }
        self.decisions = decisions
        self.trainer = ElasticTrainer(
            model, self.cells[0], rl=rl, train=train, owns_core=self.is_leader
        )
        self.training: list[int] = [0]  # process 0's view: training cells, core first
        self._pending_join: list[int] = []
        self._pending_release: list[int] = []
        self._broadcasts: dict[tuple[int, ...], CrossCellBroadcast] = {}
        self._running: dict | None = None  # process 0, during a step: who works on it
        self.last_grads = None  # process 0: the reduced gradient sum of the last step
        self._stopped = False

    # --- process 0: decisions -----------------------------------------------------------

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what} is process 0's decision (this is process {self.process})")

    def join(self, index: int) -> None:
        """Adds satellite `index` (in any process): to the running step if there is one
        and it can join it, else from the next step on.

        A satellite joins a running step (called from `on_micro_step`) when it belongs to
        another process that has no cell in the step yet and `snapshot_dir` is set: it
        pulls the step's weights from an Orbax snapshot (the core's process is busy
        training, so it cannot take part in a collective) and claims micro-steps from
        the same queue. Otherwise it joins at the next step boundary.
        """
        self._require_leader("join")
        if index in self.training or not 0 < index < len(self.cells):
            raise ValueError(f"cell {index} cannot join: training cells are {self.training}")
        self.training.append(index)
        run = self._running
        if run is None:
            return
        with run["lock"]:
            process = self._owners[index]
            busy = {self._owners[i] for i in run["cells"] + run["joined"]}
            if process in busy or self.snapshot_dir is None or run["done"]:
                logging.info("cell %d joins at the next step boundary", index)
                return
            snapshot = self._snapshot()
            self.decisions.publish(
                "join",
                step=run["step"],
                cell=index,
                num_micro_steps=run["num"],
                version=self.trainer.version,
                snapshot=str(snapshot),
            )
            run["joined"].append(index)

    def release(self, index: int) -> None:
        """Removes satellite `index` from the next step on."""
        self._require_leader("release")
        if index == 0:
            raise ValueError("the core cell holds the optimizer state and cannot be released")
        if index not in self.training:
            raise ValueError(f"cell {index} is not training")
        self.training.remove(index)

    def _snapshot(self) -> Path:
        """Process 0: the weights-only snapshot of the current version, written once.

        Older versions' snapshots are deleted: a snapshot is read only during steps on
        its version, and every such step has ended (its reduction waited for every
        process) before the version goes up.
        """
        path = self.snapshot_dir / f"version_{self.trainer.version}"
        # Written by this run: one an earlier run left (a resume from an older checkpoint
        # trains this version again) holds other weights.
        if self.trainer.version not in self._snapshots:
            save_weights(path, self.trainer.params)  # replaces any earlier one
            self._snapshots.add(self.trainer.version)
        for old in self.snapshot_dir.glob("version_*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def stop(self) -> None:
        """Tells every follower to return from `follow` (once; later calls do nothing)."""
        self._require_leader("stop")
        if not self._stopped:  # once, however many cleanups call it
            self.decisions.publish("stop")
            self._stopped = True

    def precompile(self) -> float:
        """Compiles the micro-step of every cell this process holds; returns seconds."""
        return sum(self.trainer.precompile(c) for c in self.local.values())

    # --- the step -----------------------------------------------------------------------

    def train_step(
        self,
        batch: PackedBatch,
        on_micro_step: Callable[[int, Cell], None] | None = None,
        weight_pull: str | None = None,
    ) -> StepReport:
        """Process 0: runs one step over `batch` with the training cells of all processes.

        Args:
          batch: as for `ElasticTrainer.train_step`.
          on_micro_step: called as (index, cell) after each of process 0's micro-steps.
          weight_pull: this step's weight pull ("collective" or "snapshot"); default
            the trainer's.
        """
        self._require_leader("train_step")
        self.trainer._check_batch(batch)
        weight_pull = weight_pull or self.weight_pull
        if weight_pull not in WEIGHT_PULLS or (weight_pull == "snapshot" and not self.snapshot_dir):
            raise ValueError(f"weight_pull={weight_pull!r}: not available (snapshot_dir unset?)")
        start = time.perf_counter()
        step = self.trainer.step + 1
        cells = list(self.training)
        snapshot = None
        if weight_pull == "snapshot" and any(self._owners[i] != 0 for i in cells):
            snapshot = str(self._snapshot())
        # Every follower has read the previous step's keys (its reduction needed them).
        self.decisions.delete(f"step/{step - 1}")
        self.decisions.put_bytes(f"step/{step}/rows", _pack_rows(batch))
        self.decisions.publish(
            "step",
            step=step,
            cells=cells,
            num_micro_steps=batch.num_micro_steps,
            version=self.trainer.version,
            weight_pull=weight_pull,
            snapshot=snapshot,
        )
        rows = {f: np.asarray(getattr(batch, f), _FIELD_DTYPES[f]) for f in MICRO_STEP_FIELDS}
        run = {"step": step, "cells": cells, "num": batch.num_micro_steps, "joined": []}
        run.update(lock=threading.Lock(), done=False)
        self._running = run
        try:
            results = self._work(
                step, cells, rows, batch.num_micro_steps, on_micro_step, weight_pull, snapshot
            )
        finally:
            with run["lock"]:
                run["done"] = True
            self._running = None
        working = cells + run["joined"]  # every cell that may hold micro-steps
        for index in working:
            if self._owners[index] == 0:
                continue
            summary = self.decisions.get_json(f"step/{step}/result/{index}")
            result = _CellResult(
                metrics=summary["metrics"],
                micro_steps=summary["micro_steps"],
                first_bad_micro_step=summary["first_bad_micro_step"],
            )
            if summary["weight_pull_s"] is not None:
                result.join = JoinReport(index, summary["weight_pull_s"], 0.0, None)
            results[index] = result
        # The core always takes part: the sum lands there (with zeros if it got nothing).
        took_part = [0] + [i for i in working[1:] if results[i].micro_steps > 0]
        self.decisions.put_json(f"step/{step}/reduce", took_part)
        reduce_start = time.perf_counter()
        grads = self._reduce(took_part, results)
        grads = jax.block_until_ready(grads)
        reduction_s = time.perf_counter() - reduce_start
        self.last_grads = grads

        metrics = _combine_metrics([results[i].metrics for i in took_part])
        bad = [
            r.first_bad_micro_step for r in results.values() if r.first_bad_micro_step is not None
        ]
        trainer = self.trainer
        trainer.step += 1
        update_start = time.perf_counter()
        skip_reason = ""
        if bad:
            skip_reason = f"non-finite loss or gradients in micro-step {min(bad)}"
            logging.warning("step %d: %s; update skipped, weights unchanged", step, skip_reason)
        else:
            metrics["grad_norm"] = trainer._apply_update(grads)
            trainer.version += 1
        jax.block_until_ready(trainer.params)
        return StepReport(
            step=trainer.step,
            version=trainer.version,
            skipped=bool(bad),
            skip_reason=skip_reason,
            metrics=metrics,
            cells=tuple(took_part),
            micro_steps_per_cell={i: results[i].micro_steps for i in took_part},
            joins=tuple(results[i].join for i in working if results[i].join is not None),
            released=(),
            reduction_s=reduction_s,
            update_s=time.perf_counter() - update_start,
            step_s=time.perf_counter() - start,
        )

    def follow(self) -> dict | None:
        """Processes other than 0: carries out process 0's next decision.

        Returns:
          None when process 0 stopped; else what this process did in the step:
          {"step", "cells" (that took part), "micro_steps_per_cell" (this process's),
          "weight_pull" (how its satellites got the weights), "joined_mid_step"}.
        """
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
        step = payload["step"]
        mine = [i for i in cells if i in self.local]
        done = {"step": step, "cells": [], "micro_steps_per_cell": {}, "weight_pull": None}
        done["joined_mid_step"] = decision.kind == "join"
        self.trainer.step, self.trainer.version = step - 1, payload["version"]
        if mine:
            rows = _unpack_rows(self.decisions.get_bytes(f"step/{step}/rows"))
            num = payload["num_micro_steps"]
            results = self._work(step, cells, rows, num, None, weight_pull, payload["snapshot"])
            for i in mine:
                result = results[i]
                summary = {
                    "metrics": result.metrics,
                    "micro_steps": result.micro_steps,
                    "first_bad_micro_step": result.first_bad_micro_step,
                    "weight_pull_s": result.join.weight_pull_s if result.join else None,
                }
                self.decisions.put_json(f"step/{step}/result/{i}", summary)
            took_part = self.decisions.get_json(f"step/{step}/reduce")
            self._reduce(took_part, results)
            done["cells"] = took_part
            done["micro_steps_per_cell"] = {i: results[i].micro_steps for i in mine}
            done["weight_pull"] = weight_pull
        self.trainer.step = step
        return done

    # --- shared by process 0 and the followers -----------------------------------------

    def _pull(self, cells: list[int]) -> dict[int, tuple[object, float]]:
        """Every satellite among `cells` held here gets the core's weights (one collective
        over `cells`); returns {cell: (params, seconds)}."""
        if len(cells) < 2 or not any(i in self.local for i in cells):
            return {}
        key = tuple(cells)
        if key not in self._broadcasts:
            self.trainer.compile_count += 1
            self._broadcasts[key] = CrossCellBroadcast(
                [self.cells[i] for i in cells], self.trainer._specs, self.trainer._abstract
            )
        start = time.perf_counter()
        pulled = jax.block_until_ready(self._broadcasts[key](self.trainer.params))
        seconds = time.perf_counter() - start
        return {i: (params, seconds) for i, params in pulled.items()}

    def _pull_snapshot(self, cells: list[int], snapshot: str | None):
        """The snapshot pull: satellites held by process 0 copy from the core device to
        device; the others restore the snapshot onto their own sharding."""
        pulled = {}
        for index in cells:
            if index == 0 or index not in self.local:
                continue
            start = time.perf_counter()
            shardings = self.trainer.param_shardings(self.cells[index])
            if self.is_leader:
                params = jax.device_put(self.trainer.params, shardings)
            else:
                target = jax.tree.map(
                    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                    self.trainer._abstract,
                    shardings,
                )
                params = restore_weights(snapshot, target)
            pulled[index] = (jax.block_until_ready(params), time.perf_counter() - start)
        return pulled

    def _work(
        self,
        step: int,
        cells: list[int],
        rows: dict[str, np.ndarray],
        num: int,
        on_micro_step,
        weight_pull: str,
        snapshot: str | None,
    ) -> dict[int, _CellResult]:
        """Runs a worker per training cell held here until the shared queue is empty."""
        if weight_pull == "snapshot":
            pulled = self._pull_snapshot(cells, snapshot)
        else:
            pulled = self._pull(cells)
        results = {i: _CellResult() for i in cells if i in self.local}
        threads = []
        for index, result in results.items():
            params, pull_s = (self.trainer.params, None) if index == 0 else pulled[index]
            if index != 0:
                result.join = JoinReport(index, pull_s, 0.0, None)
            worker = threading.Thread(
                target=self._worker,
                args=(self.cells[index], params, step, rows, num, result, on_micro_step),
                name=f"train-cell-{index}",
            )
            threads.append(worker)
            worker.start()
        for worker in threads:
            worker.join()
        for result in results.values():
            if result.error is not None:
                raise RuntimeError("a training cell failed") from result.error
        return results

    def _worker(self, cell, params, step, rows, num, result: _CellResult, on_micro_step):
        try:
            trainer = self.trainer
            reference = None
            if trainer.reference is not None:
                reference = jax.device_put(trainer.reference, trainer.param_shardings(cell))
            micro_step, zeros, _ = trainer._compiled_for(cell)
            row_sharding = trainer._row_sharding(cell)
            r = trainer.train_config.rows_per_micro_step
            version = np.int32(trainer.version)
            acc = None
            while (m := self.decisions.claim(f"step/{step}/claimed")) < num:
                if acc is None:
                    acc = zeros()
                micro_rows = {f: v[m * r : (m + 1) * r] for f, v in rows.items()}
                acc, metrics, finite = micro_step(
                    params, reference, acc, jax.device_put(micro_rows, row_sharding), version
                )
                metrics, finite = jax.device_get((metrics, finite))
                if not finite and result.first_bad_micro_step is None:
                    result.first_bad_micro_step = m
                _accumulate(result.metrics, metrics)
                result.micro_steps += 1
                if on_micro_step is not None:
                    on_micro_step(m, cell)
            if acc is None and cell.index == 0:  # the update needs a sum on the core
                acc = zeros()
            result.grads = acc
        except BaseException as e:  # surfaced by _work, never swallowed
            result.error = e

    def _reduce(self, took_part: list[int], results: dict[int, _CellResult]):
        """Sums the gradients of `took_part` onto the core; None where the core is not held."""
        if len(took_part) == 1:
            return results[took_part[0]].grads if took_part[0] in self.local else None
        if not any(i in self.local for i in took_part):
            return None
        reducer = self.trainer._reducer_for(tuple(self.cells[i] for i in took_part))
        return reducer([results[i].grads if i in self.local else None for i in took_part])
