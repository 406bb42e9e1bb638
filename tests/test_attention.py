"""Tree attention: blocked == dense, values and gradients, against a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.model import attention


def random_forest_subtree_end(rng: np.random.Generator, length: int) -> np.ndarray:
    """subtree_end of a random forest laid out in DFS pre-order."""
    parent = np.full(length, -1)
    stack: list[int] = []
    for i in range(length):
        while stack and rng.random() < 0.3:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    end = np.arange(1, length + 1)
    for i in reversed(range(length)):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return end


def numpy_tree_attention(q, k, v, subtree_end):
    """Independent reference: explicit loops over rows and queries."""
    b, length, h, d = q.shape
    groups = h // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for row in range(b):
        for i in range(length):
            keys = [j for j in range(length) if j <= i < subtree_end[row, j]]
            for head in range(h):
                kv = head // groups
                s = np.array([q[row, i, head] @ k[row, j, kv] for j in keys]) / np.sqrt(d)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[row, i, head] = p @ v[row, keys, kv]
    return out


def make_inputs(seed, b=2, length=37, h=4, kv=2, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, h, d)).astype(np.float32)
    k = rng.standard_normal((b, length, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, length, kv, d)).astype(np.float32)
    ends = np.stack([random_forest_subtree_end(rng, length) for _ in range(b)]).astype(np.int32)
    return q, k, v, ends


def test_tree_mask_matches_definition():
    _, _, _, ends = make_inputs(0, length=12)
    mask = np.asarray(attention.tree_mask(jnp.asarray(ends)))
    for b in range(ends.shape[0]):
        for qi in range(12):
            for ki in range(12):
                assert mask[b, qi, ki] == (ki <= qi < ends[b, ki])


def test_dense_matches_numpy_loop():
    q, k, v, ends = make_inputs(1)
    ours = attention.dense_tree_attention(*map(jnp.asarray, (q, k, v, ends)))
    np.testing.assert_allclose(np.asarray(ours), numpy_tree_attention(q, k, v, ends), atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 8, 16, 64])
def test_blocked_equals_dense(block_size):
    q, k, v, ends = make_inputs(2)
    args = tuple(map(jnp.asarray, (q, k, v, ends)))
    dense = attention.dense_tree_attention(*args)
    blocked = attention.blocked_tree_attention(*args, block_size=block_size)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(dense), atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_blocked_gradients_equal_dense(block_size):
    q, k, v, ends = make_inputs(3)
    ends = jnp.asarray(ends)
    weights = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    dense = jax.grad(loss(lambda q, k, v: attention.dense_tree_attention(q, k, v, ends)), (0, 1, 2))
    blocked = jax.jit(
        jax.grad(
            loss(lambda q, k, v: attention.blocked_tree_attention(q, k, v, ends, block_size)),
            (0, 1, 2),
        )
    )
    args = tuple(map(jnp.asarray, (q, k, v)))
    for got, want in zip(blocked(*args), dense(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_blocked_causal_rows_and_separate_trees():
    """A plain causal row, and a row of two independent sequences, both match dense."""
    q, k, v, _ = make_inputs(5, b=2, length=32)
    causal = np.full((1, 32), 32, np.int32)
    two_trees = np.concatenate([np.full(20, 20), np.full(12, 32)])[None].astype(np.int32)
    ends = jnp.asarray(np.concatenate([causal, two_trees]))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ends)
    np.testing.assert_allclose(
        np.asarray(attention.blocked_tree_attention(*args, block_size=8)),
        np.asarray(attention.dense_tree_attention(*args)),
        atol=1e-5,
    )


def test_decode_attention_matches_dense_over_valid_prefix():
    rng = np.random.default_rng(6)
    slots, max_len, h, kv, d = 3, 10, 4, 2, 8
    q = rng.standard_normal((slots, h, d)).astype(np.float32)
    k = rng.standard_normal((slots, max_len, kv, d)).astype(np.float32)
    v = rng.standard_normal((slots, max_len, kv, d)).astype(np.float32)
    lengths = np.array([1, 7, 10], np.int32)
    heads_major = (np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2))  # the cache layout
    out = np.asarray(attention.decode_attention(*map(jnp.asarray, (q, *heads_major, lengths))))
    for s, n in enumerate(lengths):
        ends = np.full((1, n), n, np.int32)
        qs = np.zeros((1, n, h, d), np.float32)
        qs[0, n - 1] = q[s]
        ref = numpy_tree_attention(qs, k[s : s + 1, :n], v[s : s + 1, :n], ends)[0, n - 1]
        np.testing.assert_allclose(out[s], ref, atol=1e-5)
