"""Logical-axis sharding: a (fsdp x tensor [x sequence]) mesh of CPU devices gives
unsharded results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_attention import packed_row

from gyrejax.cells import split_into_cells
from gyrejax.config import SAMPLE_SHARDING_RULES, TRAIN_SHARDING_RULES, CellsConfig, ModelConfig
from gyrejax.model import sharding
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import init_model

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    attention_block_size=8,
)


def mesh_2x2():
    return jax.make_mesh(
        (2, 2), ("fsdp", "tensor"), (jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )


def test_logical_to_spec():
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"), ("batch", None))
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("batch", "unnamed", None), rules) == P(None, None, None)
    # A mesh axis is used once; the second claimant stays replicated.
    assert sharding.logical_to_spec(("mlp", "vocab"), rules) == P("tensor", None)
    # A dimension the mesh axis does not divide stays replicated.
    spec = sharding.logical_to_spec(("embed", "mlp"), rules, (3, 4), {"fsdp": 2, "tensor": 2})
    assert spec == P(None, "tensor")


def batch(seed, rows=4, length=16):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (rows, length)).astype(np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    ends = np.full((rows, length), length, np.int32)
    ends[1, :6], positions[1, 6:] = 6, np.arange(length - 6)  # two sequences in row 1
    return tuple(map(jnp.asarray, (tokens, positions, ends)))


def loss_and_grads(model, tokens, positions, ends):
    def loss(model):
        logits = model(tokens, positions, ends)
        return jnp.mean(
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        )

    return nnx.value_and_grad(loss)(model)


@pytest.mark.parametrize("impl", ["dense", "blocked"])
def test_sharded_forward_and_gradients_equal_unsharded(impl):
    config = dataclasses.replace(CONFIG, attention=impl)
    inputs = batch(0)
    reference = init_model(config, seed=1)
    want_logits = np.asarray(nnx.jit(lambda m, *x: m(*x))(reference, *inputs))
    want_loss, want_grads = nnx.jit(loss_and_grads)(reference, *inputs)

    mesh = mesh_2x2()
    model = init_model(config, seed=1)
    sharding.shard_model(model, mesh, TRAIN_SHARDING_RULES)
    gate = nnx.state(model)["blocks"][0]["mlp"]["gate"][...]
    assert gate.sharding.spec == P("fsdp", "tensor") and len(gate.addressable_shards) == 4
    with jax.set_mesh(mesh), sharding.axis_rules(TRAIN_SHARDING_RULES):
        logits = nnx.jit(lambda m, *x: m(*x))(model, *inputs)
        loss, grads = nnx.jit(loss_and_grads)(model, *inputs)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
        nnx.to_pure_dict(grads),
        nnx.to_pure_dict(want_grads),
    )


def test_sharded_generation_equals_unsharded():
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    reference = generate(init_model(CONFIG, seed=2), prompts, max_new_tokens=6)
    model = init_model(CONFIG, seed=2)
    mesh = mesh_2x2()
    sharding.shard_model(model, mesh, SAMPLE_SHARDING_RULES)
    with jax.set_mesh(mesh), sharding.axis_rules(SAMPLE_SHARDING_RULES):
        sharded = generate(model, prompts, max_new_tokens=6)
    for got, want in zip(sharded, reference, strict=True):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_rows_split_over_the_sequence_axis_equal_unsharded():
    """A (fsdp 2 x tensor 2 x sequence 2) cell mesh and the train rules (`length` ->
    `sequence`): the blocked attention runs context-parallel (a ring of ppermutes in a
    shard_map), and the loss and its gradients equal one device's on rows of several
    trees plus padding. (2, 4 and 8 shards: test_attention.py.)"""
    config = dataclasses.replace(CONFIG, attention="blocked", num_layers=1)
    rng = np.random.default_rng(4)
    rows, length = 2, 64
    tokens = rng.integers(0, CONFIG.vocab_size, (rows, length)).astype(np.int32)
    ends = np.stack(
        [
            packed_row(rng, length, max_tree=20, padding=6),
            packed_row(rng, length, max_tree=10, long_tree=40, padding=4),
        ]
    )
    positions = np.stack([tree_depths(e) for e in ends])
    inputs = tuple(map(jnp.asarray, (tokens, positions, ends)))
    reference = init_model(config, seed=3)
    want_loss, want_grads = nnx.jit(loss_and_grads)(reference, *inputs)

    cells = CellsConfig(size=8, fsdp=2, tensor=2, sequence=2)
    (cell,) = split_into_cells(cells)
    model = init_model(config, seed=3)
    sharding.shard_model(model, cell.mesh, TRAIN_SHARDING_RULES)
    with jax.set_mesh(cell.mesh), sharding.axis_rules(TRAIN_SHARDING_RULES):
        graphdef, state = nnx.split(model)
        forward = lambda state, *x: nnx.merge(graphdef, state)(*x)
        assert "ppermute" in str(jax.make_jaxpr(forward)(state, *inputs))
        loss, grads = nnx.jit(loss_and_grads)(model, *inputs)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
        nnx.to_pure_dict(grads),
        nnx.to_pure_dict(want_grads),
    )


def tree_depths(subtree_end: np.ndarray) -> np.ndarray:
    """int32 positions (depth in its path) of each token of a DFS pre-order row."""
    depth = np.zeros(len(subtree_end), np.int32)
    stack: list[int] = []  # open ancestors' subtree ends
    for i, end in enumerate(subtree_end):
        while stack and stack[-1] <= i:
            stack.pop()
        depth[i] = len(stack)
        stack.append(end)
    return depth


def test_train_rules_leave_rows_whole_on_a_mesh_without_a_sequence_axis():
    spec = sharding.logical_to_spec(
        ("batch", "length"), TRAIN_SHARDING_RULES, (4, 16), {"fsdp": 2, "tensor": 2}
    )
    assert spec == P("fsdp", None)
    spec = sharding.logical_to_spec(
        ("batch", "length"), TRAIN_SHARDING_RULES, (4, 16), {"fsdp": 2, "tensor": 1, "sequence": 2}
    )
    assert spec == P("fsdp", "sequence")
