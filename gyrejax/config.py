"""Typed, self-validating configuration.

`configs/*.py` build an `ml_collections.ConfigDict`; `from_dict` turns it, once, at the
edge (`gyrejax.launch`), into the frozen dataclasses below. Library code takes these
dataclasses (or its own section of them), never a ConfigDict and never a global config.

Every dataclass validates itself in `__post_init__` and raises `ConfigError` naming the
dotted field and the bad value, so a typo or a bad override fails with one clear line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import shlex
import types
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


# Names picked by config strings. The registries that implement them live with their
# modules; these tuples are what the configuration accepts.
DTYPES = ("float32", "bfloat16")
# What the trainer keeps the weights it updates and AdamW's moments in (train.master_dtype):
# float32 master weights beside a low-precision model, or the model's own dtype ("same").
MASTER_DTYPES = ("float32", "same")
# What a decoder layer keeps for its backward in training (train.remat): "none" every
# activation autodiff saves; "layer" only its input (the layer runs again in the
# backward); "matmuls" the outputs of its weight matmuls (norms, rotary, SwiGLU and
# attention run again).
REMATS = ("none", "layer", "matmuls")
# Training attention over packed tree rows (model.attention): "dense" (the [L, L]
# reference), "blocked" (XLA: one loop over the live block pairs; the CPU default),
# "pallas" (Mosaic GPU kernels for Hopper GPUs, bfloat16, blocks of 64 or 128).
ATTENTION_IMPLS = ("dense", "blocked", "pallas")
LOSSES = ("ppo", "grpo", "decoupled_ppo", "tis", "sft")
ADVANTAGES = ("grpo", "mean_centered", "rloo")
KL_ESTIMATORS = ("k1", "k2", "k3")
# The group std GRPO divides by (rl.advantage_std): "unbiased" (ddof=1, as verl and TRL)
# or "population" (ddof=0).
ADVANTAGE_STDS = ("unbiased", "population")
# What the advantage estimator sees of each reward (rl.reward_shaping): "as_is", or "pass"
# (1 for every hidden check passed, else 0: the held-out pass@1's own criterion).
REWARD_SHAPINGS = ("as_is", "pass")
# The engine on each cell (gyrejax/rollout/factory.py): the JAX engine, or vLLM in this
# process (needs the optional vllm package). vLLM servers by URL: rollout.vllm_servers.
ENGINES = ("jax", "vllm")
# The JAX platform a config's cells must be on (cells.platform): "any" takes what JAX
# sees; "gpu" refuses to start on a CPU-only JAX (a GPU config on the CPU install).
PLATFORMS = ("any", "cpu", "gpu")
POLICIES = ("elastic", "colocate", "async")
# The order a run dispatches its tasks in (gyrejax/scheduler/driver.py,
# dispatch_permutation).
DISPATCH_ORDERS = ("fifo", "longest_first")
ENVIRONMENTS = ("mini_repo",)
# How agent code is confined (gyrejax/harness/sandbox.py): bubblewrap namespaces (a real
# boundary), the Python audit-hook guard only (not a boundary), or bwrap when it works.
SANDBOXES = ("auto", "bwrap", "python_guard")
# Experiment trackers a run writes to (gyrejax/writers.py); JSONL is always on.
LOGGING_WRITERS = ("jsonl", "tensorboard", "wandb")
# How an external agent command is confined (gyrejax/harness/agent_sandbox.py).
AGENT_SANDBOXES = ("bwrap", "none")
# Who acts in an RL execution: the built-in harness, or the user's agent program
# (`rl.agent_command`) talking to the run's OpenAI door (gyrejax/harness/external.py).
AGENTS = ("builtin", "command")
# Where an external agent's reward comes from: the environment's verifier on its
# workspace, or the `reward.json` the agent writes there.
AGENT_REWARDS = ("environment", "agent")
# model.tokenizer's name for the harness's byte tokenizer (any other value is a path).
BYTE_TOKENIZER = "bytes"
# compilation_cache_dir's names (gyrejax/compilation_cache.py): the cache in the run's
# workdir, or none (any other value is a directory).
COMPILATION_CACHE_AUTO = "auto"
COMPILATION_CACHE_OFF = ("off", "")

# Logical axis -> mesh axis (or None: replicated). Model code names logical axes only.
ShardingRules = tuple[tuple[str, str | None], ...]

# Training: parameters FSDP-sharded over `fsdp`, heads/mlp/vocab over `tensor`; rows of
# a micro-step split over `fsdp`, and each row's length over `sequence` (context
# parallelism; a mesh has that axis only when cells.sequence > 1, and without it the
# rule leaves rows whole).
TRAIN_SHARDING_RULES: ShardingRules = (
    ("batch", "fsdp"),
    ("length", "sequence"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
)
# Sampling: no FSDP gather per decode step; tensor parallelism only, slots replicated.
SAMPLE_SHARDING_RULES: ShardingRules = (
    ("batch", None),
    ("length", None),
    ("embed", None),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
)


def _fail(field: str, value: Any, expected: str) -> typing.NoReturn:
    raise ConfigError(f"config.{field}={value!r}: {expected}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(f"{section}.{name}", value, "expected a positive integer")


def _non_negative(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            _fail(f"{section}.{name}", value, "expected a number >= 0")
        if isinstance(value, float) and not math.isfinite(value):
            _fail(f"{section}.{name}", value, "expected a finite number")


def _one_of(section: str, obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        _fail(f"{section}.{name}", value, f"expected one of {', '.join(choices)}")


def _check_rules(section: str, rules: ShardingRules, mesh_axes: tuple[str, ...]) -> None:
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            _fail(f"{section}.sharding_rules", rule, "expected (logical_axis, mesh_axis|None)")
        if rule[1] is not None and rule[1] not in mesh_axes:
            _fail(
                f"{section}.sharding_rules",
                rule,
                f"mesh axis must be one of {', '.join(mesh_axes)} or None",
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen2/Qwen3-family decoder (HF `config.json` field names differ)."""

    vocab_size: int = 512  # token ids (the embedding and the head)
    hidden_size: int = 64  # the residual stream's width
    intermediate_size: int = 128  # the MLP's hidden width
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention: divides num_heads)
    head_dim: int = 16  # each head's width
    rope_theta: float = 1_000_000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon
    max_position_embeddings: int = 32768  # recorded for HF export (vLLM sizes by it).
    qk_norm: bool = True  # Qwen3: RMSNorm on q and k per head.
    qkv_bias: bool = False  # Qwen2 (and Qwen3 with attention_bias): q, k, v bias.
    o_bias: bool = False  # Qwen3 with attention_bias: output projection bias too.
    tie_embeddings: bool = True  # the output head shares the embedding
    dtype: str = "float32"  # parameters and activations; logits are always float32.
    attention: str = "dense"  # training attention over packed tree rows.
    attention_block_size: int = 512  # query/key block of the blocked attention.
    hf_checkpoint: str = ""  # load weights (and architecture) from this HF directory.
    # "bytes" (the harness's byte tokenizer) or the path of an HF tokenizer directory
    # (tokenizer.json / tokenizer_config.json; an HF checkpoint directory usually is one).
    tokenizer: str = BYTE_TOKENIZER
    init_seed: int = 0  # seed of the random initial weights (no hf_checkpoint)

    def __post_init__(self):
        s = "model"
        _positive(
            s,
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "attention_block_size",
            "max_position_embeddings",
        )
        if self.num_heads % self.num_kv_heads:
            _fail(
                f"{s}.num_kv_heads",
                self.num_kv_heads,
                f"must divide model.num_heads={self.num_heads}",
            )
        if self.head_dim % 2:
            _fail(f"{s}.head_dim", self.head_dim, "must be even (rotary embedding)")
        if not self.rope_theta > 0:
            _fail(f"{s}.rope_theta", self.rope_theta, "expected a positive number")
        if not self.rms_norm_eps > 0:
            _fail(f"{s}.rms_norm_eps", self.rms_norm_eps, "expected a positive number")
        _one_of(s, self, "dtype", DTYPES)
        _one_of(s, self, "attention", ATTENTION_IMPLS)
        if self.attention == "pallas":
            if self.attention_block_size not in (64, 128):
                _fail(f"{s}.attention_block_size", self.attention_block_size,
                      "model.attention='pallas' takes blocks of 64 or 128")  # fmt: skip
            if self.dtype != "bfloat16" or self.head_dim % 64:
                _fail(f"{s}.attention", self.attention,
                      f"the Pallas kernels take bfloat16 and head_dim a multiple of 64, not "
                      f"model.dtype={self.dtype!r}, model.head_dim={self.head_dim}")  # fmt: skip
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            _fail(
                f"{s}.tokenizer",
                self.tokenizer,
                f"expected {BYTE_TOKENIZER!r} or the path of an HF tokenizer directory",
            )

    @property
    def num_params(self) -> int:
        """Parameter count implied by the architecture."""
        e, h, kv, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = e * h * d + 2 * e * kv * d + h * d * e
        if self.qkv_bias:
            attn += h * d + 2 * kv * d
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * e * self.intermediate_size
        per_layer = attn + mlp + 2 * e
        embed = self.vocab_size * e * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + e


