"""End-to-end smoke test of the real launch path, and its one-line errors."""

import asyncio
import gc
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT, load_config_file
from test_trainer import damage_checkpoint

from gyrejax.cells import split_into_cells
from gyrejax.config import from_dict
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import init_model
from gyrejax.train.checkpoint import TrainCheckpointer
from gyrejax.train.trainer import ElasticTrainer


def launch(*args, timeout=300, unset=(), **environment):
    """`python -m gyrejax.launch *args` in a subprocess with this environment, plus
    `environment`, less the variables named in `unset`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **environment)
    for name in unset:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "gyrejax.launch", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_launch_tiny_cpu_smoke(tmp_path):
    # RL through launch is covered by test_runtime.py (kill and resume); here one batch.
    result = launch(
        "--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path),
        "--config.train.steps=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert layout["num_devices"] == 8
    assert [c["devices"] for c in layout["cells"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(c["mesh"] == {"fsdp": 2, "tensor": 1} for c in layout["cells"])
    assert "cell 0 (core)" in result.stderr
    # The suite's $JAX_COMPILATION_CACHE_DIR wins over the config's "auto".
    cache = os.path.abspath(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert f"compilation cache: {cache} (JAX_COMPILATION_CACHE_DIR)" in result.stderr
    assert not (tmp_path / "jax_cache").exists()

    config = from_dict(load_config_file("tiny_cpu", "smoke"))
    assert layout["model"]["num_params"] == config.model.num_params
    records = [
        json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()
    ]
    # The sharded run on the core cell equals an unsharded in-process run.
    prompts = [list(p) for p in config.generate.prompts]
    want = generate(
        init_model(config.model), prompts, max_new_tokens=config.generate.max_new_tokens
    )
    assert [r["prompt_ids"] for r in records] == prompts
    for record, expected in zip(records, want, strict=True):
        assert record["token_ids"] == expected.token_ids
        np.testing.assert_allclose(record["logprobs"], expected.logprobs, atol=1e-5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--config.model.num_layers=-1", "config.model.num_layers=-1: expected a positive integer"),
        ("--config.cells.size=3", "config.cells.size=3: must equal cells.fsdp * cells.tensor"),
        ("--config.rl.loss=nope", "config.rl.loss='nope': expected one of"),
        (
            "--config.model.hidden=3",
            "config: unknown field 'model.hidden'; did you mean 'model.hidden_size'?",
        ),
        ("--config.model.hf_checkpoint=/no/such/dir", "/no/such/dir: not a directory"),
        ("--config.model.tokenizer=/no/such/dir", "config.model.tokenizer=/no/such/dir: not a"),
    ],
)
def test_bad_config_exits_with_one_clear_line(tmp_path, override, message):
    result = launch("--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path), override)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gyrejax.launch: ") and message in last, last


def test_bwrap_sandbox_without_bubblewrap_exits_with_one_clear_line(tmp_path):
    # No `bwrap` on this PATH: harness.sandbox="bwrap" refuses to start (never falls back).
    result = launch(
        "--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path),
        "--config.harness.sandbox=bwrap", PATH=str(tmp_path),
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "gyrejax.launch: config.harness.sandbox='bwrap': bubblewrap (bwrap) is not on PATH"
    ), last
    assert not (tmp_path / "layout.json").exists()  # refused before anything was built


def test_override_of_a_field_the_config_file_leaves_out_names_it(tmp_path):
    """A config file may leave fields to their defaults; overriding one of those names the
    field and the fix, not ml_collections' bare KeyError."""
    config = tmp_path / "short.py"
    config.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('tiny', {str(REPO_ROOT)!r} + "
        "'/configs/tiny_cpu.py')\n"
        "tiny = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(tiny)\n"
        "def get_config():\n"
        "    c = tiny.get_config('smoke')\n"
        "    del c.train['weight_decay']\n"
        "    return c\n"
    )
    result = launch(
        "--config", str(config), "--workdir", str(tmp_path / "work"),
        "--config.train.weight_decay=0.1",
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "gyrejax.launch: config: 'train.weight_decay' is a field the config file does not "
        "list, so --config.train.weight_decay has nothing to override; add it to the file"
    ), last


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--config.seed=-5"], "config.seed=-5: expected an integer >= 0"),
        (
            ["--config.scheduler.policy=async", "--config.scheduler.async_training_cells=3.5"],
            "config.scheduler.async_training_cells=3.5: trains up to 4 cells, expected fewer "
            "than the number of cells, 4 (8 devices / cells.size=2): the async policy keeps "
            "at least one cell rolling out",
        ),
        (
            ["--config.scheduler.async_training_cells=0.5"],
            "config.scheduler.async_training_cells=0.5: expected >= 1",
        ),
        (
            ["--config.model.vocab_size=100"],
            "config.model.vocab_size=100: below the harness tokenizer's vocabulary of 264 "
            "tokens (its token ids would index past the embedding)",
        ),
        (
            ["--config.train.executions_dir={tmp}/no-store"],
            "config.train.executions_dir={tmp}/no-store: not a directory",
        ),
        (
            ["--config.model.num_layerz=3"],
            "config: unknown field 'model.num_layerz'; did you mean 'model.num_layers'?",
        ),
        (  # a GPU config on JAX's CPU build
            ["--config.cells.platform=gpu"],
            "config.cells.platform=gpu: JAX runs on cpu, not gpu: install JAX's GPU build "
            "with pip install -e '.[gpu]' (NVIDIA driver >= 580, CUDA 13; docs/gpus.md)",
        ),
    ],
)
def test_config_errors_are_one_line_before_anything_is_built(tmp_path, overrides, message):
    """Each is found before a model is built or the workdir is written (the times are
    measured, not asserted: see the commit that added this test)."""
    workdir = tmp_path / "work"
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    result = launch("--config", "configs/tiny_cpu.py:smoke", "--workdir", str(workdir), *overrides)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"gyrejax.launch: {message.format(tmp=tmp_path)}"
    assert "model:" not in result.stderr  # run.py logs the model once it is built
    assert not workdir.exists()


