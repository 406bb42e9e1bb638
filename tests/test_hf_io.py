"""HF checkpoint I/O: parity with transformers, export round trip (with the tokenizer),
config.json written last, clear errors."""

import hashlib
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import HF_VARIANTS
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyrejax.config import ConfigError
from gyrejax.model import hf_io
from gyrejax.model.hf_io import (
    TOKENIZER_EXPORT_FILES,
    CheckpointError,
    export_hf,
    hf_tensors,
    load_hf,
    read_model_config,
    tokenizer_fingerprint,
)
from gyrejax.model.sampling import generate

PROMPT = [5, 17, 99, 3, 200, 41, 7]


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    b, n = tokens.shape
    return np.asarray(
        model(
            jnp.asarray(tokens, jnp.int32),
            jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)),
            jnp.full((b, n), n, jnp.int32),
        )
    )


def hf_model(directory):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_logits_match_transformers(hf_checkpoints, variant):
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
    with torch.no_grad():
        want = hf_model(hf_checkpoints[variant])(torch.tensor(tokens)).logits.numpy()
    got = our_logits(load_hf(hf_checkpoints[variant]), tokens)
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("variant", ["qwen3", "qwen2"])
def test_greedy_generation_and_logprobs_match_transformers(hf_checkpoints, variant):
    reference = hf_model(hf_checkpoints[variant])
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            max_new_tokens=20,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    want_ids = out.sequences[0, len(PROMPT) :].tolist()
    want_logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item()
        for step, t in zip(out.logits, want_ids, strict=True)
    ]
    (ours,) = generate(load_hf(hf_checkpoints[variant]), [PROMPT], max_new_tokens=20)
    assert ours.token_ids == want_ids
    np.testing.assert_allclose(ours.logprobs, want_logprobs, atol=1e-4)


def test_config_fields_are_read(hf_checkpoints):
    c = read_model_config(hf_checkpoints["qwen3_tied_bias"])
    assert (c.qk_norm, c.qkv_bias, c.o_bias, c.tie_embeddings) == (True, True, True, True)
    assert c.rope_theta == 50000.0 and c.head_dim == 16 and c.num_kv_heads == 2
    c = read_model_config(hf_checkpoints["qwen2"])
    assert (c.qk_norm, c.qkv_bias, c.o_bias, c.tie_embeddings) == (False, True, False, False)


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_export_then_load_round_trip_is_exact(hf_checkpoints, variant, tmp_path):
    model = load_hf(hf_checkpoints[variant])
    export_hf(model, tmp_path / "out")
    again = load_hf(tmp_path / "out")
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, params_of(again), params_of(model))


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_hf_tensors_on_device_equal_the_export(hf_checkpoints, variant, tmp_path):
    """What a vLLM engine gets in memory (JAX arrays, never copied to the host) is what
    the export writes, tensor for tensor (Qwen2's zero q/k/v biases included)."""
    from safetensors.numpy import load_file

    model = load_hf(hf_checkpoints[variant])
    written = load_file(str(export_hf(model, tmp_path / "out") / "model.safetensors"))
    tensors = hf_tensors(model)
    assert sorted(tensors) == sorted(written)
    for name, value in tensors.items():
        assert isinstance(value, jax.Array), name
        np.testing.assert_array_equal(np.asarray(value), written[name], err_msg=name)


def test_export_is_loadable_by_transformers(hf_checkpoints, tmp_path):
    model = load_hf(hf_checkpoints["qwen3_tied_bias"])
    export_hf(model, tmp_path / "out")
    tokens = np.random.default_rng(1).integers(0, 256, (1, 16))
    with torch.no_grad():
        want = hf_model(tmp_path / "out")(torch.tensor(tokens)).logits.numpy()
    assert np.abs(our_logits(model, tokens) - want).max() <= 1e-4


SAMPLE = "def export_hf(model):\n    return {'tokens': [1, 2]}  # ünïcode, then more"


def test_export_with_the_tokenizer_loads_as_one_directory(hf_checkpoints, bpe_tokenizer, tmp_path):
    model = load_hf(hf_checkpoints["qwen3"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "vocab.json").write_text("{}")  # a stale file of another tokenizer: removed
    export_hf(model, out, tokenizer=bpe_tokenizer)
    source = {p.name for p in bpe_tokenizer.iterdir() if p.name in TOKENIZER_EXPORT_FILES}
    assert "tokenizer.json" in source
    assert {p.name for p in out.iterdir()} == source | {"config.json", "model.safetensors"}
    want, got = AutoTokenizer.from_pretrained(bpe_tokenizer), AutoTokenizer.from_pretrained(out)
    assert got(SAMPLE)["input_ids"] == want(SAMPLE)["input_ids"]
    assert len(got(SAMPLE)["input_ids"]) < len(SAMPLE.encode())  # the BPE, not bytes
    chat = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(chat) == want.apply_chat_template(chat)
    assert hf_model(out).config.vocab_size == model.config.vocab_size
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(bpe_tokenizer)

    # No tokenizer (or the byte one, which has no files): the export holds none.
    for tokenizer in (None, "bytes"):
        plain = tmp_path / f"plain_{tokenizer}"
        export_hf(model, plain, tokenizer=tokenizer)
        assert {p.name for p in plain.iterdir()} == {"config.json", "model.safetensors"}


def test_config_json_is_written_last_and_a_crash_leaves_no_config(
    hf_checkpoints, bpe_tokenizer, tmp_path, monkeypatch
):
    """Every file lands by rename, config.json the last; a crash while copying the
    tokenizer (re-exporting over a complete export) leaves a directory without it."""
    model = load_hf(hf_checkpoints["qwen2"])
    landed = []
    real_replace = os.replace

    def replace(src, dst):
        landed.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(hf_io.os, "replace", replace)
    export_hf(model, tmp_path / "out", tokenizer=bpe_tokenizer, max_shard_bytes=40_000)
    assert landed[-1] == "config.json" and landed.count("config.json") == 1
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(landed[:-1])
    assert "model.safetensors.index.json" in landed
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(landed)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io.shutil, "copyfile", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, tmp_path / "out", tokenizer=bpe_tokenizer)
    assert not (tmp_path / "out" / "config.json").exists()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_hf(tmp_path / "out")


