"""Per-device memory of a configuration on one cell, from abstract shapes only.

Nothing is allocated: the model is built with `nnx.eval_shape`, laid out with the config's
sharding rules on a `jax.sharding.AbstractMesh` of one cell's (fsdp, tensor) shape, and
the optimizer state is `jax.eval_shape` of the trainer's own optimizer. So a CPU host can
check that an 8B layout fits a GPU it does not have (tests/test_gpu_configs.py,
configs/qwen3_gpu.py).

Training (the core cell at the peak of a micro-step, per device):
  * parameters, as the trainer keeps them: in `model.dtype`, laid out by the train rules;
  * float32 master weights (`train.master_dtype = "float32"` with a lower-precision
    model: `ElasticTrainer.master`), laid out like the parameters; none otherwise;
  * one micro-step's gradients (parameter dtype) and the float32 gradient accumulator
    (`ElasticTrainer._compiled_for`), both laid out like the parameters;
  * the optimizer state: whatever `make_optimizer(train).init` returns for the weights
    it updates (AdamW's two moments take their dtype: float32 with masters, else the
    parameter dtype), moments laid out like their parameters, counters replicated;
  * the KL reference (a second copy of the parameters) when `rl.kl_coef > 0`;
  * activations, for the micro-step shape with the most tokens per device (rows = its
    rows / cells.fsdp, the batch being split over fsdp: [train.rows_per_micro_step,
    train.row_length], or with row buckets (`micro_step_shapes`) possibly one long row
    of a longer length): what every layer keeps for its backward,
    `rows x length x layers x kept_bytes_per_token_per_layer(train.remat)`, whose
    docstring lists each tensor (tests/test_memory.py checks the counts against JAX's
    own residuals of the real loss). The rotary tables are the same in every layer (they
    depend on the positions only), so the compiler keeps one copy: counted once;
  * then, at the peak, the larger of two working sets:
    * the loss head (`head`): the hidden-width tensors it keeps per token, float32
      logits over the vocabulary (`LOGITS_COPIES`: the logits and their cotangent) for
      every position at once, or with `train.loss_chunk_tokens` for one chunk's, and the
      float32 output matrix and its cotangent where a copy is made (a lower-precision
      model's cast, a chunked head's transposed matrix and its accumulated cotangent);
    * the layer whose backward runs (`working_per_row`): its attention's float32 dq, dk
      and dv, and under remat what it did not keep, computed again (so it holds what it
      keeps without remat).
  tests/test_memory.py holds the whole micro-step estimate (parameters, gradients,
  accumulator, activations and the working set) to XLA's own compiled memory analysis
  of the trainer's micro-step on CPU, for float32 models with and without remat and
  chunking: within 15%. (Float32, because XLA's CPU backend computes bfloat16 in float32
  and keeps float32 copies of activations that a GPU does not.)
  The update after the last micro-step holds no activations; its peak (parameters,
  masters, optimizer, accumulator, the gradients cast to the dtype of the weights it
  updates and the updates, and with masters the new parameters cast from them) is
  counted too, and the larger of the two is the training peak.

Rollout (an engine on one cell, per device): the engine's weights laid out by the
rollout (sampling) rules, tensor-parallel only; its KV cache, `rollout.max_slots` slots
of `layers x 2 x kv_heads x head_dim x max_seq_len x dtype bytes` over `tensor`; the
share `rollout.gpu_memory_utilization` of the device it may take; and on the core cell
the trainer's parameters, masters and optimizer state, which stay while the core rolls
out.

Not counted, left to the headroom (`HEADROOM`): the CUDA context and NCCL buffers, XLA's
temporaries of fused ops and fragmentation, FSDP-gathered layers in flight, and vLLM's
own activations and CUDA graphs inside its share.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from gyrejax.config import CellsConfig, Config, ModelConfig, ShardingRules
from gyrejax.model import sharding
from gyrejax.model.transformer import Transformer
from gyrejax.train.trainer import make_optimizer, micro_step_shapes

# An H200's HBM, as its "141 GB" is usually read (the device reports a little more).
H200_BYTES = 141_000_000_000
# An H100's 80 GB (the device reports 81559 MiB; 80 GB leaves the difference spare).
H100_BYTES = 80_000_000_000
# The share of the device the estimate leaves for what it does not count (module
# docstring): a layout fits only if its estimate is at most (1 - HEADROOM) of the device.
HEADROOM = 0.10
# Copies of the float32 [tokens, vocab] logits alive at the loss head's peak: the logits
# and their cotangent (XLA fuses the softmax into the cotangent; checked in
# tests/test_memory.py).
LOGITS_COPIES = 2


def cell_mesh(cells: CellsConfig) -> AbstractMesh:
    """The abstract mesh of one cell (`CellsConfig.mesh_shape`): no devices needed. The
    estimates below assume whole rows per device (cells.sequence = 1, as every GPU
    variant sets)."""
    shape = cells.mesh_shape
    return AbstractMesh(tuple(shape.values()), tuple(shape))


@functools.lru_cache(maxsize=8)
def abstract_state(model: ModelConfig) -> nnx.State:
    """The model's parameters as shapes and dtypes (with their logical axes).

    Cached (building an 8B model abstractly takes seconds, and each check needs it):
    callers only read the result.
    """
    return nnx.state(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))


def uneven_shardings(state: nnx.State, mesh: AbstractMesh, rules: ShardingRules) -> list[str]:
    """Each parameter dimension the mesh axis its rule names does not divide.

    `sharding.logical_to_spec` leaves such a dimension replicated (so tiny test models
    shard on any mesh); on a real layout that silently costs memory, so it is a problem.
    """
    problems = []
    mesh_shape = dict(mesh.shape)
    for path, variable in nnx.to_flat_state(state):
        axes = sharding.logical_axes_of(variable)
        shape = variable.get_value().shape
        wanted = sharding.logical_to_spec(axes, rules)
        for dim, (axis, size) in enumerate(zip(wanted, shape, strict=True)):
            if axis is not None and size % mesh_shape[axis]:
                name = ".".join(str(p) for p in path)
                problems.append(
                    f"{name}: dimension {dim} ({axes[dim]}={size}) is not divisible by "
                    f"{axis}={mesh_shape[axis]}"
                )
    return problems


def keeps_masters(config: Config) -> bool:
    """The trainer keeps float32 master weights and moments (`ElasticTrainer.master`):
    `train.master_dtype` is "float32" and `model.dtype` is lower."""
    return config.train.master_dtype == "float32" and config.model.dtype != "float32"


def _shards(spec: PartitionSpec, mesh_shape: dict[str, int]) -> int:
    """How many devices one copy of an array with this spec is split over."""
    return math.prod(mesh_shape[axis] for axis in spec if axis is not None)


def _per_device(leaves_and_specs, mesh_shape: dict[str, int], itemsize: int | None = None) -> int:
    """Bytes per device of (abstract array, spec) pairs; `itemsize` overrides the dtype."""
    total = 0
    for leaf, spec in leaves_and_specs:
        size = itemsize if itemsize is not None else leaf.dtype.itemsize
        total += math.ceil(leaf.size * size / _shards(spec, mesh_shape))
    return total


def kept_bytes_per_token_per_layer(model: ModelConfig, tensor: int = 1, remat: str = "none") -> int:
    """Bytes one decoder layer keeps for its backward per token, per device.

    Counted from what JAX's autodiff saves for the micro-step loss with the blocked
    attention (tests/test_memory.py checks every count against the residuals of the real
    loss): a = the activations' bytes (2 for bfloat16, 4 for float32), e = hidden, m =
    intermediate, q = heads x head_dim, kv = kv_heads x head_dim.
      * remat "none":
        * 2 (4 + 2a) e: two RMSNorms, each its float32 input, normed and scaled output;
        * 6a m: SwiGLU's gate and up projections, the three values silu's backward
          reads, and their product;
        * 3a q (+ (4 + a) q with qk-norm): rotated queries, attention output, heads
          merged; qk-norm adds its float32 input and normed output;
        * 2a kv (+ (4 + a) kv with qk-norm): rotated keys and the values;
        * 4 per query head (the attention's float32 log-sum-exp) and, with qk-norm, 8
          per query and key head (its float32 rsqrt and product);
        * 8 head_dim: rotary cos and sin (float32, head_dim / 2 each), queries and keys;
        * 16: each RMSNorm's float32 rsqrt and product.
      * "layer": a e, the layer's input;
      * "matmuls": a (2e + 2m + q + 2kv): the input and the weight matmuls' outputs the
        backward reads (o's output rebuilds the residual stream; down's is the next
        layer's input).
    The m, q, kv and per-head terms are split over `tensor` (their activations are
    constrained to the mlp and heads axes); the rest is replicated across it.

    Raises:
      ValueError: for an attention or remat the count was not derived for.
    """
    if model.attention not in ("blocked", "pallas"):  # the same residuals: q, k, v, out, lse
        raise ValueError(
            f"kept_bytes_per_token_per_layer counts the blocked or Pallas attention, not "
            f"model.attention={model.attention!r}"
        )
    a = jnp.dtype(model.dtype).itemsize
    e, m, d = model.hidden_size, model.intermediate_size, model.head_dim
    heads, kv_heads = model.num_heads, model.num_kv_heads
    q, kv = heads * d, kv_heads * d
    if remat == "layer":
        return a * e
    if remat == "matmuls":
        return a * 2 * e + math.ceil(a * (2 * m + q + 2 * kv) / tensor)
    if remat != "none":
        raise ValueError(f"remat={remat!r}: expected one of none, layer, matmuls")
    norm = 4 + a if model.qk_norm else 0
    split = (
        6 * a * m
        + (3 * a + norm) * q
        + (2 * a + norm) * kv
        + 4 * heads
        + (8 * (heads + kv_heads) if model.qk_norm else 0)
    )
    return 2 * (4 + 2 * a) * e + 8 * d + 16 + math.ceil(split / tensor)


def rotary_bytes_per_token(model: ModelConfig) -> int:
    """The rotary tables' bytes per token in what a layer keeps without remat (float32
    cos and sin, head_dim / 2 each, for queries and keys): the same in every layer."""
    return 8 * model.head_dim


def attention_gradient_bytes_per_token(model: ModelConfig, tensor: int = 1) -> int:
    """The float32 dq, dk and dv a layer's attention backward accumulates, per token:
    4 (q + 2 kv) bytes, split over `tensor`."""
    d = model.head_dim
    return math.ceil(4 * (model.num_heads * d + 2 * model.num_kv_heads * d) / tensor)


def head_bytes_per_token(model: ModelConfig, chunked: bool = False) -> int:
    """Bytes the loss head keeps per token in the hidden width: the final RMSNorm's
    float32 input and its output, the hidden states the logits are computed from (in
    float32; a chunked head keeps them in the model's dtype and casts each chunk), and
    96 bytes of per-token loss scalars (log-probs, ratios, clips, masks, the sampling
    settings and the top-k/top-p cut's threshold). The logits are `logits_bytes`."""
    a = jnp.dtype(model.dtype).itemsize
    return (4 + a + (a if chunked else 4)) * model.hidden_size + 96


def logits_bytes(model: ModelConfig, tokens: int, tensor: int = 1) -> int:
    """The loss head's float32 [tokens, vocab] buffers at their peak (`LOGITS_COPIES`),
    split over `tensor`: `tokens` is every position of the micro-step's rows, or with
    a chunked head one chunk's."""
    return math.ceil(tokens * LOGITS_COPIES * 4 * model.vocab_size / tensor)


@dataclasses.dataclass(frozen=True)
class TrainingMemory:
    """Bytes per device of the core cell while it trains (see the module docstring)."""

    params: int
    master: int  # float32 master weights; 0 without (train.master_dtype, model.dtype)
    gradients: int  # one micro-step's, in the parameter dtype
    accumulator: int  # float32 sum over micro-steps
    optimizer: int
    reference: int  # KL anchor; 0 without rl.kl_coef
    rows: int  # rows each device computes per micro-step
    activations_per_row: int  # what every layer keeps for its backward
    working_per_row: int  # what the layer whose backward runs holds beyond that
    head: int  # the loss head at its peak, all rows (logits and the output matrix)

    @property
    def activations(self) -> int:
        return self.rows * self.activations_per_row

    @property
    def working(self) -> int:
        """The larger working set on top of the activations: the head or a layer's."""
        return max(self.head, self.rows * self.working_per_row)

    @property
    def micro_step_peak(self) -> int:
        return self.resident + self.accumulator + self.gradients + self.activations + self.working

    @property
    def micro_step_program(self) -> int:
        """What the compiled micro-step itself holds: its arguments (parameters, the KL
        reference, the accumulator), the gradients, activations and working set; the
        masters and optimizer state stay outside it (what XLA's memory analysis of it
        sees)."""
        return self.micro_step_peak - self.master - self.optimizer

    @property
    def update_peak(self) -> int:
        # The gradients cast to the updated weights' dtype and the updates are alive
        # together; with masters the new parameters are cast while the old ones live.
        if self.master:
            return self.resident + self.accumulator + 2 * self.master + self.params
        return self.resident + self.accumulator + 2 * self.params

    @property
    def total(self) -> int:
        return max(self.micro_step_peak, self.update_peak)

    @property
    def resident(self) -> int:
        """What the core keeps between steps, also while it rolls out."""
        return self.params + self.master + self.optimizer + self.reference


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """Bytes per device of an engine on one cell (see the module docstring)."""

    weights: int  # laid out by the rollout rules (tensor-parallel only)
    kv_per_slot: int  # one slot of rollout.max_seq_len, the whole model (all devices)
    kv_per_slot_per_device: int
    slots: int  # rollout.max_slots
    share: int  # rollout.gpu_memory_utilization of the device
    core_resident: int  # the trainer's parameters, masters and optimizer state on the core

    @property
    def kv(self) -> int:
        return self.slots * self.kv_per_slot_per_device

    @property
    def total(self) -> int:
        return self.weights + self.kv

    @property
    def max_slots(self) -> int:
        """The most slots whose KV fits the share beside the weights."""
        return max(0, (self.share - self.weights) // self.kv_per_slot_per_device)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A configuration's per-device memory on one cell of a device with `hbm_bytes`."""

    training: TrainingMemory
    rollout: RolloutMemory
    hbm_bytes: int
    problems: tuple[str, ...]  # why it does not fit; empty if it does

    @property
    def limit(self) -> int:
        """The most the training estimate may reach: the device less `HEADROOM`."""
        return int((1 - HEADROOM) * self.hbm_bytes)

    @property
    def headroom(self) -> int:
        """What the training peak leaves of the device."""
        return self.hbm_bytes - self.training.total


def _training(config: Config, state: nnx.State, mesh: AbstractMesh) -> TrainingMemory:
    mesh_shape = dict(mesh.shape)
    specs = sharding.partition_specs(state, mesh, config.train.sharding_rules)
    params = nnx.to_pure_dict(state)
    abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), params)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    pairs = list(zip(jax.tree.leaves(abstract), spec_leaves, strict=True))

    optimizer = make_optimizer(config.train)
    masters = keeps_masters(config)
    updated = (
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract)
        if masters
        else abstract
    )
    opt_state = jax.eval_shape(optimizer.init, updated)
    # As the trainer lays it out: moments like their parameters, counters replicated.
    opt_specs = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_state,
        specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=is_spec,
    )
    opt_pairs = zip(
        jax.tree.leaves(opt_state), jax.tree.leaves(opt_specs, is_leaf=is_spec), strict=True
    )

    model, cells, train = config.model, config.cells, config.train
    param_bytes = _per_device(pairs, mesh_shape)
    float32_bytes = _per_device(pairs, mesh_shape, itemsize=4)  # the accumulator, masters
    # The micro-step shape with the most tokens per device: with row buckets one row of
    # a long length may hold more than the base [R, L] (rollout.max_seq_len may exceed L).
    rows, length = max(
        ((math.ceil(r / cells.fsdp), n) for r, n in micro_step_shapes(train)),
        key=lambda shape: shape[0] * shape[1],
    )
    tensor = cells.tensor
    kept = kept_bytes_per_token_per_layer(model, tensor, train.remat)
    everything = kept_bytes_per_token_per_layer(model, tensor)  # what "none" keeps
    rotary = rotary_bytes_per_token(model) if train.remat == "none" else 0
    working = everything - kept + attention_gradient_bytes_per_token(model, tensor)
    chunk = train.loss_chunk_tokens
    chunked = 0 < chunk < length
    head = rows * length * head_bytes_per_token(model, chunked)
    head += logits_bytes(model, rows * (chunk if chunked else length), tensor)
    if chunked or model.dtype != "float32":  # float32 [hidden, vocab] and its cotangent
        head += 2 * math.ceil(4 * model.hidden_size * model.vocab_size / tensor)
    return TrainingMemory(
        params=param_bytes,
        master=float32_bytes if masters else 0,
        gradients=param_bytes,
        accumulator=float32_bytes,
        optimizer=_per_device(opt_pairs, mesh_shape),
        reference=param_bytes if config.rl.kl_coef > 0 else 0,
        rows=rows,
        activations_per_row=length * (model.num_layers * (kept - rotary) + rotary),
        working_per_row=length * working,
        head=head,
    )


