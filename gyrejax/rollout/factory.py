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
HF export. On GPU (UNTESTED: no GPU here) it runs on the cell's GPUs, takes
`gpu_memory_utilization` of them, sleeps to free them, and a one-GPU cell gets each
version in memory (CUDA IPC, HF-named by `hf_io.hf_tensors`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import jax
from flax import nnx

from gyrejax.cells import Cell
from gyrejax.config import ENGINES, RolloutConfig
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

    on_cpu = cell.devices[0].platform == "cpu"
    m = model.config
    gpu = {}
    if not on_cpu:  # UNTESTED (no GPU here): the cell's GPUs; in-memory updates on one GPU
        gpu["devices"] = [d.local_hardware_id for d in cell.devices]
        if len(cell.devices) == 1:  # vLLM's IPC handles name one GPU per tensor
            graphdef = nnx.graphdef(model)
            device = cell.devices[0]
            gpu["weight_transfer"] = "ipc"
            gpu["params_to_hf"] = lambda params: hf_tensors(
                nnx.merge(graphdef, params), lambda x: jax.device_put(x, device)
            )
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
