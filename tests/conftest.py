"""Test setup: fix the CPU-emulated device count once, before JAX starts.

Tests that need another device count run in a subprocess.
"""

import asyncio
import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and every subprocess it starts (they
# inherit the environment): most tests compile the same tiny programs, and loading one
# from disk is much faster than compiling it. Fresh per session, so no stale entry can
# hide a change; min time and size 0, since tiny CPU programs compile in under a second.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="gyrejax-test-jax-cache-")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILATION_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite compiles thousands of tiny programs (on CPU a program is compiled per cell:
# the cache key holds the devices) and runs each briefly. LLVM at -O0 without its
# expensive passes compiles them about 35% faster (a 4-step async smoke run: 157 -> 97 s
# of compilation, 76 -> 54 s of wall time); XLA's HLO passes are unchanged.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402  (after the environment above is set)
import pytest  # noqa: E402

# Importing jax starts no backend; this must run before anything asks for devices.
NUM_TEST_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# The longest test files (measured on 2 cores) run first. With -n, xdist's --dist
# loadfile (pyproject's addopts) gives a worker whole files in collection order: a
# file's module fixtures (vLLM engines and servers) start once and its programs compile
# once, in one process, and the short files left for the end keep both workers busy.
LONGEST_FILES_FIRST = (
    "test_multiprocess.py", "test_runtime.py", "test_trainer.py", "test_jax_engine.py",
    "test_gpu_check.py", "test_vllm_server.py", "test_vllm_cells.py", "test_objective.py",
    "test_loop.py", "test_attention_kernel.py", "test_calibrate.py", "test_vllm_engine.py",
    "test_chaos.py", "test_memory.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept


def _agent_sandbox() -> str:
    from gyrejax.harness.sandbox import choose_sandbox

    return "bwrap" if choose_sandbox("auto").used == "bwrap" else "none"


# How tests run agent commands: in the sandbox wherever bubblewrap works (CI installs
# it); elsewhere beside the run, so that the rest of what they check still runs.
AGENT_SANDBOX = _agent_sandbox()

# Tiny HF checkpoints written by transformers, covering the Qwen variants we support:
# name -> (model_type, extra config fields). All use grouped-query attention (4 q heads,
# 2 kv heads) unless noted.
HF_VARIANTS = {
    "qwen3": ("qwen3", dict(attention_bias=False, tie_word_embeddings=False)),
    "qwen3_tied_bias": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2_tied_mha": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=4)),
}


def write_hf_checkpoint(directory: pathlib.Path, variant: str, seed: int = 0) -> pathlib.Path:
    """Writes a random tiny Qwen checkpoint with transformers (norms and biases randomised
    too, so a mapping mistake cannot hide behind ones and zeros)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    model_type, extra = HF_VARIANTS[variant]
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=50000.0,  # not the default, so a dropped theta shows
        rms_norm_eps=1e-6,
    )
    fields.update(extra)
    torch.manual_seed(seed)
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **fields))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """name -> directory of a tiny random HF checkpoint (see HF_VARIANTS)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: write_hf_checkpoint(root / name, name) for name in HF_VARIANTS}


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> pathlib.Path:
    """The directory of a small Qwen3-style HF tokenizer (gyrejax/harness/bpe.py: a
    1024-token BPE trained on the package's source), built once per session."""
    from gyrejax.harness.bpe import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("bpe"), vocab_size=1024)


