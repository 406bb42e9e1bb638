"""Training steps on a stored set of executions (SFT or RL), with checkpoints and resume.

`train_on_store` is the one store-training loop: what `launch` runs when
`config.train.executions_dir` is set, and the warm start's SFT. Every cell trains (no
rollout in this mode); across processes the same loop runs on process 0 with a trainer
whose transport reaches the other processes' cells, while they follow its steps
(`ElasticTrainer.follow`). Each step takes `rl.groups_per_step` groups from
the execution store in a fixed order (cycling), processes them into a packed batch
(admission seeded by `seed + step`, so a resumed run makes the same batches), and runs
one elastic training step. Checkpoints go to `workdir/checkpoints` every
`checkpoint.every_steps` steps and at the end, with the data position; an HF export of
the weights goes to `workdir/hf/step_<n>` (with the tokenizer's files when
`model.tokenizer` is an HF directory, so it loads as a Qwen checkpoint does). Starting
the same command again resumes from the latest checkpoint (metric rows of steps past it
are dropped from `metrics.jsonl`, since those steps run again, and an HF export a kill
cut short is written again); a checkpoint trained with another `model.tokenizer` is
refused (`check_tokenizer`).
Per-step metrics are appended to `workdir/metrics.jsonl` and sent to the trackers of
`logging.writers` (gyrejax/writers.py; a resumed run's redone steps replace their
earlier points); `bad_records` counts the records left out of the step's batch (skipped
by the store, or refused by the trajectory processor): one bad record never stops a
step.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import Config, ConfigError
from gyrejax.logs import prepare_for_append, up_to_step
from gyrejax.model.hf_io import export_hf, tokenizer_fingerprint
from gyrejax.model.transformer import Transformer
from gyrejax.progress import Progress
from gyrejax.train.checkpoint import TOKENIZER_KEY, TrainCheckpointer, check_tokenizer
from gyrejax.train.trainer import ElasticTrainer, StepReport
from gyrejax.trajectory import ExecutionStore, PackedBatch, process
from gyrejax.trajectory.process import check_execution
from gyrejax.writers import Writers


def process_options(config: Config, step: int) -> dict:
    """The arguments of `trajectory.process` for the step after `step` steps: the one
    place they are taken from the config (row shape and buckets, vocabulary, evaluation
    budget, admission, advantages). Admission is seeded by `seed + step`, so a resumed
    run makes the same batches."""
    train = config.train
    return dict(
        row_length=train.row_length,
        row_lengths=train.all_row_lengths if train.row_lengths else None,
        max_row_shapes=train.max_row_shapes or None,
        vocab_size=config.model.vocab_size,
        eval_retry_budget=config.harness.eval_retry_budget,
        j_max=config.rl.j_max,
        seed=config.seed + step,
        advantage=config.rl.advantage,
        advantage_std=config.rl.advantage_std,
        reward_shaping=config.rl.reward_shaping,
        rows_per_micro_step=config.train.rows_per_micro_step,
        # SFT fits every output, greedy or sampled; RL trains samples only.
        demonstrations=config.rl.loss == "sft",
    )


def batch_at(
    config: Config, store: ExecutionStore, group_ids: list[str], position: int, step: int
) -> tuple[PackedBatch, list[str]]:
    """The packed batch of `rl.groups_per_step` groups starting at data `position`, and
    the bad records left out of it (each named, with why).

    Left out: records the store skips (corrupt, or invalid fields), and executions the
    trajectory processor refuses for this config (a token id beyond model.vocab_size, a
    call longer than the longest row, ...). Those are looked for only after `process`
    raised, so the common case pays nothing extra.
    """
    groups = [group_ids[(position + i) % len(group_ids)] for i in range(config.rl.groups_per_step)]
    skipped: list[str] = []
    by_group = store.groups(list(dict.fromkeys(groups)), skipped=skipped)
    executions = [ex for g in dict.fromkeys(groups) for ex in by_group[g]]
    options = process_options(config, step)
    limits = {k: options[k] for k in ("vocab_size", "eval_retry_budget")}
    limits["row_length"] = config.train.all_row_lengths[-1]  # as `process` checks calls
    limits["base_length"] = config.train.row_length
    try:
        return process(executions, **options), skipped
    except ValueError:
        usable = []
        for ex in executions:
            try:
                check_execution(ex, **limits)
            except ValueError as e:
                logging.warning("step %d: left out of the batch: %s", step + 1, e)
                skipped.append(str(e))
            else:
                usable.append(ex)
        if len(usable) == len(executions):
            raise  # not one execution's fault
    return process(usable, **options), skipped


def _metrics_record(
    report: StepReport, batch: PackedBatch, position: int, loss_name: str, bad_records: int
) -> dict:
    return {
        "step": report.step,
        "version": report.version,
        "objective": loss_name,
        "skipped": report.skipped,
        **report.metrics,
        "cells": list(report.cells),
        "micro_steps": batch.num_micro_steps,
        "rows": int(batch.tokens.shape[0]),
        # (rows, row length) of each distinct micro-step shape, longest rows first.
        "shapes": [[int(r), int(length)] for r, length in batch.shapes],
        "waste_fraction": batch.stats.waste_fraction,
        "greedy_tokens": batch.stats.greedy_tokens,  # greedy calls' outputs: never trained
        "data_position": position,
        "step_s": report.step_s,
        "reduction_s": report.reduction_s,
        "bad_records": bad_records,
    }


def _export(trainer: ElasticTrainer, workdir: Path, config: Config) -> None:
    root, keep = workdir / "hf", config.checkpoint.keep
    export_hf(trainer.model(), root / f"step_{trainer.step}", tokenizer=config.model.tokenizer)
    exports = sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    for old in exports[:-keep]:
        shutil.rmtree(old)


def _checkpoint(
    trainer, checkpointer, config: Config, workdir: Path, position: int, tokenizer: str
) -> None:
    meta = {"data_position": position, "seed": config.seed, TOKENIZER_KEY: tokenizer}
    trainer.save(checkpointer, meta)
    if config.checkpoint.export_hf:
        _export(trainer, workdir, config)


def _log_step(report: StepReport, batch: PackedBatch) -> None:
    logging.info(
        "step %d: loss %.4f, %d tokens, %d micro-steps on cells %s, %.2f s%s",
        report.step,
        report.metrics.get("loss", float("nan")),
        int(report.metrics.get("tokens", 0)),
        batch.num_micro_steps,
        list(report.cells),
        report.step_s,
        f" (skipped: {report.skip_reason})" if report.skipped else "",
    )


@dataclasses.dataclass(frozen=True)
class StoreTraining:
    """What `train_on_store` did; `trainer` holds the trained weights."""

    steps_run: int  # steps run by this call (0 when resuming a finished run)
    last_metrics: dict
    trainer: ElasticTrainer

    def summary(self) -> dict:
        t = self.trainer
        return dict(
            steps_run=self.steps_run, step=t.step, version=t.version, last=self.last_metrics
        )


def train_on_store(
    config: Config,
    cells: list[Cell],
    model: Transformer,
    workdir: str | Path,
    *,
    trainer: ElasticTrainer | None = None,
) -> StoreTraining:
    """Runs `config.train.steps` steps on `config.train.executions_dir`; resumes if it can.

    Args:
      config: the run (`train.executions_dir`, steps, loss, checkpoints).
      cells: every cell (all of them train).
      model: the starting policy.
      workdir: metrics, checkpoints and HF exports go here.
      trainer: the trainer to train, at the start of this phase (the warm start hands
        over the job's one trainer; across processes it has their transport); default:
        a new one on `cells[0]` built from `model`.

    Raises:
      ConfigError: the store is missing or empty, or the checkpoint to resume was
        trained with another `model.tokenizer`.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not Path(config.train.executions_dir).is_dir():
        raise ConfigError(
            f"config.train.executions_dir={config.train.executions_dir}: not a directory"
        )
    store = ExecutionStore(config.train.executions_dir)
    group_ids = store.group_ids()
    if not group_ids:  # ConfigError: one line at launch, like the missing directory
        raise ConfigError(
            f"config.train.executions_dir={config.train.executions_dir}: no readable executions"
        )
    if trainer is None:
        trainer = ElasticTrainer(model, cells[0], rl=config.rl, train=config.train)
    for cell in cells[1:]:  # every cell trains in this mode; compile before the first step
        trainer.join(cell)
        trainer.precompile(cell)  # (another process compiles its own cells)
    checkpointer = TrainCheckpointer(workdir / "checkpoints", config.checkpoint)
    tokenizer = tokenizer_fingerprint(config.model.tokenizer)
    position = 0
    if checkpointer.latest_step() is not None:
        meta = trainer.restore(checkpointer)
        where = checkpointer.step_path(trainer.step)
        check_tokenizer(meta, config.model.tokenizer, tokenizer, where)
        position = int(meta["data_position"])
        logging.info("resumed from checkpoint step %d (data position %d)", trainer.step, position)
        # A kill between the checkpoint and the end of its export leaves an export
        # without config.json (one that never loads); the checkpoint has its weights.
        export = workdir / "hf" / f"step_{trainer.step}"
        if config.checkpoint.export_hf and not (export / "config.json").exists():
            _export(trainer, workdir, config)
    # Steps past the checkpoint run again: their rows (and a torn last line) go.
    prepare_for_append(workdir / "metrics.jsonl", keep=up_to_step(trainer.step))
    if trainer.step >= config.train.steps:  # finished before: no trackers opened for nothing
        checkpointer.close()
        return StoreTraining(0, {}, trainer)

    steps_run, last, empty_in_a_row = 0, {}, 0
    saved_step = trainer.step
    stage = "SFT steps" if config.rl.loss == "sft" else "steps"
    progress = Progress(stage, config.train.steps, "steps")
    try:
        with (
            open(workdir / "metrics.jsonl", "a") as metrics_file,
            Writers(config, workdir, resumed_at=trainer.step) as writers,
        ):
            while trainer.step < config.train.steps:
                batch, bad = batch_at(config, store, group_ids, position, trainer.step)
                position += config.rl.groups_per_step
                if batch.num_micro_steps == 0:
                    empty_in_a_row += 1
                    if empty_in_a_row * config.rl.groups_per_step > len(group_ids):
                        raise ConfigError(
                            f"config.train.executions_dir={store.root!s}: "
                            "no group has trainable tokens"
                        )
                    logging.warning("step %d: its groups have no trainable tokens", trainer.step)
                    continue
                empty_in_a_row = 0
                report = trainer.train_step(batch)
                steps_run += 1
                last = _metrics_record(report, batch, position, config.rl.loss, len(bad))
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                writers.write("metrics", last, step=trainer.step)
                _log_step(report, batch)
                progress.update(trainer.step)
                if trainer.step % config.checkpoint.every_steps == 0:
                    _checkpoint(trainer, checkpointer, config, workdir, position, tokenizer)
                    saved_step = trainer.step
    finally:  # at exit, normal or not: keep every completed step
        if trainer.step != saved_step:
            _checkpoint(trainer, checkpointer, config, workdir, position, tokenizer)
    checkpointer.close()
    return StoreTraining(steps_run, last, trainer)
