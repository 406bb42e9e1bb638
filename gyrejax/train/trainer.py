"""The elastic trainer: a core cell plus satellites that join and leave between steps.

One training step consumes one packed batch (`gyrejax.trajectory.PackedBatch`). Read
`train_step` top to bottom; it is the one implementation of a step:

  1. open: the step's plan (number, version, cells, micro-steps) is announced and every
     satellite that starts it pulls the core's weights, frozen for the step;
  2. claim: every cell in TRAINING runs a worker thread (`_work`) that claims
     micro-steps from one shared queue, runs its compiled micro-step and accumulates
     gradients; a satellite may join while the step runs (`join`): it pulls the weights
     and starts claiming;
  3. reduce: the gradient sums of the cells that took part are summed onto the core
     (`CrossCellReducer`, cached per set of cells);
  4. skip or update: a non-finite micro-step skips the update; otherwise the optimizer
     (its only state lives on the core) updates the weights and the version goes up;
  5. report: a `StepReport`; satellites released with `release` leave at this boundary.

Mixed precision (`train.master_dtype = "float32"`, the default): with a model in a lower
dtype (bfloat16) the core also keeps float32 master weights (`master`) and AdamW's moments
in float32. Micro-steps compute in the model's dtype from `params`, which are always the
masters cast down (the weights satellites pull, engines get and exports write); the
gradients accumulate in float32 (as they always do) and the update applies to the masters,
so an update below half a bfloat16 step of its weight is not rounded away. Checkpoints
hold the masters. With a float32 model there are no masters and nothing changes.

Because the batch weights are normalised over the whole batch, the result does not
depend on which cells took part or when they joined (up to float summation order).

How steps are announced, micro-steps claimed, weights pulled and results exchanged is a
`Transport` (`gyrejax.train.transport`): in one process (the default) or across
processes (`gyrejax.distributed.transport`), where process 0 drives `train_step` and
the others run `follow`, the same step from a follower's side.

Every function that runs on a cell is compiled ahead of time once per cell and kept, so
a satellite that leaves and rejoins never recompiles (`compile_count` proves it). With
row buckets (`train.row_lengths`) a batch's micro-steps come in a few shapes, one per
row length (`micro_step_shapes`); each is compiled once per cell, all ahead of time, and
each micro-step runs the one of its shape. A new
training phase on the same weights (`begin_phase`: RL after the warm start) keeps the
layout and whatever compiled function still fits.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from gyrejax.cells import Cell
from gyrejax.config import RLConfig, TrainConfig
from gyrejax.model import sharding
from gyrejax.model.transformer import Transformer
from gyrejax.rl.objective import MAX_METRICS, finish_metrics, micro_step_loss, token_logprobs
from gyrejax.train.checkpoint import TrainCheckpointer, abstract_like
from gyrejax.train.reduction import CrossCellReducer
from gyrejax.train.transport import (
    CellResult,
    InProcessTransport,
    JoinReport,
    ParamLayout,
    StepExchange,
    StepPlan,
    Transport,
)
from gyrejax.trajectory import PackedBatch
from gyrejax.trajectory.buckets import rows_per_micro_step_for
from gyrejax.trajectory.rows import MICRO_STEP_FIELDS, ROW_FIELDS

__all__ = [
    "ElasticTrainer",
    "JoinReport",
    "LeaveReport",
    "StepReport",
    "make_optimizer",
    "micro_step_shapes",
    "weight_decay_mask",
]


def micro_step_shapes(config: TrainConfig) -> tuple[tuple[int, int], ...]:
    """Every micro-step shape (rows, row length) a batch of `config` may have, one per
    row length, as the packer makes them (`trajectory.buckets`); ascending lengths."""
    r, base = config.rows_per_micro_step, config.row_length
    return tuple(
        (rows_per_micro_step_for(length, row_length=base, rows_per_micro_step=r), length)
        for length in config.all_row_lengths
    )


def _head_options(config: TrainConfig) -> tuple[str, int]:
    """What a micro-step trades compute for memory with (`token_logprobs`'s remat and
    chunk_tokens): part of a compiled micro-step's identity."""
    return config.remat, config.loss_chunk_tokens


