"""preflight.check_inputs on `model.tokenizer`: bytes, or an HF tokenizer directory that
loads and that the model's vocabulary covers; and `rollout.engine=vllm` needs vllm
installed. Each failure one line naming the field (launch runs it before JAX starts;
tests/test_launch.py checks the line end to end)."""

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