def kv_bytes_per_slot(model: ModelConfig, max_seq_len: int) -> int:
    """KV-cache bytes of one slot: layers x 2 (keys, values) x kv_heads x head_dim x
    max_seq_len x the dtype's bytes, the whole model."""
    itemsize = 2 if model.dtype == "bfloat16" else 4
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * max_seq_len * itemsize


def _rollout(
    config: Config, state: nnx.State, mesh: AbstractMesh, hbm_bytes: int, resident: int
) -> RolloutMemory:
    mesh_shape = dict(mesh.shape)
    specs = sharding.partition_specs(state, mesh, config.rollout.sharding_rules)
    leaves = jax.tree.leaves(nnx.to_pure_dict(state))
    is_spec = lambda x: isinstance(x, PartitionSpec)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    weights = _per_device(zip(leaves, spec_leaves, strict=True), mesh_shape)
    # The cache is [slots, kv_heads, max_len, head_dim] per layer, laid out like the heads.
    kv_axis = dict(config.rollout.sharding_rules).get("kv_heads")
    kv_split = mesh_shape[kv_axis] if kv_axis else 1
    if config.model.num_kv_heads % kv_split:
        kv_split = 1
    per_slot = kv_bytes_per_slot(config.model, config.rollout.max_seq_len)
    return RolloutMemory(
        weights=weights,
        kv_per_slot=per_slot,
        kv_per_slot_per_device=math.ceil(per_slot / kv_split),
        slots=config.rollout.max_slots,
        share=int(config.rollout.gpu_memory_utilization * hbm_bytes),
        core_resident=resident,
    )


