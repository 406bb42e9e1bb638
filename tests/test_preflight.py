"""preflight.check_inputs for model.tokenizer (the byte tokenizer's cases run through
launch in test_launch.py)."""

import pytest

from gyrejax.config import Config, ConfigError, ModelConfig
from gyrejax.preflight import check_inputs


def config(tokenizer, vocab_size: int) -> Config:
    return Config(model=ModelConfig(vocab_size=vocab_size, tokenizer=str(tokenizer)))


def test_the_model_vocabulary_must_cover_an_hf_tokenizers(bpe_tokenizer):
    check_inputs(config(bpe_tokenizer, 1024))  # sized to the tokenizer
    check_inputs(config(bpe_tokenizer, 1536))  # padded beyond it, as Qwen's checkpoints are
    with pytest.raises(ConfigError) as error:
        check_inputs(config(bpe_tokenizer, 512))
    assert str(error.value) == (
        "config.model.vocab_size=512: below the harness tokenizer's vocabulary of 1024 "
        f"tokens (model.tokenizer={bpe_tokenizer}) (its token ids would index past the "
        "embedding)"
    )


def test_a_directory_without_a_tokenizer_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"config.model.tokenizer={tmp_path}: not a loadable HF"):
        check_inputs(config(tmp_path, 1024))
    with pytest.raises(ConfigError) as error:
        check_inputs(config(tmp_path / "missing", 1024))
    assert "\n" not in str(error.value)
