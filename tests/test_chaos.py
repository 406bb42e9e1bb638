"""Fault injection in small: `benchmarks/chaos.py`'s quick run. Three SIGKILLs of the
smoke run through launch, each at a moment the job marks (a step, a checkpoint write, a
transition, rollout) and each followed by a restart of the same command: no execution
is lost, no group is trained twice, every checkpoint restores and the run completes.
An engine server killed mid-request: the request completes on the other engine."""

import importlib.util
import sys

from conftest import REPO_ROOT


def load_chaos():
    """benchmarks/chaos.py as a module (registered first: its dataclasses look their
    module up while the class is built)."""
    if "chaos" not in sys.modules:
        path = REPO_ROOT / "benchmarks" / "chaos.py"
        spec = importlib.util.spec_from_file_location("chaos", path)
        sys.modules["chaos"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["chaos"])
    return sys.modules["chaos"]


def test_three_kills_of_the_smoke_run_are_survived(tmp_path):
    chaos = load_chaos()
    result = chaos.chaos(tmp_path, chaos.QUICK, kills=3, seed=0)
    summary = chaos.summarize(result)
    assert summary["kills_tried"] == 3, result
    assert summary["kills_survived"] == 3, result
    assert all(run["completed"] and run["steps"] == chaos.QUICK.steps for run in result["runs"])


def test_an_engine_server_killed_mid_request_completes_elsewhere(tmp_path):
    outcome = load_chaos().engine_server_kill(tmp_path, quick=True)
    assert outcome["completed_on"] == ["near"] and outcome["equals_reference"], outcome
