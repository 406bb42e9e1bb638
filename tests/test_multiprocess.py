"""Across processes: 2 processes x 4 CPU-emulated devices on loopback (gloo).

Training gives the same gradients and weights as one process on the same data, while a
satellite of the other process trains, leaves at a step boundary, and rejoins a running
step. The RL loop runs through `launch/local.sh` with process 1's engine serving every
model call over HTTP and its satellite training in every step."""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    REPO_ROOT,
    call_logprobs,
    check_tensorboard_holds,
    load_config_file,
    read_jsonl,
)

from gyrejax.cells import split_into_cells
from gyrejax.config import CellsConfig, RLConfig
from gyrejax.model.transformer import init_model
from gyrejax.rl.objective import MICRO_STEP_FIELDS
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory.rows import ROW_FIELDS

# The model, the batches and the cells, shared by this test and its two processes.
SETUP = """
import dataclasses
import numpy as np
from gyrejax.config import ModelConfig, TrainConfig
from gyrejax.trajectory import generate_executions, process

VOCAB, ROW = 64, 128
MODEL = ModelConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, dtype=DTYPE,
)
TRAIN = TrainConfig(row_length=ROW, rows_per_micro_step=1, learning_rate=1e-3)
CELLS = dict(size=2, fsdp=2, tensor=1)
# Training cells at the start of each step (core first): cell 2 of process 1 trains in
# step 0, leaves, and rejoins step 1 while it runs (pulling the weights from an Orbax
# snapshot); in step 2 all cells of both processes train.
PLAN = [[0, 2], [0], [0, 1, 2, 3]]
MID_STEP_JOIN = {1: 2}  # step -> the cell that joins it while it runs

def make_batch(seed):
    executions = generate_executions(
        3, 3, seed=seed, turns=(4, 10), vocab_size=VOCAB, system_prompt_tokens=10,
        task_tokens=(3, 6), tool_output_tokens=(2, 10), model_output_tokens=(2, 10),
        summary_tokens=(2, 5), compaction_budget=80, retry_prob=0.2, max_call_tokens=ROW,
    )
    rng = np.random.default_rng(seed)
    executions = [
        dataclasses.replace(ex, calls=[
            dataclasses.replace(
                c,
                logprobs=(np.log(1 / VOCAB) + rng.normal(0, 0.1, len(c.output_ids))).astype(
                    np.float32),
                versions=np.zeros(len(c.output_ids), np.int32),
            ) for c in ex.calls])
        for ex in executions
    ]
    return process(executions, row_length=ROW, j_max=None, rows_per_micro_step=1)
"""
shared: dict = {"DTYPE": "float32"}  # each test sets the model's dtype it runs
exec(SETUP, shared)  # the same definitions as in the worker processes
CELLS, MODEL, TRAIN = shared["CELLS"], shared["MODEL"], shared["TRAIN"]
PLAN, MID_STEP_JOIN = shared["PLAN"], shared["MID_STEP_JOIN"]
make_batch = shared["make_batch"]