def estimate(config: Config, hbm_bytes: int = H200_BYTES) -> Estimate:
    """Per-device memory of `config` on one of its cells, and why it does not fit a device
    of `hbm_bytes` (each reason with its numbers): a parameter dimension its mesh axis
    does not divide, a micro-step's rows not split evenly over fsdp, the training peak
    above (1 - HEADROOM) of the device, the engine above its share, or on the core cell
    the share plus the trainer's state above the device."""
    mesh = cell_mesh(config.cells)
    state = abstract_state(config.model)
    training = _training(config, state, mesh)
    rollout = _rollout(config, state, mesh, hbm_bytes, training.resident)
    problems = []
    for section, rules in (
        ("train", config.train.sharding_rules),
        ("rollout", config.rollout.sharding_rules),
    ):
        problems += [f"{section} layout: {p}" for p in uneven_shardings(state, mesh, rules)]
    rows, fsdp = config.train.rows_per_micro_step, config.cells.fsdp
    if rows % fsdp:
        problems.append(
            f"train.rows_per_micro_step={rows} is not divisible by cells.fsdp={fsdp}: "
            "each device would compute more rows than its share"
        )
    limit = int((1 - HEADROOM) * hbm_bytes)
    t = training
    if t.total > limit:
        problems.append(
            f"training needs {gb(t.total)} GB per device, above {gb(limit)} GB "
            f"({1 - HEADROOM:.0%} of {gb(hbm_bytes)} GB): parameters {gb(t.params)}, "
            f"masters {gb(t.master)}, gradients {gb(t.gradients)}, accumulator "
            f"{gb(t.accumulator)}, optimizer {gb(t.optimizer)}, activations "
            f"{gb(t.activations)} ({t.rows} row(s) of {gb(t.activations_per_row)}), working "
            f"set {gb(t.working)} (loss head {gb(t.head)}, a layer's backward "
            f"{gb(t.rows * t.working_per_row)}); train.remat={config.train.remat!r}, "
            f"train.loss_chunk_tokens={config.train.loss_chunk_tokens}"
        )
    r = rollout
    if r.total > r.share:
        problems.append(
            f"rollout needs {gb(r.total)} GB per device (weights {gb(r.weights)}, KV "
            f"{gb(r.kv)} for {r.slots} slots of {gb(r.kv_per_slot_per_device)}), above its "
            f"share {gb(r.share)} GB (rollout.gpu_memory_utilization="
            f"{config.rollout.gpu_memory_utilization}); {r.max_slots} slots would fit"
        )
    if r.share + r.core_resident > hbm_bytes:
        problems.append(
            f"on the core cell the engine's share {gb(r.share)} GB plus the trainer's "
            f"parameters, masters and optimizer state {gb(r.core_resident)} GB exceed the device's "
            f"{gb(hbm_bytes)} GB"
        )
    return Estimate(training, rollout, hbm_bytes, tuple(problems))


