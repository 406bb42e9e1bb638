"""Sharding as data: logical axis names in model code, mapped to mesh axes by rules.

Every parameter carries its logical axes (`nnx.Param(..., logical_axes=("embed", "mlp"))`);
activations are constrained with `constrain(x, ("batch", "length", "embed"))`. A rule set
(`gyrejax.config.TRAIN_SHARDING_RULES`, `SAMPLE_SHARDING_RULES`) maps logical names to
mesh axes. A dimension that a mesh axis does not divide evenly stays replicated, so tiny
test models shard on any mesh; so does one whose rule names an axis the mesh lacks (the
train rules map `length` to `sequence`, which a cell's mesh has only when
`cells.sequence > 1`).

When the active rules split `length` over a mesh axis of more than one device, the
blocked attention runs context-parallel over it (`sequence_layout`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from flax import nnx, traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from gyrejax.config import ShardingRules
from gyrejax.model.attention import SequenceLayout

_ACTIVE_RULES: contextvars.ContextVar[ShardingRules | None] = contextvars.ContextVar(
    "gyrejax_sharding_rules", default=None
)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: ShardingRules,
    shape: Sequence[int] | None = None,
    mesh_shape: dict[str, int] | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a `PartitionSpec`.

    Args:
      logical_axes: one name (or None) per array dimension.
      rules: (logical, mesh axis or None) pairs; unnamed logical axes are replicated.
      shape: the array shape; with `mesh_shape`, a dimension the mesh axis does not
        divide is left replicated.
      mesh_shape: mesh axis name -> size; a rule naming an axis not in it is ignored.

    Returns:
      A PartitionSpec that uses each mesh axis at most once.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        axis = table.get(name) if name is not None else None
        if axis is not None and axis in used:
            axis = None
        if axis is not None and mesh_shape is not None and axis not in mesh_shape:
            axis = None
        if axis is not None and shape is not None and mesh_shape is not None:
            if shape[dim] % mesh_shape[axis]:
                axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was created with (None per dimension if unnamed)."""
    axes = variable.get_metadata().get("logical_axes")
    return tuple(axes) if axes is not None else (None,) * variable.get_value().ndim


def partition_specs(state: nnx.State, mesh: jax.sharding.Mesh, rules: ShardingRules) -> dict:
    """PartitionSpec of every variable, as a pure nested dict (`nnx.to_pure_dict` layout)."""
    mesh_shape = dict(mesh.shape)
    flat = {
        path: logical_to_spec(logical_axes_of(v), rules, v.get_value().shape, mesh_shape)
        for path, v in nnx.to_flat_state(state)
    }
    return traverse_util.unflatten_dict(flat)


def named_shardings(specs, mesh: jax.sharding.Mesh):
    """NamedSharding on `mesh` for every PartitionSpec of a pytree."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules: ShardingRules) -> None:
    """Places every parameter of `model` on `mesh` according to `rules`, in place."""
    state = nnx.state(model)
    shardings = named_shardings(partition_specs(state, mesh, rules), mesh)
    nnx.update(model, jax.device_put(nnx.to_pure_dict(state), shardings))


@contextlib.contextmanager
def axis_rules(rules: ShardingRules | None) -> Iterator[None]:
    """Activates `rules` for `constrain` while a function is traced."""
    token = _ACTIVE_RULES.set(rules)
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op without active rules and mesh."""
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    spec = logical_to_spec(logical_axes, rules, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)


def sequence_layout(rows: int, heads: int, kv_heads: int) -> SequenceLayout | None:
    """How packed rows are split for context-parallel attention, under the active rules
    and mesh; None when `length` is not split over a mesh axis of more than one device.

    Args:
      rows: rows per batch (split over the `batch` rule's axis when it divides them).
      heads, kv_heads: query and key/value heads (split over the `heads` rule's axis
        when `kv_heads` follows the same axis and it divides both).
    """
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return None
    table, sizes = dict(rules), dict(mesh.shape)
    sequence = table.get("length")
    if sequence is None or sizes.get(sequence, 1) == 1:
        return None
    batch = table.get("batch")
    if batch not in sizes or batch == sequence or rows % sizes[batch]:
        batch = None
    head_axis = table.get("heads")
    if (
        head_axis not in sizes
        or head_axis in (sequence, batch)
        or table.get("kv_heads") != head_axis
        or heads % sizes[head_axis]
        or kv_heads % sizes[head_axis]
    ):
        head_axis = None
    return SequenceLayout(mesh, sequence=sequence, batch=batch, heads=head_axis)
