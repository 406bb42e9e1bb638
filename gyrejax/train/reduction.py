"""Sum per-cell gradient pytrees onto the core cell with one collective.

The cells that took part in a step are stacked into a mesh ("cell", "fsdp", "tensor");
each cell's gradient sum becomes one slice of a global array sharded over "cell", and a
compiled sum over that axis (an all-reduce across cells) leaves the total, laid out
exactly like the parameters, on every cell; the core cell's shards are then the result.
The mesh and the compiled reduction are built once per set of cells and cached, so a
set that recurs (a satellite that rejoins) never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyrejax.cells import Cell


def _stack_on_cells(arrays: Sequence[jax.Array], sharding: NamedSharding) -> jax.Array:
    """Global [k, ...] array whose slice j is `arrays[j]` (already on cell j's devices)."""
    shards = [s.data[None] for a in arrays for s in a.addressable_shards]
    shape = (len(arrays), *arrays[0].shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _core_part(summed: jax.Array, core_sharding: NamedSharding) -> jax.Array:
    """The core cell's copy of an array replicated over the "cell" mesh axis."""
    core_devices = set(core_sharding.mesh.devices.flat)
    shards = [s.data for s in summed.addressable_shards if s.device in core_devices]
    return jax.make_array_from_single_device_arrays(summed.shape, core_sharding, shards)


class CrossCellReducer:
    """Reduces gradient pytrees from a fixed, ordered set of cells onto the first one.

    Args:
      cells: the cells that took part, core first; all have meshes of one shape.
      specs: pytree of PartitionSpec, the within-cell layout of every gradient leaf.
      abstract: pytree of jax.ShapeDtypeStruct with the same structure as `specs`.
    """

    def __init__(self, cells: Sequence[Cell], specs, abstract):
        self.cells = tuple(cells)
        devices = np.stack([np.asarray(c.mesh.devices) for c in self.cells])
        axes = ("cell", *self.cells[0].mesh.axis_names)
        self.mesh = jax.sharding.Mesh(
            devices, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes)
        )
        is_spec = lambda x: isinstance(x, PartitionSpec)
        self._stacked = jax.tree.map(
            lambda s: NamedSharding(self.mesh, PartitionSpec("cell", *s)), specs, is_leaf=is_spec
        )
        summed = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)
        self._core = jax.tree.map(
            lambda s: NamedSharding(self.cells[0].mesh, s), specs, is_leaf=is_spec
        )
        stacked_abstract = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct((len(self.cells), *a.shape), a.dtype, sharding=sh),
            abstract,
            self._stacked,
        )
        self._sum = (
            jax.jit(lambda tree: jax.tree.map(lambda x: x.sum(axis=0), tree), out_shardings=summed)
            .lower(stacked_abstract)
            .compile()
        )

    def __call__(self, per_cell: Sequence) -> object:
        """Sum of the pytrees in `per_cell` (one per cell, in `cells` order), on the core."""
        if len(per_cell) != len(self.cells):
            raise ValueError(f"expected {len(self.cells)} gradient trees, got {len(per_cell)}")
        stacked = jax.tree.map(lambda sh, *xs: _stack_on_cells(xs, sh), self._stacked, *per_cell)
        return jax.tree.map(_core_part, self._sum(stacked), self._core)
