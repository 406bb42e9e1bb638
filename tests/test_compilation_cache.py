"""The persistent compilation cache: where each process's cache is, and a second launch
loading every program the first one compiled."""

import os
import pathlib
import re

import pytest
from test_launch import launch

from gyrejax.compilation_cache import ENV_DIR, ENV_MIN_COMPILE_TIME, enable, resolve
from gyrejax.config import ConfigError


def test_the_environment_wins_then_auto_is_the_workdirs_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "from_env"))
    assert resolve("auto", "/runs/a") == (str(tmp_path / "from_env"), ENV_DIR)
    assert resolve("off", "/runs/a") == (str(tmp_path / "from_env"), ENV_DIR)
    monkeypatch.setenv(ENV_DIR, "")  # empty: as if unset
    assert resolve("auto", "/runs/a") == ("/runs/a/jax_cache", "auto")
    monkeypatch.delenv(ENV_DIR)
    assert resolve("auto", "/runs/a") == ("/runs/a/jax_cache", "auto")
    assert resolve("off", "/runs/a") == resolve("", "/runs/a") == (None, "off")
    assert resolve("auto", None) == (None, "off")  # a CLI without a run directory
    assert resolve("~/cache", None) == (os.path.expanduser("~/cache"), "config")
    monkeypatch.chdir(tmp_path)
    assert resolve("cache", "/runs/a") == (str(tmp_path / "cache"), "config")


def test_a_directory_that_cannot_be_made_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_DIR, raising=False)
    (tmp_path / "file").write_text("")
    setting = str(tmp_path / "file" / "cache" / "jax")
    with pytest.raises(ConfigError, match=r"^config\.compilation_cache_dir='.*file/cache/jax': "):
        enable(setting, None)
    with pytest.raises(ConfigError, match=r"^--compilation_cache_dir='.*jax': .*file is not a dir"):
        enable(setting, None, field="--compilation_cache_dir")
    (tmp_path / "locked").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(ConfigError, match=r"cannot write in .*locked$"):
            enable(str(tmp_path / "locked" / "cache"), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "locked"]  # nothing made


LOADED = re.compile(r"compilation cache: (\d+) of (\d+) programs loaded from (\S+)")


def test_a_second_launch_loads_every_program_from_the_workdirs_cache(tmp_path):
    """The default ("auto") without the suite's $JAX_COMPILATION_CACHE_DIR: the first
    run fills `<workdir>/jax_cache`, every program of the second (a resume: the same
    workdir) comes from it. A rollout batch on one cell of 2 devices keeps it short."""
    args = (
        "--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path),
        "--config.train.steps=0", "--config.cells.num_cpu_devices=2",
        "--config.harness.max_turns=1",
    )  # fmt: skip
    cache = tmp_path / "jax_cache"
    runs = []
    for _ in range(2):
        result = launch(*args, unset=(ENV_DIR, ENV_MIN_COMPILE_TIME))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"compilation cache: {cache} (auto)" in result.stderr
        ((loaded, requested, where),) = LOADED.findall(result.stderr)
        assert pathlib.Path(where) == cache
        runs.append((int(loaded), int(requested), sorted(os.listdir(cache))))
    (first_loaded, first_requested, first_files), (loaded, requested, files) = runs
    assert first_requested > 0 and len(first_files) == first_requested - first_loaded
    # The second run loads what the first compiled and compiles only programs new to the
    # cache (usually none, as here when idle: 33 of 33 loaded; engines compile buckets as
    # they are needed, so another timing may need another one).
    assert loaded > 0 and requested - loaded == len(files) - len(first_files)
