"""`make_engine`: the engine a cell serves rollouts with, by `config.rollout.engine`.

The one place a cell's engine is built from the rollout configuration: the RL loop, a
rollout batch and a follower process of a multi-process job all call it. Engines
outside the cells (vLLM servers, engine servers) are reached by URL instead
(`gyrejax.serve`).

`jax`: `JaxEngine` on the cell's mesh. `vllm`: `VllmEngine` in this process (vLLM runs its
engine core as a process of its own), started from an HF export of the model: the
caller's (`checkpoint`, e.g. the run's published export of that version) or one written
to a temporary directory, removed once vLLM has loaded it. On CPU its KV cache is sized
for `max_slots` full-length sequences (vLLM would otherwise take a share of host memory),
it frees its memory by stopping (no sleep mode there) and loads each version from the
HF export.

On GPU (UNTESTED: no GPU here; `gpu_fit_problem` and what it calls are unit-tested):
it runs on the cell's GPUs (their CUDA ordinals in this process, mapped through this
process's CUDA_VISIBLE_DEVICES by the engine), takes `gpu_memory_utilization` of them,
sleeps to free them, and a one-GPU cell gets each version in memory (CUDA IPC, HF-named
by `hf_io.hf_tensors`, in chunks of `vllm_engine.IPC_CHUNK_BYTES`). Before vLLM starts, the
JAX allocator must be one that lets memory move between them
(`preflight.memory_handoff_problem`: refused otherwise, as launch refuses it), and the
cell's GPUs must have the memory vLLM will ask for free (`gpu_fit_problem`; with JAX's
platform allocator also room for the in-memory update's copies beside it).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import jax
from flax import nnx

from gyrejax import preflight
from gyrejax.cells import Cell
from gyrejax.config import ENGINES, ConfigError, RolloutConfig
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine


def _jax_engine(
    name: str,
    cell: Cell,
    model: Transformer,
    config: RolloutConfig,
    version: int,
    precompile: bool,
    checkpoint: str | os.PathLike | None,  # unused: it copies `model`'s arrays
) -> Engine:
    from gyrejax.rollout.jax_engine import JaxEngine

    return JaxEngine(
        name,
        model,
        cell,
        max_slots=config.max_slots,
        max_seq_len=config.max_seq_len,
        rules=config.sharding_rules,
        version=version,
        precompile=precompile,
        narrow=config.narrow,
    )


def _vllm_engine(
    name: str,
    cell: Cell,
    model: Transformer,
    config: RolloutConfig,
    version: int,
    precompile: bool,  # unused: vLLM compiles (or not) as it starts
    checkpoint: str | os.PathLike | None,
) -> Engine:
    from gyrejax.model.hf_io import export_hf, hf_tensors
    from gyrejax.rollout.vllm_engine import VllmEngine  # vLLM is optional: imported here

    platform = cell.devices[0].platform
    on_cpu = platform == "cpu"
    m = model.config
    gpu = {}
    if not on_cpu:  # UNTESTED (no GPU here): the cell's GPUs; in-memory updates on one GPU
        problem = preflight.memory_handoff_problem("vllm", config.gpu_memory_utilization, platform)
        if problem:
            raise ConfigError(problem)
        gpu["devices"] = [d.local_hardware_id for d in cell.devices]
        ipc = len(cell.devices) == 1  # vLLM's IPC path: each worker loads whole tensors
        if ipc:
            graphdef = nnx.graphdef(model)
            device = cell.devices[0]
            gpu["weight_transfer"] = "ipc"
            gpu["params_to_hf"] = lambda params: hf_tensors(
                nnx.merge(graphdef, params), lambda x: jax.device_put(x, device)
            )
        _check_gpu_fit(cell, model, config, ipc)
    with tempfile.TemporaryDirectory(prefix=f"gyrejax-{name}-") as tmp:
        if checkpoint is None:
            checkpoint = export_hf(model, tmp)
        return VllmEngine(
            name,
            checkpoint,
            max_slots=config.max_slots,
            max_seq_len=config.max_seq_len,
            version=version,
            dtype=m.dtype,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes(model, config) if on_cpu else None,
            release="stop" if on_cpu else "sleep",
            **gpu,
        )


def gpu_fit_problem(
    cell: int, gpu: int, free: int, total: int, utilization: float, transfer_bytes: int
) -> str | None:
    """Why a vLLM engine of cell `cell` cannot start on GPU `gpu` (this process's CUDA
    ordinal) with `free` of `total` bytes free, or None: vLLM takes `utilization` of
    `total` at start and needs it free then (`vllm.v1.worker.utils.request_memory`);
    `transfer_bytes` more must stay free beside it for in-memory weight updates (0: none
    or not in this process's free memory). One line naming the config field."""
    gib = 2**30
    need = utilization * total
    field = f"config.rollout.gpu_memory_utilization={utilization:g}"
    where = f"cell {cell}'s GPU {gpu} has {free / gib:.1f} GiB free of {total / gib:.1f} GiB"
    if free < need:
        return (
            f"{field}: {where}, below the {need / gib:.1f} GiB vLLM takes at start (JAX "
            f"holds the rest: on the core cell, the trainer's state); at most "
            f"{free / total:.2f} fits"
        )
    if free - need < transfer_bytes:
        return (
            f"{field}: {where}; beside vLLM's {need / gib:.1f} GiB it leaves "
            f"{(free - need) / gib:.1f} GiB, below the {transfer_bytes / gib:.1f} GiB an "
            "in-memory weight update copies there (the weights in HF layout and one "
            f"chunk of copies); at most {(free - transfer_bytes) / total:.2f} fits"
        )
    return None


def _check_gpu_fit(cell: Cell, model: Transformer, config: RolloutConfig, ipc: bool) -> None:
    """`gpu_fit_problem` on each of the cell's GPUs, measured now. UNTESTED (GPU only)."""
    import torch  # vLLM's GPU wheel brings CUDA torch

    from gyrejax.rollout.vllm_engine import IPC_CHUNK_BYTES

    transfer = 0
    if ipc and preflight.jax_allocator() == "platform":  # JAX copies outside any pool
        transfer = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        transfer += IPC_CHUNK_BYTES
    for device in cell.devices:
        free, total = torch.cuda.mem_get_info(device.local_hardware_id)
        args = (free, total, config.gpu_memory_utilization, transfer)
        problem = gpu_fit_problem(cell.index, device.local_hardware_id, *args)
        if problem:
            raise ConfigError(problem)


def kv_cache_bytes(model: Transformer, config: RolloutConfig, block: int = 128) -> int:
    """Bytes of KV cache for `config.max_slots` sequences of `config.max_seq_len` tokens
    (rounded up to whole blocks of vLLM's largest block size, plus one block each)."""
    m = model.config
    tokens = (-(-config.max_seq_len // block) + 1) * block * config.max_slots
    itemsize = 2 if m.dtype == "bfloat16" else 4
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * itemsize * tokens


# Engine kinds by name: the names are config.ENGINES.
_KINDS: dict[str, Callable[..., Engine]] = {"jax": _jax_engine, "vllm": _vllm_engine}
if tuple(_KINDS) != ENGINES:
    raise TypeError(f"engine kinds {tuple(_KINDS)} differ from config.ENGINES {ENGINES}")


def make_engine(
    cell: Cell,
    model: Transformer,
    config: RolloutConfig,
    *,
    version: int = 0,
    precompile: bool = False,
    name: str | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> Engine:
    """The engine of kind `config.engine` serving `cell`, with `model`'s weights.

    Args:
      cell: where it runs.
      model: the policy (its weights are copied onto the cell by the rollout rules).
      config: the rollout section (engine kind, slots, sequence length, rules).
      version: the policy version of `model`.
      precompile: never compile while serving (what it needs first before it serves,
        the rest in the background): the RL loop's engines, so that no role switch
        waits for a compile.
      name: the engine's name in records and routing (default `cell<index>`).
      checkpoint: an HF export of `model`, for engines that start from one (vllm);
        default: one is written to a temporary directory.
    """
    build = _KINDS[config.engine]
    return build(name or f"cell{cell.index}", cell, model, config, version, precompile, checkpoint)
