"""Safe defaults (issue 39): no low-precision updates without saying so, AdamW's weight
decay on the matmul kernels only, and GRPO's unbiased group std threaded from the config.
(The estimators themselves: tests/test_trajectory_advantages.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gyrejax.cells import split_into_cells
from gyrejax.config import (
    ADVANTAGE_STDS,
    REWARD_SHAPINGS,
    CellsConfig,
    CheckpointConfig,
    ConfigError,
    ModelConfig,
    RLConfig,
    TrainConfig,
    from_dict,
)
from gyrejax.model.transformer import init_model
from gyrejax.train import trainer as trainer_module
from gyrejax.train.checkpoint import TrainCheckpointer
from gyrejax.train.loop import process_options
from gyrejax.train.trainer import ElasticTrainer, make_optimizer, weight_decay_mask
from gyrejax.trajectory import advantages

# --- train.master_dtype = "same" below float32 ------------------------------------------


def test_rl_with_greedy_rollouts_is_refused_since_it_would_train_nothing():
    with pytest.raises(ConfigError, match=r"rollout.temperature=0: greedy calls are context"):
        from_dict({"rollout": {"temperature": 0.0}})
    # No RL steps (one evaluation batch), SFT, or a stored set: greedy is fine.
    assert from_dict({"rollout": {"temperature": 0.0}, "train": {"steps": 0}})
    assert from_dict({"rollout": {"temperature": 0.0}, "rl": {"loss": "sft"}})


def test_same_dtype_updates_of_a_bfloat16_model_are_refused_unless_allowed():
    same = {"model": {"dtype": "bfloat16"}, "train": {"master_dtype": "same"}}
    with pytest.raises(ConfigError) as refused:
        from_dict(same)
    message = str(refused.value)
    assert message.startswith("config.train.master_dtype='same': with model.dtype='bfloat16'")
    assert "train.allow_low_precision_updates=True" in message and "\n" not in message
    same["train"]["allow_low_precision_updates"] = True
    assert from_dict(same).train.master_dtype == "same"
    # Float32 models, and float32 masters beside a bfloat16 model, need no permission.
    assert from_dict({"train": {"master_dtype": "same"}}).model.dtype == "float32"
    assert from_dict({"model": {"dtype": "bfloat16"}}).train.master_dtype == "float32"
    with pytest.raises(ConfigError, match=r"allow_low_precision_updates='yes': expected true"):
        from_dict({"train": {"allow_low_precision_updates": "yes"}})


# --- rl.advantage_std, rl.reward_shaping ---------------------------------------------------


@pytest.mark.parametrize(
    "field, names, default, other",
    [
        ("advantage_std", ADVANTAGE_STDS, "unbiased", "population"),
        ("reward_shaping", REWARD_SHAPINGS, "as_is", "pass"),
    ],
)
def test_advantage_settings_have_their_defaults_and_reach_process(field, names, default, other):
    config = from_dict({})
    assert getattr(config.rl, field) == default
    assert names == tuple(getattr(advantages, field.upper() + "S"))  # the config's, process's
    assert process_options(config, 0)[field] == default
    assert process_options(from_dict({"rl": {field: other}}), 0)[field] == other
    expected = ", ".join(names)
    with pytest.raises(
        ConfigError, match=rf"^config\.rl\.{field}='ddof1': expected one of {expected}$"
    ):
        from_dict({"rl": {field: "ddof1"}})


# --- AdamW's weight decay mask ------------------------------------------------------------

# Every kind of parameter: q/k/v and output biases, q/k norms, an untied output head.
MODEL = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=8, qkv_bias=True, o_bias=True, tie_embeddings=False,
)  # fmt: skip
UNDECAYED = ("embed", "scale", "q_bias", "k_bias", "v_bias", "o_bias")
MLP = ("gate", "up", "down")
KERNELS = ("q", "k", "v", "o", *MLP, "lm_head")


def leaf_name(path) -> str:
    return path[-1].key


def model_with_nonzero_biases(seed: int = 0):
    """The tiny model with weights drawn by NumPy (no init to compile): normal(0.02)
    matrices, norm scales 1 and biases 0.5 (not 0, where decay cannot show)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_model(MODEL)))
    rng = np.random.default_rng(seed)

    def value(path, x):
        name = leaf_name(path)
        if name == "scale" or name.endswith("_bias"):
            return jnp.full(x.shape, 1.0 if name == "scale" else 0.5, x.dtype)
        return jnp.asarray(rng.normal(0, 0.02, x.shape), x.dtype)

    params = jax.tree_util.tree_map_with_path(value, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def abstract_params(config: ModelConfig):
    """The model's parameters as ShapeDtypeStructs (the mask needs only their paths)."""
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: init_model(config))))


