"""The elastic trainer: a core cell plus satellites that join and leave between steps.

One training step consumes one packed batch (`gyrejax.trajectory.PackedBatch`). Its
micro-steps form a shared queue; every cell in TRAINING runs a worker thread that claims
micro-steps greedily and accumulates gradients against the step's frozen weights. A
satellite may join while a step runs (`join`): it pulls the weights from the core cell
device-to-device and starts claiming. At the end of the step the per-cell gradient sums
are reduced onto the core (`CrossCellReducer`, cached per set of cells), the optimizer
(the only optimizer state lives on the core) updates the weights, and the version goes
up by one. Because the batch weights are normalised over the whole batch, the result
does not depend on which cells took part or when they joined (up to float summation
order). Satellites released with `release` leave at the next step boundary.

Every function that runs on a cell is compiled ahead of time once per cell and kept, so
a satellite that leaves and rejoins never recompiles (`compile_count` proves it).
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
from gyrejax.rl.objective import MAX_METRICS, MICRO_STEP_FIELDS, micro_step_loss, token_logprobs
from gyrejax.train.checkpoint import TrainCheckpointer, abstract_like
from gyrejax.train.reduction import CrossCellReducer
from gyrejax.trajectory import PackedBatch


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (no weight decay on a tiny RL run by default)."""
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
    )


@dataclasses.dataclass(frozen=True)
class JoinReport:
    """How long a satellite took to become useful after joining a running step."""

    cell: int
    weight_pull_s: float  # snapshot copied from the core, device to device
    compile_s: float  # 0 when the cell's step was already compiled
    first_micro_step_s: float | None  # claim to gradients ready; None if it got none


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


class _MicroStepQueue:
    """Greedy, thread-safe claiming of micro-step indices."""

    def __init__(self, num: int):
        self._next = 0
        self._num = num
        self._lock = threading.Lock()

    def claim(self) -> int | None:
        with self._lock:
            if self._next >= self._num:
                return None
            self._next += 1
            return self._next - 1


@dataclasses.dataclass
class _CellResult:
    grads: object = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    micro_steps: int = 0
    first_bad_micro_step: int | None = None
    join: JoinReport | None = None
    error: BaseException | None = None


