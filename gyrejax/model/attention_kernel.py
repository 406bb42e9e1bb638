"""Tree attention as Pallas kernels for Hopper GPUs (Mosaic GPU): forward and backward.

Mask (DESIGN.md, Packing): key k is visible to query q iff `k <= q < subtree_end[k]`, on
global row indices. A call attends a (query range, key range) pair: q [B, Lq, H, D] at
global rows q_offset..., k, v [B, Lk, KV, D] at global rows k_offset..., ends int32[B, Lk]
their subtree_end (global); H a multiple of KV (grouped-query attention). The
single-device attention (`pallas_tree_attention`) is one call over the whole row; a
context-parallel ring makes one call per ring step (offsets may be traced) and merges
the steps by log-sum-exp. Inside a kernel the mask is an interval per key in local
query indices: key k is visible to query i iff first_query[k] <= i < end_query[k]
(`_key_spans`), two int32 vectors that travel with K/V, so kernels never see offsets.

Schedule (`tree_attention_schedule`, once per call, per batch row): the pair (query
block i, key block j) is live iff j starts at or before i's last query and the largest
subtree_end in j exceeds i's first query. The forward and dQ kernels run query-major
over each query block's list of live key blocks; the dK/dV kernel runs key-major over
each key block's live query blocks, one contiguous range (from the block holding the key
block's start to the block holding its largest subtree_end - 1). Loops run over these
counts (dynamic trip counts): a dead pair costs no copy and no matmul.

Kernels: a CTA is 1 or 2 compute warpgroups of 64 rows and 1 memory warpgroup, which
streams the other side's blocks (TMA copies) through 2 SMEM slots guarded by barriers.
Compute warpgroups run wgmma with float32 accumulators: an online softmax forward; the
backward recomputes probabilities from the final lse in a key-major dK/dV kernel (that
loops over the G query heads of its KV head, so GQA needs no per-head dK/dV) and a
query-major dQ kernel. A fused FA3 backward saves those 2 of 7 matmuls by adding dQ with
TMA reduce-add, which the GPU interpret mode cannot run, so nothing here could test it.

Backend: Mosaic GPU (`plgpu.kernel`). Pallas Triton is deprecated as of JAX 0.11, and a
plain `pl.pallas_call` already lowers to Mosaic GPU on GPU (warning to use
`plgpu.kernel`); only Mosaic GPU exposes wgmma, TMA and warp specialization. Lane
lowering semantics is pinned: JAX 0.11 made Warpgroup the default.

GPU interpret mode (JAX 0.10-0.11) runs these kernels on CPU but lacks transposed and
register wgmma operands, `layout_cast`, `broadcasted_iota` and `run_state`: `_Ops` writes
those few operations as plain jnp when interpreting. Barriers, TMA copies, schedule,
masks, softmax and stores are the same code in both.

Outputs: out in q's dtype (the ring merges partial outputs in float32), lse
float32[B, H, Lq] in natural log; a query that sees no key of the range gets out 0 and
lse -1e30. Gradients are float32 (or `grad_dtype`).

Limits: bfloat16/float16 (float32 only when interpreting), head_dim a multiple of 64 up
to 256, blocks of 64 or 128 dividing the lengths, SMEM <= 227 KiB (so head_dim 256 has
no backward). Not yet run on a GPU: PTX compile, register allocation, SMEM bank
conflicts, speed (yardstick: cuDNN causal flash attention per live block).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gyrejax.model import attention

_ROWS = 64  # rows per compute warpgroup: the M of one wgmma
_STAGES = 2  # blocks in flight between the memory warpgroup and the compute warpgroups
_NEG = -1e30  # lse of a query that sees nothing: finite, so ring steps merge cleanly
_LOG2E = math.log2(math.e)
_SMEM_BYTES = 227 * 1024  # dynamic shared memory per CTA on H100/H200
_MEMORY_REGISTERS = 40  # per-thread registers left to the memory warpgroup
_GPU_DTYPES = (jnp.bfloat16, jnp.float16)


# --- schedule --------------------------------------------------------------------------


class TreeSchedule(NamedTuple):
    """Live block pairs of one (query range, key range) call, per batch row.

    Attributes:
      forward_blocks: int32[B, nq, nk]; row i lists the live key blocks of query block i
        in increasing order, then padding (0).
      forward_counts: int32[B, nq], live key blocks per query block.
      backward_first: int32[B, nk], the first live query block of each key block.
      backward_counts: int32[B, nk], live query blocks per key block (a contiguous
        range from backward_first).
    """

    forward_blocks: jax.Array
    forward_counts: jax.Array
    backward_first: jax.Array
    backward_counts: jax.Array


def _key_spans(ends: jax.Array, q_offset, k_offset) -> tuple[jax.Array, jax.Array]:
    """The queries each key is visible to, in the call's local query indices.

    Returns (first_query, end_query), int32[B, Lk]: local query i sees local key k iff
    first_query[k] <= i < end_query[k].
    """
    ends = ends.astype(jnp.int32)
    shift = jnp.asarray(k_offset, jnp.int32) - jnp.asarray(q_offset, jnp.int32)
    first = jnp.arange(ends.shape[1], dtype=jnp.int32) + shift
    return jnp.broadcast_to(first, ends.shape), ends - jnp.asarray(q_offset, jnp.int32)


def _schedule_from_spans(first_query, end_query, q_len: int, block_q: int, block_k: int):
    b, k_len = end_query.shape
    nq, nk = q_len // block_q, k_len // block_k
    key_start = first_query[:, ::block_k]  # [B, nk]; first_query increases with k
    reach = end_query.reshape(b, nk, block_k).max(axis=2)  # [B, nk]
    q_first = jnp.arange(nq, dtype=jnp.int32) * block_q
    q_last = q_first + block_q - 1
    live = (key_start[:, None, :] <= q_last[None, :, None]) & (
        reach[:, None, :] > q_first[None, :, None]
    )  # [B, nq, nk]
    # Stable sort of "not live" puts the live key blocks first, in increasing order.
    blocks = jnp.argsort(~live, axis=2, stable=True).astype(jnp.int32)
    blocks = jnp.where(jnp.take_along_axis(live, blocks, axis=2), blocks, 0)
    counts = live.sum(axis=2, dtype=jnp.int32)
    # Key-major: query blocks from the one holding the key block's start to the one
    # holding its reach - 1, clipped to the query range.
    first = jnp.clip(jnp.floor_divide(key_start, block_q), 0, nq)
    last = jnp.clip(jnp.floor_divide(reach - 1, block_q), -1, nq - 1)
    return TreeSchedule(blocks, counts, first, jnp.maximum(last - first + 1, 0))


def tree_attention_schedule(
    ends: jax.Array, q_offset, k_offset, q_len: int, *, block_q: int, block_k: int
) -> TreeSchedule:
    """The live (query block, key block) pairs of a call, per batch row.

    Args:
      ends: int32[B, Lk], the keys' subtree_end (global row indices); Lk a multiple of
        block_k.
      q_offset, k_offset: global row index of the first query / key (int or traced
        int32 scalar).
      q_len: number of queries Lq, a multiple of block_q.
      block_q, block_k: query and key block lengths.

    Returns:
      A `TreeSchedule`. Pair (i, j) is live iff k_offset + j * block_k <= q_offset +
      (i + 1) * block_q - 1 and max(ends[j * block_k:(j + 1) * block_k]) > q_offset +
      i * block_q.
    """
    first_query, end_query = _key_spans(ends, q_offset, k_offset)
    return _schedule_from_spans(first_query, end_query, q_len, block_q, block_k)


# --- what differs between the compiled kernel and GPU interpret mode -------------------


class _Ops:
    """The few operations written differently for GPU interpret mode.

    Mosaic GPU wants layout hints and runs matmuls as wgmma (B transposed from SMEM, A
    from registers, accumulating in place); the GPU interpret mode of JAX 0.10-0.11
    runs none of `layout_cast`, `plgpu.broadcasted_iota`, transposed or register wgmma
    operands, or `pl.run_state`, so there they are plain jnp on values read from SMEM.
    """

    def __init__(self, interpreting: bool):
        self.interpreting = interpreting

    def layout(self, x: jax.Array, layout) -> jax.Array:
        return x if self.interpreting else plgpu.layout_cast(x, layout)

    def zeros(self, shape: tuple[int, ...], value: float = 0.0) -> jax.Array:
        """A float32 register array: [64, N] in the wgmma layout, [64] one per row."""
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return self.layout(jnp.full(shape, value, jnp.float32), layout)

    def rows(self, ref, along: int) -> jax.Array:
        """Loads a vector from SMEM to broadcast along dimension `along` of a tile."""
        return self.layout(ref[...], plgpu.Layout.WGMMA.reduce(along))

    def iota(self, shape: tuple[int, int], dimension: int) -> jax.Array:
        if self.interpreting:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def matmul_t(self, a_ref, b_ref) -> jax.Array:
        """float32 a @ b.T, both in SMEM: a [M, K], b [N, K]."""
        if self.interpreting:
            dims = (((1,), (1,)), ((), ()))
            return lax.dot_general(a_ref[...], b_ref[...], dims, preferred_element_type=jnp.float32)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a_ref, plgpu.transpose_ref(b_ref, (1, 0)))
            return acc_ref[...]

        return pl.run_scoped(product, plgpu.ACC((a_ref.shape[0], b_ref.shape[0]), jnp.float32))

    def matmul_add(self, acc: jax.Array, a: jax.Array, b_ref) -> jax.Array:
        """acc + a @ b: acc float32 [M, N], a [M, K] in registers, b [K, N] in SMEM."""
        if self.interpreting:
            return acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_ref))(plgpu.ACC.init(acc))


def _bcast(x: jax.Array, shape: tuple[int, int], along: int) -> jax.Array:
    """Repeats a vector along dimension `along` of a 2D tile (x runs along the other)."""
    return lax.broadcast_in_dim(x, shape, [1 - along])


def _visible(ops: _Ops, first, end, shape, query_dim: int, query_start) -> jax.Array:
    """bool tile: first[k] <= query < end[k], the keys' vectors broadcast along the query
    dimension, queries query_start + iota along `query_dim`."""
    query = ops.iota(shape, query_dim) + query_start
    return (_bcast(first, shape, query_dim) <= query) & (query < _bcast(end, shape, query_dim))


# --- pipelining between the memory warpgroup and the compute warpgroups ----------------


def _produce(count, load, free):
    """Memory warpgroup: load(t, slot) for t < count, reusing a slot once it is free.

    Args:
      count: number of steps (traced).
      load: issues step t's TMA copies into `slot`.
      free: barriers [_STAGES], arrived at by every compute warpgroup when done with a
        slot.
    """

    def step(t, carry):
        slot = lax.rem(t, _STAGES)

        @pl.when(t >= _STAGES)
        def _():
            plgpu.barrier_wait(free.at[slot])

        load(t, slot)
        return carry

    lax.fori_loop(0, count, step, 0)

    # Observe the last releases too: every phase of `free` is then seen by this thread
    # (GPU interpret mode checks it; on a GPU it only waits for work that runs anyway).
    def drain(t, carry):
        plgpu.barrier_wait(free.at[lax.rem(t, _STAGES)])
        return carry

    lax.fori_loop(jnp.maximum(count - _STAGES, 0), count, drain, 0)


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def _compute_registers(compute_wgs: int) -> int:
    """Per-thread registers of a compute warpgroup: the 64K register file over 128-thread
    warpgroups, less the memory warpgroup's, shared evenly, at most 256."""
    return min(256, (65536 // 128 - _MEMORY_REGISTERS) // compute_wgs // 8 * 8)


def _tiles(dtype) -> tuple:
    """SMEM transforms of a [rows, D] tile that wgmma and TMA read: 128-byte swizzle."""
    itemsize = jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128))


