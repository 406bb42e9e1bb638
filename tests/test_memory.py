"""gyrejax/memory.py against what JAX and XLA actually keep: per-layer residuals under each
remat mode (JAX's autodiff, abstract shapes only) and the whole micro-step against XLA's
own compiled memory analysis of the trainer's micro-step (the configs' fit tables rest
on both)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from gyrejax import memory
from gyrejax.cells import split_into_cells
from gyrejax.config import (
    CellsConfig,
    Config,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    TrainConfig,
)
from gyrejax.model.transformer import Transformer, init_model
from gyrejax.rl.objective import MICRO_STEP_FIELDS, micro_step_loss
from gyrejax.train.trainer import ElasticTrainer

SMALL = ModelConfig(
    vocab_size=1000, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=32, attention="blocked", attention_block_size=16,
)  # fmt: skip


def residual_bytes(model: ModelConfig, length: int, **head) -> int:
    """Bytes of every residual JAX's autodiff keeps for the micro-step loss of one row
    (parameters included: they cancel in the differences below)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    dtypes = dict.fromkeys(MICRO_STEP_FIELDS, jnp.int32)
    dtypes.update(loss_weight=jnp.float32, advantage=jnp.float32, behavior_logprob=jnp.float32)
    rows = {f: jax.ShapeDtypeStruct((1, length), dtypes[f]) for f in MICRO_STEP_FIELDS}

    def backward(params, rows):
        loss = lambda p: micro_step_loss(nnx.merge(graphdef, p), rows, RLConfig(), 0, **head)[0]
        return jax.vjp(loss, params)[1]  # a closure over the residuals

    return sum(
        r.size * r.dtype.itemsize for r in jax.tree.leaves(jax.eval_shape(backward, params, rows))
    )


def per_token(model: ModelConfig, **head) -> tuple[float, float]:
    """(bytes per token per layer, bytes per token of the rest: the head) JAX keeps, from
    1 and 2 layers at 2 lengths (parameters and per-row constants cancel)."""
    kept = {
        (layers, length): residual_bytes(
            dataclasses.replace(model, num_layers=layers), length, **head
        )
        for layers in (1, 2)
        for length in (32, 64)
    }
    layer = (kept[2, 64] - kept[1, 64] - kept[2, 32] + kept[1, 32]) / 32
    return layer, (kept[1, 64] - kept[1, 32]) / 32 - layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("remat", ["none", "layer", "matmuls"])
def test_kept_bytes_are_the_residuals_jax_keeps(dtype, qk_norm, remat):
    model = dataclasses.replace(SMALL, dtype=dtype, qk_norm=qk_norm)
    layer, _ = per_token(model, remat=remat)
    assert layer == memory.kept_bytes_per_token_per_layer(model, remat=remat)


def test_a_chunked_head_keeps_no_vocabulary_sized_residual():
    """Unchunked, the head keeps a float32 [tokens, vocab] buffer for its backward; in
    chunks it keeps only its hidden-width tensors (`head_bytes_per_token`), so the
    logits exist for one chunk at a time."""
    model = dataclasses.replace(SMALL, dtype="bfloat16")
    _, whole = per_token(model)
    _, chunked = per_token(model, chunk_tokens=8)
    assert whole - chunked >= 4 * model.vocab_size
    assert 0 <= memory.head_bytes_per_token(model, chunked=True) - chunked <= 64


# XLA's own account of the trainer's compiled micro-step, against the estimate of what
# that program holds. Float32: XLA's CPU backend computes bfloat16 in float32 and keeps
# float32 copies a GPU does not. Long rows and narrow layers, so activations dominate
# what the estimate leaves out (temporaries of the size of the weights). Measured ratios
# (XLA / estimate) when this test was written, over all six of remat x chunking and a
# wider model: 0.89-1.06; four of them run here.
XLA_MODEL = ModelConfig(
    vocab_size=2048, hidden_size=64, intermediate_size=192, num_layers=4, num_heads=2,
    num_kv_heads=1, head_dim=64, attention="blocked", attention_block_size=512,
)  # fmt: skip


@pytest.mark.parametrize(
    ("remat", "chunk", "widths"),
    [("none", 0, {}), ("layer", 0, {}), ("matmuls", 1024, {}),
     ("layer", 1024, dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2))],
)  # fmt: skip
def test_the_estimate_is_within_15_percent_of_xla_memory_analysis(remat, chunk, widths):
    model = dataclasses.replace(XLA_MODEL, **widths)
    train = TrainConfig(row_length=8192, remat=remat, loss_chunk_tokens=chunk)
    config = Config(model=model, train=train, rollout=RolloutConfig(max_seq_len=8192))
    estimate = memory.estimate(config).training.micro_step_program
    cell = split_into_cells(CellsConfig(size=1), jax.devices()[:1])[0]
    trainer = ElasticTrainer(init_model(model), cell, rl=RLConfig(), train=train)
    analysis = trainer.compiled_micro_step(cell).memory_analysis()
    xla = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )
    assert 0.85 <= xla / estimate <= 1.15, (xla, estimate)
