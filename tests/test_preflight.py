"""preflight.check_inputs on `model.tokenizer`: bytes, or a directory with an HF tokenizer's
files, each failure one line naming the field (launch runs it before JAX starts;
tests/test_launch.py checks the line end to end)."""

import pytest

from gyrejax import preflight
from gyrejax.config import ConfigError, from_dict


def check_tokenizer(tokenizer: str) -> None:
    preflight.check_inputs(from_dict({"model": {"tokenizer": tokenizer}}))


def test_bytes_needs_no_directory():
    check_tokenizer("bytes")


@pytest.mark.parametrize("name", preflight.TOKENIZER_FILES)
def test_a_directory_with_either_tokenizer_file_passes(tmp_path, name):
    (tmp_path / name).write_text("{}")
    check_tokenizer(str(tmp_path))


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
