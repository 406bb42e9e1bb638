"""`python -m gyrejax.generate`: output format and one-line errors."""

import json
import os
import re
import subprocess
import sys

import numpy as np
from conftest import REPO_ROOT

from gyrejax.model.hf_io import load_hf
from gyrejax.model.sampling import generate


def run_cli(*args, unset=()):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in unset:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "gyrejax.generate", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_json_output_matches_library(hf_checkpoints):
    ck = str(hf_checkpoints["qwen3"])
    result = run_cli(
        "--hf_checkpoint", ck, "--prompt_ids", "5,17,99", "--max_new_tokens", "6", "--json"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(printed) == {"token_ids", "logprobs"}
    (want,) = generate(load_hf(ck), [[5, 17, 99]], max_new_tokens=6)
    assert printed["token_ids"] == want.token_ids
    np.testing.assert_allclose(printed["logprobs"], want.logprobs, atol=1e-6)


def test_sampling_is_reproducible_for_a_seed(hf_checkpoints, tmp_path):
    # With --compilation_cache_dir (and not the suite's $JAX_COMPILATION_CACHE_DIR, which
    # would win): the second call loads every program the first compiled.
    args = ("--hf_checkpoint", str(hf_checkpoints["qwen2"]), "--prompt_ids", "1,2,3")
    args += ("--max_new_tokens", "8", "--temperature", "1.0", "--seed", "7", "--json")
    cache = tmp_path / "cache"
    sampled = [
        run_cli(*args, f"--compilation_cache_dir={cache}", unset=["JAX_COMPILATION_CACHE_DIR"])
        for _ in range(2)
    ]
    assert sampled[0].returncode == 0, sampled[0].stderr[-2000:]
    assert sampled[0].stdout == sampled[1].stdout
    counts = [re.findall(r"compilation cache: (\d+) of (\d+) programs", s.stderr) for s in sampled]
    ((loaded, requested),) = counts[1]
    assert int(requested) > 0 and loaded == requested and counts[0] != counts[1]


def test_errors_are_one_line(hf_checkpoints, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{oops")
    cases = [
        (("--hf_checkpoint", str(tmp_path / "missing"), "--prompt_ids", "1"), "not a directory"),
        (("--hf_checkpoint", str(tmp_path / "bad"), "--prompt_ids", "1"), "not valid JSON"),
        (
            ("--hf_checkpoint", str(hf_checkpoints["qwen3"]), "--prompt_ids", "1,x"),
            "expected comma",
        ),
        (("--hf_checkpoint", str(hf_checkpoints["qwen3"]), "--prompt_ids", "1,999"), "token 999"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode != 0, args
        assert "Traceback" not in result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("gyrejax.generate: ") and message in last, last
