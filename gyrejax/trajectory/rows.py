"""The packed-row schema: every per-token field of a packed row, its dtype and padding.

Written once, here; packing, `process`, the objective, the trainer and the distributed
transport all use it. Every array of a field is [rows, row_length]. Key k of a row is
visible to query q iff k <= q < subtree_end[k] (DESIGN.md, "Packing").

  tokens            int32    token ids (pad_id on padding)
  positions         int32    depth of each token in its path (0 on padding)
  subtree_end       int32    row index one past each token's subtree (i + 1 on padding)
  pred_index        int32    row index whose logits predict this token (-1 if none)
  loss_weight       float32  > 0 exactly on trained tokens; sums to 1 over the batch
  advantage         float32  the execution's group-relative advantage on all its tokens
  behavior_logprob  float32  sampling log-prob of trained tokens (0 elsewhere)
  version           int32    sampling policy version of trained tokens (0 elsewhere)
  temperature       float32  sampling temperature of trained tokens (1 elsewhere)
  top_p             float32  nucleus mass they were sampled with (1, no cut, elsewhere)
  top_k             int32    top-k they were sampled with (0, no cut, elsewhere)
  execution_index   int32    index of the token's execution in the batch (-1 on padding)

Pure NumPy, like the rest of `gyrejax.trajectory`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

# Field name -> dtype, in the order above.
ROW_FIELDS: dict[str, type[np.generic]] = {
    "tokens": np.int32,
    "positions": np.int32,
    "subtree_end": np.int32,
    "pred_index": np.int32,
    "loss_weight": np.float32,
    "advantage": np.float32,
    "behavior_logprob": np.float32,
    "version": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "execution_index": np.int32,
}
# What a training micro-step reads (all but the bookkeeping `execution_index`).
MICRO_STEP_FIELDS: tuple[str, ...] = tuple(f for f in ROW_FIELDS if f != "execution_index")


def padding_rows(n: int, row_length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """`n` all-padding rows of every field (the padding values of the module docstring)."""
    shape = (n, row_length)
    fill = {"tokens": pad_id, "pred_index": -1, "execution_index": -1}
    fill.update(temperature=1, top_p=1)
    rows = {name: np.full(shape, fill.get(name, 0), dtype) for name, dtype in ROW_FIELDS.items()}
    rows["subtree_end"][:] = np.arange(1, row_length + 1, dtype=np.int32)
    return rows


def micro_step_cut(
    micro_step_offsets: np.ndarray, row_lengths: np.ndarray, m: int
) -> tuple[slice, slice]:
    """Where micro-step m lies in a batch's [rows, width] arrays: its rows
    [offsets[m], offsets[m + 1]), cut to their row length (one length per micro-step).

    Raises:
      IndexError: m is not a micro-step of the batch.
    """
    num = len(micro_step_offsets) - 1
    if not 0 <= m < num:
        raise IndexError(f"micro-step {m} out of range [0, {num})")
    start, stop = (int(x) for x in micro_step_offsets[m : m + 2])
    return slice(start, stop), slice(0, int(row_lengths[start]))


def training_rows(
    get: Callable[[str], np.ndarray] | Mapping[str, np.ndarray], rows: slice = slice(None)
) -> dict[str, np.ndarray]:
    """The `MICRO_STEP_FIELDS` of some rows, in their schema dtypes.

    Args:
      get: a field's [rows, row_length] array by name (e.g. `lambda f: getattr(batch, f)`),
        or a mapping of them.
      rows: which rows (default all).
    """
    if isinstance(get, Mapping):
        get = get.__getitem__
    return {f: np.asarray(get(f)[rows], ROW_FIELDS[f]) for f in MICRO_STEP_FIELDS}
