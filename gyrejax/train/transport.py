"""How the cells of one training step share it: the transport under `ElasticTrainer`.

The step itself (claim micro-steps, run the compiled micro-step, reduce, skip a
non-finite step, update, report) is written once, in `trainer.py`. What differs between
one process and several is only how

  * the step is announced (its plan: number, version, cells, micro-step count, rows),
  * micro-steps are claimed (a shared queue),
  * a satellite pulls the step's frozen weights from the core,
  * the cells' results reach the core's process, and who takes part in the reduction is
    agreed on.

That is a `Transport`. `InProcessTransport` (here) keeps every cell in this process:
a locked counter, device-to-device copies, results in memory. Across processes,
`gyrejax.distributed.transport.MultiProcessTransport` claims through the coordinator's
key-value store, pulls by a collective or an Orbax snapshot, exchanges results as JSON
and lets the other processes follow process 0's steps (`ElasticTrainer.follow`).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time

import jax
import numpy as np

from gyrejax.cells import Cell
from gyrejax.model import sharding
from gyrejax.trajectory import PackedBatch
from gyrejax.trajectory.rows import training_rows


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where the parameters live on a cell: the same PartitionSpecs (the train rules) on
    every cell's mesh.

    Attributes:
      specs: pytree of PartitionSpec, as `nnx.to_pure_dict` lays the parameters out.
      abstract: pytree of jax.ShapeDtypeStruct (no sharding), the same structure.
    """

    specs: object
    abstract: object

    def shardings(self, cell: Cell):
        """NamedSharding of every parameter on `cell`'s mesh."""
        return sharding.named_shardings(self.specs, cell.mesh)

    def on(self, cell: Cell, dtype=None):
        """ShapeDtypeStructs of the parameters placed on `cell` (`dtype`: all leaves)."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=s),
            self.abstract,
            self.shardings(cell),
        )


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step as process 0 (or the only process) announces it.

    Attributes:
      step: the steps completed once it ends (1 for the first step).
      version: the policy version of the weights it trains from.
      cells: the cells that start it, in the trainer's order (core first).
      num_micro_steps: the micro-steps to claim.
      rows_per_micro_step: R, the rows of each of the base length (rows of other
        lengths, with row buckets: `PackedBatch.micro_step_shape`).
    """

    step: int
    version: int
    cells: tuple[Cell, ...]
    num_micro_steps: int
    rows_per_micro_step: int


@dataclasses.dataclass(frozen=True)
class JoinReport:
    """How long a satellite took to become useful after joining a running step."""

    cell: int
    weight_pull_s: float  # the step's weights copied from the core
    compile_s: float  # 0 when the cell's step was already compiled
    first_micro_step_s: float | None  # claim to gradients ready; None if it got none


@dataclasses.dataclass
class CellResult:
    """What one cell did in a step; `grads` only where this process holds the cell."""

    cell: Cell
    grads: object = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    micro_steps: int = 0
    first_bad_micro_step: int | None = None
    join: JoinReport | None = None
    error: BaseException | None = None


class StepExchange(abc.ABC):
    """One step as a transport carries it: the shared queue, the rows, the weights.

    Attributes:
      plan: the step.
      weight_pull: how satellites got the weights ("device", "collective", "snapshot").
      joined_mid_step: this process joins a step already running (a follower told to).
    """

    plan: StepPlan
    weight_pull: str
    joined_mid_step: bool = False

    @abc.abstractmethod
    def claim(self) -> int | None:
        """The next unclaimed micro-step of the step, or None when none is left."""

    @abc.abstractmethod
    def rows(self, m: int) -> dict[str, np.ndarray]:
        """Micro-step m's `rows.MICRO_STEP_FIELDS`, each of its shape (`PackedBatch.
        micro_step_shape(m)`: [R, L] without row buckets)."""

    @abc.abstractmethod
    def weights(self, cell: Cell) -> tuple[object, float]:
        """The step's frozen weights on `cell` (held by this process), and the seconds
        the copy from the core took (0 for the core)."""


