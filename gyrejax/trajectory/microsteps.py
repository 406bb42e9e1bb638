"""Micro-steps: rows grouped into equal-size micro-steps balanced by a cost model.

Cost model per row: real tokens + (visible query-key pairs) / L. Dense work (MLP,
projections) scales with real tokens; attention work with the number of visible
(query, key) pairs, and the 1/L factor makes a query that reads a full row of keys
cost as much as one token's dense work. Rows are assigned to micro-steps of R rows by
longest-processing-time first (each row to the least-loaded micro-step that still has
room); all-padding rows fill the remaining slots.
"""

from __future__ import annotations

import heapq

import numpy as np


def row_costs(subtree_end: np.ndarray, execution_index: np.ndarray) -> np.ndarray:
    """Cost model per row: real tokens + visible (query, key) pairs / row_length.

    Key k is visible to queries k..subtree_end[k]-1, so the pairs of a row are
    sum(subtree_end[k] - k) over its real tokens.

    Args:
      subtree_end: int32[rows, L].
      execution_index: int32[rows, L], -1 on padding.

    Returns:
      float64[rows].
    """
    length = subtree_end.shape[1]
    real = execution_index >= 0
    span = (subtree_end - np.arange(length)[None, :]).astype(np.int64)
    pairs = np.where(real, span, 0).sum(axis=1)
    return real.sum(axis=1) + pairs / max(length, 1)


def assign_micro_steps(costs: np.ndarray, rows_per_micro_step: int) -> np.ndarray:
    """Orders rows so that micro-step m is rows [m*R, (m+1)*R), balanced by cost.

    Longest-processing-time first: rows by decreasing cost, each to the least-loaded
    micro-step that still has room (ties: lowest micro-step). Missing rows to a
    multiple of R are all-padding rows, numbered from len(costs) on.

    Args:
      costs: float[rows] per-row cost.
      rows_per_micro_step: R >= 1.

    Returns:
      int64[M*R] row permutation (indices >= len(costs) are padding rows).
    """
    n = len(costs)
    r = rows_per_micro_step
    num_steps = max(1, -(-n // r)) if n else 0
    total = num_steps * r
    padded = np.concatenate([np.asarray(costs, dtype=np.float64), np.zeros(total - n)])
    order = sorted(range(total), key=lambda i: (-padded[i], i))
    heap = [(0.0, m) for m in range(num_steps)]
    slots: list[list[int]] = [[] for _ in range(num_steps)]
    for i in order:
        load, m = heapq.heappop(heap)
        slots[m].append(i)
        if len(slots[m]) < r:
            heapq.heappush(heap, (load + padded[i], m))
    return np.asarray([i for s in slots for i in s], dtype=np.int64)


def assign_bucketed_micro_steps(
    costs: np.ndarray, row_length: np.ndarray, rows_per_length: dict[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Micro-steps of one row length each (row buckets), balanced within each length.

    Lengths go longest first; within one length rows are ordered by `assign_micro_steps`
    with that length's rows per micro-step. With a single length this is exactly
    `assign_micro_steps(costs, rows_per_length[length])`.

    Args:
      costs: float[rows] per-row cost.
      row_length: int[rows] length of each row.
      rows_per_length: rows per micro-step for each length present.

    Returns:
      (order, lengths, offsets): order int64[rows'] is a row permutation (indices >=
      len(costs) are all-padding rows); lengths int64[rows'] the length of each ordered
      row; micro-step m is ordered rows [offsets[m], offsets[m + 1]).
    """
    costs = np.asarray(costs, dtype=np.float64)
    row_length = np.asarray(row_length, dtype=np.int64)
    orders, lengths, offsets = [], [], [0]
    next_padding = len(costs)
    for length in sorted({int(x) for x in row_length}, reverse=True):
        rows = np.flatnonzero(row_length == length)
        per = rows_per_length[length]
        sub = assign_micro_steps(costs[rows], per)
        padding = sub >= len(rows)
        mapped = np.where(
            padding, next_padding + sub - len(rows), rows[np.minimum(sub, len(rows) - 1)]
        )
        next_padding += int(padding.sum())
        orders.append(mapped)
        lengths.append(np.full(len(sub), length, dtype=np.int64))
        offsets.extend(offsets[-1] + per * np.arange(1, len(sub) // per + 1))
    if not orders:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64)
    return (
        np.concatenate(orders),
        np.concatenate(lengths),
        np.asarray(offsets, dtype=np.int64),
    )
