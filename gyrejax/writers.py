"""Experiment trackers: where a run's metrics go besides its JSONL logs
(`logging.writers`).

The JSONL logs (`metrics.jsonl`, `eval.jsonl`, `transitions.jsonl`) are always written
(gyrejax/loop/outputs.py, evaluation.py, and gyrejax/train/loop.py's store training);
`Writers` sends each of their records to the trackers asked for too:

  tensorboard   event files in `<workdir>/tensorboard` (TensorBoard's format, written with
                tensorboardX's event writer: no TensorFlow); open them with
                `tensorboard --logdir <workdir>` (a warm start's are in `warmup/`)
  wandb         Weights & Biases (`pip install wandb`), offline (files under
                `<workdir>/wandb`, `wandb sync` them later) unless WANDB_MODE says otherwise

Each record becomes scalars named `<log>/<field>` (nested fields joined by "/", "@" as
"_at_": `eval/sampled_pass_at_k`; only finite numbers and booleans; lists and text are
left to the JSONL), at the record's step (`record_steps`: `step` in metrics and
evaluations; the transition's place in its log in transitions). The config goes in as
hyperparameters (flattened to dotted names).

A resumed run (the same workdir, after a kill) trains the steps after its checkpoint
again; its JSONL logs drop their old records of them first, and TensorBoard does too:
  * each record is on disk when `write` returns (tensorboardX's SummaryWriter flushes
    every two minutes: a kill lost points of steps no resume trains again);
  * the resumed run's event file starts with a restart marker at its first new step,
    as SummaryWriter's `purge_step` writes it: TensorBoard drops the points earlier files
    hold at that step and after (every tag's; the Rust data server of `--load_fast`
    drops a tag's points from a step written to it again);
  * the records the trimmed logs keep at those steps are written again (transitions:
    every role switch stays in transitions.jsonl).
W&B's history only grows. Offline, each launch is a W&B run of its own (W&B ignores
`resume` offline): a redone step is once in the killed launch's run and once in the
resumed one's. A W&B run resumed online (WANDB_RUN_ID set; `resume="allow"`) is sent
the records past the steps it has (its summary's `<log>/step`) only: the killed
launch's points stand for the redone steps there.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import time
from pathlib import Path

from absl import logging

from gyrejax.logs import read_jsonl

LOGS = ("metrics", "eval", "transitions")  # the JSONL logs the trackers get, by name


def _leaves(value, name: str, sep: str):
    """(path, leaf) of every non-dict value in nested dicts, paths joined by `sep`."""
    stack = [(name, value)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{name}{sep}{k}" if name else str(k), v) for k, v in value.items())
        else:
            yield name, value


def scalars(record: dict, prefix: str) -> dict[str, float]:
    """`record`'s finite numbers (and booleans) as {prefix/field/...: value}; "pass@1" is
    "pass_at_1", in TensorBoard's tag alphabet."""
    return {
        name.replace("@", "_at_"): float(value)
        for name, value in _leaves(record, prefix, "/")
        if isinstance(value, bool) or (isinstance(value, int | float) and math.isfinite(value))
    }


def hyperparameters(config) -> dict[str, object]:
    """The config as {dotted.field: value} (tuples as text)."""
    return {
        name: value if isinstance(value, int | float | str | bool) else str(value)
        for name, value in _leaves(dataclasses.asdict(config), "", ".")
    }


def record_steps(log: str, records: list[dict]) -> list[int | None]:
    """The trackers' step of each record of `log`: its `step` (metrics, eval), or its
    place in the log from 1 (transitions: a role switch has no step of its own)."""
    if log == "transitions":
        return list(range(1, len(records) + 1))
    return [record.get("step") for record in records]


def _require(writer: str, package: str):
    """`package`, imported; a ConfigError naming the writer that needs it if missing."""
    from gyrejax.config import ConfigError

    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(
            f"config.logging.writers has {writer!r}: pip install {package} "
            f"(or the trackers extra: pip install -e '.[trackers]') ({e})"
        ) from e


