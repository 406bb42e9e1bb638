"""The RL runtime: every policy completes its steps (colocate with contexts longer than
train.row_length, trained in a longer row bucket); kill-and-resume loses nothing, trains
nothing twice and repairs its logs (through the real launch path); a bad stored record is
skipped, counted and run again."""

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import (
    ENGINE_TOKEN,
    REPO_ROOT,
    check_tensorboard_holds,
    load_config_file,
    read_jsonl,
    start_engine_server,
    tensorboard_series,
)
from flax import nnx
from test_evaluation import check_evaluations, record_trained_ids, with_evaluations
from test_trajectory_store import rewrite_header, set_field

from gyrejax.cells import split_into_cells
from gyrejax.config import ConfigError, from_dict
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.sandbox import sandbox_summary
from gyrejax.harness.tasks import draw_tasks
from gyrejax.loop import PublishedWeights, Runtime
from gyrejax.loop.engines import Rollout
from gyrejax.model.hf_io import export_hf, load_hf
from gyrejax.model.transformer import init_model
from gyrejax.scheduler.policies import IDLE_CAUSES
from gyrejax.trajectory import ExecutionStore, generate_executions


@pytest.mark.parametrize("policy", ["colocate", "async"])
def test_baseline_policies_run_their_steps(tmp_path, policy):
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4  # two cells: fewer engines to compile
    c.scheduler.policy = policy
    c.scheduler.async_training_cells = 1
    c.train.steps = 2
    if policy == "async":  # the capacity follows the agents' share of time in model calls
        c.scheduler.slot_occupancy = 1.0
    if policy == "colocate":  # row buckets (issue 18): contexts longer than row_length
        c.train.row_length = 128  # a call is ~100 or ~250 tokens, max_seq_len 640
        c.train.row_lengths = (640,)
        with_evaluations(c)  # and held-out evaluation (test_evaluation.py checks it)
        c.logging.writers = ("jsonl", "tensorboard")  # and a tracker (check_trackers)
    config = from_dict(c)
    runtime = Runtime(config, split_into_cells(config.cells), init_model(config.model), tmp_path)
    trained_ids = record_trained_ids(runtime)
    summary = runtime.run()
    assert summary["steps"] == 2 and summary["policy"] == policy
    if policy == "colocate":
        check_evaluations(tmp_path, runtime, summary, trained_ids)
        check_trackers(tmp_path)
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    lengths = {length for s in steps for _, length in s["shapes"]}  # the rows trained
    assert lengths <= set(config.train.all_row_lengths), lengths
    if policy == "colocate":  # calls longer than row_length, recorded and trained whole
        stored = ExecutionStore(tmp_path / "executions")
        assert max(c.length for ex in stored for c in ex.calls) > config.train.row_length
        assert max(s["longest_call"] for s in steps) > config.train.row_length
        assert 640 in lengths
    bound = config.scheduler.max_staleness  # the driver's gate holds under every policy
    assert all(0 <= s["staleness_max"] <= bound for s in steps)
    kinds = [t["kind"] for t in read_jsonl(tmp_path / "transitions.jsonl")]
    assert "to_training" in kinds
    if policy == "colocate":  # all cells train, then all roll out again
        assert "to_rollout" in kinds
    for name in ("cell_roles.png", "steps.png", "run_summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    # Which sandbox ran agent code (without bubblewrap: a warning that it is no boundary).
    written = json.loads((tmp_path / "run_summary.json").read_text())
    assert written["sandbox"] == summary["sandbox"] == sandbox_summary("auto")
    assert written["overcommitted_leaves"] is None  # elastic's count only
    # Every sampled cell-second is busy or idle for one cause: the idle share is
    # 1 - utilisation, and the per-step rows add up to no more than the run's total.
    cell_s = written["cell_s"]
    assert set(cell_s) == {"busy", *IDLE_CAUSES}
    idle = sum(v for k, v in cell_s.items() if k != "busy") / sum(cell_s.values())
    assert idle == pytest.approx(1 - written["utilisation"], abs=0.01)
    assert sum(sum(s["cell_s"].values()) for s in steps) <= sum(cell_s.values()) + 1e-6
    # The wall time from the trainer's side: its steps' own times, and the rest around them.
    spent = written["trainer_s"]
    assert sum(spent.values()) == pytest.approx(written["wall_s"])
    assert spent["training"] == pytest.approx(sum(s["step_s"] for s in steps))
    assert min(spent.values()) >= 0 and spent["before_first_step"] > 0
    assert written["schedule"]["policy"] == policy and written["over_stale"] == 0
    # What calibrate needs to predict a run like it: the dispatch depth, slot_occupancy.
    assert written["schedule"]["lookahead"] == config.scheduler.lookahead
    assert written["schedule"]["slot_occupancy"] == config.scheduler.slot_occupancy
    assert written["schedule"]["elastic_overcommit"] == config.scheduler.elastic_overcommit
    assert written["schedule"]["dispatch_order"] == "fifo"
    assert all(s["capacity"] >= config.rollout.max_slots for s in steps)
    if policy == "async":
        # The training cell waits for the first groups: before the last dispatch that is
        # train_wait, after it (all groups of this tiny run go out at once) the tail.
        assert cell_s["train_wait"] + cell_s["tail"] > 0


def test_async_with_a_fractional_split_moves_one_cell_each_step(tmp_path):
    """async_training_cells=1.5 on four cells splits its steps 1, 2, 1, 2: cell 1 joins
    for the second, returns to rollout for the third (the same Transitions as elastic's
    returns) and joins again for the fourth; cells 2 and 3 never leave rollout."""
    c = load_config_file("tiny_cpu", "smoke")
    c.scheduler.policy, c.scheduler.async_training_cells, c.scheduler.mu = "async", 1.5, 1
    c.train.steps = 4
    config = from_dict(c)
    summary = Runtime(
        config, split_into_cells(config.cells), init_model(config.model), tmp_path
    ).run()
    assert summary["steps"] == 4 and summary["schedule"]["async_training_cells"] == 1.5
    moves = [(t["cell"], t["kind"]) for t in read_jsonl(tmp_path / "transitions.jsonl")]
    moves = [m for m in moves if m[1] != "publish"]
    assert moves == [(0, "to_training"), (1, "to_training"), (1, "to_rollout"), (1, "to_training")]
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert steps[0]["cells"] == [0] and all(set(s["cells"]) <= {0, 1} for s in steps)
    # The memory each switch frees and takes back, on the cell's devices (issue 38).
    m, r = config.model, config.rollout
    itemsize = np.dtype(m.dtype).itemsize
    kv_bytes = 2 * m.num_layers * r.max_slots * m.num_kv_heads * r.max_seq_len * m.head_dim
    kv_bytes *= itemsize
    switches = [t for t in read_jsonl(tmp_path / "transitions.jsonl") if t["kind"] != "publish"]
    cells = split_into_cells(config.cells)
    for t in switches:
        memory = t["memory"]
        assert memory["source"] == "live_arrays"  # CPU devices report no memory stats
        assert memory["devices"] == [d.id for d in cells[t["cell"]].devices]
        if t["kind"] == "to_training":  # the engine's KV cache (and weights) went
            assert sum(memory["before"]) - sum(memory["after_free"]) >= kv_bytes, memory
        else:  # back: every trainer buffer of the satellite was gone before its engine
            assert sum(memory["before"]) == 0, memory  # woke; the engine's cache is back
            assert sum(memory["after"]) >= kv_bytes, memory
    satellite = [t["memory"] for t in switches if t["cell"] == 1 and t["kind"] == "to_training"]
    assert all(sum(m["after_free"]) == 0 for m in satellite), satellite  # nothing left


def launch(workdir, steps):
    return subprocess.Popen(
        [
            sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py:smoke",
            "--workdir", str(workdir), f"--config.train.steps={steps}",
            "--config.checkpoint.every_steps=1",
            "--config.logging.writers=('jsonl','tensorboard')",
        ],
        cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def checkpoint_steps(workdir) -> list[int]:
    folder = workdir / "checkpoints"
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []


def test_kill_and_resume_through_launch(tmp_path):
    # With a warm compilation cache a smoke step takes ~0.1 s, and checkpoint 2 is gone
    # (keep = 2) two steps later: the run is 8 steps long and is killed at the first
    # checkpoint >= 2 seen, polled often, so that the kill lands before its end.
    first = launch(tmp_path, steps=8)
    deadline = time.time() + 400
    while max(checkpoint_steps(tmp_path), default=0) < 2:
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.time() < deadline, "no checkpoint 2 in time"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = {e.execution_id for e in ExecutionStore(tmp_path / "executions")}
    steps_before = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(steps_before) >= 2
    # What a kill mid-write leaves: a torn last line in each log, and a metrics row of a
    # step trained after the newest checkpoint (its update died with the process).
    newest = max(checkpoint_steps(tmp_path))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": newest + 1, "groups": ["lost-with-the-kill"]}) + "\n")
        f.write('{"step": 9, "lo')
    for name in ("dispatch.jsonl", "transitions.jsonl"):
        with open(tmp_path / name, "a") as f:
            f.write('{"group": "g9", "se')

    second = launch(tmp_path, steps=8)
    _, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr[-3000:]
    resumed = re.search(r"resumed from step (\d+)", stderr)
    assert resumed, stderr[-3000:]
    after = {e.execution_id for e in ExecutionStore(tmp_path / "executions")}
    assert before <= after  # nothing finished is lost
    # The kill can land after checkpoint 3 too: the run resumes from its newest checkpoint.
    resumed_at = int(resumed.group(1))
    assert resumed_at == newest and 2 <= resumed_at <= max(s["step"] for s in steps_before)
    # Every line of every log reads (conftest's read_jsonl is strict), and metrics.jsonl is
    # the history: each step once, the first run's up to the checkpoint, then the
    # second's. No group is trained twice in it.
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[:resumed_at] == [s for s in steps_before if s["step"] <= resumed_at]
    trained = [g for s in steps for g in s["groups"]]
    assert len(trained) == len(set(trained)) and "lost-with-the-kill" not in trained
    dispatched = [d["group"] for d in read_jsonl(tmp_path / "dispatch.jsonl")]
    assert len(dispatched) == len(set(dispatched)) and set(trained) <= set(dispatched)
    assert read_jsonl(tmp_path / "transitions.jsonl")
    # TensorBoard too (issue 41): each step once, the first run's up to the checkpoint,
    # then the second's; every transition once, the first run's before the second's.
    check_tensorboard_holds(tmp_path, "metrics", ("loss", "step_s"))
    check_tensorboard_holds(tmp_path, "transitions", ("time_s",))
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == 8
    assert summary["overcommitted_leaves"] == 0  # elastic, scheduler.elastic_overcommit 0
    # Its wall time from the trainer's side counts only its own steps (the first run's
    # rows were timed by another clock).
    spent = summary["trainer_s"]
    assert sum(spent.values()) == pytest.approx(summary["wall_s"])
    assert spent["training"] == pytest.approx(sum(s["step_s"] for s in steps[resumed_at:]))


def test_resume_skips_a_bad_stored_record_counts_it_and_runs_it_again(tmp_path, bpe_tokenizer):
    """A killed run had dispatched g0 and stored both its executions; one record has since
    gone bad (a valid checksum over a bad field). The resumed run skips it (named,
    counted in the step's metrics), runs that execution again and trains the group. Its
    checkpoint, trained with the byte tokenizer, refuses a resume under another one."""
    c = two_cells_async(steps=1)
    config = from_dict(c)
    synthetic = generate_executions(
        1, 2, seed=0, turns=(2, 3), vocab_size=264, system_prompt_tokens=20,
        task_tokens=(5, 10), tool_output_tokens=(5, 20), model_output_tokens=(5, 20),
        summary_tokens=(5, 10), compaction_budget=180, max_call_tokens=256,
    )  # fmt: skip
    store = ExecutionStore(tmp_path / "executions")
    for i, ex in enumerate(synthetic):
        ex_id = f"g0/{i}"
        calls = [dataclasses.replace(call, execution_id=ex_id) for call in ex.calls]
        store.put(dataclasses.replace(ex, execution_id=ex_id, group_id="g0", calls=calls))
    # The task the config gives g0 (a resume refuses a group recorded with another).
    (task,) = draw_tasks(MiniRepoEnv(), config.harness, 1, seed=0, run_seed=config.seed)
    entry = {"group": "g0", "seq": 0, "task": task.task_id, "version": 0, "time": 0.0}
    (tmp_path / "dispatch.jsonl").write_text(json.dumps(entry) + "\n")
    bad = store.path_for("g0/1")
    rewrite_header(bad, set_field("reward", "abc"))

    summary = Runtime(
        config, split_into_cells(config.cells), init_model(config.model), tmp_path
    ).run()
    assert summary["steps"] == 1
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["groups"] == ["g0"] and row["bad_records"] == 1
    rerun = ExecutionStore(tmp_path / "executions").get("g0/1")  # run again, stored anew
    assert rerun.group_id == "g0" and rerun.calls
    assert ExecutionStore(tmp_path / "executions").get("g0/0") == store.get("g0/0")

    c.train.steps, c.model.tokenizer = 2, str(bpe_tokenizer)
    config = from_dict(c)
    runtime = Runtime(config, split_into_cells(config.cells), init_model(config.model), tmp_path)
    want = f"config.model.tokenizer={bpe_tokenizer}: checkpoint {tmp_path / 'checkpoints' / '1'} "
    with pytest.raises(ConfigError, match=re.escape(want)):
        runtime.run()
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1  # nothing trained


def test_unreachable_external_engine_is_one_clear_error(tmp_path):
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4
    c.rollout.engine_servers = ("http://127.0.0.1:1",)  # nothing listens on port 1
    config = from_dict(c)
    runtime = Runtime(config, split_into_cells(config.cells), init_model(config.model), tmp_path)
    with pytest.raises(ConfigError, match=r"config\.rollout\.engine_servers\[0\]='http://127"):
        runtime.run()
    assert runtime.engines  # the cell engines had started, and were shut down again


def two_cells_async(steps: int):
    """smoke on two cells: cell 0 trains, cell 1 rolls out; a publication per step."""
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4
    c.scheduler.policy, c.scheduler.async_training_cells = "async", 1
    c.train.steps = steps
    return c


def test_external_engine_named_like_a_cell_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GYREJAX_ENGINE_TOKEN", ENGINE_TOKEN)  # what the Runtime's client sends
    server, url = start_engine_server("cell1", "--engine=scripted")
    try:
        c = two_cells_async(steps=1)
        c.rollout.engine_servers = (url,)
        config = from_dict(c)
        runtime = Runtime(
            config, split_into_cells(config.cells), init_model(config.model), tmp_path
        )
        with pytest.raises(
            ConfigError, match=r"config\.rollout\.engine_servers\[0\]=.*named 'cell1' like another"
        ):
            runtime.run()
    finally:
        server.kill()
        server.wait()


def test_a_dead_external_engine_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch):
    """An engine server killed after the first publication: its requests move to the
    rollout cell, the next publications skip it (or drop it when they fail), and every
    step completes."""
    c = two_cells_async(steps=3)
    config = from_dict(c)
    start = export_hf(init_model(config.model), tmp_path / "start")
    workdir = tmp_path / "run"
    monkeypatch.setenv("GYREJAX_ENGINE_TOKEN", ENGINE_TOKEN)  # what the Runtime's client sends
    server, url = start_engine_server(
        "ext", "--engine=jax", f"--hf_dir={start}", f"--weights_dir={workdir / 'published'}",
        f"--max_seq_len={config.rollout.max_seq_len}", f"--max_slots={config.rollout.max_slots}",
    )  # fmt: skip
    transitions = workdir / "transitions.jsonl"
    publish = Rollout.publish

    async def publish_then_kill(rollout):  # the server dies right after the first one
        await publish(rollout)
        if server.poll() is None:
            server.kill()
            server.wait()

    monkeypatch.setattr(Rollout, "publish", publish_then_kill)
    try:
        c.rollout.engine_servers = (url,)
        config = from_dict(c)
        summary = Runtime(
            config, split_into_cells(config.cells), init_model(config.model), workdir
        ).run()
    finally:
        server.kill()
        server.wait()
    assert summary["steps"] == 3
    publishes = [t for t in read_jsonl(transitions) if t["kind"] == "publish"]
    assert len(publishes) == 3
    assert publishes[0]["engines"] == 2  # cell 1 and ext
    assert [p["engines"] for p in publishes[1:]] == [1, 1]  # ext is gone


def test_published_weights_are_this_runs_never_an_earlier_runs(tmp_path):
    """A run resumed from an older checkpoint trains later versions again: exports an
    earlier run left under the same names must not reach the engines."""
    config = from_dict(load_config_file("tiny_cpu", "smoke")).model
    earlier, now = init_model(config, seed=1), init_model(config, seed=2)
    for version in (3, 4):
        export_hf(earlier, tmp_path / f"version_{version}")  # the killed run's
    published = PublishedWeights(tmp_path)

    async def ask():
        first = await published.path(3, lambda: now)
        again = await published.path(3, lambda: earlier)  # written once per version
        return first, again

    first, again = asyncio.run(ask())
    assert first == again == tmp_path / "version_3"
    pure = lambda model: nnx.to_pure_dict(nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, pure(load_hf(first)), pure(now))
    assert not (tmp_path / "version_4").exists()  # the earlier run's later version is gone


def check_trackers(workdir):
    """logging.writers=tensorboard (issue 41): the event files, read back with
    TensorBoard's own EventAccumulator, give metrics.jsonl's reward and loss series, and
    the evaluations' and transitions' records are there too."""
    check_tensorboard_holds(workdir, "metrics", ("reward", "loss"))
    series, events = tensorboard_series(workdir / "tensorboard")
    evaluations = read_jsonl(workdir / "eval.jsonl")
    tags = events.Tags()["scalars"]
    assert len(series("eval/greedy_pass_at_1")) == len(evaluations) > 0, tags
    assert read_jsonl(workdir / "transitions.jsonl")
    check_tensorboard_holds(workdir, "transitions", ("time_s",))
    assert "config/text_summary" in events.Tags()["tensors"]  # the config, as text
