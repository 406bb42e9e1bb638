"""Orbax checkpoints of the core cell, and weights-only snapshots for satellites.

A training checkpoint holds the core's weights, the optimizer state (it exists only on
the core) and a JSON record of counters: step, policy version, the run's RNG state and
the data position. Orbax writes each step into a temporary directory and renames it
when complete, so a crash never leaves a checkpoint that restores as valid but partial.

Restoring takes *targets*: arrays (or `jax.ShapeDtypeStruct`s with shardings) laid out as
the restored values should be, so a checkpoint saved with one cell size or mesh restores
onto another (2 -> 4 -> 1 devices per cell) with identical values.

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
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from gyrejax.config import CheckpointConfig


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

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, params, opt_state, metadata: dict) -> None:
        """Writes checkpoint `step` (blocking until it is complete on disk)."""
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

    def restore(self, params_target, opt_state_target, step: int | None = None):
        """Restores (params, opt_state, metadata) laid out like the targets.

        Args:
          params_target, opt_state_target: arrays or ShapeDtypeStructs with shardings.
          step: default the latest.

        Raises:
          FileNotFoundError: there is no checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params_target),
                opt_state=ocp.args.StandardRestore(opt_state_target),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        return restored.params, restored.opt_state, dict(restored.metadata)

    def close(self) -> None:
        self._manager.close()


def save_weights(directory: str | os.PathLike, params) -> Path:
    """Writes a weights-only snapshot (atomically, via a temporary directory)."""
    path = Path(directory).absolute()
    checkpointer = ocp.StandardCheckpointer(**_this_process_only("snapshot"))
    checkpointer.save(path, _savable(params), force=True)
    checkpointer.wait_until_finished()
    return path


def restore_weights(directory: str | os.PathLike, target):
    """Restores a weights-only snapshot laid out like `target` (any mesh or cell size)."""
    checkpointer = ocp.StandardCheckpointer(**_this_process_only("snapshot"))
    return checkpointer.restore(Path(directory).absolute(), target)