# Weight decay by parameter name (the last key of its path; gyrejax/model/transformer.py):
# the matmul kernels decay (attention q/k/v/o, MLP gate/up/down, an untied lm_head); norm
# scales, biases and the token embedding (when tied, also the output head) do not:
# decaying them pulls gains and per-token rows toward 0 for no regularising gain.
DECAYED_PARAMS = frozenset({"q", "k", "v", "o", "gate", "up", "down", "lm_head"})
UNDECAYED_PARAMS = frozenset({"embed", "scale", "q_bias", "k_bias", "v_bias", "o_bias"})


def weight_decay_mask(params):
    """AdamW's decay mask for `params`: a tree like it of bools, True for the weights that
    decay (`DECAYED_PARAMS`). Any tree whose leaves' paths end in the parameter's name
    works: the pure dict of parameters, its float32 masters, their gradients or their
    ShapeDtypeStructs.

    Raises:
      ValueError: a parameter named in neither set (a new one must be placed in one).
    """

    def decays(path, _) -> bool:
        name = path[-1].key if path and hasattr(path[-1], "key") else None
        if name in DECAYED_PARAMS:
            return True
        if name in UNDECAYED_PARAMS:
            return False
        raise ValueError(
            f"weight decay: parameter {jax.tree_util.keystr(path)} is in neither "
            "DECAYED_PARAMS nor UNDECAYED_PARAMS (gyrejax/train/trainer.py)"
        )

    return jax.tree_util.tree_map_with_path(decays, params)


def _decay_matmul_kernels(weight_decay: float) -> optax.GradientTransformation:
    """AdamW's decoupled weight decay (`optax.add_decayed_weights`) on the leaves
    `weight_decay_mask` picks. Not `optax.adamw(mask=...)`: that wraps this step's state
    in a `MaskedState`, a tree Orbax will not restore a checkpoint written without the
    mask into; this step's state is the unmasked one's (`EmptyState`)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the parameters: update(..., params)")
        if weight_decay == 0:
            return updates, state
        decay = lambda u, p, m: u + weight_decay * p if m else u
        return jax.tree.map(decay, updates, params, weight_decay_mask(updates)), state

    return optax.GradientTransformation(init, update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (`optax.adamw`'s steps and defaults), its weight
    decay on the matmul kernels only (`weight_decay_mask`; no weight decay on a tiny RL
    run by default)."""
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.chain(
            optax.scale_by_adam(),
            _decay_matmul_kernels(config.weight_decay),
            optax.scale_by_learning_rate(config.learning_rate),
        ),
    )


