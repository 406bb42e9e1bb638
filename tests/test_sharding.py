"""Logical-axis sharding: a (fsdp x tensor) mesh of CPU devices gives unsharded results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gyrejax.config import SAMPLE_SHARDING_RULES, TRAIN_SHARDING_RULES, ModelConfig
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
