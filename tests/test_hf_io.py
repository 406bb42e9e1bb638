"""HF checkpoint I/O: parity with transformers, export round trip (with the tokenizer),
config.json written last, clear errors."""

import dataclasses
import hashlib
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import HF_VARIANTS
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
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


# --- the streamed export against the previous implementation ------------------------


def reference_hf_tensors(model) -> dict[str, np.ndarray]:
    """Every tensor of an HF export by plain NumPy, in the order the previous export
    listed them (which decides the sharding): embed; per layer both norms, q, k, v, o,
    (o bias), gate, up, down, (q/k/v biases), (q/k norms); final norm; (lm_head); a
    bias-free Qwen2's zero q/k/v biases last. Ours: q/k/v [e, n, d], o [h, d, e], MLP and
    lm_head [in, out]; HF: [out, in], heads flattened."""
    c = model.config
    dtype = ml_dtypes.bfloat16 if c.dtype == "bfloat16" else np.float32
    p = params_of(model)
    out = {"model.embed_tokens.weight": p["embed"]}
    for i in range(c.num_layers):
        b, hf = p["blocks"][i], f"model.layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = b["attn_norm"]["scale"]
        out[f"{hf}.post_attention_layernorm.weight"] = b["mlp_norm"]["scale"]
        for proj in "qkv":
            w = b["attn"][proj]
            out[f"{hf}.self_attn.{proj}_proj.weight"] = w.reshape(w.shape[0], -1).T
        o = b["attn"]["o"]
        out[f"{hf}.self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        if c.o_bias:
            out[f"{hf}.self_attn.o_proj.bias"] = b["attn"]["o_bias"]
        for proj in ("gate", "up", "down"):
            out[f"{hf}.mlp.{proj}_proj.weight"] = b["mlp"][proj].T
        if c.qkv_bias:
            for proj in "qkv":
                out[f"{hf}.self_attn.{proj}_proj.bias"] = b["attn"][f"{proj}_bias"].reshape(-1)
        if c.qk_norm:
            for proj in "qk":
                out[f"{hf}.self_attn.{proj}_norm.weight"] = b["attn"][f"{proj}_norm"]["scale"]
    out["model.norm.weight"] = p["final_norm"]["scale"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"].T
    if not c.qk_norm and not c.qkv_bias:
        for i in range(c.num_layers):
            for proj, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
                out[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = np.zeros(heads * c.head_dim)
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def reference_export(model, directory, max_shard_bytes):
    """The files the previous `export_hf` wrote (its weights and index; config.json from
    `hf_config_from_model`): tensors sharded greedily in order, each file by
    `safetensors.numpy.save_file`."""
    directory.mkdir(parents=True)
    shards = [{}]
    size = 0
    tensors = reference_hf_tensors(model)
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / name), metadata={"format": "pt"})
    if n > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
            "weight_map": {
                k: name for name, shard in zip(names, shards, strict=True) for k in shard
            },
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = hf_io.hf_config_from_model(model.config)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 40_000], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["qwen3", "qwen2"])
def test_export_equals_the_reference_byte_for_byte(
    hf_checkpoints, variant, dtype, max_shard_bytes, tmp_path
):
    """Tensor by tensor, then file by file: the same names, dtypes, values, order in each
    file, sharding and index as the NumPy reference written by safetensors itself."""
    model = load_hf(hf_checkpoints[variant], dtype=dtype)
    want = reference_export(model, tmp_path / "want", max_shard_bytes)
    got = export_hf(model, tmp_path / "got", max_shard_bytes=max_shard_bytes)
    files = sorted(p.name for p in (tmp_path / "want").iterdir())
    assert sorted(p.name for p in got.iterdir()) == files
    assert (len(files) > 3) == (max_shard_bytes == 40_000)
    seen = set()
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(got / name, framework="numpy") as f:
                for key in f.keys():
                    value = f.get_tensor(key)
                    assert value.dtype == want[key].dtype, key
                    np.testing.assert_array_equal(value, want[key], err_msg=key)
                    seen.add(key)
        assert (got / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    assert seen == set(want)


def test_float32_parameters_exported_as_bfloat16_round_like_numpy(hf_checkpoints, tmp_path):
    """Parameters held in float32 under a bfloat16 config are cast on the device: to
    the same bits as ml_dtypes' round-to-nearest-even on the host."""
    model = load_hf(hf_checkpoints["qwen3"])
    model.config = dataclasses.replace(model.config, dtype="bfloat16")
    assert nnx.state(model)["embed"][...].dtype == jnp.float32
    want = reference_export(model, tmp_path / "want", 2 << 30)
    assert want["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    got = export_hf(model, tmp_path / "got")
    for name in ("model.safetensors", "config.json"):
        assert (got / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name


def test_export_one_tensor_at_a_time_is_the_same(hf_checkpoints, tmp_path, monkeypatch):
    """With no room to convert ahead (each tensor converted only once the last is
    written) the files are the same."""
    model = load_hf(hf_checkpoints["qwen2"], dtype="bfloat16")
    export_hf(model, tmp_path / "ahead", max_shard_bytes=40_000)
    monkeypatch.setattr(hf_io, "_EXPORT_LOOKAHEAD_BYTES", 0)
    export_hf(model, tmp_path / "one", max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "ahead").iterdir())
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == files
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "ahead" / name).read_bytes()


def test_a_crash_while_streaming_tensors_leaves_no_checkpoint(
    hf_checkpoints, tmp_path, monkeypatch
):
    """Re-exporting over a complete export and failing mid-way (on the device, in the
    second file): no config.json, no temporary file; the next export is whole again."""
    model = load_hf(hf_checkpoints["qwen3"])
    out = export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    real = hf_io._to_hf_on_device
    calls = []

    def failing(x, to_hf, dtype):
        calls.append(to_hf)
        if len(calls) == 6:
            raise RuntimeError("device lost")
        return real(x, to_hf, dtype)

    monkeypatch.setattr(hf_io, "_EXPORT_LOOKAHEAD_BYTES", 0)
    monkeypatch.setattr(hf_io, "_to_hf_on_device", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        export_hf(model, out, max_shard_bytes=40_000)
    assert not (out / "config.json").exists()
    assert list(out.glob("model-00001-of-*.safetensors"))  # this export's first file
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_hf(out)
    monkeypatch.setattr(hf_io, "_to_hf_on_device", real)
    export_hf(model, out, max_shard_bytes=40_000)
    jax.tree.map(np.testing.assert_array_equal, params_of(load_hf(out)), params_of(model))


def test_export_of_a_model_sharded_over_a_mesh_is_the_same(hf_checkpoints, tmp_path):
    """Parameters sharded over 4 devices (as a training cell holds them) are converted
    where they lie and gathered to the host: the same files as from one device."""
    mesh = jax.make_mesh(
        (2, 2), ("fsdp", "tensor"), (jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4]
    )
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"))
    sharded = load_hf(hf_checkpoints["qwen3"], mesh=mesh, rules=rules, dtype="bfloat16")
    assert len(nnx.state(sharded)["blocks"][0]["attn"]["q"][...].addressable_shards) == 4
    one = export_hf(load_hf(hf_checkpoints["qwen3"], dtype="bfloat16"), tmp_path / "one")
    export_hf(sharded, tmp_path / "mesh")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "mesh" / name).read_bytes() == (one / name).read_bytes(), name


def test_bfloat16_export_loads_in_transformers_bit_exactly(hf_checkpoints, tmp_path):
    """transformers reads the bfloat16 export's bits as they were (its state dict equals
    ours) and, upcast to float32, computes our logits."""
    model = load_hf(hf_checkpoints["qwen2"], dtype="bfloat16")
    out = export_hf(model, tmp_path / "out", max_shard_bytes=40_000)
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    state = reference.state_dict()
    for name, value in reference_hf_tensors(model).items():
        got = state[name].view(torch.int16).numpy()
        np.testing.assert_array_equal(got, value.view(np.int16), err_msg=name)
    tokens = np.random.default_rng(3).integers(0, 256, (1, 12))
    with torch.no_grad():
        want = hf_model(out)(torch.tensor(tokens)).logits.numpy()
    ours = load_hf(out, dtype="float32")
    assert np.abs(our_logits(ours, tokens) - want).max() <= 1e-4


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
