"""Attention over packed tree rows, and over a KV cache for decoding.

Tree mask (DESIGN.md, Packing): key k is visible to query q iff
`k <= q < subtree_end[k]`. One integer per key encodes the whole prefix-shared tree;
separate trees in one row never see each other. An ordinary causal sequence is the
special case `subtree_end = length`.

Three implementations with equal outputs:
  * `dense_tree_attention`: builds the [L, L] mask; the reference.
  * `blocked_tree_attention`: online softmax over key blocks with a hand-written
    backward pass (flash-attention style); memory O(L * block), never an [L, L] tensor.
    Both passes run one loop over a schedule of the live (query block, key block)
    pairs (`live_block_schedule`), so blocks that the mask hides entirely (above the
    diagonal, or keys whose subtrees end before the query block) are never visited.
  * `context_parallel_tree_attention`: the blocked attention over rows split over a
    mesh axis (`sequence`): K/V shards travel a ring (`ppermute` in a `shard_map`), the
    mask is applied on global row indices, the backward pass runs the same ring, and
    transfers the mask makes useless are skipped; memory per device O(L / S).

Shapes: q float[B, L, H, D]; k, v float[B, L, KV, D] with H a multiple of KV (grouped
query attention); subtree_end int32[B, L]. Scores and softmax are float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

_NEG = -1e30  # finite "minus infinity": keeps exp() and max() free of inf - inf.


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    b, length, h, d = q.shape
    return q.reshape(b, length, num_kv_heads, h // num_kv_heads, d)


def tree_mask(subtree_end: jax.Array) -> jax.Array:
    """bool[B, L, L] mask[b, q, k] = k <= q < subtree_end[b, k]."""
    idx = jnp.arange(subtree_end.shape[-1])
    causal = idx[None, :] <= idx[:, None]  # [q, k]
    inside = idx[None, :, None] < subtree_end[:, None, :]  # [b, q, k]
    return causal[None] & inside


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention with an explicit mask.

    Args:
      q: float[B, T, H, D] queries.
      k: float[B, S, KV, D] keys.
      v: float[B, S, KV, D] values.
      mask: bool[B, T, S]; every query must see at least one key.

    Returns:
      float[B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    qg = _group(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def dense_tree_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, subtree_end: jax.Array
) -> jax.Array:
    """Reference tree attention: materialises the [L, L] mask."""
    return dense_attention(q, k, v, tree_mask(subtree_end))


def blocked_tree_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, subtree_end: jax.Array, block_size: int = 512
) -> jax.Array:
    """Memory-efficient tree attention; equal to `dense_tree_attention`.

    Args:
      q: float[B, L, H, D].
      k: float[B, L, KV, D].
      v: float[B, L, KV, D].
      subtree_end: int32[B, L], row index one past each key's subtree.
      block_size: query and key block length; L is padded up to a multiple of it.

    Returns:
      float[B, L, H, D] in q's dtype.
    """
    b, length, h, d = q.shape
    block = min(block_size, length)
    padded = -(-length // block) * block
    if padded != length:
        q, k, v, subtree_end = pad_rows(q, k, v, subtree_end, padded)
    out = _blocked(_group(q, k.shape[2]), k, v, subtree_end.astype(jnp.int32), block)
    return out.reshape(b, padded, h, d)[:, :length].astype(q.dtype)


def pad_rows(q, k, v, subtree_end, padded: int):
    """Pads rows at their end to `padded` tokens, with keys that see only themselves (so
    real queries never read them)."""
    b, length = subtree_end.shape
    extra = padded - length
    pad = ((0, 0), (0, extra), (0, 0), (0, 0))
    tail = jnp.arange(length, padded, dtype=subtree_end.dtype) + 1
    ends = jnp.concatenate([subtree_end, jnp.broadcast_to(tail, (b, extra))], axis=1)
    return jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), ends


# --- kernels shared by the single-device and the context-parallel attention -----------
#
# Each runs over one (query range, key range) pair: the single-device attention once,
# with both ranges the whole row; the context-parallel one once per ring step, with the
# local queries against the key shard that has arrived. Ranges carry their global row
# offsets, so the tree mask is always applied on global indices.
#
# A pair of ranges first gets its schedule: the list of live (query block, key block)
# pairs, computed once from subtree_end and the offsets. Then one loop runs over that
# list and nothing else: its trip count is the number of live pairs (a while loop with
# a traced bound), so no block pair the mask hides is visited, and no pair is tested
# with a conditional. On a GPU each loop iteration and each conditional costs a host
# round trip; in a row of agent-shaped trees only a few percent of all pairs are live
# (4.7% of a 32k-token row at block 512, benchmarks/attention_bench.py). Blocks are cut
# with dynamic slices of the [B, L, ...] arrays and the running state is updated in
# place, so no block-major copy of q, k, v or of the state is ever made.


def _block_live(ends, q_offset, k_offset, nq: int, block: int) -> jax.Array:
    """bool[nq, nk]: some query of query block i may see some key of key block j (any row).

    Args:
      ends: int32[B, Lk], the keys' subtree_end (global row indices).
      q_offset, k_offset: global row index of the first query / key; multiples of
        `block`, so query and key blocks lie on one grid and "key block after query
        block" is a comparison of their starts.
      nq: number of query blocks.
      block: block length.
    """
    b, length = ends.shape
    q_starts = q_offset + jnp.arange(nq) * block
    k_starts = k_offset + jnp.arange(length // block) * block
    key_reach = ends.reshape(b, length // block, block).max(axis=(0, 2))  # [nk]
    causal = k_starts[None, :] <= q_starts[:, None]  # key block not after query block
    reaches = key_reach[None, :] > q_starts[:, None]  # some key's subtree reaches block i
    return causal & reaches


class BlockSchedule(NamedTuple):
    """The live (query block, key block) pairs of a (query range, key range) pair.

    Attributes:
      query_block: int32[P], each pair's query block (index within the query range).
      key_block: int32[P], its key block (index within the key range).
      count: int32[], the number of live pairs: the first `count` entries, in the
        schedule's order. P is static, the most pairs that can be live. Entries past
        `count` repeat the last live pair ((0, 0) when none is live), so a kernel that
        runs a fixed grid of P steps and skips those past `count` fetches no new block
        for them.
    """

    query_block: jax.Array
    key_block: jax.Array
    count: jax.Array


def live_block_schedule(
    subtree_end: jax.Array,
    block: int,
    num_query_blocks: int | None = None,
    q_offset=0,
    k_offset=0,
    *,
    key_major: bool = False,
    valid=True,
) -> BlockSchedule:
    """The (query block, key block) pairs in which some query may see some key.

    A pair is live iff its key block does not start after its query block (k <= q) and
    some key of the block has a subtree reaching the query block's start
    (q < subtree_end[k]). One schedule serves every row of the batch (the union over
    rows), since the blocked attention handles all rows in each vectorised step.

    Args:
      subtree_end: int32[B, Lk], the keys' subtree_end (global row indices); Lk a
        multiple of `block`.
      block: query and key block length.
      num_query_blocks: blocks in the query range; by default Lk // block (the
        single-device attention, where both ranges are the whole row).
      q_offset: global row index of the first query (int or int32 scalar), a multiple
        of `block`.
      k_offset: global row index of the first key, likewise.
      key_major: order the pairs by key block, then query block (the backward pass);
        otherwise by query block, then key block (the forward pass).
      valid: bool (or a traced bool); False gives an empty schedule (a ring step with
        nothing to attend).

    Returns:
      A `BlockSchedule` whose static length P is the number of pairs with the key block
      not after the query block when both offsets are Python ints, else
      num_query_blocks * (Lk // block).
    """
    ends = subtree_end.astype(jnp.int32)
    nk = ends.shape[1] // block
    nq = nk if num_query_blocks is None else num_query_blocks
    if isinstance(q_offset, int) and isinstance(k_offset, int):
        q_starts = q_offset + np.arange(nq) * block
        k_starts = k_offset + np.arange(nk) * block
        size = int((k_starts[None, :] <= q_starts[:, None]).sum())
    else:
        size = nq * nk
    size = max(size, 1)
    live = _block_live(ends, q_offset, k_offset, nq, block) & valid
    flat = (live.T if key_major else live).reshape(-1)
    (index,) = jnp.nonzero(flat, size=size, fill_value=0)
    count = jnp.sum(flat, dtype=jnp.int32)
    index = jnp.where(jnp.arange(size) < count, index, index[jnp.maximum(count - 1, 0)])
    major, minor = jnp.divmod(index.astype(jnp.int32), nq if key_major else nk)
    query_block, key_block = (minor, major) if key_major else (major, minor)
    return BlockSchedule(query_block, key_block, count)


def _for_live_pairs(schedule: BlockSchedule, update, carry):
    """carry = update(query block, key block, carry) for each live pair, in order.

    One while loop of `schedule.count` iterations. Returns the final carry and the
    loop's own iteration counter (the pairs computed).
    """

    def step(loop):
        t, carry = loop
        return t + 1, update(schedule.query_block[t], schedule.key_block[t], carry)

    def more(loop):
        return loop[0] < schedule.count

    pairs, carry = jax.lax.while_loop(more, step, (jnp.zeros((), jnp.int32), carry))
    return carry, pairs


def _tile(q_blk, k_blk, ends_blk, q_start, k_start):
    """Masked float32 scores of a query block against a key block.

    Shapes: q_blk [B, bq, KV, G, D], k_blk [B, bk, KV, D], ends_blk [B, bk]; q_start,
    k_start: global row index of the blocks' first query / key.
    Returns scores [B, KV, G, bq, bk] and mask [B, 1, 1, bq, bk].
    """
    d = q_blk.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    q_idx = q_start + jnp.arange(q_blk.shape[1])
    k_idx = k_start + jnp.arange(k_blk.shape[1])
    mask = (k_idx[None, :] <= q_idx[:, None])[None] & (q_idx[None, :, None] < ends_blk[:, None, :])
    mask = mask[:, None, None]
    return jnp.where(mask, scores, _NEG), mask


def _slice(x: jax.Array, index, block: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def _put(x: jax.Array, update: jax.Array, index, block: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update, index * block, axis)


def _after(buffers, anchor: jax.Array):
    """`buffers` (float32 initial states), computed only once `anchor` exists.

    A loop's constant initial state is copied into the loop's carry, and a scheduler
    may make that copy as early as it likes: XLA's CPU scheduler makes every layer's at
    the start of the program and holds them through the forward and backward, a few
    row-sized buffers per layer. Adding 0 x one element of `anchor` (x * 0 is not 0 for
    floats, so no compiler folds it; a non-finite anchor makes the attention non-finite
    anyway) ties each state to the values its loop consumes.
    """
    zero = 0 * anchor.reshape(-1)[0].astype(jnp.float32)
    return jax.tree.map(lambda b: b + zero, buffers)


def _softmax_state(q: jax.Array):
    """Empty online-softmax state for queries q [B, L, KV, G, D]: running max and
    denominator float32[B, KV, G, L], accumulator float32[B, KV, G, L, D]."""
    b, length, kv, g, d = q.shape
    state = (
        jnp.full((b, kv, g, length), _NEG, jnp.float32),
        jnp.zeros((b, kv, g, length), jnp.float32),
        jnp.zeros((b, kv, g, length, d), jnp.float32),
    )
    return _after(state, q)


def _attend(q, k, v, ends, q_offset, k_offset, state, block: int, valid=True):
    """Online-softmax update of the queries with every live (query, key) block pair.

    Query-major: a query block's pairs are consecutive, so its running state stays hot
    while its key blocks stream past, and each query block takes its key blocks in
    increasing order (the float summation order of a plain loop over key blocks).

    Args:
      q: [B, Lq, KV, G, D] queries at global rows q_offset ...
      k, v: [B, Lk, KV, D] keys and values at global rows k_offset ...
      ends: int32[B, Lk] the keys' subtree_end (global row indices).
      state: `_softmax_state` of q.
      valid: bool; False skips every block (a ring step with nothing to attend).

    Returns:
      (the updated state, int32[] the number of block pairs computed).
    """
    nq = q.shape[1] // block
    schedule = live_block_schedule(ends, block, nq, q_offset, k_offset, valid=valid)

    def update(i, j, state):
        m_all, denom_all, acc_all = state
        m, denom, acc = (_slice(x, i, block, 3) for x in state)
        scores, mask = _tile(
            _slice(q, i, block),
            _slice(k, j, block),
            _slice(ends, j, block),
            q_offset + i * block,
            k_offset + j * block,
        )
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        denom = denom * corr + p.sum(axis=-1)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _slice(v, j, block))
        acc = acc * corr[..., None] + pv.astype(jnp.float32)
        return (
            _put(m_all, m_new, i, block, 3),
            _put(denom_all, denom, i, block, 3),
            _put(acc_all, acc, i, block, 3),
        )

    return _for_live_pairs(schedule, update, state)


def _finish(state):
    """out float32[B, L, KV, G, D] and log-sum-exp float32[B, KV, G, L] from the state.

    Every query sees at least itself (subtree_end[q] > q), so no denominator is zero.
    """
    m, denom, acc = state
    out = jnp.transpose(acc / denom[..., None], (0, 3, 1, 2, 4))
    return out, m + jnp.log(denom)


def _attend_bwd(
    q, do, lse, delta, k, v, ends, q_offset, k_offset, grads, block, *, valid=True, send=None
):
    """Adds the gradient contributions of every live (query, key) block pair.

    Key-major (FlashAttention-2's order): a key block's pairs are consecutive (its live
    query blocks are one contiguous run, from its own up to where its subtrees end), so
    a kernel keeps the block's dK/dV in fast memory while the query blocks stream past.
    Here the loop adds each pair's dK/dV into dk, dv in place; the summation order is
    that of nested loops over key blocks, then query blocks.

    In the ring (`send` given) the keys are a visiting shard whose dK/dV belong to
    another device. A flat loop cannot send a key block home when its last pair is
    done: which pair is last, and how many pairs there are, differ from device to
    device, and a collective (ppermute) must run equally often on every device: under
    a per-pair conditional or inside a loop of device-dependent length it would hang.
    So the visiting shard's dK/dV are summed into a float32 buffer of the shard's size
    and sent home in one transfer after the loop. Transfers: the bytes of sending every
    key block (which a per-key-block send had to do as well, dead blocks' zeros
    included, for the same reason) in one collective per ring step instead of one per
    key block, so devices meet once a step rather than waiting for the slowest device
    at every key block. Memory: one more shard-sized dK/dV pair, O(L / S) like the two
    K/V shards the ring already holds; nothing of size (L / block)^2 beyond the
    schedule's indices.

    Args:
      q, do: [B, Lq, KV, G, D] queries and output cotangents (global rows from q_offset).
      lse, delta: float32[B, KV, G, Lq] log-sum-exp and sum_d dO * O per query.
      k, v: [B, Lk, KV, D] keys and values (global rows from k_offset).
      ends: int32[B, Lk].
      grads: (dq float32[B, Lq, KV, G, D], dk, dv float32[B, Lk, KV, D]) so far.
      valid: bool; False skips every block (a ring step with nothing to attend).
      send: None, or applied to this range's (dk, dv) contributions [B, Lk, KV, D]
        before they are added to dk, dv (the ring sends them to the device that owns
        the key shard, which adds them to its own).

    Returns:
      ((dq, dk, dv) with this pair's contributions added, int32[] the number of block
      pairs computed).
    """
    scale = q.shape[-1] ** -0.5
    nq = q.shape[1] // block
    schedule = live_block_schedule(ends, block, nq, q_offset, k_offset, key_major=True, valid=valid)

    def update(i, j, grads):
        dq, dk, dv = grads
        q_blk, do_blk = _slice(q, i, block), _slice(do, i, block)
        lse_blk, delta_blk = _slice(lse, i, block, 3), _slice(delta, i, block, 3)
        k_blk, v_blk = _slice(k, j, block), _slice(v, j, block)
        scores, mask = _tile(
            q_blk, k_blk, _slice(ends, j, block), q_offset + i * block, k_offset + j * block
        )
        p = jnp.where(mask, jnp.exp(scores - lse_blk[..., None]), 0.0)
        dv_blk = jnp.einsum("bkgqs,bqkgd->bskd", p, do_blk.astype(jnp.float32))
        dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_blk[..., None]) * scale
        dq_blk = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk.astype(jnp.float32))
        dk_blk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk.astype(jnp.float32))
        return (
            _put(dq, _slice(dq, i, block) + dq_blk, i, block),
            _put(dk, _slice(dk, j, block) + dk_blk, j, block),
            _put(dv, _slice(dv, j, block) + dv_blk, j, block),
        )

    if send is None:
        return _for_live_pairs(schedule, update, grads)
    dq, dk, dv = grads
    zeros = jnp.zeros(k.shape, jnp.float32)
    (dq, dk_here, dv_here), pairs = _for_live_pairs(schedule, update, (dq, zeros, zeros))
    dk_here, dv_here = send((dk_here, dv_here))
    return (dq, dk + dk_here, dv + dv_here), pairs


def _zero_grads(q, k, d_out):
    """float32 zeros (dq, dk, dv) for grouped queries q [B, L, KV, G, D] and keys k,
    made once the output cotangent `d_out` exists (`_after`)."""
    zeros_kv = jnp.zeros(k.shape, jnp.float32)
    return _after((jnp.zeros(q.shape, jnp.float32), zeros_kv, zeros_kv), d_out)


def _delta(d_out, out):
    """float32[B, KV, G, L] sum_d dO * O, the softmax-backward correction per query."""
    return jnp.einsum("blkgd,blkgd->bkgl", d_out.astype(jnp.float32), out.astype(jnp.float32))


# --- single device -------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q, k, v, subtree_end, block):
    return _blocked_fwd(q, k, v, subtree_end, block)[0]


def _blocked_fwd(q, k, v, subtree_end, block):
    state, _ = _attend(q, k, v, subtree_end, 0, 0, _softmax_state(q), block)
    out, lse = _finish(state)
    out = out.astype(q.dtype)
    return out, (q, k, v, subtree_end, out, lse)


def _blocked_bwd(block, residuals, d_out):
    q, k, v, subtree_end, out, lse = residuals
    delta = _delta(d_out, out)
    grads = _zero_grads(q, k, d_out)
    (dq, dk, dv), _ = _attend_bwd(q, d_out, lse, delta, k, v, subtree_end, 0, 0, grads, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# --- context parallel: a row split over a `sequence` mesh axis ------------------------
#
# Ring, not all-gather. Gathering K/V puts the whole row's keys and values on every
# device (and, in the backward pass, whole-row dK/dV sums before a reduce-scatter), so
# per-device memory would stay O(L) however many shards there are; the point of the
# axis is memory falling with the shard count. In the ring a device holds its own shard
# plus the K/V shard in use and the one arriving: O(L / S). The ring also lets the tree
# mask save communication, which a gather cannot:
#   * k <= q, so query shard s needs K/V only from shards t <= s: K/V move forward only
#     (never S-1 -> 0), and step r sends only the S - r shards someone still needs
#     (S(S-1)/2 shard transfers in all, not S(S-1));
#   * a key shard's subtrees reach a contiguous run of later shards, so `hops` (the most
#     shards any key's subtree reaches past its own, over the mesh) bounds every useful
#     transfer, and steps past it are skipped whole: a row of many short trees, each
#     within one or two shards, needs one step however large S is.
# The backward pass runs the same ring: dq stays home; the dK/dV a ring step computes for
# the visiting key shard go back to the shard that owns it in one transfer at the end of
# the step (see `_attend_bwd` for why not a key block at a time).


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Where packed rows lie on a mesh, for `context_parallel_tree_attention`.

    Attributes:
      mesh: the mesh (concrete, or the abstract mesh of `jax.set_mesh`), Auto axes.
      sequence: the mesh axis the row length is split over.
      batch: the mesh axis rows are split over, or None.
      heads: the mesh axis query and key/value heads are split over, or None (it must
        divide both the query and the key/value heads).
    """

    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    sequence: str = "sequence"
    batch: str | None = None
    heads: str | None = None

    @property
    def shards(self) -> int:
        return dict(self.mesh.shape)[self.sequence]


def context_parallel_tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    subtree_end: jax.Array,
    layout: SequenceLayout,
    block_size: int = 512,
    kernel: str = "xla",
) -> jax.Array:
    """Tree attention over rows split over a mesh axis; equal to `blocked_tree_attention`.

    Each device keeps its shard of queries; K/V shards (with their subtree_end) travel
    forward around a ring, and the mask `k <= q < subtree_end[k]` is applied on global
    row indices. The backward pass is hand-written (custom VJP) and runs the same ring.
    Memory per device O(L / S); no tensor is [L, L] or [L / S, L / S].

    Args:
      q: float[B, L, H, D].
      k: float[B, L, KV, D].
      v: float[B, L, KV, D].
      subtree_end: int32[B, L], row index one past each key's subtree.
      layout: the mesh and its axes; S = `layout.shards` shards of the row.
      block_size: query and key block length within a shard. L is padded at its end
        (with tokens that see only themselves) to a multiple of S * block, so rows that
        S * block divides are used as they are.
      kernel: what a ring step runs: "xla" (the live-pair loop of `_attend`) or
        "pallas" (the Mosaic GPU kernels of `attention_kernel`, the same per-step pair
        computation; block 64 or 128).

    Returns:
      float[B, L, H, D] in q's dtype.
    """
    if kernel not in _RING_STEPS:
        raise ValueError(f"kernel={kernel!r}: expected one of {', '.join(_RING_STEPS)}")
    length = q.shape[1]
    shards = layout.shards
    per_shard = -(-length // shards)
    block = min(block_size, per_shard)
    per_shard = -(-per_shard // block) * block
    padded = shards * per_shard
    if padded != length:
        q, k, v, subtree_end = pad_rows(q, k, v, subtree_end, padded)
    out = _ring(q, k, v, subtree_end.astype(jnp.int32), layout, block, kernel)
    return out[:, :length]


def _specs(layout: SequenceLayout):
    """PartitionSpecs of [B, L, heads, D] rows, [B, L] subtree_end, [B, H, L] lse."""
    row = PartitionSpec(layout.batch, layout.sequence, layout.heads, None)
    ends = PartitionSpec(layout.batch, layout.sequence)
    lse = PartitionSpec(layout.batch, layout.heads, layout.sequence)
    return row, ends, lse


def _hops(ends: jax.Array, shard, per_shard: int, layout: SequenceLayout):
    """The most shards any key's subtree reaches past its own, over the whole mesh.

    Taken over every device, not only this ring, so that a skip is the same everywhere:
    collectives run under `lax.cond`/`lax.switch` only on a predicate all devices share.
    """
    last = (jnp.max(ends) - 1) // per_shard  # subtree_end[k] > k: last >= shard
    axes = tuple(a for a in (layout.batch, layout.sequence) if a is not None)
    return jax.lax.pmax(last - shard, axes)


def _sends(layout: SequenceLayout, back: bool) -> list:
    """`lax.switch` branches: branch r sends for ring step r; branch 0 sends nothing.

    Forward (K/V for step r): device i holds the shard of origin i - r + 1, which exists
    only for i >= r - 1, so devices r - 1 .. S - 2 send one hop on. Back (dK/dV computed
    at step r, for the shard of origin i - r): device i -> i - r, for i >= r.
    """

    def send(x, step):
        if back:
            perm = [(i, i - step) for i in range(step, layout.shards)]
        else:
            perm = [(i, i + 1) for i in range(step - 1, layout.shards - 1)]
        return jax.lax.ppermute(x, layout.sequence, perm)

    return [lambda x: x] + [functools.partial(send, step=r) for r in range(1, layout.shards)]


def _ring_forward(q, k, v, ends, *, layout: SequenceLayout, block: int, kernel: str):
    """shard_map body: local q [B, Ls, H, D], k/v [B, Ls, KV, D], ends int32[B, Ls]
    (global indices) -> out [B, Ls, H, D] in q's dtype and lse float32[B, H, Ls]."""
    attend_step = _RING_STEPS[kernel][0]
    b, per_shard, h, d = q.shape
    shard = jax.lax.axis_index(layout.sequence)
    q = _group(q, k.shape[2])
    hops = _hops(ends, shard, per_shard, layout)
    sends = _sends(layout, back=False)
    here = shard * per_shard

    state, _ = attend_step(q, k, v, ends, here, here, _softmax_state(q), block)  # step 0: own

    # One ring step per loop iteration, not unrolled: the loop carry keeps two K/V shards
    # alive (in use, arriving). Unrolled, no transfer depends on any compute, so XLA may
    # run them all first and hold all S shards, an all-gather's memory.
    def ring_step(carry, r):
        state, kv = carry
        # Sent before this step's compute, so the transfer can overlap it.
        arriving = jax.lax.switch(jnp.where(r + 1 <= hops, r + 1, 0), sends, kv)
        origin = (shard - r) * per_shard
        valid = (r <= shard) & (r <= hops)
        state, _ = attend_step(q, *kv, here, origin, state, block, valid=valid)
        return (state, arriving), None

    if layout.shards > 1:
        first = jax.lax.switch(jnp.minimum(hops, 1), sends[:2], (k, v, ends))
        steps = jnp.arange(1, layout.shards)
        (state, _), _ = jax.lax.scan(ring_step, (state, first), steps)
    out, lse = _finish(state)
    return out.reshape(b, per_shard, h, d).astype(q.dtype), lse.reshape(b, h, per_shard)


def _ring_backward(
    q, k, v, ends, out, lse, d_out, *, layout: SequenceLayout, block: int, kernel: str
):
    """shard_map body of the backward pass: dq, dk, dv of the local shard.

    K/V travel forward exactly as in the forward pass; dq accumulates locally; the dK/dV
    that step r computes for the key shard of origin s - r go back to it in one transfer
    at the end of the step (device s -> s - r), and are added to its own.
    """
    attend_bwd = _RING_STEPS[kernel][1]
    b, per_shard, h, d = q.shape
    kv_heads = k.shape[2]
    shard = jax.lax.axis_index(layout.sequence)
    q, d_out, out = (_group(x, kv_heads) for x in (q, d_out, out))
    lse = lse.reshape(b, kv_heads, h // kv_heads, per_shard)
    delta = _delta(d_out, out)
    hops = _hops(ends, shard, per_shard, layout)
    sends, returns = _sends(layout, back=False), _sends(layout, back=True)
    here = shard * per_shard

    def attend(grads, kv, origin, **opts):
        grads, _ = attend_bwd(q, d_out, lse, delta, *kv, here, origin, grads, block, **opts)
        return grads

    grads = attend(_zero_grads(q, k, d_out), (k, v, ends), here)  # step 0: own

    def ring_step(carry, r):
        grads, kv = carry
        arriving = jax.lax.switch(jnp.where(r + 1 <= hops, r + 1, 0), sends, kv)
        send = lambda blocks: jax.lax.switch(r, returns, blocks)

        def step(grads, kv):
            origin = (shard - r) * per_shard
            return attend(grads, kv, origin, valid=r <= shard, send=send)

        # Past `hops` nothing is computed or sent anywhere (the predicate is shared).
        grads = jax.lax.cond(r <= hops, step, lambda grads, _: grads, grads, kv)
        return (grads, arriving), None

    if layout.shards > 1:
        first = jax.lax.switch(jnp.minimum(hops, 1), sends[:2], (k, v, ends))
        steps = jnp.arange(1, layout.shards)
        (grads, _), _ = jax.lax.scan(ring_step, (grads, first), steps)
    dq, dk, dv = grads
    dq = dq.reshape(b, per_shard, h, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, subtree_end, layout, block, kernel):
    return _ring_fwd(q, k, v, subtree_end, layout, block, kernel)[0]


def _ring_fwd(q, k, v, subtree_end, layout, block, kernel):
    row, ends, lse = _specs(layout)
    forward = jax.shard_map(
        functools.partial(_ring_forward, layout=layout, block=block, kernel=kernel),
        mesh=layout.mesh,
        in_specs=(row, row, row, ends),
        out_specs=(row, lse),
        check_vma=False,  # see _ring_bwd
    )
    out, lse_value = forward(q, k, v, subtree_end)
    return out, (q, k, v, subtree_end, out, lse_value)


def _ring_bwd(layout, block, kernel, residuals, d_out):
    row, ends, lse = _specs(layout)
    backward = jax.shard_map(
        functools.partial(_ring_backward, layout=layout, block=block, kernel=kernel),
        mesh=layout.mesh,
        in_specs=(row, row, row, ends, row, lse, row),
        out_specs=(row, row, row),
        # The kernels are shared with the single-device attention, whose zero-initialised
        # states would need casting to "varying" for the check; nothing here is
        # differentiated by JAX (this is the VJP), so the check would buy nothing.
        check_vma=False,
    )
    dq, dk, dv = backward(*residuals, d_out)
    return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# --- the ring step on the Pallas kernels ---------------------------------------------------
#
# The same contract as `_attend` / `_attend_bwd` (grouped queries, the online-softmax
# state, gradients added in place, `valid`, `send`), so the ring above runs either. The
# kernel returns a range's output normalised over that range with its log-sum-exp, which
# is the state of that range alone (max = lse, denominator 1, accumulator = output), so
# it merges into the running state like a block. A step a device must skip (`valid`
# false: its ring buffer holds no shard yet) runs the kernel all the same and discards
# what it gives: a ring step lasts as long as its slowest device anyway, and the GPU
# interpret mode that tests the kernels on CPU synchronises every device's call.


def _ungroup(x: jax.Array) -> jax.Array:
    """[B, L, KV, G, D] -> [B, L, H, D] (query head h = kv * G + g, as `_group` splits)."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])


def _kernel_attend(q, k, v, ends, q_offset, k_offset, state, block: int, valid=True):
    from gyrejax.model import attention_kernel  # Mosaic GPU: imported only when used

    b, length, kv, g, d = q.shape

    out, lse = attention_kernel.tree_attention_forward(
        _ungroup(q), k, v, ends, q_offset, k_offset, block_q=block, block_k=block
    )
    out = jnp.transpose(out.reshape(b, length, kv, g, d), (0, 2, 3, 1, 4)).astype(jnp.float32)
    lse = jnp.where(valid, lse.reshape(b, kv, g, length), _NEG)
    m, denom, acc = state
    m_new = jnp.maximum(m, lse)
    # A query that sees nothing in this range (lse -1e30) adds nothing, as in `_attend`.
    old, new = jnp.exp(m - m_new), jnp.where(lse > _NEG / 2, jnp.exp(lse - m_new), 0.0)
    state = (m_new, denom * old + new, acc * old[..., None] + out * new[..., None])
    return state, jnp.zeros((), jnp.int32)


def _kernel_attend_bwd(
    q, do, lse, delta, k, v, ends, q_offset, k_offset, grads, block, *, valid=True, send=None
):
    from gyrejax.model import attention_kernel

    b, length, kv, g, _ = q.shape
    flat = lambda x: x.reshape(b, kv * g, length)  # [B, KV, G, L] -> [B, H, L]

    dq_step, dk_step, dv_step = attention_kernel.tree_attention_backward(
        _ungroup(q), k, v, ends, _ungroup(do), flat(lse), flat(delta), q_offset, k_offset,
        block_q=64, block_k=block,
    )  # fmt: skip
    dq_step, dk_step, dv_step = (
        jnp.where(valid, x, 0.0) for x in (dq_step.reshape(q.shape), dk_step, dv_step)
    )
    if send is not None:
        dk_step, dv_step = send((dk_step, dv_step))
    dq, dk, dv = grads
    return (dq + dq_step, dk + dk_step, dv + dv_step), jnp.zeros((), jnp.int32)


# What a ring step runs, by `context_parallel_tree_attention`'s `kernel`: (forward,
# backward), each over one (query range, key range) pair.
_RING_STEPS = {"xla": (_attend, _attend_bwd), "pallas": (_kernel_attend, _kernel_attend_bwd)}


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> jax.Array:
    """One query per slot against that slot's cached keys.

    Args:
      q: float[S, H, D], the new token of each slot.
      k_cache: float[S, KV, M, D], already holding the new token's key.
      v_cache: float[S, KV, M, D].
      lengths: int32[S], valid cache entries per slot (the new token included).

    Returns:
      float[S, H, D].
    """
    s, h, d = q.shape
    kv, m = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(s, kv, h // kv, d)
    scores = jnp.einsum("skgd,skmd->skgm", qg, k_cache, preferred_element_type=jnp.float32)
    valid = jnp.arange(m)[None, :] < lengths[:, None]  # [S, M]
    scores = jnp.where(valid[:, None, None], scores * (d**-0.5), _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("skgm,skmd->skgd", probs.astype(v_cache.dtype), v_cache)
    return out.reshape(s, h, d).astype(q.dtype)