def test_a_second_launch_on_a_workdir_in_use_exits_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from gyrejax.workdir_lock import hold; "
         f"hold({str(tmp_path)!r}); print('held', flush=True); time.sleep(120)"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        result = launch("--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path))
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"gyrejax.launch: --workdir={tmp_path}: in use by pid {holder.pid} (lock "
            f"{tmp_path}/.lock); wait for it to end or pick another workdir"
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # nothing touched
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: the next taker gets it (pid rewritten).
    taker = subprocess.run(
        [sys.executable, "-c", f"from gyrejax.workdir_lock import hold; hold({str(tmp_path)!r})"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert taker.returncode == 0, taker.stderr
    assert int((tmp_path / ".lock").read_text()) not in (holder.pid, os.getpid())


def test_unreadable_checkpoints_are_one_clear_line_and_stay_where_they_are(tmp_path):
    """Both checkpoints an RL run left are damaged: launch says so in one line, and moves
    nothing (a rerun must not silently start afresh)."""
    config = from_dict(load_config_file("tiny_cpu", "smoke"))
    trainer = ElasticTrainer(
        init_model(config.model), split_into_cells(config.cells)[0], rl=config.rl,
        train=config.train,
    )  # fmt: skip
    checkpointer = TrainCheckpointer(tmp_path / "checkpoints", config.checkpoint)
    for step in (1, 2):
        trainer.step = trainer.version = step
        trainer.save(checkpointer, {"trained_groups": [], "next_seq": 0, "burst": 0, "seed": 0})
    checkpointer.close()
    damage_checkpoint(tmp_path / "checkpoints" / "2", "data")
    damage_checkpoint(tmp_path / "checkpoints" / "1", "metadata")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())

    result = launch("--config", "configs/tiny_cpu.py:smoke", "--workdir", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"gyrejax.launch: no readable checkpoint under {tmp_path}"), last
    assert "step 2: " in last and "step 1: " in last
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_an_orbax_task_nobody_retrieved_is_one_line_under_launch(caplog):
    """The same coroutines as tasks, collected while their loop still runs: asyncio logs
    "Task exception was never retrieved" with a traceback (CI saw it once in the
    damaged-checkpoint test above). Launch's filter makes an Orbax task's one line; any
    other task's keeps its traceback."""
    from gyrejax.launch import _one_line_orbax_task

    orbax = {}  # a coroutine whose code lives in Orbax, as the read coroutines' does
    source = "async def read():\n    raise Exception('Encountered error while reading\\nspec')\n"
    exec(compile(source, "/site-packages/orbax/checkpoint/serialization.py", "exec"), orbax)

    async def ours():
        raise ValueError("a bug of our own")

    async def leave_unretrieved():
        for coroutine in (orbax["read"](), ours()):
            task = asyncio.ensure_future(coroutine)
            await asyncio.sleep(0)  # it runs and fails; nobody asks for its exception
            del task
            gc.collect()  # collected while the loop runs: asyncio logs it

    logger = logging.getLogger("asyncio")
    logger.addFilter(_one_line_orbax_task)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(leave_unretrieved())
    finally:
        logger.removeFilter(_one_line_orbax_task)
    read, own = [r for r in caplog.records if r.name == "asyncio"]
    assert read.getMessage() == "gyrejax.launch: ignored Exception: Encountered error while reading"
    assert read.exc_info is None and "Traceback" not in caplog.text.split("a bug of our own")[0]
    assert "never retrieved" in own.getMessage() and own.exc_info[0] is ValueError


def test_an_exception_python_can_only_ignore_is_one_line_under_launch(monkeypatch, capsys):
    """Orbax's read coroutines, left pending by a damaged checkpoint, raise as they are
    collected (at random, so the test above cannot count on one): under launch's hook
    that is one line, not a traceback."""
    from gyrejax.launch import _one_line_unraisable

    monkeypatch.setattr(sys, "unraisablehook", _one_line_unraisable)

    class Pending:
        def __del__(self):
            raise RuntimeError("Encountered error while reading array index\nspec: {...}")

    Pending()  # collected at once: its __del__ raises where nobody can catch it
    err = capsys.readouterr().err
    assert err == (
        "gyrejax.launch: ignored RuntimeError: Encountered error while reading array index\n"
    )
