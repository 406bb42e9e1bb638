"""`run_multiprocess(config, workdir)`: what `gyrejax.launch` runs in a multi-process job.

Every process splits all devices into the same cells and holds those of its local
devices; process 0 writes `layout.json` (which process holds which cell). Then either:

  * with `config.train.executions_dir`, training on that stored set with every cell of
    every process training: process 0 reads the store, makes each step's packed batch
    (`gyrejax.train.loop.batch_at`, the single-process recipe), drives
    `DistributedTrainer` and writes `metrics.jsonl`, checkpoints (`checkpoints/`, resumed
    from when the command runs again) and a weights-only snapshot at the end
    (`weights/`); the others follow;
  * otherwise RL (`gyrejax.distributed.rl`): the warm start, if configured, on process
    0's cells; then process 0 runs the RL runtime over every process's cells while the
    others serve their cells' engines over HTTP and train them when told to. The
    outputs are those of a single-process run, in process 0's workdir.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from absl import logging

from gyrejax.cells import split_into_cells
from gyrejax.config import Config, ConfigError
from gyrejax.distributed import rl
from gyrejax.distributed.runtime import Decisions, local_cells, owner
from gyrejax.distributed.training import DistributedTrainer
from gyrejax.logs import prepare_for_append, up_to_step
from gyrejax.model.transformer import Transformer
from gyrejax.train.checkpoint import TrainCheckpointer, save_weights


def run_multiprocess(config: Config, workdir: str | Path) -> dict:
    """Runs this process's part of a multi-process job; returns a summary (process 0's
    has the run's summary, the others what they did)."""
    if not config.train.executions_dir and not config.train.steps:
        raise ConfigError(
            "config.train.steps=0: a multi-process job trains (RL with train.steps > 0, or "
            "a stored set with train.executions_dir); run a single rollout batch in one process"
        )
    from gyrejax.run import build_model  # the single-process model recipe

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
    if process == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        layout = {
            "num_processes": processes,
            "cells": [
                {"index": c.index, "process": owner(c), "devices": [d.id for d in c.devices]}
                for c in cells
            ],
        }
        (workdir / "layout.json").write_text(json.dumps(layout, indent=2))
    # Built on a cell of this process; identical in every process (same seed or checkpoint).
    model = build_model(config, mine[0])
    if config.train.executions_dir:
        return _train_on_store(config, workdir, cells, model)
    return _reinforce(config, workdir, cells, mine, model)


def _reinforce(config: Config, workdir: Path, cells: list, mine: list, model: Transformer) -> dict:
    """RL across processes (see `gyrejax.distributed.rl`)."""
    start = Decisions("gyrejax/start", timeout_s=rl.FOLLOWER_TIMEOUT_S)
    leader = jax.process_index() == 0
    # One engine token per run, drawn by process 0 before anything else is handed over.
    token = rl.share_engine_token(start) if leader else rl.receive_engine_token(start)
    if leader and config.warmup.steps:
        from gyrejax.stages import warm_start

        model = warm_start(config, mine, model, workdir)  # on process 0's cells
        rl.share_start_weights(model, workdir, start)
    elif leader:
        rl.announce_no_start_weights(start)
    else:
        model = rl.receive_start_weights(model, start)
    trainer = DistributedTrainer(
        model,
        cells,
        rl=config.rl,
        train=config.train,
        decisions=Decisions(timeout_s=rl.FOLLOWER_TIMEOUT_S),
        snapshot_dir=workdir / "snapshots",
    )
    if not leader:
        trainer.precompile()  # idle until process 0 needs the engines anyway
        return rl.serve_and_follow(
            config, cells, model, trainer, token=token, weights_dir=rl.published_dir(workdir)
        )
    try:
        return rl.DistributedRuntime(config, cells, trainer, workdir, engine_token=token).run()
    finally:  # followers stop serving and return even if this process fails
        trainer.stop()


def _train_on_store(config: Config, workdir: Path, cells: list, model: Transformer) -> dict:
    """Training on `config.train.executions_dir` with every cell of every process."""
    from gyrejax.train.loop import _metrics_record, batch_at
    from gyrejax.trajectory import ExecutionStore

    trainer = DistributedTrainer(
        model,
        cells,
        rl=config.rl,
        train=config.train,
        decisions=Decisions(),
        snapshot_dir=workdir / "snapshots",
    )
    trainer.precompile()
    if jax.process_index() != 0:
        steps = 0
        while trainer.follow() is not None:
            steps += 1
        return {"process": jax.process_index(), "steps_followed": steps}

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
        checkpointer = TrainCheckpointer(workdir / "checkpoints", config.checkpoint)
        position = 0
        if checkpointer.latest_step() is not None:
            meta = trainer.trainer.restore(checkpointer)
            position = int(meta["data_position"])
            logging.info(
                "resumed from checkpoint step %d (data position %d)", meta["step"], position
            )
        # Steps past the checkpoint run again: their rows (and a torn last line) go.
        prepare_for_append(workdir / "metrics.jsonl", keep=up_to_step(trainer.trainer.step))
        with open(workdir / "metrics.jsonl", "a") as metrics_file:
            while trainer.trainer.step < config.train.steps:
                batch, bad = batch_at(config, store, group_ids, position, trainer.trainer.step)
                position += config.rl.groups_per_step
                if batch.num_micro_steps == 0:
                    logging.warning("step %d: no trainable tokens", trainer.trainer.step)
                    continue
                report = trainer.train_step(batch)
                last = _metrics_record(report, batch, position, config.rl.loss, len(bad))
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
        save_weights(workdir / "weights", trainer.trainer.params)
    finally:  # followers return from `follow` even if this process fails
        trainer.stop()
    return {"process": 0, "step": trainer.trainer.step, "last": last}