@dataclasses.dataclass(frozen=True)
class CellsConfig:
    """How devices are grouped into cells and how each cell's mesh is shaped."""

    num_cpu_devices: int = 0  # CPU-emulated device count set before JAX starts; 0: leave.
    size: int = 1  # devices per cell; every model-parallel group lies inside one cell.
    fsdp: int = 1  # devices of a cell's fsdp axis
    tensor: int = 1  # devices of a cell's tensor axis
    # Devices a packed row's length is split over (context-parallel tree attention); the
    # cell's mesh gets a `sequence` axis when > 1.
    sequence: int = 1
    platform: str = "any"  # PLATFORMS: the devices JAX must see

    def __post_init__(self):
        _one_of("cells", self, "platform", PLATFORMS)
        _non_negative("cells", self, "num_cpu_devices")
        _positive("cells", self, "size", "fsdp", "tensor", "sequence")
        if self.fsdp * self.tensor * self.sequence != self.size:
            _fail(
                "cells.size",
                self.size,
                "must equal cells.fsdp * cells.tensor * cells.sequence = "
                f"{self.fsdp} * {self.tensor} * {self.sequence}",
            )
        if self.num_cpu_devices and self.num_cpu_devices % self.size:
            _fail(
                "cells.size",
                self.size,
                f"must divide the device count cells.num_cpu_devices={self.num_cpu_devices}",
            )

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Each cell's mesh axes and sizes: fsdp x tensor, and x sequence when > 1 (so a
        cell without context parallelism keeps the two-axis mesh it always had)."""
        shape = {"fsdp": self.fsdp, "tensor": self.tensor}
        if self.sequence > 1:
            shape["sequence"] = self.sequence
        return shape


# Every mesh axis a rule may name. A cell's mesh has the first two always and
# `sequence` when cells.sequence > 1 (`CellsConfig.mesh_shape`).
MESH_AXES = ("fsdp", "tensor", "sequence")
# Most row lengths (train.row_length included): the packer enumerates their subsets
# (gyrejax.trajectory.buckets.MAX_ALLOWED_LENGTHS, the same number).
MAX_ROW_LENGTHS = 12


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout engines (consumed by gyrejax/rollout)."""

    # The rollout engine of every cell: ENGINES (jax, or vllm on its own devices).
    engine: str = "jax"
    max_slots: int = 8  # concurrent sequences per engine.
    max_seq_len: int = 2048  # KV-cache length per slot.
    # How the built-in agent samples every call (0 is greedy: never trained); an agent
    # through the OpenAI door sets its own per request. Every call records its settings
    # and the trainer takes log-probs under that same distribution.
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps every token
    top_k: int = 0  # keep the k most likely tokens; 0 keeps every token
    # JAX engines decode only as wide as their busy slots (a power of four, or max_slots):
    # a batch-1 tail costs one slot, not all. False: every decode computes every slot.
    narrow: bool = True
    # The fraction of each device's memory a vLLM engine may take (weights, KV cache, its
    # activations); the trainer's state on the core cell needs the rest, and beside JAX
    # only some allocator set-ups let vLLM have it (preflight.memory_handoff_problem).
    # Unused on CPU, where a vLLM engine's KV cache is sized to max_slots x max_seq_len.
    gpu_memory_utilization: float = 0.9
    # Logical axis -> mesh axis, for the engines.
    sharding_rules: ShardingRules = SAMPLE_SHARDING_RULES
    # Engines outside the cells, reached by URL and always rolling out beside the rollout
    # cells; each published version reaches them as an HF export under the workdir, which
    # their hosts must read. vLLM servers (serve/vllm_server_engine.py says how to start
    # one) and gyrejax engine servers (python -m gyrejax.serve.engine_server).
    vllm_servers: tuple[str, ...] = ()
    engine_servers: tuple[str, ...] = ()  # engine servers (URLs) beside the cells

    def __post_init__(self):
        _one_of("rollout", self, "engine", ENGINES)
        for name in ("vllm_servers", "engine_servers"):
            for i, url in enumerate(getattr(self, name)):
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    _fail(f"rollout.{name}[{i}]", url, "expected an http:// or https:// URL")
        _positive("rollout", self, "max_slots", "max_seq_len")
        _non_negative("rollout", self, "temperature", "top_k")
        if not 0 < self.top_p <= 1:
            _fail("rollout.top_p", self.top_p, "expected in (0, 1] (1 keeps every token)")
        fraction = self.gpu_memory_utilization
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            _fail(
                "rollout.gpu_memory_utilization",
                self.gpu_memory_utilization,
                "expected a fraction in (0, 1]",
            )
        _check_rules("rollout", self.sharding_rules, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Trainer (consumed by gyrejax/train)."""

    steps: int = 1  # RL (or store-training) steps; 0: after the warm start, one batch only
    executions_dir: str = ""  # if set, launch trains on this execution store (SFT or RL)
    learning_rate: float = 1e-5  # AdamW's learning rate
    row_length: int = 2048  # tokens per packed row; the longest row >= rollout.max_seq_len.
    rows_per_micro_step: int = 1  # packed rows per micro-step
    # Row buckets: more lengths rows may have besides row_length (each divides it or is a
    # multiple of it; above it, a row is split over cells.sequence when > 1, else it is
    # held whole by one device). A micro-step of length l holds max(1, R * L // l) rows.
    # Empty: every row is [row_length]. The trainer compiles each length once per cell.
    row_lengths: tuple[int, ...] = ()
    max_row_shapes: int = 0  # most distinct lengths in one batch; 0: no cap
    max_grad_norm: float = 1.0  # global gradient-norm clip
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    # Mixed precision: "float32" keeps float32 master weights and AdamW moments when
    # model.dtype is lower (bfloat16), computes each micro-step in model.dtype from the
    # masters cast down, and applies the update to the masters (a 1e-6 update of a 0.02
    # weight is below bfloat16's resolution); with a float32 model it changes nothing.
    # "same": weights and moments in model.dtype only (no master copy).
    master_dtype: str = "float32"
    # "same" with a model below float32 is refused unless this is True: bfloat16 weights
    # updated in bfloat16 at lr 1e-6 lose ~99% of their updates to rounding.
    allow_low_precision_updates: bool = False
    remat: str = "none"  # REMATS: what a layer keeps for its backward
    # The loss head's logits over chunks of this many tokens, each recomputed in the
    # backward, so a micro-step never holds float32 [tokens, vocab] whole; 0: unchunked.
    loss_chunk_tokens: int = 0
    sharding_rules: ShardingRules = TRAIN_SHARDING_RULES  # logical axis -> mesh axis, for training

    def __post_init__(self):
        _positive("train", self, "row_length", "rows_per_micro_step")
        _one_of("train", self, "master_dtype", MASTER_DTYPES)
        _one_of("train", self, "remat", REMATS)
        chunk = self.loss_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            _fail("train.loss_chunk_tokens", chunk, "expected an integer >= 0 (0: unchunked)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            _fail("train.steps", self.steps, "expected an integer >= 0")
        _non_negative("train", self, "learning_rate", "max_grad_norm", "weight_decay")
        _check_rules("train", self.sharding_rules, MESH_AXES)
        self._check_row_buckets()

    def _check_row_buckets(self) -> None:
        lengths, base = self.row_lengths, self.row_length
        if not isinstance(lengths, tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in lengths
        ):
            _fail("train.row_lengths", lengths, "expected a tuple of positive integers")
        if len(set(lengths)) != len(lengths) or base in lengths:
            _fail(
                "train.row_lengths",
                lengths,
                f"repeats a length (train.row_length={base} is always one)",
            )
        if len(lengths) + 1 > MAX_ROW_LENGTHS:
            _fail("train.row_lengths", lengths, f"at most {MAX_ROW_LENGTHS - 1} lengths")
        for x in lengths:  # equal token budgets: every micro-step holds R * L tokens
            if base % x and x % base:
                _fail(
                    "train.row_lengths",
                    lengths,
                    f"{x} neither divides nor is a multiple of train.row_length={base}",
                )
        shapes = self.max_row_shapes
        if isinstance(shapes, bool) or not isinstance(shapes, int) or shapes < 0:
            _fail("train.max_row_shapes", shapes, "expected an integer >= 0 (0: no cap)")
        if shapes and not lengths:
            _fail("train.max_row_shapes", shapes, "only with train.row_lengths")

    @property
    def all_row_lengths(self) -> tuple[int, ...]:
        """Every length a packed row may have, ascending: row_length and row_lengths."""
        return tuple(sorted({self.row_length, *self.row_lengths}))


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Loss and trajectory processing (consumed by gyrejax/rl and gyrejax/trajectory)."""

    loss: str = "ppo"  # LOSSES: the policy loss (gyrejax/rl/losses.py)
    # ADVANTAGES: how rewards become advantages (gyrejax/trajectory/advantages.py).
    advantage: str = "grpo"
    advantage_std: str = "unbiased"  # ADVANTAGE_STDS: the group std GRPO divides by
    # REWARD_SHAPINGS: what the estimator sees of each reward; metrics keep the reward.
    reward_shaping: str = "as_is"
    clip_low: float = 0.2  # PPO clip: the ratio's lower bound is 1 - clip_low
    clip_high: float = 0.28  # and its upper bound 1 + clip_high
    # tis: the ratio is capped at this value; decoupled_ppo: the behaviour-to-proximal
    # importance weight is.
    tis_cap: float = 2.0
    kl_coef: float = 0.0  # KL to a reference policy (the initial weights); off by default.
    # Which estimator of KL(policy || reference) the KL term uses (gyrejax/rl/losses.py
    # says what each one's gradient optimises): k1, k2 or k3.
    kl_estimator: str = "k3"
    # Dual-clip: with a negative advantage the per-token loss is capped at
    # -clip_ratio_c * A, so a token whose ratio ran away stops pulling (0 turns it off).
    clip_ratio_c: float = 3.0
    # The log of every importance ratio is clamped to +-this (no gradient beyond), so no
    # single token can overflow the loss and cost the step.
    log_ratio_clamp: float = 20.0
    group_size: int = 4  # executions per task (N).
    groups_per_step: int = 2  # B.
    j_max: int = 5  # admitted root-to-leaf paths per execution.
    # External agents (see AGENTS, AGENT_REWARDS): the command started per execution
    # (shell-split, run in its workspace, harness.timeout_s of wall clock), where its
    # reward comes from, and optionally its tasks (a JSONL file, each line with at least
    # "id" and "prompt"; default: the environment's).
    agent: str = "builtin"
    agent_command: str = ""  # shell-split; run in the workspace
    reward: str = "environment"  # AGENT_REWARDS
    tasks_path: str = ""  # JSONL tasks; "": the environment's

    def __post_init__(self):
        _one_of("rl", self, "loss", LOSSES)
        _one_of("rl", self, "advantage", ADVANTAGES)
        _one_of("rl", self, "advantage_std", ADVANTAGE_STDS)
        _one_of("rl", self, "reward_shaping", REWARD_SHAPINGS)
        _non_negative("rl", self, "clip_low", "clip_high", "tis_cap", "kl_coef")
        _one_of("rl", self, "kl_estimator", KL_ESTIMATORS)
        if self.clip_ratio_c != 0 and not self.clip_ratio_c > 1 + self.clip_high:
            _fail(
                "rl.clip_ratio_c",
                self.clip_ratio_c,
                f"expected 0 (off) or > 1 + rl.clip_high = {1 + self.clip_high} (the cap "
                "must lie above the clip band)",
            )
        _non_negative("rl", self, "log_ratio_clamp")
        if self.log_ratio_clamp == 0:
            _fail("rl.log_ratio_clamp", 0, "expected > 0 (every ratio would be 1)")
        if self.clip_low >= 1:
            _fail(
                "rl.clip_low", self.clip_low, "expected < 1 (the ratio is clipped at 1 - clip_low)"
            )
        _positive("rl", self, "group_size", "groups_per_step", "j_max")
        _one_of("rl", self, "agent", AGENTS)
        _one_of("rl", self, "reward", AGENT_REWARDS)
        if self.agent == "command":
            try:
                words = shlex.split(self.agent_command)
            except ValueError as e:
                _fail("rl.agent_command", self.agent_command, f"not shell-splittable: {e}")
            if not words:
                _fail("rl.agent_command", self.agent_command, "empty; rl.agent=command runs it")
        else:  # what only an external agent uses must not be set silently unused
            for name, unset in (
                ("agent_command", ""),
                ("reward", "environment"),
                ("tasks_path", ""),
            ):
                if getattr(self, name) != unset:
                    _fail(f"rl.{name}", getattr(self, name), "only with rl.agent=command")


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """Agent harness and environment (consumed by gyrejax/harness)."""

    environment: str = "mini_repo"  # ENVIRONMENTS: where tasks and their verifiers come from
    difficulty: int = 1  # task difficulty level of the environment
    task_pool: int = 0  # > 0: draw every task from a fixed pool of this many
    max_turns: int = 32  # main-agent turns before the execution times out
    sub_agent_max_turns: int = 8  # turns of a sub-agent
    timeout_s: float = 600.0  # wall clock per execution
    context_budget_tokens: int = 1280  # compaction trigger
    max_new_tokens: int = 128  # per model call
    max_observation_tokens: int = 256  # tool output beyond this is cut
    max_retries: int = 2  # re-asks of the same context after a malformed action
    eval_retry_budget: int = 3  # evaluation attempts before `eval_failed`
    # Wall time of each tool call, as real tools (builds, test suites) take it: a seeded
    # lognormal with this median and sigma, waited without using a CPU. 0: no wait.
    tool_latency_median_s: float = 0.0
    tool_latency_sigma: float = 0.0  # the lognormal's sigma (0: always the median)
    # Agent code's sandbox: "bwrap" (bubblewrap; refuses to start without it),
    # "python_guard" (the audit-hook guard only: NOT a security boundary) or "auto" (bwrap
    # when it works here, else the guard with a warning in the log and run_summary.json).
    sandbox: str = "auto"
    # The agent command's sandbox (rl.agent=command; gyrejax/harness/agent_sandbox.py):
    # "bwrap" (bubblewrap; refuses to start without it: own PID and network namespaces,
    # the door its one way out, the workdir hidden) or "none" (beside the run, trusted
    # agents only: a warning in the log and run_summary.json). Its per-process address
    # space and file size, and the size of its private /tmp:
    agent_sandbox: str = "bwrap"
    # Processes and threads of one agent's whole tree, and its memory (the tree's, in a
    # cgroup where the run is root; also each process's address space, an rlimit).
    agent_max_processes: int = 512
    agent_memory_bytes: int = 4 << 30  # the tree's (cgroup) and each process's
    agent_file_bytes: int = 256 << 20  # per process (RLIMIT_FSIZE)
    agent_tmp_bytes: int = 256 << 20  # its private /tmp
    # Each execution's workspace: bytes and inodes (files and directories) whoever
    # writes them, agent code included. Enforced by a tmpfs per workspace where the run
    # is root (gyrejax/harness/workspace_quota.py); run_summary.json says whether.
    workspace_bytes: int = 64 << 20
    workspace_inodes: int = 4096  # files and directories it may hold

    def __post_init__(self):
        _one_of("harness", self, "environment", ENVIRONMENTS)
        _one_of("harness", self, "sandbox", SANDBOXES)
        _one_of("harness", self, "agent_sandbox", AGENT_SANDBOXES)
        _positive(
            "harness",
            self,
            "difficulty",
            "max_turns",
            "sub_agent_max_turns",
            "context_budget_tokens",
            "max_new_tokens",
            "max_observation_tokens",
            "eval_retry_budget",
            "agent_max_processes",
            "agent_memory_bytes",
            "agent_file_bytes",
            "agent_tmp_bytes",
            "workspace_bytes",
            "workspace_inodes",
        )
        _non_negative("harness", self, "max_retries", "task_pool")
        if not self.timeout_s > 0:
            _fail("harness.timeout_s", self.timeout_s, "expected a positive number")
        for name in ("tool_latency_median_s", "tool_latency_sigma"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                _fail(f"harness.{name}", value, "expected a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm start on demonstrations before RL (consumed by gyrejax/stages)."""

    steps: int = 0  # SFT steps; 0 skips the warm start
    demonstrations: int = 64  # tasks demonstrated (one execution each)
    quality: float = 0.8  # chance that a demonstrated file is right
    delegation_prob: float = 0.2  # share of demonstrations that use a sub-agent
    groups_per_step: int = 8  # demonstrations per SFT step
    learning_rate: float = 1e-3  # the warm start's learning rate

    def __post_init__(self):
        _non_negative("warmup", self, "steps", "learning_rate")
        _positive("warmup", self, "demonstrations", "groups_per_step")
        for name in ("quality", "delegation_prob"):
            if not 0 <= getattr(self, name) <= 1:
                _fail(f"warmup.{name}", getattr(self, name), "expected a value in [0, 1]")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Cell role policy (consumed by gyrejax/scheduler)."""

    # POLICIES: who rolls out and who trains, when (gyrejax/scheduler/policies.py).
    policy: str = "elastic"
    phi: int = 1  # extra bursts of dispatch depth (staleness bound).
    mu: int = 1  # training steps per weight publication.
    # The async policy's split: cells in training. A fraction alternates the whole splits
    # around it step by step (1.5: 1, 2, 1, 2, ... cells; policies.Async).
    async_training_cells: float = 1.0
    # Dispatch depth of async and elastic: "gate" dispatches as far ahead as S allows
    # (rollout holds the cells that depth needs), "phi" only (phi + mu) steps ahead;
    # "default": each policy's own (elastic "gate", async "phi").
    lookahead: str = "default"
    # Executions a rollout cell counts as serving in the policies' view (0: its engine's
    # rollout.max_slots). An agent waiting on a tool holds no slot: where executions
    # spend most of their time in tool calls, max_slots over the share of the time they
    # generate lets elastic's waterlevel free the cells whose engines would only idle.
    cell_capacity: int = 0
    # > 0: the capacity follows the agents instead (cell_capacity must be 0): a rollout
    # cell counts as serving max_slots * slot_occupancy / g executions (at least
    # max_slots), g the share of an execution's wall time spent in model calls, measured
    # over the last executions that finished (scheduler/driver.py, capacity_from_share).
    slot_occupancy: float = 0.0
    # Elastic: while training is behind, the waterlevel may leave up to this share of a
    # cell's capacity of executions waiting for a slot (policies.Elastic, `overcommit`).
    elastic_overcommit: float = 0.0
    # The order tasks are dispatched in: "fifo" (the data's) or "longest_first": within
    # each block of S steps' groups, the task with the longest "expected_s" first (needs
    # rl.tasks_path lines that carry it; scheduler/driver.py, dispatch_permutation). The
    # run ends no sooner than its last dispatch plus the longest execution dispatched
    # then, so long tasks started first shorten the tail.
    dispatch_order: str = "fifo"
    # S: no group is trained more than S weight versions after the one it was sampled
    # with (None: groups train in finish order, bounded only by the dispatch depth).
    max_staleness: int | None = None
    progress_every_s: float = 10.0  # how often the runtime logs its progress line

    def __post_init__(self):
        _one_of("scheduler", self, "policy", POLICIES)
        _one_of("scheduler", self, "lookahead", ("default", "gate", "phi"))
        _one_of("scheduler", self, "dispatch_order", DISPATCH_ORDERS)
        _non_negative("scheduler", self, "phi", "cell_capacity", "slot_occupancy")
        if self.slot_occupancy > 0 and self.cell_capacity > 0:
            _fail(
                "scheduler.slot_occupancy",
                self.slot_occupancy,
                f"set with scheduler.cell_capacity={self.cell_capacity}; set one of them",
            )
        _positive("scheduler", self, "mu")
        if not 0 <= self.elastic_overcommit <= 1:
            _fail("scheduler.elastic_overcommit", self.elastic_overcommit, "expected in [0, 1]")
        if not self.async_training_cells >= 1 or not math.isfinite(self.async_training_cells):
            _fail("scheduler.async_training_cells", self.async_training_cells, "expected >= 1")
        if self.max_staleness is not None:
            _non_negative("scheduler", self, "max_staleness")
        if not self.progress_every_s > 0:
            _fail("scheduler.progress_every_s", self.progress_every_s, "expected > 0")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation in the RL loop (consumed by gyrejax/loop/evaluation.py): at
    the first burst boundary at or after every `every_steps` steps, each held-out task
    runs once greedily (temperature 0) and `samples_per_task` times at the rollout
    temperature on the rollout engines, never trained; figures in `eval.jsonl`."""

    every_steps: int = 0  # 0: no evaluation
    # A JSONL file of environment tasks (one per line, as `task_line` writes them: "id",
    # "prompt" and where the environment draws it); "": a held-out split of the
    # environment's own tasks instead, `num_tasks` of them drawn with `seed`, none of
    # which the run's training can draw (gyrejax/harness/held_out.py).
    tasks_path: str = ""
    num_tasks: int = 8  # held-out tasks drawn for the split
    seed: int = 1_000_003  # any value: tasks training can draw are left out whatever it is
    samples_per_task: int = 4  # k: sampled executions per task (pass@k)

    def __post_init__(self):
        _non_negative("eval", self, "every_steps", "seed")
        _positive("eval", self, "num_tasks", "samples_per_task")
        if not isinstance(self.every_steps, int):
            _fail("eval.every_steps", self.every_steps, "expected an integer >= 0 (0: off)")
        if not isinstance(self.tasks_path, str) or self.tasks_path != self.tasks_path.strip():
            _fail("eval.tasks_path", self.tasks_path, "expected a path to a JSONL file, or ''")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under --workdir (consumed by gyrejax/train)."""

    every_steps: int = 10  # steps between two checkpoints (and the run's last step)
    keep: int = 3  # checkpoints (and HF exports) kept; older ones are deleted
    # Each checkpoint also written as an HF checkpoint (config.json + safetensors).
    export_hf: bool = True

    def __post_init__(self):
        _positive("checkpoint", self, "every_steps", "keep")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Greedy generations that launch runs as a smoke check of the model."""

    # Prompts (token ids) the generate CLI and the main job's greedy check decode.
    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3),)
    max_new_tokens: int = 8  # tokens generated for each

    def __post_init__(self):
        _positive("generate", self, "max_new_tokens")
        for prompt in self.prompts:
            if not prompt or any(not isinstance(t, int) or t < 0 for t in prompt):
                _fail("generate.prompts", prompt, "expected non-empty tuples of token ids >= 0")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where a run's metrics go (consumed by gyrejax/writers.py)."""

    # Besides the JSONL logs, always written: "tensorboard" (event files in
    # <workdir>/tensorboard, via tensorboardX: no TensorFlow) and/or "wandb" (Weights &
    # Biases; offline unless WANDB_MODE says otherwise). "jsonl" may be listed too.
    writers: tuple[str, ...] = ("jsonl",)
    wandb_project: str = "gyrejax"  # the W&B project (logging.writers has wandb)

    def __post_init__(self):
        writers = self.writers
        if not isinstance(writers, tuple) or not all(w in LOGGING_WRITERS for w in writers):
            _fail("logging.writers", writers, f"expected a tuple of {', '.join(LOGGING_WRITERS)}")
        if len(set(writers)) != len(writers):
            _fail("logging.writers", writers, "each writer once")
        if not self.wandb_project:
            _fail("logging.wandb_project", self.wandb_project, "expected a project name")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    model: ModelConfig = ModelConfig()
    cells: CellsConfig = CellsConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    rl: RLConfig = RLConfig()
    harness: HarnessConfig = HarnessConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    warmup: WarmupConfig = WarmupConfig()
    generate: GenerateConfig = GenerateConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = 0  # every seed of the run (init, tasks, sampling) derives from it
    # JAX's persistent compilation cache (gyrejax/compilation_cache.py): compiled programs
    # kept on disk, so a resumed run, and each process of a run, loads what was compiled
    # before instead of compiling it again. "auto": `<workdir>/jax_cache` (the run's own,
    # visible to all its processes like the rest of the workdir, and gone with it); a
    # directory: shared by every run naming it (e.g. ~/.cache/gyrejax/jax; entries are
    # keyed by program, jaxlib and devices, so sharing is safe); "off" or "": none. A
    # process setting, not a stage's, hence top level (launch applies it before anything
    # compiles, as it does cells.num_cpu_devices). A non-empty $JAX_COMPILATION_CACHE_DIR
    # wins over it.
    compilation_cache_dir: str = COMPILATION_CACHE_AUTO

    def __post_init__(self):
        # numpy seeds the task draws and admission: it refuses negative seeds, deep in the
        # first rollout; say so here.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            _fail("seed", self.seed, "expected an integer >= 0")
        cache = self.compilation_cache_dir
        if not isinstance(cache, str) or cache != cache.strip() or "://" in cache:
            _fail(
                "compilation_cache_dir",
                cache,
                f"expected {COMPILATION_CACHE_AUTO!r}, 'off' (or '') or a local directory",
            )
        # A context may pass the budget by one turn (an answer and an observation) before
        # it is compacted, and the call then adds one more answer.
        h = self.harness
        needed = h.context_budget_tokens + 2 * h.max_new_tokens + h.max_observation_tokens + 8
        if needed > self.rollout.max_seq_len:
            _fail(
                "rollout.max_seq_len",
                self.rollout.max_seq_len,
                f"must hold harness.context_budget_tokens + 2 * harness.max_new_tokens + "
                f"harness.max_observation_tokens + 8 = {needed}",
            )
        # Updates below half a step of a weight's dtype round away: with bfloat16 weights
        # updated in bfloat16 at lr 1e-6, ~99% of them (tests/test_trainer.py measures it).
        low_precision = self.model.dtype != "float32"
        if self.train.master_dtype == "same" and low_precision:
            if not self.train.allow_low_precision_updates:
                _fail(
                    "train.master_dtype",
                    self.train.master_dtype,
                    f"with model.dtype={self.model.dtype!r} the weights would be updated in "
                    f"{self.model.dtype}, where most small updates round away; use 'float32' "
                    "(master weights), or set train.allow_low_precision_updates=True",
                )
        longest = self.train.all_row_lengths[-1]
        if longest < self.rollout.max_seq_len:  # a longer call would fit no row
            _fail(
                "rollout.max_seq_len",
                self.rollout.max_seq_len,
                f"must be <= the longest row, max(train.row_length={self.train.row_length}, "
                f"train.row_lengths={self.train.row_lengths}) = {longest}: a call is trained "
                "with its whole context in one row",
            )
        sequence = self.cells.sequence
        for x in self.train.row_lengths:  # else the length stays whole on every device
            if x > self.train.row_length and sequence > 1 and x % sequence:
                _fail(
                    "train.row_lengths",
                    self.train.row_lengths,
                    f"{x} is not a multiple of cells.sequence={sequence}, the axis a row "
                    "longer than train.row_length is split over",
                )
        if self.scheduler.dispatch_order == "longest_first" and not self.rl.tasks_path:
            _fail(
                "scheduler.dispatch_order",
                self.scheduler.dispatch_order,
                'needs tasks that carry "expected_s": rl.tasks_path (with rl.agent=command)',
            )
        rl_rollouts = self.rl.loss != "sft" and not self.train.executions_dir and self.train.steps
        if rl_rollouts and self.rl.agent == "builtin" and self.rollout.temperature == 0:
            _fail(
                "rollout.temperature",
                0,
                "greedy calls are context, never trained as samples, so RL would train "
                "nothing; use a temperature > 0",
            )
        if self.eval.every_steps and self.rl.agent != "builtin":
            _fail(
                "eval.every_steps",
                self.eval.every_steps,
                "evaluation runs the built-in harness (rl.agent=builtin), which can sample "
                f"greedily; rl.agent={self.rl.agent!r} chooses its own sampling",
            )
        for name in ("vllm_servers", "engine_servers"):
            servers = getattr(self.rollout, name)
            if servers and (self.train.executions_dir or not self.train.steps):
                _fail(
                    f"rollout.{name}",
                    servers,
                    "external engines roll out in the RL loop only (train.steps > 0 "
                    "and no train.executions_dir)",
                )
        for prompt in self.generate.prompts:
            for token in prompt:
                if token >= self.model.vocab_size:
                    _fail(
                        "generate.prompts",
                        prompt,
                        f"token {token} >= model.vocab_size={self.model.vocab_size}",
                    )

    @property
    def cell_capacity(self) -> int:
        """Executions a rollout cell serves in the policies' view (scheduler.cell_capacity,
        or the engine's slots)."""
        return self.scheduler.cell_capacity or self.rollout.max_slots


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Converts a plain value (from a ConfigDict) to the dataclass field's type."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(path, hint, value)
    if value is None and not (
        origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    ):
        # A config file marks a field it cannot default with config_dict.placeholder
        # (e.g. the checkpoint of configs/qwen3_gpu.py): None until the command line sets it.
        _fail(path, value, f"required, not set (pass --config.{path}=...)")
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(path, value, "expected a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, "expected an integer")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            _fail(path, value, "expected true or false")
        return value
    if hint is str:
        if not isinstance(value, str):
            _fail(path, value, "expected a string")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            _fail(path, value, "expected a sequence")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(args) != len(value):
            _fail(path, value, f"expected {len(args)} items")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in pairs)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, value, arg)
            except ConfigError:
                continue
        _fail(path, value, f"expected {hint}")
    return value


