"""Sum per-cell gradient pytrees onto the core cell with one collective.

The cells that took part in a step are stacked into a mesh ("cell", "fsdp", "tensor");
each cell's gradient sum becomes one slice of a global array sharded over "cell", and a
compiled sum over that axis (an all-reduce across cells) leaves the total, laid out
exactly like the parameters, on every cell; the core cell's shards are then the result.
The mesh and the compiled reduction are built once per set of cells and cached, so a
set that recurs (a satellite that rejoins) never recompiles.

The cells may belong to several processes (`gyrejax.distributed`): every process that
holds one of them calls the reduction with its own cells' gradients (None for the
others) and only the core's process gets the sum. `CrossCellBroadcast` is the same
construction the other way round: the core's weights copied onto the satellites.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyrejax.cells import Cell


def _stack_on_cells(arrays: Sequence[jax.Array | None], sharding: NamedSharding) -> jax.Array:
    """Global [k, ...] array whose slice j is `arrays[j]` (already on cell j's devices).

    In a multi-process run each process passes only its own cells' arrays and None for
    the others (their shards are not addressable here); the shapes must agree.
    """
    present = [a for a in arrays if a is not None]
    shards = [s.data[None] for a in present for s in a.addressable_shards]
    shape = (len(arrays), *present[0].shape)
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _cell_part(replicated: jax.Array, cell_sharding: NamedSharding) -> jax.Array:
    """One cell's copy of an array replicated over the "cell" mesh axis."""
    cell_devices = set(cell_sharding.mesh.devices.flat)
    shards = [s.data for s in replicated.addressable_shards if s.device in cell_devices]
    return jax.make_array_from_single_device_arrays(replicated.shape, cell_sharding, shards)


def _is_local(cell: Cell) -> bool:
    return all(d.process_index == jax.process_index() for d in cell.devices)


def _cells_mesh(cells: Sequence[Cell]) -> jax.sharding.Mesh:
    devices = np.stack([np.asarray(c.mesh.devices) for c in cells])
    axes = ("cell", *cells[0].mesh.axis_names)
    return jax.sharding.Mesh(devices, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


class _StackedLayout:
    """Shardings of a pytree stacked over a "cell" axis of the given cells' joint mesh.

    Attributes:
      mesh: the (cell, *cell mesh axes) mesh.
      stacked: per-leaf sharding of the [k, ...] stacked array (slice j on cell j).
      replicated: per-leaf sharding replicated over "cell" (every cell holds a copy).
      abstract: per-leaf ShapeDtypeStruct of the stacked array.
    """

    def __init__(self, cells: Sequence[Cell], specs, abstract):
        self.mesh = _cells_mesh(cells)
        is_spec = lambda x: isinstance(x, PartitionSpec)
        self.stacked = jax.tree.map(
            lambda s: NamedSharding(self.mesh, PartitionSpec("cell", *s)), specs, is_leaf=is_spec
        )
        self.replicated = jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec
        )
        self.per_cell = [
            jax.tree.map(lambda s, c=c: NamedSharding(c.mesh, s), specs, is_leaf=is_spec)
            for c in cells
        ]
        self.abstract = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct((len(cells), *a.shape), a.dtype, sharding=sh),
            abstract,
            self.stacked,
        )

    def compile(self, fn):
        """`fn` (stacked pytree -> pytree) compiled with a replicated result."""
        return jax.jit(fn, out_shardings=self.replicated).lower(self.abstract).compile()


class CrossCellReducer:
    """Reduces gradient pytrees from a fixed, ordered set of cells onto the first one.

    Args:
      cells: the cells that took part, core first; all have meshes of one shape.
      specs: pytree of PartitionSpec, the within-cell layout of every gradient leaf.
      abstract: pytree of jax.ShapeDtypeStruct with the same structure as `specs`.
    """

    def __init__(self, cells: Sequence[Cell], specs, abstract):
        self.cells = tuple(cells)
        layout = _StackedLayout(self.cells, specs, abstract)
        self.mesh = layout.mesh
        self._stacked = layout.stacked
        self._core = layout.per_cell[0]
        self._sum = layout.compile(lambda tree: jax.tree.map(lambda x: x.sum(axis=0), tree))

    def __call__(self, per_cell: Sequence) -> object:
        """Sum of the pytrees in `per_cell` (one per cell, in `cells` order), on the core.

        Across processes, every process that holds one of the cells calls this with its
        own cells' pytrees and None for the others; the result is None in a process
        that does not hold the core.
        """
        if len(per_cell) != len(self.cells):
            raise ValueError(f"expected {len(self.cells)} gradient trees, got {len(per_cell)}")
        slots = [i for i, tree in enumerate(per_cell) if tree is not None]

        def stack(sharding, *leaves):
            by_cell: list = [None] * len(per_cell)
            for i, leaf in zip(slots, leaves, strict=True):
                by_cell[i] = leaf
            return _stack_on_cells(by_cell, sharding)

        stacked = jax.tree.map(stack, self._stacked, *[per_cell[i] for i in slots])
        summed = self._sum(stacked)
        if not _is_local(self.cells[0]):
            return None
        return jax.tree.map(_cell_part, summed, self._core)


class CrossCellBroadcast:
    """Copies a pytree from the first cell of a fixed, ordered set onto all the others
    with one collective (the weight pull of satellites in other processes).

    The pytree becomes slice 0 of a global array sharded over "cell" (the other slices
    are zeros, cached per cell); a compiled selection of slice 0, replicated over "cell",
    leaves every cell with the first cell's values, exactly.

    Args:
      cells: source cell first; all have meshes of one shape.
      specs: pytree of PartitionSpec, the within-cell layout of every leaf.
      abstract: pytree of jax.ShapeDtypeStruct with the same structure as `specs`.
    """

    def __init__(self, cells: Sequence[Cell], specs, abstract):
        self.cells = tuple(cells)
        layout = _StackedLayout(self.cells, specs, abstract)
        self.mesh = layout.mesh
        self._stacked = layout.stacked
        self._per_cell = layout.per_cell
        self._abstract = abstract
        self._select = layout.compile(lambda tree: jax.tree.map(lambda x: x[0], tree))
        self._zeros: dict[int, object] = {}

    def _zeros_on(self, j: int):
        """Zeros laid out like the pytree on cell j (a placeholder slice), made once."""
        if j not in self._zeros:
            self._zeros[j] = jax.tree.map(
                lambda a, sh: jax.device_put(np.zeros(a.shape, a.dtype), sh),
                self._abstract,
                self._per_cell[j],
            )
        return self._zeros[j]

    def __call__(self, source) -> dict[int, object]:
        """Copies `source` (the first cell's pytree; None in a process that does not hold
        that cell) onto the cells held by this process; returns {cell index: pytree}."""
        local = [j for j, c in enumerate(self.cells) if _is_local(c)]
        if 0 in local and source is None:
            raise ValueError("this process holds the source cell: pass its pytree")
        held = [source if j == 0 else self._zeros_on(j) for j in local]

        def stack(sharding, *leaves):
            by_cell: list = [None] * len(self.cells)
            for j, leaf in zip(local, leaves, strict=True):
                by_cell[j] = leaf
            return _stack_on_cells(by_cell, sharding)

        replicated = self._select(jax.tree.map(stack, self._stacked, *held))
        return {
            self.cells[j].index: jax.tree.map(_cell_part, replicated, self._per_cell[j])
            for j in local
            if j != 0
        }