def test_the_mask_decays_matmul_kernels_only():
    params = abstract_params(MODEL)
    mask = weight_decay_mask(params)
    named = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    kernels = [f"['attn']['{k}']" for k in "qkvo"] + [f"['mlp']['{k}']" for k in MLP]
    decayed = {f"['blocks'][0]{k}" for k in kernels} | {"['lm_head']"}
    assert {n for n, m in named.items() if m} == decayed
    # Tied: the embedding is also the output head, and is not decayed.
    tied = abstract_params(dataclasses.replace(MODEL, tie_embeddings=True))
    assert "lm_head" not in tied and weight_decay_mask(tied)["embed"] is False
    with pytest.raises(ValueError, match=r"parameter \['router'\] is in neither DECAYED_PARAMS"):
        weight_decay_mask({"router": np.zeros((4, 4))})


def test_decay_with_zero_gradients_shrinks_kernels_by_one_minus_lr_wd_and_nothing_else():
    """The trainer's optimizer, on its sharded core, with zero gradients: Adam's step is 0,
    so only the decay moves weights. Kernels become w * (1 - lr * wd) (float32: within a
    few ulps of the float64 formula); the embedding, norm scales and biases are unchanged,
    bit for bit."""
    lr, wd = 0.1, 0.5  # a 5% shrink, far above float32's rounding
    train = TrainConfig(row_length=64, learning_rate=lr, weight_decay=wd)
    core = split_into_cells(CellsConfig(size=2, fsdp=2, tensor=1))[0]
    trainer = ElasticTrainer(model_with_nonzero_biases(), core, rl=RLConfig(), train=train)
    before = jax.tree.map(np.asarray, trainer.params)
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), before)
    assert trainer._apply_update(zeros) == 0.0  # the gradient norm
    after = jax.tree.map(np.asarray, trainer.params)
    seen = set()
    for (path, old), new in zip(
        jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after), strict=True
    ):
        name = leaf_name(path)
        seen.add(name)
        assert np.abs(old).min() > 0, name  # nonzero, so a decay would show
        if name in KERNELS:
            expected = old.astype(np.float64) * (1 - lr * wd)
            np.testing.assert_allclose(new, expected, rtol=3e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(new, old, err_msg=name)
    assert seen == set(UNDECAYED) | set(KERNELS)


def test_the_optimizer_is_optax_adamw_with_the_mask():
    """make_optimizer's steps equal optax's own AdamW given the same mask (clipping
    first), over steps of random gradients, leaf for leaf."""
    lr, wd = 1e-2, 0.3
    params = nnx.to_pure_dict(nnx.state(model_with_nonzero_biases()))
    ours = make_optimizer(TrainConfig(learning_rate=lr, weight_decay=wd, max_grad_norm=1.0))
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lr, weight_decay=wd, mask=weight_decay_mask),
    )

    def step_of(optimizer):
        def step(state, weights, grads):
            updates, state = optimizer.update(grads, state, weights)
            return state, optax.apply_updates(weights, updates)

        return jax.jit(step)

    ours_step, reference_step = step_of(ours), step_of(reference)
    rng = np.random.default_rng(0)
    mine, theirs = (ours.init(params), params), (reference.init(params), params)
    for _ in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
        results = []
        for step, (state, weights) in ((ours_step, mine), (reference_step, theirs)):
            results.append(step(state, weights, grads))
        mine, theirs = results
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
            mine[1],
            theirs[1],
        )


def test_a_checkpoint_from_before_the_mask_restores(tmp_path, monkeypatch):
    """The decay step's state is the unmasked one's (optax's `mask=` would wrap it in a
    MaskedState, which Orbax refuses to restore an older checkpoint into): a checkpoint
    written by the unmasked AdamW restores, moments and counter equal."""

    def unmasked(config):
        return optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
        )

    train = TrainConfig(row_length=64, learning_rate=1e-3, weight_decay=0.1)
    core = split_into_cells(CellsConfig(size=2, fsdp=2, tensor=1))[0]
    checkpoints = CheckpointConfig(every_steps=1, keep=1)
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "make_optimizer", unmasked)
        old = ElasticTrainer(model_with_nonzero_biases(), core, rl=RLConfig(), train=train)
    grads = jax.tree.map(lambda x: np.full(x.shape, 0.01, np.float32), old.params)
    old._apply_update(grads)
    old.save(TrainCheckpointer(tmp_path / "ck", checkpoints))
    new = ElasticTrainer(model_with_nonzero_biases(seed=5), core, rl=RLConfig(), train=train)
    assert jax.tree.structure(new.opt_state) == jax.tree.structure(old.opt_state)
    new.restore(TrainCheckpointer(tmp_path / "ck", checkpoints))
    old_leaves, new_leaves = jax.tree.leaves(old.opt_state), jax.tree.leaves(new.opt_state)
    assert len(old_leaves) == len(new_leaves)
    for a, b in zip(old_leaves, new_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    jax.tree.map(np.testing.assert_array_equal, new.params, old.params)