def gb(num_bytes: float) -> str:
    """Bytes as decimal gigabytes (1e9) with one decimal: the unit of every table."""
    return f"{num_bytes / 1e9:.1f}"


# The tables configs/qwen3_gpu.py's docstring shows; tests/test_gpu_configs.py renders
# every row again from the config and finds it there, so no figure can drift.
_TRAINING_COLUMNS = (
    ("variant", -14),
    ("cell", -4),
    ("rows", 4),
    ("params", 6),
    ("master", 6),
    ("grads", 5),
    ("accum", 5),
    ("optim", 5),
    ("remat", -7),
    ("act/row", 7),
    ("head", 5),
    ("layer", 5),
    ("total", 6),
    ("free", 4),
)
_ROLLOUT_COLUMNS = (
    ("variant", -14),
    ("KV/slot", 7),
    ("per device", 10),
    ("slots", 5),
    ("KV", 6),
    ("weights", 7),
    ("share", 6),
    ("max slots", 9),
    ("core", 6),
)


def _line(columns: tuple[tuple[str, int], ...], values: tuple[object, ...]) -> str:
    """Values in columns of the given widths (negative: left-aligned), one space apart."""
    cells = [
        f"{v!s:<{-w}}" if w < 0 else f"{v!s:>{w}}"
        for (_, w), v in zip(columns, values, strict=True)
    ]
    return " ".join(cells).rstrip()