def load_config_file(name: str, variant: str | None = None):
    """`get_config(variant)` of `configs/<name>.py`, loaded by path like ml_collections."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"configs_{name}", REPO_ROOT / "configs" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def call_logprobs(model, call):
    """Log-probs of a recorded call's output tokens under `model`: a plain forward pass
    over prompt + output (one causal sequence). With temperature 1 and no top-p/k this
    is the behaviour distribution an engine should have recorded."""
    import numpy as np

    tokens = np.concatenate([call.prompt_ids, call.output_ids]).astype(np.int32)[None]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    subtree_end = np.full_like(tokens, tokens.shape[1])
    logprobs = jax.nn.log_softmax(model(tokens, positions, subtree_end)[0], axis=-1)
    rows = np.arange(len(call.prompt_ids) - 1, len(call.prompt_ids) - 1 + len(call.output_ids))
    return np.asarray(logprobs[rows, call.output_ids])


# Every sampling setting the trainer must reproduce: temperature x top_p x top_k.
SAMPLING_GRID = [
    (t, p, k) for t in (0.6, 1.0, 1.3) for p in (1.0, 0.95) for k in (0, 20)
]  # fmt: skip


def settings(ratios: dict) -> tuple:
    """The (temperature, top_p, top_k) arrays of `trainer_ratios`' result."""
    return ratios["temperature"], ratios["top_p"], ratios["top_k"]


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The records of a `.jsonl` log the runtime writes (metrics, transitions, ...)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tensorboard_series(logdir: pathlib.Path):
    """The event files in `logdir` read back with TensorBoard's own reader: a function of
    a scalar tag giving its [(step, value)] (what TensorBoard plots), and the reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return lambda tag: [(e.step, e.value) for e in events.Scalars(tag)], events


def check_tensorboard_holds(workdir: pathlib.Path, log: str, fields: tuple[str, ...]):
    """Each of `fields` of `workdir/<log>.jsonl`, plotted from `workdir/tensorboard`, is
    one point per record, at the record's step (a transition's: its place in the log,
    from 1), of its value (float32: rel 1e-6)."""
    series, _ = tensorboard_series(workdir / "tensorboard")
    records = read_jsonl(workdir / f"{log}.jsonl")
    steps = range(1, len(records) + 1) if log == "transitions" else [r["step"] for r in records]
    for field in fields:
        values = [pytest.approx(r[field], rel=1e-6) for r in records]
        assert series(f"{log}/{field}") == list(zip(steps, values, strict=True)), field


# The engine token of test engine servers (tests that reach them with a Runtime set it
# as GYREJAX_ENGINE_TOKEN, which HttpEngine reads).
ENGINE_TOKEN = "test-engine-token-0123456789"


def start_engine_server(name: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """A gyrejax engine server named `name` in a subprocess (`python -m
    gyrejax.serve.engine_server`) requiring `ENGINE_TOKEN` (given in its environment,
    as a deployment would); returns it and its URL once it serves."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GYREJAX_ENGINE_TOKEN": ENGINE_TOKEN}
    server = subprocess.Popen(
        [sys.executable, "-m", "gyrejax.serve.engine_server", "--port=0", f"--name={name}",
         *flags],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    banner = server.stdout.readline()
    if not banner.startswith(f"serving engine {name} at "):
        server.kill()
        server.wait()
        raise AssertionError(f"engine server {name}: unexpected banner {banner!r}")
    return server, banner.split()[-1]


class HoldAfterTokens:
    """Test hook: a JaxEngine's thread stops after the `n`-th token it generates from now
    until the test has posted its next command (an update, an export, a cancel, a
    failure). A tiny model decodes a whole budget in a few milliseconds, faster than a
    test can poll for it, so "in flight" must be held, not raced."""

    def __init__(self, engine, n: int):
        self.engine = engine
        self._reached, self._released = threading.Event(), threading.Event()
        emit, at = engine._emit, engine.tokens_generated + n

        def emit_then_hold(*args):
            reason = emit(*args)
            if engine.tokens_generated == at:
                self._reached.set()
                self._released.wait()
            return reason

        engine._emit = emit_then_hold

    async def reached(self, timeout_s: float = 60) -> None:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._reached.wait, timeout_s):
            self.release()
            raise AssertionError(f"engine {self.engine.name} never generated its tokens")

    async def meanwhile(self, awaitable):
        """Awaits `awaitable`, releasing the engine once it has posted a command to the
        engine thread (or finished without one)."""
        task = asyncio.ensure_future(awaitable)
        while self.engine._commands.empty() and not task.done():
            await asyncio.sleep(0.001)
        self.release()
        return await task

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs mounted for the test (a disk that fills on purpose); needs root,
    which CI has. Yields (its path, fill(): takes every free byte, free(): gives them
    back)."""
    root = tmp_path / "small"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    filler = root / "filler"

    def fill():
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)

    try:
        yield root, fill, lambda: filler.unlink(missing_ok=True)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
