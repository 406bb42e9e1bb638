"""Row buckets: rows come in a few lengths, chosen per batch to minimise packed tokens.

The trainer compiles one micro-step per shape, so the packer may use only lengths from
an allowed menu (`row_lengths`), and at most `max_row_shapes` distinct ones per batch.

A micro-step holds rows of one length. Its token budget is that of the base shape
[R, row_length]: rows of length l go `max(1, R * row_length // l)` to a micro-step, so
shorter rows come more to a micro-step and a row longer than the budget (one sharded
over a sequence axis) is a micro-step on its own. Each length's row count is padded to
a multiple of its rows per micro-step with all-padding rows, and those count as packed.

Choice. For a planned packing (the fill of every row), each allowed subset S of at most
`max_row_shapes` lengths, with max(S) >= the fullest row, puts every row in the
shortest length of S that holds it; the subset with the fewest packed tokens wins (ties:
fewer shapes, then the shorter lengths). The caller plans once per candidate longest
length and keeps the best, so the choice is never worse than any single allowed length.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

MAX_ALLOWED_LENGTHS = 12  # subsets are enumerated: keep the menu small


def rows_per_micro_step_for(length: int, *, row_length: int, rows_per_micro_step: int) -> int:
    """Rows of `length` in one micro-step: the token budget of [R, row_length], at least 1."""
    return max(1, rows_per_micro_step * row_length // length)


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """Lengths chosen for the rows of one planned packing.

    Attributes:
      lengths: the distinct lengths used, ascending.
      row_length: int64[rows] length of each planned row.
      packed_tokens: sum of row lengths, padding rows that fill micro-steps included.
    """

    lengths: tuple[int, ...]
    row_length: np.ndarray
    packed_tokens: int

    @property
    def key(self) -> tuple[int, int, tuple[int, ...]]:
        """Order of preference: fewer packed tokens, then fewer shapes, then shorter."""
        return (self.packed_tokens, len(self.lengths), self.lengths)


def packed_tokens_of(row_length: np.ndarray, *, base_length: int, rows_per_micro_step: int) -> int:
    """Packed tokens of rows with these lengths (int[rows]), micro-step padding included."""
    total = 0
    for length, count in zip(*np.unique(row_length, return_counts=True), strict=True):
        per = rows_per_micro_step_for(
            int(length), row_length=base_length, rows_per_micro_step=rows_per_micro_step
        )
        total += -(-int(count) // per) * per * int(length)
    return total


def choose_lengths(
    fills: np.ndarray,
    allowed: Sequence[int],
    max_shapes: int,
    *,
    base_length: int,
    rows_per_micro_step: int,
) -> BucketChoice:
    """The subset of `allowed` (at most `max_shapes`) that packs `fills` in fewest tokens.

    Args:
      fills: int[rows] tokens used in each planned row.
      allowed: allowed lengths, ascending; the longest must hold the fullest row.
      max_shapes: most distinct lengths.
      base_length, rows_per_micro_step: the base micro-step shape [R, row_length].

    Returns:
      A `BucketChoice`.
    """
    fills = np.asarray(fills, dtype=np.int64)
    if not len(fills):
        return BucketChoice((), np.zeros(0, np.int64), 0)
    need = int(fills.max())
    if not allowed or allowed[-1] < need:
        raise ValueError(f"no allowed row length {list(allowed)} holds a row of {need} tokens")
    best: BucketChoice | None = None
    for size in range(1, min(max_shapes, len(allowed)) + 1):
        for subset in itertools.combinations(allowed, size):
            if subset[-1] < need:
                continue
            lengths = np.asarray(subset, dtype=np.int64)
            row_length = lengths[np.searchsorted(lengths, fills)]
            used = tuple(int(x) for x in np.unique(row_length))
            packed = packed_tokens_of(
                row_length, base_length=base_length, rows_per_micro_step=rows_per_micro_step
            )
            choice = BucketChoice(used, row_length, packed)
            if best is None or choice.key < best.key:
                best = choice
    assert best is not None  # the longest allowed length alone always qualifies
    return best


def check_row_lengths(row_lengths: object, max_row_shapes: object) -> tuple[int, ...]:
    """Validates the menu and the cap; returns the menu sorted, without duplicates."""

    def is_int(x: object) -> bool:
        return isinstance(x, int | np.integer) and not isinstance(x, bool)

    if isinstance(row_lengths, str | bytes) or not isinstance(row_lengths, Sequence):
        raise ValueError(f"row_lengths must be a sequence of ints >= 1, got {row_lengths!r}")
    if not row_lengths or not all(is_int(x) and x >= 1 for x in row_lengths):
        raise ValueError(f"row_lengths must be a non-empty list of ints >= 1, got {row_lengths!r}")
    menu = tuple(sorted({int(x) for x in row_lengths}))
    if len(menu) > MAX_ALLOWED_LENGTHS:
        raise ValueError(
            f"row_lengths has {len(menu)} lengths; at most {MAX_ALLOWED_LENGTHS} are allowed"
        )
    if max_row_shapes is not None and (not is_int(max_row_shapes) or max_row_shapes < 1):
        raise ValueError(f"max_row_shapes must be an int >= 1 or None, got {max_row_shapes!r}")
    return menu
