"""What the parts of the RL loop share: the run's configuration, cells, trainer and
driver, its clock, and the tasks it spawns on its one asyncio loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from absl import logging

from gyrejax.cells import Cell
from gyrejax.config import Config
from gyrejax.logs import append_jsonl
from gyrejax.scheduler.driver import Driver, Schedule
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.writers import Writers


def schedule_of(config: Config, cells: int) -> Schedule:
    """The driver's view of the run's configuration."""
    s = config.scheduler
    return Schedule(
        cells=cells,
        capacity=config.cell_capacity,
        group_size=config.rl.group_size,
        groups_per_step=config.rl.groups_per_step,
        mu=s.mu,
        phi=s.phi,
        max_staleness=s.max_staleness,
        groups_total=config.train.steps * config.rl.groups_per_step,
    )


@dataclasses.dataclass
class RunContext:
    """The RL loop's shared state (each field says which part writes it).

    Attributes:
      config, cells, workdir: the run.
      trainer: the core and its satellites.
      driver: roles, switches, bursts, the transition queue (scheduler/driver.py).
      step_task: the running training step (steps.py), None between steps.
      weight_pulls: engines copying the trainer's weights now (transitions.py,
        engines.py): no step may start, since its update donates those buffers.
      phase: cell -> "queued" | "wait_boundary" | "switch" while it switches
        (transitions.py; the idle accounting reads it; no step starts while a cell
        waits at the boundary).
      timeline: (seconds, cell, role or "switching") role changes (transitions.py).
    """

    config: Config
    cells: list[Cell]
    workdir: Path
    trainer: ElasticTrainer
    driver: Driver
    step_task: asyncio.Task | None = None
    weight_pulls: int = 0
    phase: dict[int, str] = dataclasses.field(default_factory=dict)
    timeline: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    writers: Writers | None = None  # logging.writers' trackers (runtime.py opens them)
    # transitions.jsonl's records so far (steps.py counts a resumed run's): the trackers'
    # step of the next (writers.record_steps).
    transitions_logged: int = 0

    def __post_init__(self):
        self._start = time.monotonic()
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None

    def start(self) -> None:
        """The run begins (on the running event loop): the clock starts."""
        self._changed = asyncio.Event()
        self._start = time.monotonic()

    def log(self, name: str, record: dict, step: int) -> None:
        """Appends `record` to `<workdir>/<name>.jsonl` and sends it to the trackers."""
        append_jsonl(self.workdir / f"{name}.jsonl", record)
        if self.writers is not None:
            self.writers.write(name, record, step)

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self._start

    def spawn(self, coroutine) -> asyncio.Task:
        """Runs `coroutine` as a task of the run; a failure ends the run (`check`)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._surface_errors)
        return task

    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks)

    def notify(self) -> None:
        """Something changed: the main loop asks the policy again."""
        if self._changed is not None:
            self._changed.set()

    async def changed(self, timeout_s: float) -> None:
        """Waits until something changed, or `timeout_s` passed."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)
        except TimeoutError:
            pass
        self._changed.clear()

    def check(self) -> None:
        """Raises if a task of the run failed: its own error, whose type callers may
        catch (launch's one-line errors), with the task's traceback."""
        if self._failure is not None:
            raise self._failure

    def _surface_errors(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logging.error("runtime task failed: %r", task.exception())
            self._failure = task.exception()
        self.notify()
