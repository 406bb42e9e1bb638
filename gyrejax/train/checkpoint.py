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


class TrainCheckpointer:
    """Saves and restores (params, optimizer state, metadata) under `directory`.

    The caller decides when to save (every `config.every_steps` steps and at exit); the
    newest `config.keep` checkpoints are kept.
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.config = config
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep, create=True, enable_async_checkpointing=False
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
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
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
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params, force=True)
    checkpointer.wait_until_finished()
    return path


def restore_weights(directory: str | os.PathLike, target):
    """Restores a weights-only snapshot laid out like `target` (any mesh or cell size)."""
    return ocp.StandardCheckpointer().restore(Path(directory).absolute(), target)