class _EventFile:
    """A TensorBoard event file whose events are on disk when `flush` returns.

    Args:
      logdir: the event files' directory.
      purge_step: TensorBoard drops the points earlier files hold at this step and
        later (a restart marker, SessionLog.START, as SummaryWriter's purge_step).
    """

    def __init__(self, logdir: Path, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import text

        self._event, self._summary, self._text = Event, Summary, text
        logdir.mkdir(parents=True, exist_ok=True)
        # Named after the second it opens (TensorBoard reads files in name order), then the
        # nanosecond: two opened within one second never overwrite each other.
        suffix = f".{time.time_ns()}"
        self._file = EventsWriter(str(logdir / "events"), filename_suffix=suffix)
        self._write(step=purge_step, session_log=SessionLog(status=SessionLog.START))

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=name, simple_value=v) for name, v in values.items()]
        self._write(step=step, summary=self._summary(value=values))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._write(step=step, summary=self._text(tag, text))

    def _write(self, **fields) -> None:
        self._file.write_event(self._event(wall_time=time.time(), **fields))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Writers:
    """The trackers of `logging.writers` for one run (see the module docstring); also a
    context manager that closes them.

    Args:
      config: the run's config (its `logging.writers`; the rest as hyperparameters).
      workdir: the run's directory.
      resumed_at: the step the run resumes from (its checkpoint's; 0: from the start).
        Its JSONL logs must be trimmed already: TensorBoard gets their records at later
        steps again, in place of its earlier files' points there.

    Raises:
      ConfigError: a tracker asked for whose package is not installed.
    """

    def __init__(self, config, workdir: str | os.PathLike, *, resumed_at: int = 0):
        self.workdir = Path(workdir)
        self._tensorboard = self._wandb = None
        self._wandb_last_step: dict[str, int | None] = {}
        wanted = config.logging.writers
        if "tensorboard" in wanted:
            _require("tensorboard", "tensorboardX")
            first_step = resumed_at + 1  # the first this run trains
            self._tensorboard = _EventFile(self.workdir / "tensorboard", first_step)
            lines = [f"    {k} = {v!r}" for k, v in sorted(hyperparameters(config).items())]
            self._tensorboard.add_text("config", "\n".join(lines), step=0)  # indented: verbatim
            self._rewrite_from(first_step)
        if "wandb" in wanted:
            wandb = _require("wandb", "wandb")
            mode = os.environ.get("WANDB_MODE", "offline")
            self._wandb = wandb.init(
                project=config.logging.wandb_project,
                dir=str(self.workdir),
                mode=mode,
                config=hyperparameters(config),
                resume=None if mode == "offline" else "allow",  # (offline: a warning)
            )
            # The last step of each log a run resumed online has (a new run: None).
            summary = self._wandb.summary
            self._wandb_last_step = {log: summary.get(f"{log}/step") for log in LOGS}

    def __enter__(self) -> Writers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def write(self, log: str, record: dict, step: int) -> None:
        """Sends one JSONL record of `log` ("metrics", "eval", "transitions")."""
        values = scalars(record, log)
        if not values:
            return
        try:
            if self._tensorboard is not None:
                self._tensorboard.add_scalars(values, step)
                self._tensorboard.flush()  # on disk before a checkpoint makes the step final
            last = self._wandb_last_step.get(log)
            # W&B's own step only grows: each log's step is a field ("<log>/step").
            if self._wandb is not None and (last is None or step > last):
                self._wandb.log(values | {f"{log}/step": step})
        except Exception as e:  # a tracker's trouble never costs the run its step
            logging.warning("trackers: %s record at step %d not written: %r", log, step, e)

    def _rewrite_from(self, first_step: int) -> None:
        """TensorBoard gets the records the logs keep at `first_step` and later again: the
        restart marker drops earlier files' points there, also those no resume redoes."""
        for log in LOGS:
            records = read_jsonl(self.workdir / f"{log}.jsonl")
            for step, record in zip(record_steps(log, records), records, strict=True):
                values = scalars(record, log)
                if isinstance(step, int) and step >= first_step and values:
                    self._tensorboard.add_scalars(values, step)
        self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
