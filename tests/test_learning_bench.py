"""benchmarks/learning_bench.py's report, on hand-written eval.jsonl files (its runs are
benchmark-sized): the per-arm means and 95% intervals over seeds, and the verdict."""

import importlib.util
import json
import math

import pytest
from conftest import REPO_ROOT


def load_bench():
    path = REPO_ROOT / "benchmarks" / "learning_bench.py"
    spec = importlib.util.spec_from_file_location("learning_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def write_runs(root, passes: dict[str, list[list[float]]]) -> dict:
    """One workdir per (arm, seed) whose eval.jsonl has an evaluation at steps 40 and 80
    with the given sampled pass@1 values."""
    runs = {}
    for arm, per_seed in passes.items():
        for seed, values in enumerate(per_seed):
            workdir = root / f"{arm}_seed{seed}"
            workdir.mkdir()
            lines = [
                json.dumps({"step": step, "sampled_pass@1": v, "greedy_pass@1": 0.5})
                for step, v in zip((40, 80), values, strict=True)
            ]
            (workdir / "eval.jsonl").write_text("\n".join(lines) + "\n")
            runs[arm, seed] = workdir
    return runs


def test_intervals_and_verdict_match_a_hand_computation(tmp_path):
    bench = load_bench()
    rl = [[0.27, 0.336], [0.32, 0.332], [0.30, 0.340]]
    control = [[0.184, 0.215], [0.203, 0.211], [0.19, 0.20]]
    table = bench.summarise(write_runs(tmp_path, {"rl": rl, "control": control}))
    last = [seed[1] for seed in rl]
    mean = sum(last) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in last) / 2)
    row = table["rl"][80]["sampled_pass@1"]
    assert row["values"] == last
    assert row["mean"] == pytest.approx(mean)
    assert row["ci95"] == pytest.approx(4.303 * sd / math.sqrt(3))  # t(0.975, 2 dof)
    assert table["control"][40]["seeds"] == [0, 1, 2]
    verdict = bench.verdict(table)
    assert verdict.startswith("RL above control, intervals apart"), verdict

    # The control's evaluations all measure the same weights: pooled (6 values here).
    close = [[0.2, 0.22], [0.19, 0.2], [0.21, 0.23]]
    (tmp_path / "b").mkdir()
    table = bench.summarise(write_runs(tmp_path / "b", {"rl": close, "control": control}))
    assert bench.verdict(table).startswith("not shown: intervals overlap")


def test_the_t_quantiles_are_students():
    stats = pytest.importorskip("scipy.stats")
    bench = load_bench()
    for dof, t in bench.T95.items():
        assert t == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-3)
