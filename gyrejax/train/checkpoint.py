"""Orbax checkpoints of the core cell, and weights-only snapshots for satellites.

A training checkpoint holds the core's weights, the optimizer state (it exists only on
the core) and a JSON record of counters: step, policy version, the run's RNG state and
the data position. Orbax writes each step into a temporary directory and renames it
when complete, so a crash never leaves a checkpoint that restores as valid but partial.

The weights are those the optimizer updates (`ElasticTrainer.updated_weights`): float32
master weights beside a bfloat16 model (`train.master_dtype`), else the parameters.

Restoring takes *targets*: arrays (or `jax.ShapeDtypeStruct`s with shardings) laid out as
the restored values should be, so a checkpoint saved with one cell size or mesh restores
onto another (2 -> 4 -> 1 devices per cell) with identical values. Orbax casts each array
to its target's dtype, so a checkpoint written without masters (bfloat16 weights and
moments) restores into float32 masters and moments with the same values.

Checkpoints are read defensively (DESIGN.md, "Trust boundaries"): a checkpoint damaged
on disk (array data cut short, metadata JSON cut short, a file gone) does not restore,
so the newest *readable* one is used. A failed read is retried (`RESTORE_ATTEMPTS`);
only a checkpoint proven damaged (every attempt failing, by no I/O error) is passed
over, so a storage hiccup costs a retry, never a checkpoint: one that keeps
failing by an I/O error stops the restore with one `CheckpointError` line, nothing moved
and nothing older used in its place. Each damaged newer one is named in a warning
and moved aside to `<step>.corrupt-<time>` in the same directory: kept for inspection,
never deleted, and no longer a step Orbax lists (a later save of that step is then a
fresh one). When no checkpoint is readable nothing is moved, and one `CheckpointError`
line names them all. Every failure to create, save or restore a checkpoint is a
`CheckpointError`, which launch prints as one line.

The metadata also records `model.tokenizer`'s fingerprint (`TOKENIZER_KEY`,
`hf_io.tokenizer_fingerprint`): the model's ids mean that tokenizer's strings, so a
resume under another tokenizer (a different directory, or the demo tokenizer rebuilt
after a code change) is refused by `check_tokenizer` with one `ConfigError` line; a
checkpoint from before the field existed resumes as it did.

A weights-only snapshot (`save_weights` / `restore_weights`) is what a satellite in
another process restores with its own sharding (DESIGN.md: "restoring sharded params
from the core cell via Orbax").

In a multi-process job (`gyrejax.distributed`) the arrays saved here live in one process
(the core's, or a follower's own cell), not across processes: Orbax would otherwise have
every process take part in every save. So each save and restore involves the calling
process alone (`_this_process_only`), and saves go through host memory (Orbax
serialises only fully addressable global arrays in a multi-process job).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from gyrejax.config import CheckpointConfig, ConfigError
from gyrejax.logs import mark
from gyrejax.model.hf_io import CheckpointError

# The checkpoint metadata's record of the tokenizer the weights were trained with.
TOKENIZER_KEY = "tokenizer"
# A restore that fails is tried this often, waiting RESTORE_RETRY_S x attempt between.
RESTORE_ATTEMPTS = 3
RESTORE_RETRY_S = 0.25
# TensorStore's words for a failure of the storage, not of the bytes stored.
_TRANSIENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED")
# Suffix of a checkpoint moved aside: `<step>.corrupt-<time>` is no step name to Orbax.
CORRUPT_MARK = ".corrupt-"


class _Corrupt(Exception):
    """A checkpoint proven damaged (`why`: its failure's first line)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _io_error(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is the storage failing rather than bad bytes:
    an OSError other than a missing file, or a TensorStore status of that kind."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and not isinstance(
            error, FileNotFoundError | NotADirectoryError | IsADirectoryError
        ):
            return True
        if any(status in str(error) for status in _TRANSIENT_STATUS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _first_line(error: BaseException, limit: int = 300) -> str:
    """One line of an error for a message: Orbax and TensorStore errors run to pages."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0].split(" See full TensorStore details")[0] if lines else ""
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_tokenizer(
    metadata: dict, tokenizer: str, fingerprint: str, checkpoint: str | os.PathLike
) -> None:
    """Refuses to resume `checkpoint` under another tokenizer than it was trained with.

    Args:
      metadata: the restored checkpoint's metadata (without `TOKENIZER_KEY`, from an
        older run: accepted).
      tokenizer: `config.model.tokenizer` of this run.
      fingerprint: its `hf_io.tokenizer_fingerprint`.
      checkpoint: the restored checkpoint's directory, for the message.

    Raises:
      ConfigError: one line naming `config.model.tokenizer`, its value and `checkpoint`.
    """
    recorded = metadata.get(TOKENIZER_KEY)
    if recorded is None or recorded == fingerprint:
        return
    raise ConfigError(
        f"config.model.tokenizer={tokenizer}: checkpoint {checkpoint} was trained with "
        f"another tokenizer ({_short(recorded)}, this one is {_short(fingerprint)}), so "
        "its token ids would mean other strings; resume with the tokenizer it was trained "
        "with, or start in a new workdir"
    )


def _short(fingerprint: str) -> str:
    return fingerprint[: len("sha256:") + 12] if fingerprint.startswith("sha256:") else fingerprint


def abstract_like(tree, shardings) -> Any:
    """ShapeDtypeStructs of `tree` carrying `shardings` (a restore target)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _this_process_only(kind: str) -> dict:
    """Orbax options that keep a save or restore within the calling process (empty in a
    single-process job, where Orbax's defaults already do); `kind` keeps the barrier
    keys of checkpoints and snapshots apart."""
    if jax.process_count() == 1:
        return {}
    process = jax.process_index()
    options = ocp.options.MultiprocessingOptions(
        primary_host=process,
        active_processes={process},
        barrier_sync_key_prefix=f"gyrejax_{kind}_{process}",
    )
    return {"multiprocessing_options": options}