class _KeyStream(NamedTuple):
    """SMEM slots for key blocks streamed to a query-major CTA (forward, dQ), and their
    barriers: k_full (k, first, end landed), v_full (v landed), free (all compute
    warpgroups done with the slot)."""

    k: Any
    v: Any
    first: Any
    end: Any
    k_full: Any
    v_full: Any
    free: Any


def _key_stream_scratch(block_k: int, d: int, dtype, compute_wgs: int) -> _KeyStream:
    tiles = _tiles(dtype)
    return _KeyStream(
        plgpu.SMEM((_STAGES, block_k, d), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, block_k, d), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, block_k), jnp.int32),
        plgpu.SMEM((_STAGES, block_k), jnp.int32),
        plgpu.Barrier(num_arrivals=3, num_barriers=_STAGES),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=_STAGES),
    )


def _stream_keys(key_refs, blocks_ref, stream: _KeyStream, row, qblk, kv_head, count, block_k):
    """Memory warpgroup of a query-major kernel: the live key blocks of query block qblk
    (their k, v and key spans, from key_refs = (k, v, first_query, end_query))."""
    k_ref, v_ref, first_ref, end_ref = key_refs

    def load(t, slot):
        keys = pl.ds(blocks_ref[row, qblk, t] * block_k, block_k)
        full = stream.k_full.at[slot]
        plgpu.copy_gmem_to_smem(k_ref.at[row, keys, kv_head], stream.k.at[slot], full)
        plgpu.copy_gmem_to_smem(first_ref.at[row, keys], stream.first.at[slot], full)
        plgpu.copy_gmem_to_smem(end_ref.at[row, keys], stream.end.at[slot], full)
        v_full = stream.v_full.at[slot]
        plgpu.copy_gmem_to_smem(v_ref.at[row, keys, kv_head], stream.v.at[slot], v_full)

    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
    _produce(count, load, stream.free)


