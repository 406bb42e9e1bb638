"""Tree attention: one loop over the live block pairs vs today's loop over every pair.

  python benchmarks/attention_bench.py [--quick] [--json PATH]

On one CPU device, forward + backward (q, k, v gradients of sum(out * w)) of the
single-device blocked tree attention, small heads (2 query heads, 1 key/value head,
head_dim 32), over one packed row:
  * ours: `attention.blocked_tree_attention`, a schedule of the live (query block, key
    block) pairs built once per call, then one while loop per pass whose trip count is
    the number of live pairs (no conditional);
  * baseline: the same attention as of commit 3eff77c (`git show
    3eff77c:gyrejax/model/attention.py`, copied verbatim below): two nested `lax.scan`
    loops over every (query block, key block) pair with a `lax.cond` per pair.
Rows: agent-shaped trees (chains of 1-2k tokens with a few forks, `model_bench.forest_row`)
at 8k and 32k tokens, and a causal row of the same length for contrast, block 512 (the
model's default); and the 32k tree row at block 128, a GPU kernel's usual block (--quick:
8k only). Per case: median wall and process CPU seconds over interleaved runs (the CPU
seconds are steadier while other jobs share the cores) and baseline / ours; the loop
iterations each runs (ours: live pairs, forward + backward; baseline: every pair and
every query / key block of the outer loops, a conditional each pair); the while loops
and conditionals in the compiled program; the largest difference between the two
implementations' outputs and gradients. On a GPU each loop iteration and each
conditional costs a host round trip (10-20 us), so the iteration counts carry over
where these CPU times do not. Takes about 7 minutes on 2 idle cores (--quick: 30 s).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_bench import forest_row  # benchmarks/ is on the path when run

from gyrejax.model import attention

BLOCK = 512
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32


# --- BASELINE: the blocked path of gyrejax/model/attention.py at commit 3eff77c -------
# Copied verbatim (only `blocked_tree_attention` renamed), so that later changes to
# attention.py cannot move the baseline.

_NEG = -1e30  # finite "minus infinity": keeps exp() and max() free of inf - inf.


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    b, length, h, d = q.shape
    return q.reshape(b, length, num_kv_heads, h // num_kv_heads, d)


def baseline_blocked_tree_attention(
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
        q, k, v, subtree_end = _pad_rows(q, k, v, subtree_end, padded)
    out = _blocked(_group(q, k.shape[2]), k, v, subtree_end.astype(jnp.int32), block)
    return out.reshape(b, padded, h, d)[:, :length].astype(q.dtype)


def _pad_rows(q, k, v, subtree_end, padded: int):
    """Pads rows at their end to `padded` tokens, with keys that see only themselves (so
    real queries never read them)."""
    b, length = subtree_end.shape
    extra = padded - length
    pad = ((0, 0), (0, extra), (0, 0), (0, 0))
    tail = jnp.arange(length, padded, dtype=subtree_end.dtype) + 1
    ends = jnp.concatenate([subtree_end, jnp.broadcast_to(tail, (b, extra))], axis=1)
    return jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), ends


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


def _softmax_state(q: jax.Array):
    """Empty online-softmax state for queries q [B, L, KV, G, D]: running max and
    denominator float32[B, KV, G, L], accumulator float32[B, KV, G, L, D]."""
    b, length, kv, g, d = q.shape
    return (
        jnp.full((b, kv, g, length), _NEG, jnp.float32),
        jnp.zeros((b, kv, g, length), jnp.float32),
        jnp.zeros((b, kv, g, length, d), jnp.float32),
    )


def _attend(q, k, v, ends, q_offset, k_offset, state, block: int, valid=True):
    """Online-softmax update of every query block with every live key block.

    Args:
      q: [B, Lq, KV, G, D] queries at global rows q_offset ...
      k, v: [B, Lk, KV, D] keys and values at global rows k_offset ...
      ends: int32[B, Lk] the keys' subtree_end (global row indices).
      state: `_softmax_state` of q.
      valid: bool; False skips every block (a ring step with nothing to attend).

    Returns:
      The updated state.
    """
    nq, nk = q.shape[1] // block, k.shape[1] // block
    live = _block_live(ends, q_offset, k_offset, nq, block) & valid

    def query_block(state, i):
        m, denom, acc = state
        q_blk = _slice(q, i, block)
        row = (_slice(m, i, block, 3), _slice(denom, i, block, 3), _slice(acc, i, block, 3))

        def key_block(row, j):
            def update(row):
                m, denom, acc = row
                k_blk, v_blk = _slice(k, j, block), _slice(v, j, block)
                scores, mask = _tile(
                    q_blk, k_blk, _slice(ends, j, block), q_offset + i * block, k_offset + j * block
                )
                m_new = jnp.maximum(m, scores.max(axis=-1))
                p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                denom = denom * corr + p.sum(axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_blk)
                acc = acc * corr[..., None] + pv.astype(jnp.float32)
                return m_new, denom, acc

            return jax.lax.cond(live[i, j], update, lambda r: r, row), None

        (m_i, denom_i, acc_i), _ = jax.lax.scan(key_block, row, jnp.arange(nk))
        state = (
            _put(m, m_i, i, block, 3),
            _put(denom, denom_i, i, block, 3),
            _put(acc, acc_i, i, block, 3),
        )
        return state, None

    state, _ = jax.lax.scan(query_block, state, jnp.arange(nq))
    return state


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
    """Adds one (query range, key range) pair's gradient contributions.

    Key-major (FlashAttention-2's order): each key block's dK/dV is complete after one
    pass over the query blocks, so it is added (or, in the ring, sent home) at once and
    never needs a whole-range buffer of partial sums.

    Args:
      q, do: [B, Lq, KV, G, D] queries and output cotangents (global rows from q_offset).
      lse, delta: float32[B, KV, G, Lq] log-sum-exp and sum_d dO * O per query.
      k, v: [B, Lk, KV, D] keys and values (global rows from k_offset).
      ends: int32[B, Lk].
      grads: (dq float32[B, Lq, KV, G, D], dk, dv float32[B, Lk, KV, D]) so far.
      valid: bool; False skips every block (a ring step with nothing to attend).
      send: None, or applied to each key block's (dk, dv) [B, bk, KV, D] before they are
        added to dk, dv (the ring sends them to the device that owns the key shard,
        which adds them to its own).

    Returns:
      (dq, dk, dv) with this pair's contributions added.
    """
    scale = q.shape[-1] ** -0.5
    nq, nk = q.shape[1] // block, k.shape[1] // block
    live = _block_live(ends, q_offset, k_offset, nq, block) & valid

    def key_block(grads, j):
        dq, dk, dv = grads
        k_blk, v_blk, e_blk = _slice(k, j, block), _slice(v, j, block), _slice(ends, j, block)

        def query_block(inner, i):
            def update(inner):
                dq, dk_blk, dv_blk = inner
                q_blk, do_blk = _slice(q, i, block), _slice(do, i, block)
                lse_blk, delta_blk = _slice(lse, i, block, 3), _slice(delta, i, block, 3)
                scores, mask = _tile(
                    q_blk, k_blk, e_blk, q_offset + i * block, k_offset + j * block
                )
                p = jnp.where(mask, jnp.exp(scores - lse_blk[..., None]), 0.0)
                dv_blk = dv_blk + jnp.einsum("bkgqs,bqkgd->bskd", p, do_blk.astype(jnp.float32))
                dp = jnp.einsum(
                    "bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32
                )
                ds = p * (dp - delta_blk[..., None]) * scale
                dq_blk = _slice(dq, i, block) + jnp.einsum(
                    "bkgqs,bskd->bqkgd", ds, k_blk.astype(jnp.float32)
                )
                dk_blk = dk_blk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk.astype(jnp.float32))
                return _put(dq, dq_blk, i, block), dk_blk, dv_blk

            return jax.lax.cond(live[i, j], update, lambda c: c, inner), None

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        (dq, dk_blk, dv_blk), _ = jax.lax.scan(query_block, (dq, zeros, zeros), jnp.arange(nq))
        if send is not None:
            dk_blk, dv_blk = send((dk_blk, dv_blk))
        dk = _put(dk, _slice(dk, j, block) + dk_blk, j, block)
        dv = _put(dv, _slice(dv, j, block) + dv_blk, j, block)
        return (dq, dk, dv), None

    grads, _ = jax.lax.scan(key_block, grads, jnp.arange(nk))
    return grads


def _zero_grads(q, k):
    """float32 zeros (dq, dk, dv) for grouped queries q [B, L, KV, G, D] and keys k."""
    zeros_kv = jnp.zeros(k.shape, jnp.float32)
    return jnp.zeros(q.shape, jnp.float32), zeros_kv, zeros_kv


def _delta(d_out, out):
    """float32[B, KV, G, L] sum_d dO * O, the softmax-backward correction per query."""
    return jnp.einsum("blkgd,blkgd->bkgl", d_out.astype(jnp.float32), out.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked(q, k, v, subtree_end, block):
    return _blocked_fwd(q, k, v, subtree_end, block)[0]


def _blocked_fwd(q, k, v, subtree_end, block):
    state = _attend(q, k, v, subtree_end, 0, 0, _softmax_state(q), block)
    out, lse = _finish(state)
    out = out.astype(q.dtype)
    return out, (q, k, v, subtree_end, out, lse)


def _blocked_bwd(block, residuals, d_out):
    q, k, v, subtree_end, out, lse = residuals
    delta = _delta(d_out, out)
    grads = _zero_grads(q, k)
    dq, dk, dv = _attend_bwd(q, d_out, lse, delta, k, v, subtree_end, 0, 0, grads, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


# --- the benchmark -------------------------------------------------------------------

IMPLEMENTATIONS = {
    "ours": attention.blocked_tree_attention,
    "baseline": baseline_blocked_tree_attention,
}


def gradient_fn(implementation: str, block: int):
    """jit of (q, k, v, subtree_end, w) -> (out, (dq, dk, dv)) of sum(attention * w)."""
    attend = IMPLEMENTATIONS[implementation]

    def loss(q, k, v, ends, w):
        out = attend(q, k, v, ends, block)
        return jnp.sum(out * w), out

    def fn(q, k, v, ends, w):
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v, ends, w)
        return out, grads

    return jax.jit(fn)


def hlo_counts(compiled) -> dict:
    """While loops and conditionals in a compiled program's HLO."""
    text = compiled.as_text()
    return {
        "while_loops": len(re.findall(r"\bwhile\(", text)),
        "conditionals": len(re.findall(r"\bconditional\(", text)),
    }


def loop_iterations(ends: np.ndarray, block: int) -> dict:
    """Loop iterations of forward + backward: ours (the schedules' live pairs) and the
    baseline's (outer loop per query / key block, inner loop and a conditional per pair).
    """
    n = ends.shape[1] // block
    schedule = functools.partial(attention.live_block_schedule, jnp.asarray(ends), block)
    forward, backward = int(schedule().count), int(schedule(key_major=True).count)
    return {
        "blocks": n,
        "all_pairs": n * n,
        "live_pairs": forward,
        "live_share": forward / (n * n),
        "ours_iterations": forward + backward,
        "baseline_iterations": 2 * (n + n * n),
        "baseline_conds_run": 2 * n * n,
    }


def case(row: str, length: int, block: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, length, HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((1, length, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, length, KV_HEADS, HEAD_DIM)).astype(np.float32)
    w = rng.standard_normal(q.shape).astype(np.float32)
    ends = forest_row(length)[2] if row == "tree" else np.full((1, length), length, np.int32)
    args = tuple(jnp.asarray(x) for x in (q, k, v, ends, w))
    result = {"row": row, "length": length, "block": block, **loop_iterations(ends, block)}
    compiled, outputs, wall, cpu = {}, {}, {}, {}
    for name in IMPLEMENTATIONS:
        compiled[name] = gradient_fn(name, block).lower(*args).compile()
        result[f"{name}_hlo"] = hlo_counts(compiled[name])
        outputs[name] = jax.block_until_ready(compiled[name](*args))  # warm up
        wall[name], cpu[name] = [], []
    for _ in range(reps):  # interleaved, so drift on a shared machine hits both alike
        for name in IMPLEMENTATIONS:
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled[name](*args))
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    for name in IMPLEMENTATIONS:
        result[f"{name}_s"] = float(np.median(wall[name]))
        result[f"{name}_cpu_s"] = float(np.median(cpu[name]))
    result["speedup"] = result["baseline_s"] / result["ours_s"]
    result["cpu_speedup"] = result["baseline_cpu_s"] / result["ours_cpu_s"]
    result["max_abs_diff"] = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(outputs["ours"]), jax.tree.leaves(outputs["baseline"]), strict=True
        )
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8k only, few repetitions")
    parser.add_argument("--json", help="write the figures to this path")
    args = parser.parse_args()
    if args.quick:
        cases = [("tree", 8192, 512), ("causal", 8192, 512), ("tree", 8192, 128)]
    else:
        cases = [("tree", 8192, 512), ("causal", 8192, 512), ("tree", 32768, 512)]
        cases += [("causal", 32768, 512), ("tree", 32768, 128)]
    reps = 3 if args.quick else 5

    print(
        f"devices: {jax.devices()[0].platform}; {HEADS} heads / {KV_HEADS} kv head of "
        f"{HEAD_DIM}; forward + backward, median of {reps} (wall s; process CPU s)"
    )
    print(
        f"{'row':>6} {'length':>6} {'block':>5} {'live/all pairs':>19} | "
        f"{'ours s':>7} {'base s':>7} {'ratio':>6} | {'ours cpu':>8} {'base cpu':>8} "
        f"{'ratio':>6} | {'iterations ours/base':>20} {'conds':>6} | "
        f"{'HLO while/cond: ours':>20} {'base':>5} | {'max diff':>8}"
    )
    rows = []
    for row, length, block in cases:
        r = case(row, length, block, reps)
        rows.append(r)
        ours, base = r["ours_hlo"], r["baseline_hlo"]
        pairs = f"{r['live_pairs']}/{r['all_pairs']} ({r['live_share']:.1%})"
        print(
            f"{row:>6} {length:>6} {block:>5} {pairs:>19} | "
            f"{r['ours_s']:>7.3f} {r['baseline_s']:>7.3f} {r['speedup']:>5.2f}x | "
            f"{r['ours_cpu_s']:>8.3f} {r['baseline_cpu_s']:>8.3f} {r['cpu_speedup']:>5.2f}x | "
            f"{r['ours_iterations']:>9}/{r['baseline_iterations']:<10} "
            f"{r['baseline_conds_run']:>6} | "
            f"{ours['while_loops']:>16}/{ours['conditionals']:<3} "
            f"{base['while_loops']:>2}/{base['conditionals']:<2} | {r['max_abs_diff']:>8.1e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows, "quick": args.quick}, f, indent=2)


if __name__ == "__main__":
    main()