def test_tokenizer_fingerprint(bpe_tokenizer, tmp_path):
    assert tokenizer_fingerprint("bytes") == "bytes"
    data = (bpe_tokenizer / "tokenizer.json").read_bytes()
    assert tokenizer_fingerprint(bpe_tokenizer) == f"sha256:{hashlib.sha256(data).hexdigest()}"
    other = tmp_path / "other"
    shutil.copytree(bpe_tokenizer, other)
    (other / "chat_template.jinja").write_text("{{ messages }}")  # ids mean the same
    assert tokenizer_fingerprint(other) == tokenizer_fingerprint(bpe_tokenizer)
    changed = data.replace(b'"def"', b'"fed"', 1)  # one vocabulary entry's string
    assert changed != data
    (other / "tokenizer.json").write_bytes(changed)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(bpe_tokenizer)
    with pytest.raises(ConfigError, match=re.escape(f"tokenizer={tmp_path}: no tokenizer")):
        tokenizer_fingerprint(tmp_path)


def test_sharded_export_writes_index_and_loads(hf_checkpoints, tmp_path):
    model = load_hf(hf_checkpoints["qwen2"])
    export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "out" / "model.safetensors").exists()
    jax.tree.map(
        np.testing.assert_array_equal, params_of(load_hf(tmp_path / "out")), params_of(model)
    )
    tokens = np.random.default_rng(2).integers(0, 256, (1, 12))
    with torch.no_grad():
        want = hf_model(tmp_path / "out")(torch.tensor(tokens)).logits.numpy()
    assert np.abs(our_logits(model, tokens) - want).max() <= 1e-4


def test_bfloat16_export_round_trip(hf_checkpoints, tmp_path):
    model = load_hf(hf_checkpoints["qwen3"], dtype="bfloat16")
    assert nnx.state(model)["embed"][...].dtype == jnp.bfloat16
    export_hf(model, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_hf(tmp_path / "bf16")
    assert again.config.dtype == "bfloat16"
    jax.tree.map(np.testing.assert_array_equal, params_of(again), params_of(model))


def test_load_onto_a_mesh_places_shards(hf_checkpoints):
    mesh = jax.make_mesh(
        (2, 2), ("fsdp", "tensor"), (jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"))
    model = load_hf(hf_checkpoints["qwen3"], mesh=mesh, rules=rules)
    gate = nnx.state(model)["blocks"][0]["mlp"]["gate"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert len(gate.addressable_shards) == 4


# --- bad checkpoints: one clear error naming the file and what is wrong -------------


def copy_of(hf_checkpoints, tmp_path, variant="qwen3"):
    return shutil.copytree(hf_checkpoints[variant], tmp_path / "ck")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "nothing")


def test_missing_or_malformed_config(hf_checkpoints, tmp_path):
    ck = copy_of(hf_checkpoints, tmp_path)
    (ck / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_hf(ck)
    (ck / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_hf(ck)


def test_unsupported_architecture(hf_checkpoints, tmp_path):
    ck = copy_of(hf_checkpoints, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    config["model_type"] = "llama"
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        load_hf(ck)


def test_missing_weights_file(hf_checkpoints, tmp_path):
    ck = copy_of(hf_checkpoints, tmp_path)
    (ck / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors"):
        load_hf(ck)


def test_truncated_weights_file(hf_checkpoints, tmp_path):
    ck = copy_of(hf_checkpoints, tmp_path)
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_hf(ck)


def test_config_that_does_not_match_the_weights(hf_checkpoints, tmp_path):
    ck = copy_of(hf_checkpoints, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    config["intermediate_size"] = 96
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf(ck)
    config["intermediate_size"] = 128
    config["num_hidden_layers"] = 3
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\."):
        load_hf(ck)


def test_index_pointing_at_a_missing_shard(hf_checkpoints, tmp_path):
    model = load_hf(hf_checkpoints["qwen2"])
    out = export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_hf(out)