class ElasticTrainer:
    """Trains a model on the core cell with satellites as extra data-parallel replicas.

    Args:
      model: the policy; its weights are copied onto the core cell.
      core: cell 0, which keeps the authoritative weights and the optimizer state.
      rl: loss configuration.
      train: optimizer, row shape and sharding rules.
      owns_core: False in a process that does not hold the core cell (multi-process
        training, `gyrejax.distributed`): nothing is placed on the core and there is no
        optimizer state; the process only compiles and runs its own satellites, with
        the KL reference (if any) kept on the host.
    """

    def __init__(
        self,
        model: Transformer,
        core: Cell,
        *,
        rl: RLConfig,
        train: TrainConfig,
        owns_core: bool = True,
    ):
        self.rl = rl
        self.train_config = train
        self.rules = train.sharding_rules
        self.core = core
        # Parameters as a pure nested dict of arrays (nnx.merge accepts it directly).
        self.graphdef, state = nnx.split(model)
        self._specs = sharding.partition_specs(state, core.mesh, self.rules)
        params = nnx.to_pure_dict(state)
        self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.optimizer = make_optimizer(train)
        self.reference = None
        self.version = 0
        self.step = 0
        self.compile_count = 0
        self.training: list[Cell] = [core]
        self._compiled: dict[int, tuple[Callable, Callable]] = {}
        self._compile_lock = threading.Lock()
        self._reducers: dict[tuple[int, ...], CrossCellReducer] = {}
        self._update = None
        self._run: _StepRun | None = None
        self._pending_release: dict[int, float] = {}  # cell -> time release was asked
        self._state_lock = threading.Lock()
        if not owns_core:
            self.params = self.opt_state = None
            if rl.kl_coef > 0:  # the initial weights, identical in every process
                self.reference = jax.tree.map(np.asarray, params)
            return
        self.params = jax.device_put(params, self.param_shardings(core))
        # Moments shard like their parameters; counters are replicated on the core.
        abstract_opt = jax.eval_shape(self.optimizer.init, self._abstract)
        replicated = NamedSharding(core.mesh, jax.sharding.PartitionSpec())
        self._opt_shardings = optax.tree_utils.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_opt,
            self.param_shardings(core),
            transform_non_params=lambda _: replicated,
        )
        self.opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_shardings)(
            self.params
        )
        if rl.kl_coef > 0:  # KL anchor: the initial weights, frozen.
            self.reference = jax.tree.map(jnp.copy, self.params)

    # --- layout -----------------------------------------------------------------------

    def param_shardings(self, cell: Cell):
        """NamedSharding of every parameter on `cell`'s mesh (same layout on every cell)."""
        return sharding.named_shardings(self._specs, cell.mesh)

    def _row_sharding(self, cell: Cell) -> NamedSharding:
        shape = (self.train_config.rows_per_micro_step, self.train_config.row_length)
        mesh_shape = dict(cell.mesh.shape)
        spec = sharding.logical_to_spec(("batch", "length"), self.rules, shape, mesh_shape)
        return NamedSharding(cell.mesh, spec)

    def model(self) -> Transformer:
        """The current core weights as a model (shares the arrays)."""
        return nnx.merge(self.graphdef, self.params)

    # --- compiled functions, once per cell --------------------------------------------

    def _micro_step_fn(self, params, reference, acc, rows, version):
        self.compile_count += 1  # runs at trace time only

        def loss_fn(params):
            model = nnx.merge(self.graphdef, params)
            ref = None
            if reference is not None:
                ref_model = nnx.merge(self.graphdef, reference)
                ref = jax.lax.stop_gradient(token_logprobs(ref_model, rows)[0])
            return micro_step_loss(model, rows, self.rl, version, ref)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        finite = jnp.isfinite(loss) & jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
        )
        return jax.tree.map(jnp.add, acc, grads), metrics, finite

    def _compiled_for(self, cell: Cell) -> tuple[Callable, Callable, float]:
        """The cell's compiled micro-step and gradient-accumulator initialiser, and the
        seconds spent compiling them (0 if cached)."""
        with self._compile_lock:
            if cell.index in self._compiled:
                return (*self._compiled[cell.index], 0.0)
            start = time.perf_counter()
            shardings = self.param_shardings(cell)
            params = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                self._abstract,
                shardings,
            )
            acc = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=s),
                self._abstract,
                shardings,
            )
            row_sharding = self._row_sharding(cell)
            shape = (self.train_config.rows_per_micro_step, self.train_config.row_length)
            rows = {
                f: jax.ShapeDtypeStruct(shape, _FIELD_DTYPES[f], sharding=row_sharding)
                for f in MICRO_STEP_FIELDS
            }
            version = jax.ShapeDtypeStruct((), jnp.int32)
            reference = params if self.reference is not None else None
            with jax.set_mesh(cell.mesh), sharding.axis_rules(self.rules):
                # Pin the accumulator's layout: it is fed back in on the next micro-step.
                replicated = NamedSharding(cell.mesh, jax.sharding.PartitionSpec())
                micro_step = (
                    jax.jit(
                        self._micro_step_fn,
                        donate_argnums=(2,),
                        out_shardings=(shardings, replicated, replicated),
                    )
                    .lower(params, reference, acc, rows, version)
                    .compile()
                )
            zeros = (
                jax.jit(
                    lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), acc),
                    out_shardings=shardings,
                )
                .lower()
                .compile()
            )
            self._compiled[cell.index] = (micro_step, zeros)
            return micro_step, zeros, time.perf_counter() - start

    def precompile(self, cell: Cell) -> float:
        """Compiles `cell`'s micro-step ahead of its first join; returns seconds spent."""
        return self._compiled_for(cell)[2]

    def _reducer_for(self, cells: tuple[Cell, ...]) -> CrossCellReducer:
        key = tuple(c.index for c in cells)
        if key not in self._reducers:
            self.compile_count += 1
            acc = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), self._abstract)
            self._reducers[key] = CrossCellReducer(cells, self._specs, acc)
        return self._reducers[key]

    def _apply_update(self, grads):
        if self._update is None:
            self.compile_count += 1

            def update(params, opt_state, grads):
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

            replicated = NamedSharding(self.core.mesh, jax.sharding.PartitionSpec())
            self._update = jax.jit(
                update,
                donate_argnums=(0, 1),
                out_shardings=(self.param_shardings(self.core), self._opt_shardings, replicated),
            )
        self.params, self.opt_state, grad_norm = self._update(self.params, self.opt_state, grads)
        return float(grad_norm)

    # --- checkpoints ---------------------------------------------------------------------

    def save(self, checkpointer: TrainCheckpointer, metadata: dict | None = None) -> None:
        """Checkpoints the core's weights and optimizer state at the current step."""
        meta = {"step": self.step, "version": self.version, **(metadata or {})}
        checkpointer.save(self.step, self.params, self.opt_state, meta)

    def restore(self, checkpointer: TrainCheckpointer, step: int | None = None) -> dict:
        """Restores the latest (or `step`) checkpoint onto this trainer's core layout,
        whatever layout it was saved from; returns its metadata."""
        params, opt_state, meta = checkpointer.restore(
            abstract_like(self.params, self.param_shardings(self.core)),
            abstract_like(self.opt_state, self._opt_shardings),
            step,
        )
        self.params, self.opt_state = params, opt_state
        self.step, self.version = int(meta["step"]), int(meta["version"])
        return meta

    # --- cells joining and leaving ----------------------------------------------------

    def join(self, cell: Cell) -> None:
        """Adds a satellite: to the running step if there is one, else to the next step."""
        with self._state_lock:
            if any(c.index == cell.index for c in self.training):
                raise ValueError(f"cell {cell.index} is already training")
            self._pending_release.pop(cell.index, None)
            self.training.append(cell)
            if self._run is not None:
                self._run.start_worker(cell, joined_mid_step=True)

    def release(self, cell: Cell) -> None:
        """Removes a satellite at the next step boundary (now, if no step is running)."""
        if cell.index == self.core.index:
            raise ValueError("the core cell holds the optimizer state and cannot be released")
        with self._state_lock:
            if not any(c.index == cell.index for c in self.training):
                raise ValueError(f"cell {cell.index} is not training")
            if self._run is None:
                self.training = [c for c in self.training if c.index != cell.index]
            else:
                self._pending_release[cell.index] = time.perf_counter()

    # --- the step -----------------------------------------------------------------------

    def train_step(
        self,
        batch: PackedBatch,
        on_micro_step: Callable[[int, Cell], None] | None = None,
    ) -> StepReport:
        """Runs one step over every micro-step of `batch` with the cells in TRAINING.

        Args:
          batch: rows of shape [M * R, L] with R = train.rows_per_micro_step and
            L = train.row_length.
          on_micro_step: called after each micro-step as (index, cell), from the worker
            thread; it may call `join` (tests and the scheduler use this).
        """
        self._check_batch(batch)
        start = time.perf_counter()
        run = _StepRun(self, batch, on_micro_step)
        with self._state_lock:
            self._run = run
            for cell in self.training:
                run.start_worker(cell, joined_mid_step=False)
        results = run.wait()
        with self._state_lock:
            self._run = None
            leaving = dict(self._pending_release)
            self.training = [c for c in self.training if c.index not in leaving]
            self._pending_release.clear()
        for result in results.values():
            if result.error is not None:
                raise RuntimeError("a training cell failed") from result.error

        # The core always takes part (zeros if the satellites claimed every micro-step),
        # so the reduced gradients land on the core, next to the weights they update.
        core = self.core.index
        took_part = [
            c for c in run.cells_in_order() if c.index == core or results[c.index].micro_steps
        ]
        # A set of cells seen for the first time compiles its reduction (not timed below).
        reducer = self._reducer_for(tuple(took_part)) if len(took_part) > 1 else None
        reduce_start = time.perf_counter()
        if reducer is None:
            grads = results[took_part[0].index].grads
        else:
            grads = reducer([results[c.index].grads for c in took_part])
        grads = jax.block_until_ready(grads)
        reduction_s = time.perf_counter() - reduce_start

        metrics = _combine_metrics([results[c.index].metrics for c in took_part])
        bad = [
            r.first_bad_micro_step for r in results.values() if r.first_bad_micro_step is not None
        ]
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

    def _check_batch(self, batch: PackedBatch) -> None:
        r, length = self.train_config.rows_per_micro_step, self.train_config.row_length
        if batch.tokens.shape[1] != length or batch.tokens.shape[0] % r:
            raise ValueError(
                f"packed batch rows {batch.tokens.shape} do not fit micro-steps of "
                f"[train.rows_per_micro_step={r}, train.row_length={length}]"
            )
        if batch.rows_per_micro_step != r:
            raise ValueError(
                f"packed batch has rows_per_micro_step={batch.rows_per_micro_step}, "
                f"the trainer expects train.rows_per_micro_step={r}"
            )

    # --- worker -------------------------------------------------------------------------

    def _work(self, cell: Cell, run: _StepRun, result: _CellResult, joined_mid_step: bool):
        start = time.perf_counter()
        if cell.index == self.core.index:
            params = self.params
        else:  # pull the step's frozen weights from the core, device to device
            params = jax.block_until_ready(jax.device_put(self.params, self.param_shardings(cell)))
        reference = None
        if self.reference is not None:
            reference = jax.device_put(self.reference, self.param_shardings(cell))
        pull_s = time.perf_counter() - start
        micro_step, zeros, compile_s = self._compiled_for(cell)
        row_sharding = self._row_sharding(cell)
        acc = None
        version = np.int32(self.version)
        first_s = None
        while (m := run.queue.claim()) is not None:
            claimed = time.perf_counter()
            if acc is None:
                acc = zeros()
            rows = jax.device_put(run.micro_step_rows(m), row_sharding)
            acc, metrics, finite = micro_step(params, reference, acc, rows, version)
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
        if joined_mid_step:
            result.join = JoinReport(cell.index, pull_s, compile_s, first_s)