WORKER = (
    "import sys\nDTYPE = sys.argv[4]\n"
    + SETUP
    + """
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 4)
from gyrejax.cells import split_into_cells
from gyrejax.config import CellsConfig, RLConfig
from gyrejax.distributed import Decisions, initialize
from gyrejax.distributed.transport import MultiProcessTransport
from gyrejax.model.transformer import init_model
from gyrejax.train.trainer import ElasticTrainer

process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
assert initialize(f"127.0.0.1:{port}", 2, process_id, timeout_s=120)
assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
cells = split_into_cells(CellsConfig(**CELLS))
transport = MultiProcessTransport(
    cells, Decisions(timeout_s=300), snapshot_dir=f"{out}/snapshots"
)
trainer = ElasticTrainer(
    init_model(MODEL), cells[0], rl=RLConfig(), train=TRAIN, transport=transport,
    keep_last_grads=True,
)
for cell in cells:
    trainer.precompile(cell)
compiled = trainer.compile_count
record = {"steps": []}
if process_id == 0:
    arrays = {}
    for step, training in enumerate(PLAN):
        indices = [c.index for c in trainer.training]
        for index in [i for i in indices if i not in training]:
            trainer.release(cells[index])
        for index in [i for i in training if i not in indices]:
            trainer.join(cells[index])
        claims = []

        def on_micro_step(m, cell):  # leave the other process's satellites room to claim
            claims.append(m)
            if MID_STEP_JOIN.get(step) is not None and len(claims) == 1:
                trainer.join(cells[MID_STEP_JOIN[step]])
                deadline = time.time() + 60  # hold the core until the newcomer claims one
                while transport.decisions.claimed(f"step/{step + 1}/claimed") <= len(claims):
                    assert time.time() < deadline, "the satellite never claimed"
                    time.sleep(0.05)
            time.sleep(0.1)

        report = trainer.train_step(make_batch(step), on_micro_step=on_micro_step)
        record["steps"].append({
            "cells": list(report.cells), "micro_steps": report.micro_steps_per_cell,
            "loss": report.metrics["loss"], "grad_norm": report.metrics["grad_norm"],
            "version": report.version, "joins": [j.cell for j in report.joins],
        })
        flat = jax.tree_util.tree_flatten_with_path(trainer.params)[0]
        # (as float32: exact for bfloat16 weights, which np.savez cannot store)
        arrays.update(
            {f"params{step}/{jax.tree_util.keystr(k)}": np.float32(v) for k, v in flat}
        )
        grads = jax.tree_util.tree_flatten_with_path(trainer.last_grads)[0]
        arrays.update({f"grads{step}/{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in grads})
        if trainer.master is not None:  # float32 masters beside a bfloat16 model
            masters = jax.tree_util.tree_flatten_with_path(trainer.master)[0]
            arrays.update(
                {f"master{step}/{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in masters}
            )
    trainer.stop()
    np.savez(f"{out}/process0.npz", **arrays)
else:
    while (done := trainer.follow()) is not None:
        record["steps"].append(done)
record["compiles_after_precompile"] = trainer.compile_count - compiled
with open(f"{out}/process{process_id}.json", "w") as f:
    json.dump(record, f)
jax.distributed.shutdown()
"""
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(out, dtype: str = "float32") -> None:
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), str(port), str(out), dtype],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-3000:]}"


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def assert_close(got: np.ndarray, want: np.ndarray, name: str, rtol=1e-5):
    scale = max(np.abs(want).max(), 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=name)


def plain_gradient_sum(trainer: ElasticTrainer, batch) -> dict[str, np.ndarray]:
    """The reference: every micro-step on the core alone, one after another."""
    micro_step, zeros, _ = trainer._compiled_for(trainer.core)
    acc = zeros()
    for m in range(batch.num_micro_steps):
        rows = {
            f: np.asarray(getattr(batch, f)[m : m + 1], ROW_FIELDS[f]) for f in MICRO_STEP_FIELDS
        }
        rows = jax.device_put(rows, trainer._row_sharding(trainer.core))
        acc, _, _ = micro_step(trainer.params, None, acc, rows, np.int32(trainer.version))
    return flat(acc)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_processes_train_like_one(tmp_path, dtype):
    """With a bfloat16 model the core keeps float32 masters (train.master_dtype): the
    satellites of both processes pull the masters cast down, and the masters match."""
    run_two_processes(tmp_path, dtype)
    got = np.load(tmp_path / "process0.npz")
    leader = json.loads((tmp_path / "process0.json").read_text())
    follower = json.loads((tmp_path / "process1.json").read_text())

    # The reference: one process, the core cell alone (tests/test_trainer.py shows that
    # satellites in one process change nothing), and for the gradients a plain loop.
    cells = split_into_cells(CellsConfig(**CELLS))  # this process: the same 8 devices
    model = init_model(dataclasses.replace(MODEL, dtype=dtype))
    single = ElasticTrainer(model, cells[0], rl=RLConfig(), train=TRAIN)
    assert (single.master is not None) is (dtype == "bfloat16")
    for step, training in enumerate(PLAN):
        batch = make_batch(step)
        want_grads = plain_gradient_sum(single, batch)
        report = single.train_step(batch)
        took = leader["steps"][step]
        # Every satellite took part, the one that joined mid-step too.
        expected = training + ([MID_STEP_JOIN[step]] if step in MID_STEP_JOIN else [])
        assert sorted(took["cells"]) == sorted(expected), took
        assert sum(took["micro_steps"].values()) == batch.num_micro_steps
        np.testing.assert_allclose(took["loss"], report.metrics["loss"], rtol=1e-5)
        np.testing.assert_allclose(took["grad_norm"], report.metrics["grad_norm"], rtol=1e-5)
        assert took["version"] == single.version == step + 1
        for name, want in want_grads.items():
            assert_close(got[f"grads{step}/{name}"], want, f"step {step} gradient {name}")
        for name, want in flat(single.params).items():
            assert_close(got[f"params{step}/{name}"], want, f"step {step} weights {name}")
        masters = flat(single.master) if single.master is not None else {}
        for name, want in masters.items():
            assert_close(got[f"master{step}/{name}"], want, f"step {step} master {name}")
            # the weights every cell trains with are the masters cast down
            down = np.float32(want.astype(jnp.bfloat16))
            np.testing.assert_array_equal(got[f"params{step}/{name}"], down, err_msg=name)
    saved = [k for k in got.files if k.startswith("master")]
    assert len(saved) == len(masters) * len(PLAN) and (len(saved) > 0) is (dtype == "bfloat16")

    # Process 1 took part in the steps that had its cells, pulling the weights by a
    # collective at a step boundary and from a snapshot mid-step, and never recompiled
    # a micro-step: only the broadcast and reduction of each new set of cells compile.
    done = [(s["step"], s["weight_pull"], s["joined_mid_step"]) for s in follower["steps"]]
    assert done == [
        (1, "collective", False),
        (2, None, False),  # step 2 starts without process 1's cells ...
        (2, "snapshot", True),  # ... and cell 2 joins it while it runs
        (3, "collective", False),
    ]
    assert leader["steps"][1]["joins"] == [2]
    assert (tmp_path / "snapshots" / "version_1").is_dir()
    # {0,2}: pull + reduce; {0,2} again after the mid-step join: cached; {0,1,2,3}: both.
    assert follower["compiles_after_precompile"] == 4


