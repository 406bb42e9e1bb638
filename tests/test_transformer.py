"""The NNX transformer: tree rows equal per-path causal runs; cache decode equals forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyrejax.config import ModelConfig
from gyrejax.model.transformer import KVCache, count_params, init_model

CONFIG = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10_000.0,
    qk_norm=True,
    qkv_bias=True,
    tie_embeddings=False,
    attention_block_size=4,
)


@nnx.jit
def _forward(model, tokens, positions, subtree_end):
    return model(tokens, positions, subtree_end)


def run_row(model, tokens, positions, subtree_end):
    """Logits float32[L, vocab] of one packed row."""
    rows = (np.asarray(x, np.int32)[None] for x in (tokens, positions, subtree_end))
    return np.asarray(_forward(model, *rows))[0]


def causal_logits(model, tokens):
    n = len(tokens)
    return run_row(model, tokens, np.arange(n), np.full(n, n))


def hand_built_row():
    """Two trees and padding in one row of 16, laid out in DFS pre-order.

    tree A: root r(3 tokens) -> child c1 (2) -> grandchild g (1)
                             -> child c2 (3)
    tree B: one node b (4 tokens); then 3 padding tokens.
    Returns tokens, positions, subtree_end, and for each non-padding index its
    root-to-token path as row indices.
    """
    segments = {  # name: (row start, length, parent, start position)
        "r": (0, 3, None, 0),
        "c1": (3, 2, "r", 3),
        "g": (5, 1, "c1", 5),
        "c2": (6, 3, "r", 3),
        "b": (9, 4, None, 0),
    }
    subtree_end_of = {"r": 9, "c1": 6, "g": 6, "c2": 9, "b": 13}
    length = 16
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, length).astype(np.int32)
    positions = np.zeros(length, np.int32)
    subtree_end = np.arange(1, length + 1, dtype=np.int32)  # padding: only itself
    paths = {}
    for name, (start, n, parent, pos) in segments.items():
        ancestors: list[int] = []
        p = parent
        while p is not None:
            ps, pn, pp, _ = segments[p]
            ancestors = list(range(ps, ps + pn)) + ancestors
            p = pp
        for j in range(n):
            i = start + j
            positions[i] = pos + j
            subtree_end[i] = subtree_end_of[name]
            paths[i] = [*ancestors, *range(start, i + 1)]
    return tokens, positions, subtree_end, paths


@pytest.mark.parametrize("impl", ["dense", "blocked"])
def test_tree_row_equals_each_path_alone(impl):
    model = init_model(dataclasses.replace(CONFIG, attention=impl), seed=1)
    tokens, positions, subtree_end, paths = hand_built_row()
    row = np.asarray(
        model(
            jnp.asarray(tokens[None]), jnp.asarray(positions[None]), jnp.asarray(subtree_end[None])
        )
    )[0]
    # A token's root-to-token path is a prefix of some longest path; one causal run of
    # each longest path gives every prefix's last logits (causality).
    longest = [p for p in paths.values() if not any(set(p) < set(o) for o in paths.values())]
    alone = {tuple(p): causal_logits(model, tokens[p].tolist()) for p in longest}
    for i, path in paths.items():
        assert positions[path].tolist() == list(range(len(path)))
        full = next(p for p in alone if list(p[: len(path)]) == path)
        np.testing.assert_allclose(row[i], alone[full][len(path) - 1], atol=1e-4, err_msg=f"{i}")


def test_padding_does_not_change_real_tokens():
    model = init_model(CONFIG, seed=2)
    tokens = np.arange(1, 9, dtype=np.int32)
    base = causal_logits(model, tokens.tolist())
    padded = np.concatenate([tokens, np.zeros(4, np.int32)])
    ends = np.concatenate([np.full(8, 8), np.arange(9, 13)]).astype(np.int32)
    positions = np.concatenate([np.arange(8), np.zeros(4)]).astype(np.int32)
    out = np.asarray(
        model(jnp.asarray(padded[None]), jnp.asarray(positions[None]), jnp.asarray(ends[None]))
    )
    np.testing.assert_allclose(out[0, :8], base, atol=1e-5)


def prefilled(model, prompts):
    """Each prompt (<= 8 tokens) prefilled into its own slot of a 16-position cache."""
    cache = KVCache.create(CONFIG, slots=len(prompts), max_len=16)
    tokens = np.zeros((len(prompts), 8), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    return model.prefill(jnp.asarray(tokens), lengths, jnp.arange(len(prompts)), cache)


def test_prefill_and_decode_equal_full_forward():
    """Slots of different lengths, one inactive, decoded together."""
    model = init_model(CONFIG, seed=3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 6, 5)]
    continuation = [rng.integers(0, 97, 4).tolist() for _ in prompts]
    logits, cache = prefilled(model, prompts)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logits[i]), causal_logits(model, p)[-1], atol=1e-4)
    active = np.array([True, False, True])
    for step in range(4):
        step_tokens = np.array([c[step] for c in continuation], np.int32)
        logits, cache = model.decode(jnp.asarray(step_tokens), cache, jnp.asarray(active))
        for i in np.flatnonzero(active):
            seq = prompts[i] + continuation[i][: step + 1]
            np.testing.assert_allclose(
                np.asarray(logits[i]), causal_logits(model, seq)[-1], atol=1e-4
            )
    assert np.asarray(cache.lengths).tolist() == [7, 6, 9]


def test_decode_over_the_first_slots_leaves_the_others():
    """A decode as wide as the busy slots (an engine keeps them first) computes the same
    logits as a full forward and never touches the slots past its width."""
    model = init_model(CONFIG, seed=4)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 3, 6, 4)]
    _, cache = prefilled(model, prompts)
    before = jax.tree.map(np.asarray, cache)
    step_tokens = np.array([7, 9], np.int32)
    logits, cache = model.decode(jnp.asarray(step_tokens), cache, jnp.array([True, True]), 8)
    assert logits.shape == (2, CONFIG.vocab_size)
    for i in range(2):
        seq = prompts[i] + [int(step_tokens[i])]
        np.testing.assert_allclose(np.asarray(logits[i]), causal_logits(model, seq)[-1], atol=1e-4)
    assert np.asarray(cache.lengths).tolist() == [6, 4, 6, 4]
    for old, new in zip(jax.tree.leaves(before)[:-1], jax.tree.leaves(cache)[:-1], strict=True):
        np.testing.assert_array_equal(np.asarray(new)[2:], old[2:])


@pytest.mark.parametrize(
    "changes", [{}, {"qk_norm": False, "qkv_bias": False, "tie_embeddings": True}, {"o_bias": True}]
)
def test_parameter_count_matches_config(changes):
    config = dataclasses.replace(CONFIG, **changes)
    assert count_params(init_model(config)) == config.num_params


def test_bfloat16_model_runs_close_to_float32():
    f32 = init_model(CONFIG, seed=4)
    bf16 = init_model(dataclasses.replace(CONFIG, dtype="bfloat16"))
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(f32)))
    assert nnx.state(bf16)["embed"][...].dtype == jnp.bfloat16
    tokens = np.arange(10, 30, dtype=np.int32).tolist()
    a, b = causal_logits(f32, tokens), causal_logits(bf16, tokens)
    assert b.dtype == np.float32
    # bfloat16 keeps 8 mantissa bits: agreement to a few percent of the logit scale.
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9