# --- forward ---------------------------------------------------------------------------


def _forward_kernel(q, k, v, first_query, end_query, *, block_q, block_k, ops):
    b, q_len, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    compute_wgs = block_q // _ROWS
    nq = q_len // block_q
    dtype = q.dtype
    scale = d**-0.5 * _LOG2E  # scores in log2 units: exp2 is the native instruction

    def body(q_ref, k_ref, v_ref, first_ref, end_ref, blocks_ref, counts_ref, out_ref,
             lse_ref, q_smem, lse_smem, q_bar, stream):  # fmt: skip
        head = lax.axis_index("head")
        qblk = nq - 1 - lax.axis_index("qblk")  # longest rows (most key blocks) first
        row = lax.axis_index("row")
        wg = lax.axis_index("wg")
        count = counts_ref[row, qblk]

        @pl.when(wg < compute_wgs)
        def _compute():
            plgpu.set_max_registers(_compute_registers(compute_wgs), action="increase")
            start = qblk * block_q + wg * _ROWS
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(start, _ROWS), head], q_tile, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            shape = (_ROWS, block_k)

            def step(t, carry):
                acc, row_max, denom = carry
                slot = lax.rem(t, _STAGES)
                plgpu.barrier_wait(stream.k_full.at[slot])
                s = ops.matmul_t(q_tile, stream.k.at[slot])
                first = ops.rows(stream.first.at[slot], 0)
                end = ops.rows(stream.end.at[slot], 0)
                visible = _visible(ops, first, end, shape, 0, start)
                # Masked scores are -inf while the running max starts finite: exp2 of a
                # masked score is 0, and a row that sees nothing yet keeps -1e30.
                s = jnp.where(visible, s * scale, -jnp.inf)
                new_max = jnp.maximum(row_max, s.max(axis=1))
                alpha = jnp.exp2(row_max - new_max)
                p = jnp.exp2(s - _bcast(new_max, shape, 1))
                denom = denom * alpha + p.sum(axis=1)
                acc = acc * _bcast(alpha, acc.shape, 1)
                plgpu.barrier_wait(stream.v_full.at[slot])
                acc = ops.matmul_add(acc, p.astype(dtype), stream.v.at[slot])
                plgpu.barrier_arrive(stream.free.at[slot])
                return acc, new_max, denom

            init = (ops.zeros((_ROWS, d)), ops.zeros((_ROWS,), _NEG), ops.zeros((_ROWS,)))
            acc, row_max, denom = lax.fori_loop(0, count, step, init)
            empty = denom == 0.0
            denom = jnp.where(empty, 1.0, denom)
            q_tile[...] = (acc / _bcast(denom, acc.shape, 1)).astype(dtype)  # 0 where empty
            lse_smem.at[wg][...] = jnp.where(empty, _NEG, (row_max + jnp.log2(denom)) / _LOG2E)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, out_ref.at[row, pl.ds(start, _ROWS), head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[row, head, pl.ds(start, _ROWS)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            kv_head = lax.div(head, jnp.array(group, head.dtype))
            key_refs = (k_ref, v_ref, first_ref, end_ref)
            _stream_keys(key_refs, blocks_ref, stream, row, qblk, kv_head, count, block_k)

    tiles = _tiles(dtype)
    scratch = [
        plgpu.SMEM((compute_wgs, _ROWS, d), dtype, transforms=tiles),  # q, then out
        plgpu.SMEM((compute_wgs, _ROWS), jnp.float32),  # lse
        plgpu.Barrier(num_barriers=compute_wgs),  # own q landed
        _key_stream_scratch(block_k, d, dtype, compute_wgs),
    ]
    out_type = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((b, heads, q_len), jnp.float32),
    )
    return body, scratch, out_type, (heads, nq, b), ("head", "qblk", "row"), compute_wgs


# --- backward: dK, dV (key-major) ------------------------------------------------------


def _dkv_kernel(q, k, v, first_query, end_query, d_out, lse, delta, *, block_q, block_k, ops,
                grad_dtype):  # fmt: skip
    b, _, heads, d = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    compute_wgs = block_k // _ROWS
    dtype = q.dtype
    scale = d**-0.5

    def body(q_ref, k_ref, v_ref, first_ref, end_ref, do_ref, lse_ref, delta_ref,
             firsts_ref, counts_ref, dk_ref, dv_ref, k_smem, v_smem, first_smem, end_smem,
             q_smem, do_smem, lse_smem, delta_smem, out_smem, kv_bar, full, free):  # fmt: skip
        kv_head = lax.axis_index("kv_head")
        kblk = lax.axis_index("kblk")
        row = lax.axis_index("row")
        wg = lax.axis_index("wg")
        first_block = firsts_ref[row, kblk]
        n = counts_ref[row, kblk]
        count = group * n  # steps: the query heads of this KV head x the live query blocks

        @pl.when(wg < compute_wgs)
        def _compute():
            plgpu.set_max_registers(_compute_registers(compute_wgs), action="increase")
            start = kblk * block_k + wg * _ROWS
            keys = pl.ds(start, _ROWS)
            k_tile, v_tile, bar = k_smem.at[wg], v_smem.at[wg], kv_bar.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[row, keys, kv_head], k_tile, bar)
            plgpu.copy_gmem_to_smem(v_ref.at[row, keys, kv_head], v_tile, bar)
            plgpu.copy_gmem_to_smem(first_ref.at[row, keys], first_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(end_ref.at[row, keys], end_smem.at[wg], bar)
            plgpu.barrier_wait(bar)
            first = ops.rows(first_smem.at[wg], 1)
            end = ops.rows(end_smem.at[wg], 1)
            shape = (_ROWS, block_q)  # transposed tiles: keys x queries

            def step(t, carry):
                dk, dv = carry
                slot = lax.rem(t, _STAGES)
                query_block = first_block + lax.rem(t, n)
                plgpu.barrier_wait(full.at[slot])
                s_t = ops.matmul_t(k_tile, q_smem.at[slot])
                visible = _visible(ops, first, end, shape, 1, query_block * block_q)
                lse_q = ops.rows(lse_smem.at[slot], 0) * _LOG2E
                # where, not a product: exp2 of an invisible pair may overflow to inf.
                p_t = jnp.where(
                    visible, jnp.exp2(s_t * (scale * _LOG2E) - _bcast(lse_q, shape, 0)), 0.0
                )
                dp_t = ops.matmul_t(v_tile, do_smem.at[slot])
                dv = ops.matmul_add(dv, p_t.astype(dtype), do_smem.at[slot])
                ds_t = p_t * (dp_t - _bcast(ops.rows(delta_smem.at[slot], 0), shape, 0))
                dk = ops.matmul_add(dk, ds_t.astype(dtype), q_smem.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            dk, dv = lax.fori_loop(0, count, step, (ops.zeros((_ROWS, d)), ops.zeros((_ROWS, d))))
            out_tile = out_smem.at[wg]
            for grad, grad_ref in ((dk * scale, dk_ref), (dv, dv_ref)):
                out_tile[...] = grad.astype(grad_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_tile, grad_ref.at[row, keys, kv_head])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_tile is reused
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

            def load(t, slot):  # the query blocks of each query head of this KV head
                head = kv_head * group + lax.div(t, n)
                rows = pl.ds((first_block + lax.rem(t, n)) * block_q, block_q)
                bar = full.at[slot]
                plgpu.copy_gmem_to_smem(q_ref.at[row, rows, head], q_smem.at[slot], bar)
                plgpu.copy_gmem_to_smem(do_ref.at[row, rows, head], do_smem.at[slot], bar)
                plgpu.copy_gmem_to_smem(lse_ref.at[row, head, rows], lse_smem.at[slot], bar)
                plgpu.copy_gmem_to_smem(delta_ref.at[row, head, rows], delta_smem.at[slot], bar)

            _produce(count, load, free)

    tiles = _tiles(dtype)
    scratch = [
        plgpu.SMEM((compute_wgs, _ROWS, d), dtype, transforms=tiles),  # k
        plgpu.SMEM((compute_wgs, _ROWS, d), dtype, transforms=tiles),  # v
        plgpu.SMEM((compute_wgs, _ROWS), jnp.int32),  # first_query
        plgpu.SMEM((compute_wgs, _ROWS), jnp.int32),  # end_query
        plgpu.SMEM((_STAGES, block_q, d), dtype, transforms=tiles),  # q
        plgpu.SMEM((_STAGES, block_q, d), dtype, transforms=tiles),  # d_out
        plgpu.SMEM((_STAGES, block_q), jnp.float32),  # lse
        plgpu.SMEM((_STAGES, block_q), jnp.float32),  # delta
        plgpu.SMEM((compute_wgs, _ROWS, d), grad_dtype, transforms=_tiles(grad_dtype)),
        plgpu.Barrier(num_arrivals=4, num_barriers=compute_wgs),  # own k, v, spans
        plgpu.Barrier(num_arrivals=4, num_barriers=_STAGES),  # q, d_out, lse, delta
        plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=_STAGES),  # slot free
    ]
    grad = jax.ShapeDtypeStruct((b, k_len, kv_heads, d), grad_dtype)
    grid = (kv_heads, k_len // block_k, b)
    return body, scratch, (grad, grad), grid, ("kv_head", "kblk", "row"), compute_wgs


# --- backward: dQ (query-major) --------------------------------------------------------


def _dq_kernel(q, k, v, first_query, end_query, d_out, lse, delta, *, block_q, block_k, ops,
               grad_dtype):  # fmt: skip
    b, q_len, heads, d = q.shape
    group = heads // k.shape[2]
    compute_wgs = block_q // _ROWS
    nq = q_len // block_q
    dtype = q.dtype
    scale = d**-0.5

    def body(q_ref, k_ref, v_ref, first_ref, end_ref, do_ref, lse_ref, delta_ref,
             blocks_ref, counts_ref, dq_ref, q_smem, do_smem, lse_smem, delta_smem, out_smem,
             q_bar, stream):  # fmt: skip
        head = lax.axis_index("head")
        qblk = nq - 1 - lax.axis_index("qblk")  # longest rows first
        row = lax.axis_index("row")
        wg = lax.axis_index("wg")
        count = counts_ref[row, qblk]

        @pl.when(wg < compute_wgs)
        def _compute():
            plgpu.set_max_registers(_compute_registers(compute_wgs), action="increase")
            start = qblk * block_q + wg * _ROWS
            rows = pl.ds(start, _ROWS)
            q_tile, do_tile, bar = q_smem.at[wg], do_smem.at[wg], q_bar.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[row, rows, head], q_tile, bar)
            plgpu.copy_gmem_to_smem(do_ref.at[row, rows, head], do_tile, bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[row, head, rows], lse_smem.at[wg], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[row, head, rows], delta_smem.at[wg], bar)
            plgpu.barrier_wait(bar)
            lse_q = ops.rows(lse_smem.at[wg], 1) * _LOG2E
            delta_q = ops.rows(delta_smem.at[wg], 1)
            shape = (_ROWS, block_k)

            def step(t, dq):
                slot = lax.rem(t, _STAGES)
                plgpu.barrier_wait(stream.k_full.at[slot])
                s = ops.matmul_t(q_tile, stream.k.at[slot])
                first = ops.rows(stream.first.at[slot], 0)
                end = ops.rows(stream.end.at[slot], 0)
                visible = _visible(ops, first, end, shape, 0, start)
                p = jnp.where(
                    visible, jnp.exp2(s * (scale * _LOG2E) - _bcast(lse_q, shape, 1)), 0.0
                )
                plgpu.barrier_wait(stream.v_full.at[slot])
                dp = ops.matmul_t(do_tile, stream.v.at[slot])
                ds = p * (dp - _bcast(delta_q, shape, 1))
                dq = ops.matmul_add(dq, ds.astype(dtype), stream.k.at[slot])
                plgpu.barrier_arrive(stream.free.at[slot])
                return dq

            dq = lax.fori_loop(0, count, step, ops.zeros((_ROWS, d)))
            out_smem.at[wg][...] = (dq * scale).astype(grad_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], dq_ref.at[row, rows, head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            kv_head = lax.div(head, jnp.array(group, head.dtype))
            key_refs = (k_ref, v_ref, first_ref, end_ref)
            _stream_keys(key_refs, blocks_ref, stream, row, qblk, kv_head, count, block_k)

    tiles = _tiles(dtype)
    scratch = [
        plgpu.SMEM((compute_wgs, _ROWS, d), dtype, transforms=tiles),  # q
        plgpu.SMEM((compute_wgs, _ROWS, d), dtype, transforms=tiles),  # d_out
        plgpu.SMEM((compute_wgs, _ROWS), jnp.float32),  # lse
        plgpu.SMEM((compute_wgs, _ROWS), jnp.float32),  # delta
        plgpu.SMEM((compute_wgs, _ROWS, d), grad_dtype, transforms=_tiles(grad_dtype)),  # dq
        plgpu.Barrier(num_arrivals=4, num_barriers=compute_wgs),  # own q, d_out, lse, delta
        _key_stream_scratch(block_k, d, dtype, compute_wgs),
    ]
    out_type = jax.ShapeDtypeStruct(q.shape, grad_dtype)
    return body, scratch, out_type, (heads, nq, b), ("head", "qblk", "row"), compute_wgs


def _run(kernel, arrays, schedule, interpret, **options):
    """Builds `kernel` (one of the `_*_kernel` above) for `arrays` and runs it on them and
    the schedule's arrays (its loop counts and block indices)."""
    ops = _Ops(interpret is not None)
    body, scratch, out_type, grid, names, compute_wgs = kernel(*arrays, ops=ops, **options)
    smem = sum(_scratch_bytes(s) for s in jax.tree.leaves(scratch))
    if smem > _SMEM_BYTES:
        blocks = ", ".join(f"{k}={options[k]}" for k in ("block_q", "block_k"))
        raise ValueError(
            f"{blocks} with head_dim={arrays[0].shape[-1]} needs {smem} bytes of shared "
            f"memory in {kernel.__name__}, over the {_SMEM_BYTES} a CTA has: use smaller "
            "blocks"
        )
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=interpret,
    )
    return call(*arrays, *schedule)


def _scratch_bytes(scratch) -> int:
    """SMEM bytes of one scratch buffer, rounded up to 1 KiB (the alignment of a swizzled
    tile; Mosaic GPU makes the exact count when it lowers the kernel)."""
    if isinstance(scratch, plgpu.Barrier):
        count = scratch.num_barriers  # an int, or a shape tuple in newer JAX
        size = 8 * (math.prod(count) if isinstance(count, tuple) else count)
    else:
        size = math.prod(scratch.shape) * jnp.dtype(scratch.dtype).itemsize
    return -(-size // 1024) * 1024


# --- public entry points ---------------------------------------------------------------


def resolve_interpret(interpret: Any = None) -> Any:
    """The `interpret` argument of `plgpu.kernel`: GPU interpret-mode parameters, or None
    for the compiled kernel.

    Args:
      interpret: None (interpret unless the default backend is a GPU), a bool, or
        `InterpretGPUParams` (e.g. with detect_races=True) to interpret with.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if interpret is False:
        return None
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return InterpretGPUParams()
    return interpret


def _check_block(name: str, block: int, length_name: str, length: int) -> None:
    if block not in (64, 128):
        raise ValueError(f"{name}={block}: must be 64 or 128 (one or two 64-row warpgroups)")
    if length % block:
        raise ValueError(f"{length_name}={length} is not a multiple of {name}={block}")


def _check_inputs(q, k, v, ends, interpret, block_q: int, block_k: int) -> None:
    """Raises ValueError, naming the argument and value, for what the kernels can't run."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, L, heads, D]; got q {q.shape}, k {k.shape}")
    b, q_len, heads, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [{b}, Lk, KV, {d}] for q {q.shape}")
    if heads % k.shape[2]:
        raise ValueError(f"query heads {heads} are not a multiple of kv heads {k.shape[2]}")
    if ends.shape != k.shape[:2]:
        raise ValueError(f"ends {ends.shape} must be [B, Lk] = {k.shape[:2]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = _GPU_DTYPES if interpret is None else (*_GPU_DTYPES, jnp.float32)
    if q.dtype not in allowed:
        names = ", ".join(jnp.dtype(t).name for t in allowed)
        raise ValueError(f"dtype {q.dtype} not supported (supported: {names})")
    lane = 128 // q.dtype.itemsize  # elements in one 128-byte swizzle row
    if d % lane or d > 256:
        raise ValueError(f"head_dim={d}: must be a multiple of {lane} and at most 256")
    _check_block("block_q", block_q, "query length", q_len)
    _check_block("block_k", block_k, "key length", k.shape[1])


def tree_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ends: jax.Array,
    q_offset=0,
    k_offset=0,
    *,
    block_q: int = 128,
    block_k: int = 128,
    interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of a query range over a key range, normalised over that key range.

    Args:
      q: [B, Lq, H, D] queries at global rows q_offset ... (bfloat16 or float16; float32
        too when interpreting).
      k, v: [B, Lk, KV, D] keys and values at global rows k_offset ...; H % KV == 0.
      ends: int32[B, Lk], the keys' subtree_end (global row indices).
      q_offset, k_offset: int or traced int32 scalar.
      block_q: queries per CTA, 64 or 128 (one or two compute warpgroups); divides Lq.
      block_k: keys per pipeline step, 64 or 128; divides Lk.
      interpret: see `resolve_interpret`.

    Returns:
      out [B, Lq, H, D] in q's dtype and lse float32[B, H, Lq] (natural log); a query
      that sees no key of the range has out 0 and lse -1e30.
    """
    interpret = resolve_interpret(interpret)
    _check_inputs(q, k, v, ends, interpret, block_q, block_k)
    first_query, end_query = _key_spans(ends, q_offset, k_offset)
    schedule = _schedule_from_spans(first_query, end_query, q.shape[1], block_q, block_k)
    arrays = (q, k, v, first_query, end_query)
    forward = schedule.forward_blocks, schedule.forward_counts
    return _run(_forward_kernel, arrays, forward, interpret, block_q=block_q, block_k=block_k)


def tree_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ends: jax.Array,
    d_out: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_offset=0,
    k_offset=0,
    *,
    block_q: int = 64,
    block_k: int = 128,
    interpret: Any = None,
    grad_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one (query range, key range) pair, given the final softmax statistics.

    Summed over the key ranges of a ring (and the query ranges, for dK/dV), these are
    the gradients of the whole attention.

    Args:
      q, k, v, ends, q_offset, k_offset: as in `tree_attention_forward`.
      d_out: [B, Lq, H, D] cotangent of the whole attention's output (cast to q's dtype).
      lse: float32[B, H, Lq], the whole attention's log-sum-exp (over every key range).
      delta: float32[B, H, Lq], sum over D of d_out * out (the whole attention's out).
      block_q: query rows per step of the dK/dV kernel and per CTA of the dQ kernel.
      block_k: key rows per CTA of the dK/dV kernel and per step of the dQ kernel.
      interpret: see `resolve_interpret`.
      grad_dtype: dtype of the gradients.

    Returns:
      (dq [B, Lq, H, D], dk [B, Lk, KV, D], dv [B, Lk, KV, D]) in grad_dtype.
    """
    interpret = resolve_interpret(interpret)
    _check_inputs(q, k, v, ends, interpret, block_q, block_k)
    stats = (q.shape[0], q.shape[2], q.shape[1])
    if d_out.shape != q.shape or lse.shape != stats or delta.shape != stats:
        raise ValueError(
            f"d_out {d_out.shape}, lse {lse.shape}, delta {delta.shape} must be "
            f"{q.shape}, {stats}, {stats}"
        )
    first_query, end_query = _key_spans(ends, q_offset, k_offset)
    schedule = _schedule_from_spans(first_query, end_query, q.shape[1], block_q, block_k)
    arrays = (
        q, k, v, first_query, end_query, d_out.astype(q.dtype),
        lse.astype(jnp.float32), delta.astype(jnp.float32),
    )  # fmt: skip
    options = dict(block_q=block_q, block_k=block_k, grad_dtype=jnp.dtype(grad_dtype))
    dk, dv = _run(
        _dkv_kernel, arrays, (schedule.backward_first, schedule.backward_counts), interpret,
        **options,
    )  # fmt: skip
    dq = _run(
        _dq_kernel, arrays, (schedule.forward_blocks, schedule.forward_counts), interpret,
        **options,
    )  # fmt: skip
    return dq, dk, dv


def pallas_tree_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    subtree_end: jax.Array,
    block_size: int = 128,
    interpret: Any = None,
) -> jax.Array:
    """Single-device tree attention by the kernels; equal to `dense_tree_attention`.

    Args:
      q: [B, L, H, D].
      k, v: [B, L, KV, D].
      subtree_end: int32[B, L], row index one past each key's subtree.
      block_size: 64 or 128, the forward pass's query and key blocks (and the backward
        pass's key blocks; its query blocks are 64). L is padded to a multiple of it.
      interpret: see `resolve_interpret`.

    Returns:
      [B, L, H, D] in q's dtype, differentiable in q, k, v (custom VJP).
    """
    length = q.shape[1]
    padded = -(-length // block_size) * block_size
    if padded != length:
        q, k, v, subtree_end = attention.pad_rows(q, k, v, subtree_end, padded)
    out = _tree_attention(q, k, v, subtree_end.astype(jnp.int32), block_size, interpret)
    return out[:, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tree_attention(q, k, v, ends, block, interpret):
    return _tree_attention_fwd(q, k, v, ends, block, interpret)[0]


def _tree_attention_fwd(q, k, v, ends, block, interpret):
    out, lse = tree_attention_forward(
        q, k, v, ends, block_q=block, block_k=block, interpret=interpret
    )
    return out, (q, k, v, ends, out, lse)


def _tree_attention_bwd(block, interpret, residuals, d_out):
    q, k, v, ends, out, lse = residuals
    delta = jnp.einsum("blhd,blhd->bhl", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = tree_attention_backward(
        q, k, v, ends, d_out, lse, delta, block_q=_ROWS, block_k=block, interpret=interpret,
        grad_dtype=q.dtype,
    )  # fmt: skip
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_tree_attention.defvjp(_tree_attention_fwd, _tree_attention_bwd)
