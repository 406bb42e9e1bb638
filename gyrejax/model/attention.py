"""Attention over packed tree rows, and over a KV cache for decoding.

Tree mask (DESIGN.md, Packing): key k is visible to query q iff
`k <= q < subtree_end[k]`. One integer per key encodes the whole prefix-shared tree;
separate trees in one row never see each other. An ordinary causal sequence is the
special case `subtree_end = length`.

Two implementations with equal outputs:
  * `dense_tree_attention`: builds the [L, L] mask; the reference.
  * `blocked_tree_attention`: online softmax over key blocks with a hand-written
    backward pass (flash-attention style); memory O(L * block), never an [L, L] tensor,
    and blocks that the mask hides entirely (above the diagonal, or keys whose subtrees
    end before the query block) are skipped in both passes.

Shapes: q float[B, L, H, D]; k, v float[B, L, KV, D] with H a multiple of KV (grouped
query attention); subtree_end int32[B, L]. Scores and softmax are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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
        extra = padded - length
        pad = ((0, 0), (0, extra), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        # Padding keys see only themselves, so real queries never read them.
        tail = jnp.arange(length, padded, dtype=subtree_end.dtype) + 1
        subtree_end = jnp.concatenate([subtree_end, jnp.broadcast_to(tail, (b, extra))], axis=1)
    out = _blocked(_group(q, k.shape[2]), k, v, subtree_end.astype(jnp.int32), block)
    return out.reshape(b, padded, h, d)[:, :length].astype(q.dtype)


def _block_live(subtree_end: jax.Array, block: int) -> jax.Array:
    """bool[nq, nk]: some query of block i may see some key of block j (any row)."""
    b, length = subtree_end.shape
    n = length // block
    starts = jnp.arange(n) * block
    key_reach = subtree_end.reshape(b, n, block).max(axis=(0, 2))  # [nk]
    causal = starts[None, :] <= starts[:, None]  # key block not after query block
    reaches = key_reach[None, :] > starts[:, None]  # some key's subtree reaches block i
    return causal & reaches


def _tile(q_blk, k_blk, subtree_end_blk, i, j, block):
    """Masked float32 scores of query block i against key block j.

    Shapes: q_blk [B, bq, KV, G, D], k_blk [B, bk, KV, D], subtree_end_blk [B, bk].
    Returns scores [B, KV, G, bq, bk] and mask [B, 1, 1, bq, bk].
    """
    d = q_blk.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    q_idx = i * block + jnp.arange(block)
    k_idx = j * block + jnp.arange(block)
    mask = (k_idx[None, :] <= q_idx[:, None])[None] & (
        q_idx[None, :, None] < subtree_end_blk[:, None, :]
    )
    mask = mask[:, None, None]
    return jnp.where(mask, scores, _NEG), mask


def _split_blocks(x: jax.Array, block: int) -> jax.Array:
    """[B, L, ...] -> [L // block, B, block, ...]."""
    b, length = x.shape[:2]
    x = x.reshape(b, length // block, block, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _merge_blocks(x: jax.Array) -> jax.Array:
    """[n, B, block, ...] -> [B, n * block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _forward(q, k, v, subtree_end, block):
    """Returns out float32[B, L, KV, G, D] and log-sum-exp float32[B, KV, G, L]."""
    qs, ks, vs = _split_blocks(q, block), _split_blocks(k, block), _split_blocks(v, block)
    ends = _split_blocks(subtree_end, block)
    live = _block_live(subtree_end, block)
    n = qs.shape[0]
    b, bq, kv, g, d = qs.shape[1:]

    def query_block(i):
        q_blk = qs[i]

        def key_block(carry, j):
            def update(carry):
                m, denom, acc = carry
                scores, mask = _tile(q_blk, ks[j], ends[j], i, j, block)
                m_new = jnp.maximum(m, scores.max(axis=-1))
                p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                denom = denom * corr + p.sum(axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vs.dtype), vs[j])
                acc = acc * corr[..., None] + pv.astype(jnp.float32)
                return m_new, denom, acc

            return jax.lax.cond(live[i, j], update, lambda c: c, carry), None

        init = (
            jnp.full((b, kv, g, bq), _NEG, jnp.float32),
            jnp.zeros((b, kv, g, bq), jnp.float32),
            jnp.zeros((b, kv, g, bq, d), jnp.float32),
        )
        (m, denom, acc), _ = jax.lax.scan(key_block, init, jnp.arange(n))
        out = acc / denom[..., None]  # [B, KV, G, bq, D]
        return jnp.moveaxis(out, 3, 1), m + jnp.log(denom)

    outs, lses = jax.lax.map(query_block, jnp.arange(n))
    out = _merge_blocks(outs)  # [B, L, KV, G, D]
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, kv, g, n * bq)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q, k, v, subtree_end, block):
    out, _ = _forward(q, k, v, subtree_end, block)
    return out.astype(q.dtype)


def _blocked_fwd(q, k, v, subtree_end, block):
    out, lse = _forward(q, k, v, subtree_end, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, subtree_end, out, lse)


def _blocked_bwd(block, residuals, d_out):
    q, k, v, subtree_end, out, lse = residuals
    d = q.shape[-1]
    scale = d**-0.5
    # delta_q = sum_d dO * O: the softmax-backward correction per query.
    delta = jnp.einsum("blkgd,blkgd->bkgl", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qs, ks, vs = _split_blocks(q, block), _split_blocks(k, block), _split_blocks(v, block)
    d_outs, ends = _split_blocks(d_out, block), _split_blocks(subtree_end, block)
    n = qs.shape[0]
    b, bq, kv, g, _ = qs.shape[1:]
    lse_blocks = jnp.moveaxis(lse.reshape(b, kv, g, n, bq), 3, 0)  # [n, B, KV, G, bq]
    delta_blocks = jnp.moveaxis(delta.reshape(b, kv, g, n, bq), 3, 0)
    live = _block_live(subtree_end, block)

    def query_block(carry, i):
        dk_all, dv_all = carry
        q_blk, do_blk = qs[i], d_outs[i]
        lse_blk, delta_blk = lse_blocks[i], delta_blocks[i]

        def key_block(inner, j):
            def update(inner):
                dq, dk_all, dv_all = inner
                scores, mask = _tile(q_blk, ks[j], ends[j], i, j, block)
                p = jnp.where(mask, jnp.exp(scores - lse_blk[..., None]), 0.0)
                dv = jnp.einsum("bkgqs,bqkgd->bskd", p, do_blk.astype(jnp.float32))
                dp = jnp.einsum(
                    "bqkgd,bskd->bkgqs", do_blk, vs[j], preferred_element_type=jnp.float32
                )
                ds = p * (dp - delta_blk[..., None]) * scale
                dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, ks[j].astype(jnp.float32))
                dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk.astype(jnp.float32))
                dk_all = dk_all.at[j].add(dk)
                dv_all = dv_all.at[j].add(dv)
                return dq, dk_all, dv_all

            return jax.lax.cond(live[i, j], update, lambda c: c, inner), None

        dq0 = jnp.zeros(q_blk.shape, jnp.float32)
        (dq, dk_all, dv_all), _ = jax.lax.scan(key_block, (dq0, dk_all, dv_all), jnp.arange(n))
        return (dk_all, dv_all), dq

    zeros_kv = jnp.zeros(ks.shape, jnp.float32)
    (dk_all, dv_all), dqs = jax.lax.scan(query_block, (zeros_kv, zeros_kv), jnp.arange(n))
    dq = _merge_blocks(dqs).astype(q.dtype)
    dk = _merge_blocks(dk_all).astype(k.dtype)
    dv = _merge_blocks(dv_all).astype(v.dtype)
    return dq, dk, dv, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


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