@dataclasses.dataclass(frozen=True)
class LeaveReport:
    """How long a released satellite waited for the step boundary before it was free."""

    cell: int
    wait_s: float  # from `release` to the end of the step's reduction


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one training step did."""

    step: int  # steps completed after this one
    version: int  # policy version after this step
    skipped: bool  # non-finite loss or gradients: weights unchanged
    skip_reason: str
    metrics: dict[str, float]
    cells: tuple[int, ...]  # cells whose gradients were reduced, core first
    micro_steps_per_cell: dict[int, int]
    joins: tuple[JoinReport, ...]
    released: tuple[LeaveReport, ...]  # satellites that left at this step's boundary
    reduction_s: float
    update_s: float
    step_s: float


def _cast_like(tree, abstract):
    """`tree` with each leaf cast to the dtype of its counterpart in `abstract`."""
    return jax.tree.map(lambda x, a: x.astype(a.dtype), tree, abstract)


class ElasticTrainer:
    """Trains a model on the core cell with satellites as extra data-parallel replicas.

    Args:
      model: the policy; its weights are copied onto the core cell (by the train rules).
      core: cell 0, which keeps the authoritative weights (float32 masters beside a
        lower-precision model, `train.master_dtype`) and the optimizer state.
      rl: loss configuration.
      train: optimizer, row shape and sharding rules.
      transport: how the cells share a step (default: every cell in this process). In a
        process that does not hold the core (a follower of a multi-process job) nothing
        is placed on the core and there is no optimizer state; it compiles and runs its
        own satellites, with the KL reference (if any) kept on the host.
      keep_last_grads: keep the reduced gradient sum of the last step (`last_grads`; for
        tests and debugging: it holds a gradient-sized buffer between steps).
    """

    def __init__(
        self,
        model: Transformer,
        core: Cell,
        *,
        rl: RLConfig,
        train: TrainConfig,
        transport: Transport | None = None,
        keep_last_grads: bool = False,
    ):
        self.core = core
        self.transport = transport or InProcessTransport()
        # Parameters as a pure nested dict of arrays (nnx.merge accepts it directly).
        self.graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        self.rules = train.sharding_rules
        self.layout = ParamLayout(
            sharding.partition_specs(state, core.mesh, self.rules),
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
        )
        self.transport.bind(self.layout, core)
        self.owns_core = self.transport.holds(core)
        self.params = None
        self.master = None  # float32 master weights (train.master_dtype), on the core
        self._warned_dropped = False  # the one warning per run of dropped tokens
        if self.owns_core:
            self.params = jax.device_put(params, self.param_shardings(core))
        self.keep_last_grads = keep_last_grads
        self.last_grads = None
        self._compiles = 0
        self._compiled: dict[tuple, Callable] = {}  # micro-steps, by cell, objective, shape
        self._zeros: dict[int, Callable] = {}  # gradient accumulators, by cell
        self._compile_lock = threading.Lock()
        self._reducers: dict[tuple[int, ...], CrossCellReducer] = {}
        self._run: _StepRun | None = None
        self._pending_release: dict[int, float] = {}  # cell -> time release was asked
        self._state_lock = threading.Lock()
        self._start_phase(rl, train, initial=params)

    # --- phases -------------------------------------------------------------------------

    def begin_phase(
        self, *, rl: RLConfig, train: TrainConfig, transport: Transport | None = None
    ) -> None:
        """Starts a new training phase on the current weights (RL after the warm start),
        as a new trainer built from `model()` would: a fresh optimizer, step and version
        0, the current weights as the KL reference, the core alone in TRAINING. The
        weights stay where they are, and compiled functions that still fit are kept (a
        micro-step of the same objective and shape, the reductions, accumulators).

        Args:
          rl, train: the phase's configuration.
          transport: a new transport (e.g. the warm start ran on one process's cells,
            RL runs across processes); default: keep this one.

        Raises:
          ValueError: `train.sharding_rules` differ (the layout is the trainer's), a
            step is running, or this process does not hold the core.
        """
        if train.sharding_rules != self.rules:
            raise ValueError("a new phase keeps the parameter layout: train.sharding_rules differ")
        if self._run is not None or not self.owns_core:
            raise ValueError("a new phase begins where the core is, between steps")
        if transport is not None:
            transport.bind(self.layout, self.core)
            self.transport = transport
        keep = {(rl, *_head_options(train), *shape) for shape in micro_step_shapes(train)}
        self._compiled = {k: v for k, v in self._compiled.items() if k[1:] in keep}
        self._start_phase(rl, train)

    def _start_phase(self, rl: RLConfig, train: TrainConfig, initial=None) -> None:
        """Optimizer, counters and KL reference of a phase (`initial`: the host's
        initial weights, where this process does not hold the core)."""
        self.rl = rl
        self.train_config = train
        self.optimizer = make_optimizer(train)
        self._update = None
        self.version = 0
        self.step = 0
        self.training: list[Cell] = [self.core]
        self._pending_release.clear()
        self.reference = None
        self.opt_state = None
        self.master = None if not self.owns_core else self._masters(train)
        if not self.owns_core:
            if rl.kl_coef > 0:  # the initial weights, identical in every process
                self.reference = jax.tree.map(np.asarray, initial)
            return
        # Moments shard like their parameters; counters are replicated on the core.
        abstract_opt = jax.eval_shape(self.optimizer.init, self.layout.abstract)
        replicated = NamedSharding(self.core.mesh, jax.sharding.PartitionSpec())
        self._opt_shardings = optax.tree_utils.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_opt,
            self.param_shardings(self.core),
            transform_non_params=lambda _: replicated,
        )
        # With masters the moments take their dtype (float32): optax's moments follow
        # the parameters they are initialised from.
        self.opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_shardings)(
            self.updated_weights
        )
        if rl.kl_coef > 0:  # KL anchor: the phase's initial weights, frozen.
            self.reference = jax.tree.map(jnp.copy, self.params)

    def _masters(self, train: TrainConfig):
        """The phase's float32 master weights: None unless `train.master_dtype` is
        "float32" and the model's dtype is lower; a previous phase's masters are kept
        (they are the weights; `params` are only their cast)."""
        abstract = jax.tree.leaves(self.layout.abstract)
        if train.master_dtype != "float32" or all(a.dtype == jnp.float32 for a in abstract):
            return None
        if self.master is not None:
            return self.master
        to_float32 = lambda params: jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return jax.jit(to_float32, out_shardings=self.param_shardings(self.core))(self.params)

    def _cast_down(self, master):
        """The model's weights from the masters: each cast to its parameter's dtype,
        laid out like the parameters (the weights micro-steps and engines get)."""
        down = lambda master: _cast_like(master, self.layout.abstract)
        return jax.jit(down, out_shardings=self.param_shardings(self.core))(master)

    @property
    def updated_weights(self):
        """The weights the optimizer updates and checkpoints hold: the float32 masters
        when the trainer keeps them, else `params` (None off the core)."""
        return self.master if self.master is not None else self.params

    # --- layout -------------------------------------------------------------------------

    def param_shardings(self, cell: Cell):
        """NamedSharding of every parameter on `cell`'s mesh (same layout on every cell)."""
        return self.layout.shardings(cell)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The micro-step shapes this phase compiles on every cell (`micro_step_shapes`)."""
        return micro_step_shapes(self.train_config)

    def _row_sharding(self, cell: Cell, shape: tuple[int, int] | None = None) -> NamedSharding:
        """Rows of one micro-step of `shape` (default: the base [R, L]) on `cell`."""
        if shape is None:
            shape = (self.train_config.rows_per_micro_step, self.train_config.row_length)
        mesh_shape = dict(cell.mesh.shape)
        spec = sharding.logical_to_spec(("batch", "length"), self.rules, shape, mesh_shape)
        return NamedSharding(cell.mesh, spec)

    def model(self) -> Transformer:
        """The current core weights as a model (shares the arrays): in the model's dtype,
        the masters cast down when the trainer keeps them."""
        return nnx.merge(self.graphdef, self.params)

    @property
    def compile_count(self) -> int:
        """Functions compiled so far (micro-steps, accumulators, reductions, updates,
        and the transport's weight pulls)."""
        return self._compiles + self.transport.compile_count

    # --- compiled functions, once per cell --------------------------------------------

    def _compiled_for(
        self, cell: Cell, shape: tuple[int, int] | None = None
    ) -> tuple[Callable, Callable, float]:
        """The cell's compiled micro-step for rows of `shape` (default: the base [R, L])
        and gradient-accumulator initialiser, and the seconds spent compiling them (0 if
        cached)."""
        train, rl = self.train_config, self.rl
        if shape is None:
            shape = (train.rows_per_micro_step, train.row_length)
        key = (cell.index, rl, *_head_options(train), *shape)
        with self._compile_lock:
            if key in self._compiled:
                return self._compiled[key], self._zeros[cell.index], 0.0
            start = time.perf_counter()
            graphdef = self.graphdef
            params = self.layout.on(cell)
            acc = self.layout.on(cell, jnp.float32)
            shardings = self.param_shardings(cell)
            head = dict(zip(("remat", "chunk_tokens"), _head_options(train), strict=True))

            def micro_step(params, reference, acc, rows, version):
                self._compiles += 1  # runs at trace time only

                def loss_fn(params):
                    model = nnx.merge(graphdef, params)
                    ref = None
                    if reference is not None:
                        ref_model = nnx.merge(graphdef, reference)
                        ref = jax.lax.stop_gradient(token_logprobs(ref_model, rows, **head)[0])
                    return micro_step_loss(model, rows, rl, version, ref, **head)

                (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
                leaves = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
                finite = jnp.isfinite(loss) & jnp.all(jnp.stack(leaves))
                return jax.tree.map(jnp.add, acc, grads), metrics, finite

            row_sharding = self._row_sharding(cell, shape)
            rows = {
                f: jax.ShapeDtypeStruct(shape, ROW_FIELDS[f], sharding=row_sharding)
                for f in MICRO_STEP_FIELDS
            }
            version = jax.ShapeDtypeStruct((), jnp.int32)
            reference = params if self.reference is not None else None
            with jax.set_mesh(cell.mesh), sharding.axis_rules(self.rules):
                # Pin the accumulator's layout: it is fed back in on the next micro-step.
                replicated = NamedSharding(cell.mesh, jax.sharding.PartitionSpec())
                out_shardings = (shardings, replicated, replicated)
                jitted = jax.jit(micro_step, donate_argnums=(2,), out_shardings=out_shardings)
                compiled = jitted.lower(params, reference, acc, rows, version).compile()
            if cell.index not in self._zeros:
                zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), acc)
                jitted = jax.jit(zeros, out_shardings=shardings)
                self._zeros[cell.index] = jitted.lower().compile()
            self._compiled[key] = compiled
            return compiled, self._zeros[cell.index], time.perf_counter() - start

    def compiled_micro_step(self, cell: Cell, shape: tuple[int, int] | None = None):
        """The cell's compiled micro-step for rows of `shape` (default: the base [R, L]),
        compiling it if needed: a `jax.stages.Compiled`, whose `memory_analysis()` is
        XLA's own account of the step's memory (tests/test_memory.py holds memory.py to
        it)."""
        return self._compiled_for(cell, shape)[0]

    def precompile(self, cell: Cell) -> float:
        """Compiles `cell`'s micro-step of every shape (`shapes`) ahead of its first
        join; returns seconds spent (0 for a cell another process holds: that process
        compiles it)."""
        if not self.transport.holds(cell):
            return 0.0
        return sum(self._compiled_for(cell, shape)[2] for shape in self.shapes)

    def _reducer_for(self, cells: tuple[Cell, ...]) -> CrossCellReducer:
        key = tuple(c.index for c in cells)
        if key not in self._reducers:
            self._compiles += 1
            acc = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), self.layout.abstract
            )
            self._reducers[key] = CrossCellReducer(cells, self.layout.specs, acc)
        return self._reducers[key]

    def _apply_update(self, grads) -> float:
        """The optimizer step on `updated_weights`. With float32 masters the float32
        gradient sum (never rounded to the model's dtype) updates the masters and their
        float32 moments, and the same program casts the new masters down to `params`."""
        masters = self.master is not None
        if self._update is None:
            self._compiles += 1
            optimizer, abstract = self.optimizer, self.layout.abstract

            def update(weights, opt_state, grads):
                grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, weights)
                updates, opt_state = optimizer.update(grads, opt_state, weights)
                weights = optax.apply_updates(weights, updates)
                params = _cast_like(weights, abstract) if masters else None
                return weights, params, opt_state, optax.tree.norm(grads)

            shardings = self.param_shardings(self.core)
            replicated = NamedSharding(self.core.mesh, jax.sharding.PartitionSpec())
            cast_shardings = shardings if masters else None
            out_shardings = (shardings, cast_shardings, self._opt_shardings, replicated)
            self._update = jax.jit(update, donate_argnums=(0, 1), out_shardings=out_shardings)
        weights, params, self.opt_state, grad_norm = self._update(
            self.updated_weights, self.opt_state, grads
        )
        if masters:
            self.master, self.params = weights, params
        else:
            self.params = weights
        return float(grad_norm)

    # --- checkpoints ---------------------------------------------------------------------

    def save(self, checkpointer: TrainCheckpointer, metadata: dict | None = None) -> None:
        """Checkpoints the core's weights (`updated_weights`: the float32 masters when
        kept) and optimizer state at the current step."""
        meta = {"step": self.step, "version": self.version, **(metadata or {})}
        checkpointer.save(self.step, self.updated_weights, self.opt_state, meta)

    def restore(self, checkpointer: TrainCheckpointer, step: int | None = None) -> dict:
        """Restores the latest (or `step`) checkpoint onto this trainer's core layout,
        whatever layout it was saved from; returns its metadata.

        Orbax casts each array to its target's dtype, so a checkpoint saved without
        masters (weights and moments in the model's dtype) resumes with masters (and
        float32 moments) that equal its weights exactly, and one with masters resumes
        under `train.master_dtype = "same"` rounded to the model's dtype.
        """
        weights, opt_state, meta = checkpointer.restore(
            abstract_like(self.updated_weights, self.param_shardings(self.core)),
            abstract_like(self.opt_state, self._opt_shardings),
            step,
        )
        if self.master is not None:
            self.master, self.params = weights, self._cast_down(weights)
        else:
            self.params = weights
        self.opt_state = opt_state
        self.step, self.version = int(meta["step"]), int(meta["version"])
        return meta

    # --- cells joining and leaving ----------------------------------------------------

    def join(self, cell: Cell) -> None:
        """Adds a satellite: to the running step if it can join it, else to the next step."""
        self._require_driver("join")
        with self._state_lock:
            if any(c.index == cell.index for c in self.training):
                raise ValueError(f"cell {cell.index} is already training")
            self._pending_release.pop(cell.index, None)
            self.training.append(cell)
            run = self._run
            if run is not None and self.transport.join_running(run.exchange, cell):
                run.start_worker(cell, joined_mid_step=True)

    def release(self, cell: Cell) -> None:
        """Removes a satellite at the next step boundary (now, if no step is running)."""
        self._require_driver("release")
        if cell.index == self.core.index:
            raise ValueError("the core cell holds the optimizer state and cannot be released")
        with self._state_lock:
            if not any(c.index == cell.index for c in self.training):
                raise ValueError(f"cell {cell.index} is not training")
            if self._run is None:
                self.training = [c for c in self.training if c.index != cell.index]
            else:
                self._pending_release[cell.index] = time.perf_counter()

    def stop(self) -> None:
        """Tells any process that follows this one's steps that none follows (a no-op
        in one process); once, however many cleanups call it."""
        self.transport.stop()

    def _require_driver(self, what: str) -> None:
        if not self.transport.is_driver:
            raise RuntimeError(f"{what} is the driving process's call; this one follows")

    # --- the step -----------------------------------------------------------------------

    def train_step(
        self,
        batch: PackedBatch,
        on_micro_step: Callable[[int, Cell], None] | None = None,
    ) -> StepReport:
        """Runs one step over every micro-step of `batch` with the cells in TRAINING.

        Args:
          batch: packed with R = train.rows_per_micro_step and L = train.row_length
            (rows of [M * R, L]), or with row buckets of `train.all_row_lengths`: every
            micro-step's shape is one of `shapes`.
          on_micro_step: called after each of this process's micro-steps as (index,
            cell), from the worker thread; it may call `join` (tests and the scheduler
            use this).
        """
        self._require_driver("train_step")
        self._check_batch(batch)
        start = time.perf_counter()

        # 1-2. Open the step; every training cell held here claims micro-steps.
        with self._state_lock:
            cells = tuple(self.training)
            r = batch.rows_per_micro_step
            plan = StepPlan(self.step + 1, self.version, cells, batch.num_micro_steps, r)
            run = _StepRun(self, self.transport.open(plan, batch, self.params), on_micro_step)
            self._run = run
            for cell in cells:
                if self.transport.holds(cell):
                    run.start_worker(cell, joined_mid_step=False)
        try:
            results = run.wait()
        finally:
            with self._state_lock:  # the boundary: no more joins; released cells leave
                self._run = None
                self.transport.close(run.exchange)
                leaving = dict(self._pending_release)
                self.training = [c for c in self.training if c.index not in leaving]
                self._pending_release.clear()
        results = self.transport.collect(run.exchange, results)

        # 3. Reduce onto the core. The core always takes part (zeros if the satellites
        # claimed every micro-step), so the sum lands next to the weights it updates.
        took_part = self._took_part(results)
        self.transport.announce(run.exchange, took_part)
        reducer = self._reducer_for(tuple(took_part)) if len(took_part) > 1 else None
        reduce_start = time.perf_counter()  # a new set of cells compiles above, untimed
        grads = self._reduce(took_part, results, reducer)
        grads = jax.block_until_ready(grads)
        reduction_s = time.perf_counter() - reduce_start
        if self.keep_last_grads:
            self.last_grads = grads

        # 4. Skip a non-finite step, or update.
        metrics = finish_metrics(_combine_metrics([results[c.index].metrics for c in took_part]))
        if metrics.get("dropped_tokens") and not self._warned_dropped:
            self._warned_dropped = True
            logging.warning(
                "step %d: %d trained tokens dropped (counted in dropped_tokens; warned once "
                "per run): the trainer could not reproduce the distribution they were "
                "sampled from (outside its top-k/top-p cut, a temperature near 0, or a "
                "non-finite log-prob)",
                self.step + 1,
                metrics["dropped_tokens"],
            )
        bad = [r.first_bad_micro_step for r in results.values()]
        bad = [m for m in bad if m is not None]
        self.step += 1
        update_start = time.perf_counter()
        skip_reason = ""
        if bad:
            skip_reason = f"non-finite loss or gradients in micro-step {min(bad)}"
            logging.warning(
                "step %d: %s; update skipped, weights unchanged", self.step, skip_reason
            )
        else:
            metrics["grad_norm"] = self._apply_update(grads)
            self.version += 1
        jax.block_until_ready(self.params)
        update_s = time.perf_counter() - update_start

        # 5. Report.
        released = tuple(
            LeaveReport(index, reduce_start + reduction_s - asked)
            for index, asked in sorted(leaving.items())
        )
        return StepReport(
            step=self.step,
            version=self.version,
            skipped=bool(bad),
            skip_reason=skip_reason,
            metrics=metrics,
            cells=tuple(c.index for c in took_part),
            micro_steps_per_cell={c.index: results[c.index].micro_steps for c in took_part},
            joins=tuple(r.join for r in results.values() if r.join is not None),
            released=released,
            reduction_s=reduction_s,
            update_s=update_s,
            step_s=time.perf_counter() - start,
        )

    def follow(self) -> dict | None:
        """A process that does not drive: takes part in the driver's next step (or a
        running step one of its satellites was told to join) with its own cells.

        Returns:
          None when the driver stopped; else what this process did in the step:
          {"step", "cells" (that took part), "micro_steps_per_cell" (this process's),
          "weight_pull" (how its satellites got the weights; None without a cell in
          the step), "joined_mid_step"}.
        """
        exchange = self.transport.next()
        if exchange is None:
            return None
        plan = exchange.plan
        self.step, self.version = plan.step - 1, plan.version
        mine = [c for c in plan.cells if self.transport.holds(c)]
        done = {"step": plan.step, "cells": [], "micro_steps_per_cell": {}, "weight_pull": None}
        done["joined_mid_step"] = exchange.joined_mid_step
        if mine:
            run = _StepRun(self, exchange, None)
            for cell in mine:
                run.start_worker(cell, joined_mid_step=exchange.joined_mid_step)
            results = run.wait()
            self.transport.report(exchange, results)
            took_part = self.transport.took_part(exchange)
            if any(self.transport.holds(c) for c in took_part) and len(took_part) > 1:
                self._reduce(took_part, results, self._reducer_for(tuple(took_part)))
            done["cells"] = [c.index for c in took_part]
            done["micro_steps_per_cell"] = {c.index: results[c.index].micro_steps for c in mine}
            done["weight_pull"] = exchange.weight_pull
        self.step = plan.step
        return done

    def _took_part(self, results: dict[int, CellResult]) -> list[Cell]:
        """The cells whose gradients are reduced: the core, then every cell that ran a
        micro-step, in cell order."""
        core = self.core.index
        took_part = [r.cell for r in results.values() if r.cell.index == core or r.micro_steps]
        return sorted(took_part, key=lambda c: (c.index != core, c.index))

    def _reduce(self, took_part: list[Cell], results: dict[int, CellResult], reducer):
        """The gradient sum of `took_part` on the core (None in a process without it).
        Across processes every process holding one of the cells calls the reducer."""
        if reducer is None:
            return results[took_part[0].index].grads
        held = [results[c.index].grads if self.transport.holds(c) else None for c in took_part]
        return reducer(held)

    def _check_batch(self, batch: PackedBatch) -> None:
        train = self.train_config
        r, length = train.rows_per_micro_step, train.row_length
        if batch.rows_per_micro_step != r:
            raise ValueError(
                f"packed batch has rows_per_micro_step={batch.rows_per_micro_step}, "
                f"the trainer expects train.rows_per_micro_step={r}"
            )
        unknown = sorted(set(batch.shapes) - set(self.shapes))
        if unknown:
            raise ValueError(
                f"packed batch micro-steps of shapes {unknown} do not fit micro-steps of "
                f"[train.rows_per_micro_step={r}, train.row_length={length}] "
                f"(train.row_lengths={train.row_lengths}): expected shapes {list(self.shapes)}"
            )

    # --- worker -------------------------------------------------------------------------

    def _work(self, cell: Cell, run: _StepRun, result: CellResult, joined_mid_step: bool):
        """One cell's part of a step: pull the weights, claim micro-steps until none is
        left, accumulate their gradients."""
        params, pull_s = run.exchange.weights(cell)  # the step's frozen weights
        reference = None
        if self.reference is not None:
            start = time.perf_counter()
            reference = jax.device_put(self.reference, self.param_shardings(cell))
            pull_s += time.perf_counter() - start
        # Every shape, before claiming (none if precompiled): a claim is never held up.
        compiled = {shape: self._compiled_for(cell, shape) for shape in self.shapes}
        zeros = compiled[self.shapes[0]][1]
        compile_s = sum(c[2] for c in compiled.values())
        shardings = {shape: self._row_sharding(cell, shape) for shape in compiled}
        acc = None
        version = np.int32(run.exchange.plan.version)
        first_s = None
        while (m := run.exchange.claim()) is not None:
            claimed = time.perf_counter()
            if acc is None:
                acc = zeros()
            rows = run.exchange.rows(m)
            shape = rows["tokens"].shape
            rows = jax.device_put(rows, shardings[shape])
            acc, metrics, finite = compiled[shape][0](params, reference, acc, rows, version)
            metrics, finite = jax.device_get((metrics, finite))
            if first_s is None:
                first_s = time.perf_counter() - claimed
            if not finite and result.first_bad_micro_step is None:
                result.first_bad_micro_step = m
            _accumulate(result.metrics, metrics)
            result.micro_steps += 1
            if run.on_micro_step is not None:
                run.on_micro_step(m, cell)
        if acc is None and cell.index == self.core.index:
            acc = zeros()  # the core's sum is the reduction's destination even when empty
        result.grads = acc
        satellite = cell.index != self.core.index
        if joined_mid_step or (satellite and self.transport.reports_every_pull):
            result.join = JoinReport(cell.index, pull_s, compile_s, first_s)


