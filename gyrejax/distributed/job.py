"""`run_multiprocess(config, workdir)`: what `gyrejax.launch` runs in a multi-process job.

Every process splits all devices into the same cells and holds those of its local
devices. Supported today: training on a stored set of executions
(`config.train.executions_dir`), with every cell of every process training. Process 0
reads the store, makes each step's packed batch (`gyrejax.train.loop.batch_at`, the
single-process recipe), drives `DistributedTrainer` and writes `metrics.jsonl`,
`layout.json`, checkpoints (`checkpoints/`, resumed from when the command runs again)
and a weights-only snapshot at the end (`weights/`); the others follow.
The multi-process RL runtime (scheduler, proxy and harness on process 0, engines on
every process's cells) is not built yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging

from gyrejax.cells import split_into_cells
from gyrejax.config import CheckpointConfig, Config, ConfigError
from gyrejax.distributed.runtime import Decisions, local_cells, owner
from gyrejax.distributed.training import DistributedTrainer, save_snapshot
from gyrejax.train.checkpoint import TrainCheckpointer


class ProcessZeroCheckpointer(TrainCheckpointer):
    """`TrainCheckpointer` written and read by process 0 alone.

    Orbax normally has every process write its shards of global arrays; here the core's
    arrays live in process 0 only, so they are saved from host memory with Orbax's
    multi-process coordination limited to process 0, and restored onto the core's
    shardings as usual (`ElasticTrainer.restore`).
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.config = config
        # Orbax cannot create the directory when only some processes take part.
        self.directory.mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep,
                create=False,
                enable_async_checkpointing=False,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=0, active_processes={0}, barrier_sync_key_prefix="gyrejax_ckpt"
                ),
            ),
        )

    def save(self, step: int, params, opt_state, metadata: dict) -> None:
        super().save(step, jax.device_get(params), jax.device_get(opt_state), metadata)


def run_multiprocess(config: Config, workdir: str | Path) -> dict:
    """Runs this process's part of a multi-process job; returns a summary (process 0's
    has the last step's metrics)."""
    if not config.train.executions_dir:
        raise ConfigError(
            "multi-process runs train on a store only for now: set "
            "config.train.executions_dir (the multi-process RL runtime is not built yet)"
        )
    from gyrejax.run import build_model  # the single-process model recipe
    from gyrejax.train.loop import _metrics_record, batch_at
    from gyrejax.trajectory import ExecutionStore

    workdir = Path(workdir)
    process, processes = jax.process_index(), jax.process_count()
    cells = split_into_cells(config.cells)
    for cell in cells:
        owner(cell)  # raises if a cell spans processes
    mine = local_cells(cells)
    if not mine:
        raise ConfigError(f"process {process} holds no cell: check config.cells.size")
    logging.info(
        "process %d of %d: cells %s of %d", process, processes, [c.index for c in mine], len(cells)
    )
    # Built on a cell of this process; identical in every process (same seed or checkpoint).
    model = build_model(config, mine[0])
    trainer = DistributedTrainer(
        model,
        cells,
        rl=config.rl,
        train=config.train,
        decisions=Decisions(),
        snapshot_dir=workdir / "snapshots",
    )
    trainer.precompile()
    if process != 0:
        steps = 0
        while trainer.follow() is not None:
            steps += 1
        return {"process": process, "steps_followed": steps}

    workdir.mkdir(parents=True, exist_ok=True)
    layout = {
        "num_processes": processes,
        "cells": [
            {"index": c.index, "process": owner(c), "devices": [d.id for d in c.devices]}
            for c in cells
        ],
    }
    (workdir / "layout.json").write_text(json.dumps(layout, indent=2))
    store = ExecutionStore(config.train.executions_dir)
    group_ids = store.group_ids()
    last: dict = {}
    try:
        if not group_ids:
            raise ConfigError(
                f"config.train.executions_dir={config.train.executions_dir!r}: no executions"
            )
        for cell in cells[1:]:
            trainer.join(cell.index)
        checkpointer = ProcessZeroCheckpointer(workdir / "checkpoints", config.checkpoint)
        position = 0
        if checkpointer.latest_step() is not None:
            meta = trainer.trainer.restore(checkpointer)
            position = int(meta["data_position"])
            logging.info(
                "resumed from checkpoint step %d (data position %d)", meta["step"], position
            )
        with open(workdir / "metrics.jsonl", "a") as metrics_file:
            while trainer.trainer.step < config.train.steps:
                batch = batch_at(config, store, group_ids, position, trainer.trainer.step)
                position += config.rl.groups_per_step
                if batch.num_micro_steps == 0:
                    logging.warning("step %d: no trainable tokens", trainer.trainer.step)
                    continue
                report = trainer.train_step(batch)
                last = _metrics_record(report, batch, position, config.rl.loss)
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                logging.info(
                    "step %d: loss %.4f on cells %s (micro-steps %s), %.2f s",
                    report.step,
                    report.metrics.get("loss", float("nan")),
                    list(report.cells),
                    report.micro_steps_per_cell,
                    report.step_s,
                )
                if report.step % config.checkpoint.every_steps == 0:
                    trainer.trainer.save(checkpointer, {"data_position": position})
        if trainer.trainer.step != checkpointer.latest_step():
            trainer.trainer.save(checkpointer, {"data_position": position})
        checkpointer.close()
        save_snapshot(workdir / "weights", trainer.trainer.params)
    finally:  # followers return from `follow` even if this process fails
        trainer.stop()
    return {"process": 0, "step": trainer.trainer.step, "last": last}