class Transport(abc.ABC):
    """How the cells of a step claim, pull and exchange (module docstring).

    The driver (the only process, or process 0) calls `open`, `join_running`,
    `collect` and `announce` in its `train_step`; the other processes call `next`,
    `report` and `took_part` in `ElasticTrainer.follow`.

    Attributes:
      reports_every_pull: every satellite in a step reports its weight pull as a join
        (across processes: a follower holds no weights between steps); otherwise only
        satellites that join a running step do.
      compile_count: functions the transport compiled (the trainer adds them to its own).
    """

    reports_every_pull: bool = False
    compile_count: int = 0

    def bind(self, layout: ParamLayout, core: Cell) -> None:
        """Called once by the trainer with its parameter layout and core cell."""
        self.layout = layout
        self.core = core

    @property
    def is_driver(self) -> bool:
        """This process decides the steps (holds the core)."""
        return True

    def holds(self, cell: Cell) -> bool:
        """`cell`'s devices belong to this process."""
        return True

    # --- the driver -----------------------------------------------------------------------

    @abc.abstractmethod
    def open(self, plan: StepPlan, batch: PackedBatch, params) -> StepExchange:
        """Announces a step and pulls the weights for the satellites that start it
        (`params`: the core's weights, frozen for the step)."""

    @abc.abstractmethod
    def join_running(self, exchange: StepExchange, cell: Cell) -> bool:
        """A satellite joins the running step; True if this process must start its
        worker (False: another process does, or the cell waits for the next step)."""

    @abc.abstractmethod
    def close(self, exchange: StepExchange) -> None:
        """This process's workers are done: no satellite joins the step any more."""

    @abc.abstractmethod
    def collect(
        self, exchange: StepExchange, results: dict[int, CellResult]
    ) -> dict[int, CellResult]:
        """Every cell's result (this process's `results` and the others')."""

    @abc.abstractmethod
    def announce(self, exchange: StepExchange, took_part: list[Cell]) -> None:
        """Tells every process which cells' gradients the reduction sums."""

    def stop(self) -> None:  # noqa: B027 (nothing to tell without other processes)
        """Tells the other processes that no step follows."""

    # --- the other processes ------------------------------------------------------------

    def next(self) -> StepExchange | None:
        """Blocks for the driver's next step (None: it stopped)."""
        raise RuntimeError("this transport has no followers: one process drives every step")

    def report(self, exchange: StepExchange, results: dict[int, CellResult]) -> None:
        """Hands this process's results to the driver."""
        raise RuntimeError("this transport has no followers")

    def took_part(self, exchange: StepExchange) -> list[Cell]:
        """The cells the driver announced for the reduction."""
        raise RuntimeError("this transport has no followers")


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


class _InProcessStep(StepExchange):
    weight_pull = "device"

    def __init__(self, plan: StepPlan, batch: PackedBatch, params, transport: Transport):
        self.plan = plan
        self._batch = batch
        self._params = params
        self._core = transport.core
        self._layout = transport.layout
        self._queue = _MicroStepQueue(plan.num_micro_steps)

    def claim(self) -> int | None:
        return self._queue.claim()

    def rows(self, m: int) -> dict[str, np.ndarray]:
        return training_rows(self._batch.micro_step(m))

    def weights(self, cell: Cell) -> tuple[object, float]:
        if cell.index == self._core.index:
            return self._params, 0.0
        start = time.perf_counter()  # device to device, onto the satellite's mesh
        params = jax.block_until_ready(jax.device_put(self._params, self._layout.shardings(cell)))
        return params, time.perf_counter() - start


class InProcessTransport(Transport):
    """Every cell in this process: a locked counter, device-to-device weight copies,
    results handed over in memory."""

    def open(self, plan: StepPlan, batch: PackedBatch, params) -> StepExchange:
        return _InProcessStep(plan, batch, params, self)

    def join_running(self, exchange: StepExchange, cell: Cell) -> bool:
        return True

    def close(self, exchange: StepExchange) -> None:
        pass

    def collect(
        self, exchange: StepExchange, results: dict[int, CellResult]
    ) -> dict[int, CellResult]:
        return results

    def announce(self, exchange: StepExchange, took_part: list[Cell]) -> None:
        pass