# Dtypes of the packed fields as the compiled micro-step expects them.
_FIELD_DTYPES = {
    "tokens": jnp.int32,
    "positions": jnp.int32,
    "subtree_end": jnp.int32,
    "pred_index": jnp.int32,
    "loss_weight": jnp.float32,
    "advantage": jnp.float32,
    "behavior_logprob": jnp.float32,
    "version": jnp.int32,
}


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
    """The workers of one step and their shared micro-step queue."""

    def __init__(self, trainer: ElasticTrainer, batch: PackedBatch, on_micro_step):
        self.trainer = trainer
        self.batch = batch
        self.on_micro_step = on_micro_step
        self.queue = _MicroStepQueue(batch.num_micro_steps)
        self._threads: dict[int, threading.Thread] = {}
        self._results: dict[int, _CellResult] = {}
        self._order: list[Cell] = []
        self._lock = threading.Lock()

    def micro_step_rows(self, m: int) -> dict[str, np.ndarray]:
        r = self.batch.rows_per_micro_step
        return {
            f: np.asarray(getattr(self.batch, f)[m * r : (m + 1) * r], _FIELD_DTYPES[f])
            for f in MICRO_STEP_FIELDS
        }

    def start_worker(self, cell: Cell, joined_mid_step: bool) -> None:
        with self._lock:
            result = _CellResult()
            self._results[cell.index] = result
            self._order.append(cell)

            def target():
                try:
                    self.trainer._work(cell, self, result, joined_mid_step)
                except BaseException as e:  # surfaced by train_step, never swallowed
                    result.error = e

            thread = threading.Thread(target=target, name=f"train-cell-{cell.index}")
            self._threads[cell.index] = thread
            thread.start()

    def wait(self) -> dict[int, _CellResult]:
        """Blocks until every worker, including ones that join meanwhile, is done."""
        while True:
            with self._lock:
                pending = [t for t in self._threads.values() if t.is_alive()]
            if not pending:
                break
            for thread in pending:
                thread.join()
        return dict(self._results)

    def cells_in_order(self) -> list[Cell]:
        core = self.trainer.core.index
        return sorted(self._order, key=lambda c: (c.index != core, c.index))
