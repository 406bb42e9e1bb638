"""configs/qwen3_gpu.py on abstract shapes: published architectures, even layouts, and
per-device memory that fits an H200 or, for the `_h100` twins, an H100 (gyrejax/memory.py),
with every figure its docstring states rendered again here. Nothing is allocated:
`nnx.eval_shape`, `jax.eval_shape` and an `AbstractMesh` of one cell stand in for an 8B
model and its GPUs."""

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO_ROOT
from test_memory import per_token

from gyrejax import memory, preflight
from gyrejax.config import TRAIN_SHARDING_RULES, ConfigError, from_dict
from gyrejax.model.hf_io import model_config_from_hf

ARCHITECTURES = ("0.6b", "1.7b", "4b", "8b", "qwen25_7b")
VARIANTS = tuple(v for a in ARCHITECTURES for v in (a, f"{a}_h100"))

_QWEN3_JSON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
# The published config.json of each checkpoint (the fields load_hf reads), from
# huggingface.co/Qwen/<name>/blob/main/config.json, and the model card's parameter
# counts in billions: (total, without embeddings).
PUBLISHED = {
    "0.6b": (
        dict(_QWEN3_JSON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
        ("0.6", "0.44"),
    ),
    "1.7b": (
        dict(_QWEN3_JSON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
        ("1.7", "1.4"),
    ),
    "4b": (
        dict(_QWEN3_JSON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
        ("4.0", "3.6"),
    ),
    "8b": (
        dict(_QWEN3_JSON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
        ("8.2", "6.95"),
    ),
    "qwen25_7b": (  # Qwen2.5-7B-Instruct
        {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
            "intermediate_size": 18944, "max_position_embeddings": 32768,
            "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 131072, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064,
        },
        ("7.61", "6.53"),
    ),
}  # fmt: skip


@functools.cache
def config_module():
    spec = importlib.util.spec_from_file_location("qwen3_gpu", REPO_ROOT / "configs/qwen3_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_config(variant: str, **changes):
    """The variant's Config with a checkpoint path set (it need not exist: nothing reads
    it here) and `changes` as {"section.field": value}."""
    c = config_module().get_config(variant)
    c.model.hf_checkpoint = f"/models/{variant}"
    for path, value in changes.items():
        section, name = path.split(".")
        c[section][name] = value
    return from_dict(c)


def memory_of(variant: str, **changes) -> memory.Estimate:
    """The per-device memory of the variant's config with `changes`, on the device the
    variant is sized for."""
    module = config_module()
    return memory.estimate(gpu_config(variant, **changes), module.DEVICES[module.device(variant)])


@functools.cache
def estimate(variant: str) -> memory.Estimate:
    return memory_of(variant)


def test_variants_are_the_config_files():
    assert config_module().VARIANTS == VARIANTS
    with pytest.raises(ValueError, match=r"variant 'nope'; pick one of 0\.6b, 0\.6b_h100, 1\.7b"):
        config_module().get_config("nope")


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_is_what_load_hf_reads_from_the_published_checkpoint(variant):
    config = gpu_config(variant)
    hf, (total_b, non_embedding_b) = PUBLISHED[config_module().architecture(variant)]
    # The overrides run.build_model passes to load_hf; the rest comes from config.json.
    loaded = model_config_from_hf(
        hf,
        "config.json",
        dtype=config.model.dtype,
        attention=config.model.attention,
        attention_block_size=config.model.attention_block_size,
    )
    runtime_only = dict(hf_checkpoint=f"/models/{variant}", tokenizer=f"/models/{variant}")
    assert dataclasses.replace(loaded, **runtime_only) == config.model
    assert config.model.dtype == "bfloat16"
    # The model card's counts, to the digits it gives them.
    m = config.model
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    for published, ours in ((total_b, m.num_params), (non_embedding_b, m.num_params - embeddings)):
        digits = len(published.split(".")[1])
        assert abs(ours / 1e9 - float(published)) < 10**-digits, (published, ours)


def test_checkpoint_is_required_and_the_tokenizer_follows_it():
    raw = config_module().get_config("8b")
    with pytest.raises(ConfigError) as error:
        from_dict(raw)
    assert str(error.value) == (
        "config.model.hf_checkpoint=None: required, not set (pass --config.model.hf_checkpoint=...)"
    )
    config = gpu_config("8b")
    assert config.model.tokenizer == config.model.hf_checkpoint == "/models/8b"
    assert config.harness.sandbox == "bwrap"
    assert config.cells.num_cpu_devices == 0


def test_tokenizer_is_overridden_on_its_own():
    """`--config.model.tokenizer=DIR` sets the tokenizer only: the checkpoint stays."""
    raw = config_module().get_config("4b")
    raw.model.hf_checkpoint = "/models/4b"
    raw.model.tokenizer = "/tokenizers/qwen3"
    config = from_dict(raw)
    assert config.model.hf_checkpoint == "/models/4b"
    assert config.model.tokenizer == "/tokenizers/qwen3"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_host_of_8_gpus_splits_into_cells(variant):
    """The cell shape leaves a core and at least one satellite on one 8-GPU host, and the
    checks launch runs once it knows the device count pass."""
    config = gpu_config(variant)
    assert 8 % config.cells.size == 0 and 8 // config.cells.size >= 2
    preflight.check_devices(config, 8, "gpu")


def test_launch_without_a_checkpoint_exits_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gyrejax.launch", "--config", "configs/qwen3_gpu.py:0.6b",
         "--workdir", str(tmp_path)],
        cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "gyrejax.launch: config.model.hf_checkpoint=None: required, not set "
        "(pass --config.model.hf_checkpoint=...)"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_shards_evenly_on_the_cell(variant):
    config = gpu_config(variant)
    mesh = memory.cell_mesh(config.cells)
    assert mesh.size == config.cells.size
    state = memory.abstract_state(config.model)
    for rules in (config.train.sharding_rules, config.rollout.sharding_rules):
        assert memory.uneven_shardings(state, mesh, rules) == []
    assert config.train.rows_per_micro_step % config.cells.fsdp == 0


def test_an_uneven_layout_is_named():
    model = gpu_config("qwen25_7b").model  # 4 kv heads, 28 query heads
    mesh = jax.sharding.AbstractMesh((1, 8), ("fsdp", "tensor"))
    problems = memory.uneven_shardings(memory.abstract_state(model), mesh, TRAIN_SHARDING_RULES)
    assert "blocks.0.attn.k: dimension 1 (kv_heads=4) is not divisible by tensor=8" in problems
    assert "blocks.0.attn.q: dimension 1 (heads=28) is not divisible by tensor=8" in problems
    est = memory_of("qwen25_7b", **{"cells.size": 8, "cells.tensor": 8})
    assert any("kv_heads=4" in p for p in est.problems)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_fits_its_device_and_the_docstring_shows_its_figures(variant):
    module = config_module()
    config, est = gpu_config(variant), estimate(variant)
    assert module.DEVICES == {"h200": memory.H200_BYTES, "h100": memory.H100_BYTES}
    assert est.hbm_bytes == (141e9 if module.device(variant) == "h200" else 80e9)
    assert est.problems == ()
    assert est.training.total <= est.limit == int(0.9 * est.hbm_bytes)
    # The docstring's tables, rendered from the config: no figure is copied by hand.
    doc = module.__doc__
    assert memory.TRAINING_HEADER in doc and memory.ROLLOUT_HEADER in doc
    assert memory.training_row(variant, config, est) in doc
    assert memory.rollout_row(variant, est) in doc
    assert config.rollout.max_seq_len == config.train.row_length == 32768
    # Never a whole row's float32 [tokens, vocab] logits.
    assert 0 < config.train.loss_chunk_tokens < config.train.row_length


CHEAPEST_FIRST = ("none", "matmuls", "layer")  # recomputation each remat costs


@pytest.mark.parametrize("variant", VARIANTS)
def test_layout_is_the_smallest_cell_and_the_cheapest_remat_that_fit(variant):
    """The docstring's rule: the smallest cell of at most 4 GPUs (1, 2, 4 along
    `tensor`) that trains 32768-token rows, with the least recomputation that fits; an
    H200 variant then takes a second row per device where that still fits, an H100 one
    never does; the engine's share leaves the core room for the trainer (at most 0.75, in
    steps of 0.05) and its slots are what fits the share (at most 32)."""
    module = config_module()
    config, est = gpu_config(variant), estimate(variant)
    cells, train = config.cells, config.train
    assert cells.fsdp == 1 and cells.size == cells.tensor <= 4
    trains = lambda e: not [p for p in e.problems if p.startswith(("training", "train "))]
    one_row = {"train.rows_per_micro_step": 1}
    for smaller in (1, 2, 4)[: (1, 2, 4).index(cells.tensor)]:
        for remat in CHEAPEST_FIRST:
            shape = {"cells.size": smaller, "cells.tensor": smaller, "train.remat": remat}
            assert not trains(memory_of(variant, **shape, **one_row)), (smaller, remat)
    for cheaper in CHEAPEST_FIRST[: CHEAPEST_FIRST.index(train.remat)]:
        assert not trains(memory_of(variant, **{"train.remat": cheaper}, **one_row)), cheaper
    rows_per_device = train.rows_per_micro_step // cells.fsdp
    if module.device(variant) == "h100":
        assert rows_per_device == 1
    else:
        two = trains(memory_of(variant, **{"train.rows_per_micro_step": 2}))
        assert rows_per_device == (2 if two else 1)
    share = config.rollout.gpu_memory_utilization
    r = est.rollout
    assert share == min(0.75, int((1 - r.core_resident / est.hbm_bytes) * 20) / 20)
    assert config.rollout.max_slots == min(32, r.max_slots)


def test_a_long_row_bucket_is_counted_at_its_length():
    """With row buckets the estimate is of the micro-step with the most tokens per
    device: one row of a bucket longer than train.row_length (and than the base [R, L]
    budget) may hold a context up to rollout.max_seq_len."""
    row = gpu_config("0.6b").train.row_length
    longer = {"train.row_length": row // 2, "train.row_lengths": (2 * row,)}
    est = memory_of("0.6b", **longer, **{"rollout.max_seq_len": 2 * row})
    base = estimate("0.6b").training
    assert est.training.rows == base.rows == 1
    assert est.training.activations_per_row == 2 * base.activations_per_row
    assert any(p.startswith("training needs") for p in est.problems)  # 2L: beyond the cell


def test_too_small_cells_are_reported_with_the_numbers():
    est = memory_of("8b", **{"cells.size": 1, "cells.tensor": 1})
    t = est.training
    assert t.total > est.limit
    assert (
        f"training needs {memory.gb(t.total)} GB per device, above 126.9 GB (90% of 141.0 GB): "
        f"parameters {memory.gb(t.params)}, masters {memory.gb(t.master)}, gradients "
        f"{memory.gb(t.gradients)}, accumulator {memory.gb(t.accumulator)}, optimizer "
        f"{memory.gb(t.optimizer)}, activations {memory.gb(t.activations)} (2 row(s) of "
        f"{memory.gb(t.activations_per_row)}), working set {memory.gb(t.working)} (loss head "
        f"{memory.gb(t.head)}, a layer's backward {memory.gb(t.rows * t.working_per_row)}); "
        "train.remat='layer', train.loss_chunk_tokens=4096"
    ) in est.problems


def test_remat_and_a_chunked_head_are_what_make_32k_rows_fit():
    """Without them (the trainer before issue 38) no variant's layout holds a 32768-token
    row on its device: each layer's activations and a whole row's float32 logits."""
    for variant in VARIANTS:
        plain = memory_of(variant, **{"train.remat": "none", "train.loss_chunk_tokens": 0})
        assert estimate(variant).training.total < plain.training.total
        if gpu_config(variant).train.remat != "none":
            assert any(p.startswith("training needs") for p in plain.problems), variant


def test_rollout_beyond_its_share_is_reported():
    est = estimate("8b")
    r = est.rollout
    slots = r.max_slots + 1
    over = memory_of("8b", **{"rollout.max_slots": slots})
    assert over.problems == (
        f"rollout needs {memory.gb(over.rollout.total)} GB per device (weights "
        f"{memory.gb(r.weights)}, KV {memory.gb(over.rollout.kv)} for {slots} slots of "
        f"{memory.gb(r.kv_per_slot_per_device)}), above its share {memory.gb(r.share)} GB "
        f"(rollout.gpu_memory_utilization=0.55); {slots - 1} slots would fit",
    )
    # The core keeps the trainer's weights and optimizer state beside the engine.
    whole = memory_of("8b", **{"rollout.gpu_memory_utilization": 1.0})
    assert whole.problems[-1] == (
        f"on the core cell the engine's share 141.0 GB plus the trainer's parameters, "
        f"masters and optimizer state {memory.gb(est.training.resident)} GB exceed the "
        "device's 141.0 GB"
    )


def test_trainer_keeps_float32_masters_and_moments_beside_bfloat16_weights():
    """What the docstring says the trainer keeps: float32 masters (twice the bfloat16
    parameters) and float32 moments (four times, plus a step counter), 8 bytes per
    parameter more than train.master_dtype="same", and why: a 1e-6 update of a 0.02
    weight is lost in bfloat16, not in float32 (tests/test_trainer.py trains it)."""
    t = estimate("0.6b").training
    assert t.master == t.accumulator == 2 * t.params  # float32 vs bfloat16
    assert 0 <= t.optimizer - 4 * t.params < 1024
    same = memory_of(
        "0.6b", **{"train.master_dtype": "same", "train.allow_low_precision_updates": True}
    ).training
    assert same.master == 0 and 0 <= same.optimizer - 2 * same.params < 1024
    assert t.resident - same.resident == t.master + t.optimizer - same.optimizer
    assert t.resident - same.resident - 4 * t.params < 1024  # 8 bytes per parameter
    weight, update = jnp.asarray(0.02, jnp.bfloat16), jnp.asarray(1e-6, jnp.bfloat16)
    assert weight + update == weight
    assert jnp.asarray(0.02, jnp.float32) + 1e-6 != jnp.asarray(0.02, jnp.float32)


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_kept_bytes_equal_the_residuals_jax_keeps(variant):
    """The activation term's per-token count equals what autodiff saves for the real
    loss at the variant's widths (1 and 2 layers, 2 lengths: parameters and per-row
    constants cancel in the differences)."""
    model = dataclasses.replace(gpu_config(variant).model, attention_block_size=16)
    per_layer, head = per_token(model)
    assert per_layer == memory.kept_bytes_per_token_per_layer(model)
    # The head keeps one float32 copy of the logits (memory.logits_bytes counts the
    # copies alive at its peak) and its hidden-width tensors.
    one_copy = 4 * model.vocab_size
    assert 0 <= memory.head_bytes_per_token(model) + one_copy - head <= 64
