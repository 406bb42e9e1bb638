"""Cells: fixed groups of devices that switch between rollout and training as a unit.

The devices are split, in order, into K cells of equal size; each cell has its own
(fsdp x tensor) mesh, x sequence when `cells.sequence > 1` (a packed row's length split
over it: context-parallel tree attention), so every model-parallel group lies inside one
cell. Cell 0 is the
core cell (authoritative weights, the only optimizer state); the others are satellites.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from gyrejax.config import CellsConfig, ConfigError


@dataclasses.dataclass(frozen=True)
class Cell:
    """One group of devices and its mesh.

    Attributes:
      index: position in the fixed cell order; 0 is the core cell.
      devices: the cell's devices, in mesh order.
      mesh: `jax.sharding.Mesh` over `devices` with axes ("fsdp", "tensor"), and
        "sequence" when the config has one (`CellsConfig.mesh_shape`).
    """

    index: int
    devices: tuple[jax.Device, ...]
    mesh: jax.sharding.Mesh

    @property
    def is_core(self) -> bool:
        return self.index == 0

    def describe(self) -> str:
        ids = ",".join(str(d.id) for d in self.devices)
        shape = "x".join(f"{n}={s}" for n, s in self.mesh.shape.items())
        return f"cell {self.index}{' (core)' if self.is_core else ''}: devices [{ids}] mesh {shape}"


def split_into_cells(
    config: CellsConfig, devices: Sequence[jax.Device] | None = None
) -> list[Cell]:
    """Splits `devices` (default: all of `jax.devices()`) into cells of `config.size`.

    Raises:
      ConfigError: the cell size does not divide the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) % config.size:
        raise ConfigError(
            f"config.cells.size={config.size}: must divide the device count {len(devices)}"
        )
    cells = []
    for index in range(len(devices) // config.size):
        group = devices[index * config.size : (index + 1) * config.size]
        # Auto axes: GSPMD propagates shardings from parameters and inputs.
        shape = config.mesh_shape
        mesh = jax.make_mesh(
            tuple(shape.values()),
            tuple(shape),
            axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
            devices=group,
        )
        cells.append(Cell(index=index, devices=tuple(group), mesh=mesh))
    return cells