def _accumulate(total: dict[str, float], metrics: dict) -> None:
    for name, value in metrics.items():
        value = float(value)
        if name in MAX_METRICS:
            total[name] = max(total.get(name, value), value)
        else:
            total[name] = total.get(name, 0.0) + value


def _combine_metrics(per_cell: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for metrics in per_cell:
        _accumulate(total, metrics)
    return total


class _StepRun:
    """This process's workers of one step, and what each of them did."""

    def __init__(self, trainer: ElasticTrainer, exchange: StepExchange, on_micro_step):
        self.trainer = trainer
        self.exchange = exchange
        self.on_micro_step = on_micro_step
        self._threads: dict[int, threading.Thread] = {}
        self._results: dict[int, CellResult] = {}
        self._lock = threading.Lock()

    def start_worker(self, cell: Cell, joined_mid_step: bool) -> None:
        with self._lock:
            result = CellResult(cell)
            self._results[cell.index] = result

            def target():
                try:
                    self.trainer._work(cell, self, result, joined_mid_step)
                except BaseException as e:  # surfaced by `wait`, never swallowed
                    result.error = e

            thread = threading.Thread(target=target, name=f"train-cell-{cell.index}")
            self._threads[cell.index] = thread
            thread.start()

    def wait(self) -> dict[int, CellResult]:
        """Blocks until every worker, including ones that join meanwhile, is done.

        Raises:
          RuntimeError: a worker failed (its error is the cause).
        """
        while True:
            with self._lock:
                pending = [t for t in self._threads.values() if t.is_alive()]
            if not pending:
                break
            for thread in pending:
                thread.join()
        for result in self._results.values():
            if result.error is not None:
                raise RuntimeError("a training cell failed") from result.error
        return dict(self._results)
