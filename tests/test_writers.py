"""Experiment trackers (gyrejax/writers.py): records as scalars, a resumed run's
TensorBoard (read back with TensorBoard's own reader) and W&B. The round trip of a
whole run rides on test_runtime's colocate run (`check_trackers`)."""

import dataclasses
import sys
import types

import pytest
from conftest import check_tensorboard_holds, tensorboard_series

from gyrejax import preflight
from gyrejax.config import Config, ConfigError, LoggingConfig
from gyrejax.logs import append_jsonl, prepare_for_append, up_to_step
from gyrejax.writers import Writers, hyperparameters, scalars


def test_a_record_becomes_its_finite_numbers_named_by_path():
    record = {
        "step": 3,
        "reward": 0.5,
        "skipped": False,
        "eval": {"greedy_pass@1": 0.25, "families": {"L1": {"tasks": 4}}},
        "loss": float("nan"),  # not finite: left to the JSONL
        "groups": ["g0"],
        "policy": "elastic",
        "nothing": None,
    }
    assert scalars(record, "metrics") == {
        "metrics/step": 3.0,
        "metrics/reward": 0.5,
        "metrics/skipped": 0.0,
        "metrics/eval/greedy_pass_at_1": 0.25,
        "metrics/eval/families/L1/tasks": 4.0,
    }


def test_the_config_goes_in_flat():
    flat = hyperparameters(Config())
    assert flat["rl.group_size"] == Config().rl.group_size
    assert flat["logging.writers"] == "('jsonl',)"


@pytest.mark.parametrize(
    "writers, message",
    [
        (("jsonl", "mlflow"), r"config\.logging\.writers=\('jsonl', 'mlflow'\): expected a tuple"),
        (("tensorboard", "tensorboard"), r"each writer once"),
    ],
)
def test_bad_writers_are_one_line_naming_the_field(writers, message):
    with pytest.raises(ConfigError, match=message):
        LoggingConfig(writers=writers)


def test_a_tracker_that_is_not_installed_is_refused_before_the_run(monkeypatch):
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(
        preflight.importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n)
    )
    config = dataclasses.replace(Config(), logging=LoggingConfig(writers=("jsonl", "wandb")))
    with pytest.raises(ConfigError, match=r"wandb needs the wandb package"):
        preflight.check_inputs(config)


def logged(writers: Writers, workdir, log: str, record: dict, step: int) -> None:
    """What `RunContext.log` does: the JSONL record, then the trackers."""
    append_jsonl(workdir / f"{log}.jsonl", record)
    writers.write(log, record, step)


def test_a_resumed_run_leaves_tensorboard_one_point_per_step_as_its_logs(tmp_path):
    """Killed after step 4 with a checkpoint at step 2: the resumed run's JSONL drops
    steps 3 and 4 and writes them again, and TensorBoard plots them once, the resumed
    run's; the killed run's role switches stay (at their places in transitions.jsonl,
    also past the first redone step), and the resumed run's come after them."""
    config = dataclasses.replace(Config(), logging=LoggingConfig(writers=("jsonl", "tensorboard")))
    with Writers(config, tmp_path) as killed:
        for step in (1, 2, 3, 4):
            logged(killed, tmp_path, "metrics", {"step": step, "loss": 10.0 + step}, step)
            logged(killed, tmp_path, "transitions", {"time_s": float(step)}, step)
    prepare_for_append(tmp_path / "metrics.jsonl", keep=up_to_step(2))  # as Steps.restore
    with Writers(config, tmp_path, resumed_at=2) as resumed:
        for step in (3, 4, 5):
            logged(resumed, tmp_path, "metrics", {"step": step, "loss": 20.0 + step}, step)
        logged(resumed, tmp_path, "transitions", {"time_s": 5.0}, step=5)
    series, _ = tensorboard_series(tmp_path / "tensorboard")
    assert series("metrics/loss") == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]
    check_tensorboard_holds(tmp_path, "metrics", ("loss",))
    check_tensorboard_holds(tmp_path, "transitions", ("time_s",))
    assert len(series("transitions/time_s")) == 5


class FakeWandbRun:
    """What Writers uses of a W&B run: its summary (a resumed run's last values) and log."""

    def __init__(self, summary: dict):
        self.summary, self.history = summary, []

    def log(self, values: dict) -> None:
        self.history.append(values)

    def finish(self) -> None:
        pass


@pytest.mark.parametrize("summary, sent", [({}, [1, 2, 3]), ({"metrics/step": 2}, [3])])
def test_wandb_gets_only_steps_past_those_its_run_has(monkeypatch, tmp_path, summary, sent):
    """W&B's history only grows: a run resumed online (its summary has metrics/step 2)
    is not sent the steps it has again; a new run (offline: each launch) gets all."""
    run = FakeWandbRun(summary)
    fake = types.SimpleNamespace(init=lambda **kwargs: run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = dataclasses.replace(Config(), logging=LoggingConfig(writers=("jsonl", "wandb")))
    with Writers(config, tmp_path, resumed_at=1) as writers:
        for step in (1, 2, 3):
            writers.write("metrics", {"step": step, "loss": 1.0}, step)
    assert [values["metrics/step"] for values in run.history] == sent