def _savable(tree):
    """Host copies in a multi-process job (see the module docstring); else the arrays."""
    return jax.device_get(tree) if jax.process_count() > 1 else tree


class TrainCheckpointer:
    """Saves and restores (params, optimizer state, metadata) under `directory`.

    The caller decides when to save (every `config.every_steps` steps and at exit); the
    newest `config.keep` checkpoints are kept.
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.config = config
        try:
            # Orbax cannot create the directory when only some processes take part.
            self.directory.mkdir(parents=True, exist_ok=True)
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=config.keep,
                    create=False,
                    enable_async_checkpointing=False,
                    **_this_process_only("checkpoint"),
                ),
            )
        except OSError as e:
            raise CheckpointError(f"checkpoints {self.directory}: {_first_line(e)}") from e

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def step_path(self, step: int) -> Path:
        """The directory of checkpoint `step` (Orbax's default step naming)."""
        return self.directory / str(step)

    def save(self, step: int, params, opt_state, metadata: dict) -> None:
        """Writes checkpoint `step` (blocking until it is complete on disk).

        Raises:
          CheckpointError naming the step directory (disk full, permissions, ...).
        """
        mark("checkpoint")  # for benchmarks/chaos.py
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(_savable(params)),
                    opt_state=ocp.args.StandardSave(_savable(opt_state)),
                    metadata=ocp.args.JsonSave(metadata),
                ),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as e:  # Orbax and TensorStore raise plain Exceptions
            raise CheckpointError(
                f"checkpoint {self.step_path(step)}: cannot save: {_first_line(e)}"
            ) from e
        mark("checkpoint done")

    def _restore_step(self, step: int, params_target, opt_state_target):
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params_target),
                opt_state=ocp.args.StandardRestore(opt_state_target),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        metadata = restored.metadata
        # The metadata is what a resume trusts for counters and data position: it must be
        # the record this step wrote.
        if not isinstance(metadata, dict) or metadata.get("step") != step:
            raise ValueError(f"metadata {metadata!r:.200} is not step {step}'s record")
        return restored.params, restored.opt_state, dict(metadata)

    def restore(self, params_target, opt_state_target, step: int | None = None):
        """Restores (params, opt_state, metadata) laid out like the targets.

        Args:
          params_target, opt_state_target: arrays or ShapeDtypeStructs with shardings.
          step: a given step, or None for the newest readable checkpoint; unreadable
            newer ones are then moved aside (see the module docstring).

        Raises:
          FileNotFoundError: there is no checkpoint.
          CheckpointError: `step` is unreadable, or (step None) no checkpoint is.
        """
        if step is not None:
            try:
                return self._restore_step(step, params_target, opt_state_target)
            except Exception as e:  # Orbax and TensorStore raise plain Exceptions
                raise CheckpointError(
                    f"checkpoint {self.step_path(step)}: unreadable: {_first_line(e)}"
                ) from e
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        corrupt: list[tuple[int, str]] = []
        for candidate in steps:
            try:
                restored = self._read(candidate, params_target, opt_state_target)
            except _Corrupt as e:
                corrupt.append((candidate, e.why))
                continue
            for bad, why in corrupt:
                self._move_aside(bad, why, candidate)
            if corrupt:
                self._manager.reload()  # forget the steps moved aside
            return restored
        reasons = "; ".join(f"step {s}: {why}" for s, why in corrupt)
        raise CheckpointError(
            f"no readable checkpoint under {self.directory} ({reasons}); nothing was moved: "
            "move the directory aside to start afresh"
        )

    def _read(self, step: int, params_target, opt_state_target):
        """One step restored, a failed read retried (`RESTORE_ATTEMPTS`, each retry in a
        warning).

        Raises:
          _Corrupt: every attempt failed, by no I/O error: the bytes themselves are bad,
            and the caller may fall back past them.
          CheckpointError: the read kept failing, once or more by an I/O error: nothing
            proves the checkpoint bad, so nothing is moved and no older one is used in
            its place (that would drop its steps).
        """
        failures: list[Exception] = []
        for attempt in range(1, RESTORE_ATTEMPTS + 1):
            try:
                return self._restore_step(step, params_target, opt_state_target)
            except Exception as e:  # Orbax and TensorStore raise plain Exceptions
                failures.append(e)
                if attempt < RESTORE_ATTEMPTS:
                    logging.warning(
                        "checkpoint %s: read failed (%s), attempt %d of %d; retrying",
                        self.step_path(step),
                        _first_line(e),
                        attempt,
                        RESTORE_ATTEMPTS,
                    )
                    time.sleep(RESTORE_RETRY_S * attempt)
        if not any(_io_error(e) for e in failures):
            raise _Corrupt(_first_line(failures[-1]))
        raise CheckpointError(
            f"checkpoint {self.step_path(step)}: could not be read in {RESTORE_ATTEMPTS} "
            f"attempts ({_first_line(failures[-1])}): an I/O error, which does not prove "
            "it damaged, so nothing was moved and no older checkpoint was used; launch "
            "again once the storage reads"
        ) from failures[-1]

    def _move_aside(self, step: int, why: str, fallback: int) -> None:
        path = self.step_path(step)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = path.with_name(f"{path.name}{CORRUPT_MARK}{stamp}")
        n = 1
        while aside.exists():  # two in the same second: keep both
            aside = path.with_name(f"{path.name}{CORRUPT_MARK}{stamp}-{n}")
            n += 1
        os.rename(path, aside)
        logging.warning(
            "checkpoint %s is unreadable (%s): moved aside to %s; resuming from step %d",
            path,
            why,
            aside.name,
            fallback,
        )

    def close(self) -> None:
        self._manager.close()


def save_weights(directory: str | os.PathLike, params) -> Path:
    """Writes a weights-only snapshot (atomically, via a temporary directory).

    Raises:
      CheckpointError naming the directory.
    """
    path = Path(directory).absolute()
    try:
        checkpointer = ocp.StandardCheckpointer(**_this_process_only("snapshot"))
        checkpointer.save(path, _savable(params), force=True)
        checkpointer.wait_until_finished()
    except Exception as e:  # Orbax and TensorStore raise plain Exceptions
        raise CheckpointError(f"weights snapshot {path}: cannot save: {_first_line(e)}") from e
    return path


def restore_weights(directory: str | os.PathLike, target):
    """Restores a weights-only snapshot laid out like `target` (any mesh or cell size).

    Raises:
      CheckpointError naming the directory (missing, or unreadable).
    """
    path = Path(directory).absolute()
    try:
        checkpointer = ocp.StandardCheckpointer(**_this_process_only("snapshot"))
        return checkpointer.restore(path, target)
    except Exception as e:  # Orbax and TensorStore raise plain Exceptions
        raise CheckpointError(f"weights snapshot {path}: unreadable: {_first_line(e)}") from e