def test_rl_across_two_processes_through_launch(tmp_path):
    """The whole RL loop with process 1's cells remote: process 0 runs the warm start,
    the scheduler, proxy, harness and core; process 1 starts from the warm-started
    weights, serves its engines over HTTP and trains a satellite. The async policy with
    3 training cells makes the roles certain: cells 0, 1 (process 0) and 2 (process 1)
    train, cell 3 (process 1) serves every model call after the first publication."""
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    command = [
        "bash", "launch/local.sh", "2", "--",
        sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py:smoke",
        "--workdir", str(workdir), "--config.cells.num_cpu_devices=4",
        "--config.scheduler.policy=async", "--config.scheduler.async_training_cells=3",
        "--config.train.steps=3", "--config.scheduler.max_staleness=1",
        "--config.train.rows_per_micro_step=1", "--config.warmup.steps=1",
        "--config.warmup.demonstrations=8", "--config.warmup.groups_per_step=4",
        "--config.logging.writers=('jsonl','tensorboard')",
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", LOG_DIR=str(logs))
    env.pop("GYREJAX_ENGINE_TOKEN", None)  # the job draws its own
    logs.mkdir(parents=True)
    with open(logs / "launch.out", "w+") as out:
        job = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=out)
        try:
            refused = probe_follower_engine(logs / "gyrejax_process_1.log", job)
            returncode = job.wait(timeout=400)
        finally:
            job.kill()
            job.wait()
        out.seek(0)
        stdout = out.read()
    follower_log = (logs / "gyrejax_process_1.log").read_text()
    assert returncode == 0, stdout[-3000:] + "\nprocess 1:\n" + follower_log[-3000:]
    # Process 1's engine refused requests without the run's token (only process 0 has it).
    assert refused == {"status": 401, "update_weights": 401}, refused

    layout = json.loads((workdir / "layout.json").read_text())
    assert [c["process"] for c in layout["cells"]] == [0, 0, 1, 1]
    steps = read_jsonl(workdir / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    # Process 1's satellite (cell 2) is in every step: it pulls the weights each step.
    for s in steps:
        assert 2 in [j["cell"] for j in s["joins"]], s
        assert s["staleness_max"] <= 1 and s["roles"] == "TTTR"
    # Groups dispatched at the start may begin on any cell and migrate (re-submitted
    # across processes) when cells 0-2 leave for training; every group dispatched after
    # the first publication ran on the remote engine alone, over HTTP.
    from gyrejax.trajectory import ExecutionStore

    executions = list(ExecutionStore(workdir / "executions"))
    calls = [c for e in executions for c in e.calls]
    later = {d["group"] for d in read_jsonl(workdir / "dispatch.jsonl") if d["version"] >= 1}
    assert later and len({e.group_id for e in executions}) >= 3
    for e in executions:
        if e.group_id in later:
            assert all(c.engines == ("cell3",) for c in e.calls), e.execution_id
    for c in calls:  # recorded in full, wherever they ran
        assert len(c.output_ids) == len(c.logprobs) == len(c.versions) > 0
        assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
    # Step 3 may train nothing older than version 1 (staleness 1), so the remote engine
    # sampled with weights published to it (an HF export it reloaded by path).
    versions = {int(v) for c in calls for v in c.versions}
    assert max(versions) >= 1 and versions <= {0, 1, 2, 3}
    assert any((workdir / "published").glob("version_*/config.json"))
    publishes = [t for t in read_jsonl(workdir / "transitions.jsonl") if t["kind"] == "publish"]
    assert len(publishes) == 3 and all(p["engines"] == 1 for p in publishes)
    # The trackers (issue 41) get the RL steps, the transitions and the warm start's SFT
    # steps, from process 0 alone: one event file each.
    check_tensorboard_holds(workdir, "metrics", ("loss", "step_s"))
    check_tensorboard_holds(workdir, "transitions", ("time_s",))
    check_tensorboard_holds(workdir / "warmup", "metrics", ("loss", "step_s"))
    for run in (workdir, workdir / "warmup"):
        assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert "cell 3: serving engine cell3" in follower_log

    # Version-0 tokens were sampled with the warm-started weights wherever they ran, on
    # process 1 too: their recorded log-probs are those of a plain forward pass of the
    # start snapshot (temperature 1, no top-p/k: the behaviour distribution is softmax).
    first = [c for c in calls if not np.any(c.versions)]
    assert any(set(c.engines) & {"cell2", "cell3"} for c in first)
    for c in first:
        np.testing.assert_allclose(
            c.logprobs, start_logprobs(workdir, c), atol=2e-4, err_msg=c.execution_id
        )
    summary = json.loads((workdir / "run_summary.json").read_text())
    assert summary["steps"] == 3


def probe_follower_engine(log: pathlib.Path, job: subprocess.Popen) -> dict:
    """Once process 1 serves its engine, asks it for its status and to load /etc without
    the run's token; returns the HTTP statuses (empty if the job ended first)."""
    while job.poll() is None:
        text = log.read_text() if log.exists() else ""
        found = re.search(r"serving engine cell3 at (http://\S+)", text)
        if found:
            url = f"{found.group(1)}/v1/engine"
            return {
                "status": httpx.get(f"{url}/status", timeout=30).status_code,
                "update_weights": httpx.post(
                    f"{url}/update_weights", json={"path": "/etc", "version": 9}, timeout=30
                ).status_code,
            }
        time.sleep(0.5)
    return {}


def start_logprobs(workdir, call) -> np.ndarray:
    """Log-probs of `call`'s output tokens under the run's start weights (a reference
    forward pass in this process)."""
    from flax import nnx

    from gyrejax.config import from_dict
    from gyrejax.train.checkpoint import restore_weights

    if "model" not in _START:
        config = from_dict(load_config_file("tiny_cpu", "smoke"))
        graphdef, state = nnx.split(init_model(config.model))
        target = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state, restore_weights(workdir / "snapshots" / "start", target))
        _START["model"] = nnx.merge(graphdef, state)
    return call_logprobs(_START["model"], call)


_START: dict = {}


KEY_VALUE_STORE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(sys.argv[1], num_processes=1, process_id=0)
from jax._src.distributed import global_state
from gyrejax.distributed import rl
from gyrejax.distributed.runtime import Decisions
start = Decisions("gyrejax/start")
token = rl.share_engine_token(start)
store = global_state.client.key_value_dir_get("gyrejax/")
print(json.dumps({"token": token, "store": store, "digest": rl.receive_engine_token_digest(start)}))
"""


def test_the_key_value_store_carries_the_engine_tokens_digest_not_the_token():
    """JAX's coordinator service has no authentication: whoever reaches its port reads
    the store. Process 0 keeps the engine token and puts only its digest there (the
    followers' servers check against it; the launch test above runs them)."""
    run = subprocess.run(
        [sys.executable, "-c", KEY_VALUE_STORE, f"127.0.0.1:{free_port()}"],
        cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    token, store = shared["token"], shared["store"]
    assert len(token) >= 43 and store, shared
    assert all(token not in key + value for key, value in store), store
    assert shared["digest"] == hashlib.sha256(token.encode()).hexdigest()
