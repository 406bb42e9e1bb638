"""benchmarks/gpu_check.py --cpu_dry_run: every part of the GPU check runs at tiny sizes on
CPU and writes its JSON, so the script cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, TEST_XLA_FLAGS


def test_the_gpu_check_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu_dry_run", "--json", str(out)],
        cwd=REPO_ROOT, env=dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS=TEST_XLA_FLAGS),
        capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == ["attention", "train_step", "engine", "rl", "vllm"]
    for name, part in parts.items():
        assert "error" not in part, (name, part.get("traceback", part["error"]))
    (row,) = parts["attention"]["rows"]
    assert 0 < row["live_blocks"] < row["causal_blocks"]  # a tree row skips blocks
    for variant in ("pallas", "blocked", "cudnn_causal"):
        assert row[variant]["fwd_bwd_s"] > 0
    equality = parts["attention"]["equality"]  # float32 in the interpret mode: exact
    assert equality["loss_relative_error"] < 1e-5
    assert max(equality["grad_relative_error"].values()) < 1e-5
    (step,) = parts["train_step"]["rows"]
    assert step["tokens"] > 0 and step["memory"]["xla_micro_step_bytes"] > 0
    assert [d["busy"] for d in parts["engine"]["decode"]] == [1, 4]
    assert parts["engine"]["logprob_difference"]["max"] < 0.05  # bfloat16 trainer vs engine
    assert parts["rl"]["steps"] == 2 and parts["rl"]["rl_summary"]["policy"] == "colocate"
    assert "new_tokens" in parts["vllm"] or "skipped" in parts["vllm"]
