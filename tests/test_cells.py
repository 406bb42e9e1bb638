"""Cells: ordered, equal groups of devices, each with its own (fsdp x tensor [x sequence]) mesh."""

import jax
import pytest

from gyrejax.cells import split_into_cells
from gyrejax.config import CellsConfig, ConfigError


def test_eight_devices_in_four_cells_of_two():
    cells = split_into_cells(CellsConfig(size=2, fsdp=1, tensor=2))
    assert [c.index for c in cells] == [0, 1, 2, 3]
    assert cells[0].is_core and not cells[1].is_core
    assert [[d.id for d in c.devices] for c in cells] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dict(cells[2].mesh.shape) == {"fsdp": 1, "tensor": 2}
    assert set(cells[2].mesh.devices.flat) == set(cells[2].devices)


def test_one_cell_of_all_devices():
    (cell,) = split_into_cells(CellsConfig(size=8, fsdp=4, tensor=2))
    assert dict(cell.mesh.shape) == {"fsdp": 4, "tensor": 2}
    assert len(cell.devices) == len(jax.devices())


def test_cell_size_must_divide_the_devices():
    with pytest.raises(ConfigError, match=r"config\.cells\.size=3: must divide the device count 8"):
        split_into_cells(CellsConfig(size=3, fsdp=3, tensor=1))


def test_sequence_axis_joins_the_mesh_when_configured():
    """cells.sequence > 1 adds a `sequence` axis (innermost: a ring of neighbours);
    sequence = 1 keeps the two-axis mesh."""
    (cell,) = split_into_cells(CellsConfig(size=8, fsdp=2, tensor=1, sequence=4))
    assert dict(cell.mesh.shape) == {"fsdp": 2, "tensor": 1, "sequence": 4}
    assert [d.id for d in cell.mesh.devices[1, 0]] == [4, 5, 6, 7]
    cells = split_into_cells(CellsConfig(size=4, fsdp=1, tensor=2, sequence=2))
    assert [dict(c.mesh.shape) for c in cells] == [{"fsdp": 1, "tensor": 2, "sequence": 2}] * 2
    (cell,) = split_into_cells(CellsConfig(size=8, fsdp=8, sequence=1))
    assert cell.mesh.axis_names == ("fsdp", "tensor")