TRAINING_HEADER = _line(_TRAINING_COLUMNS, tuple(name for name, _ in _TRAINING_COLUMNS))
ROLLOUT_HEADER = _line(_ROLLOUT_COLUMNS, tuple(name for name, _ in _ROLLOUT_COLUMNS))


def training_row(name: str, config: Config, est: Estimate) -> str:
    """One line of the training table (GB per device of the core cell)."""
    t, c = est.training, config.cells
    free = f"{est.headroom / est.hbm_bytes:.0%}"
    values = (name, f"{c.fsdp}x{c.tensor}", t.rows, gb(t.params))
    values += (gb(t.master), gb(t.gradients), gb(t.accumulator), gb(t.optimizer))
    values += (config.train.remat, gb(t.activations_per_row), gb(t.head))
    values += (gb(t.rows * t.working_per_row), gb(t.total), free)
    return _line(_TRAINING_COLUMNS, values)


def rollout_row(name: str, est: Estimate) -> str:
    """One line of the rollout table (GB per device)."""
    r = est.rollout
    values = (name, gb(r.kv_per_slot), gb(r.kv_per_slot_per_device), r.slots, gb(r.kv))
    values += (gb(r.weights), gb(r.share), r.max_slots, gb(r.share + r.core_resident))
    return _line(_ROLLOUT_COLUMNS, values)