def _build(path: str, cls: type, values: Any) -> Any:
    if dataclasses.is_dataclass(values):
        return values
    if not isinstance(values, Mapping):
        _fail(path or "<root>", values, "expected a section (a dict of fields)")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{path}." if path else ""
    for key in values:
        if key not in fields:
            raise ConfigError(_unknown(cls, path, str(key)))
    kwargs = {k: _coerce(f"{prefix}{k}", v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def _unknown(cls: type, section: str, name: str) -> str:
    """The message for a field `name` that section `section` (of dataclass `cls`) lacks."""
    names = [f.name for f in dataclasses.fields(cls)]
    full = lambda n: f"{section}.{n}" if section else n
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {full(close[0])!r}?" if close else f"known: {', '.join(sorted(names))}"
    return f"config: unknown field {full(name)!r}; {hint}"


def unknown_field(path: str) -> str | None:
    """Why a dotted field path ("model.num_layerz") names no config field, in one line
    with the closest known name; None if it names one."""
    cls: Any = Config
    parts = path.split(".")
    for i, name in enumerate(parts):
        section = ".".join(parts[:i])
        if not dataclasses.is_dataclass(cls):
            return f"config: unknown field {path!r}; {section!r} is a value, not a section"
        if name not in {f.name for f in dataclasses.fields(cls)}:
            return _unknown(cls, section, name)
        cls = typing.get_type_hints(cls)[name]
    return None


def from_dict(values: Mapping[str, Any]) -> Config:
    """Builds a validated `Config` from a nested mapping (e.g. `ConfigDict.to_dict()`).

    Missing keys take their defaults; unknown keys and bad values raise `ConfigError`.
    """
    if hasattr(values, "to_dict"):
        values = values.to_dict()
    return _build("", Config, values)
