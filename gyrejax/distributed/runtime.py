"""JAX's distributed runtime for gyrejax: start it, find this process's cells, and pass
process 0's decisions to the other processes.

Every process owns the cells made of its local devices (a cell never spans processes).
Process 0 holds the core cell and decides; the others follow. Decisions travel through
the distributed runtime's key-value store (the coordinator service that
`jax.distributed.initialize` starts), as numbered JSON records with optional byte blobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import jax

from gyrejax.cells import Cell

# Followers wait this long for process 0's next decision by default.
DEFAULT_TIMEOUT_S = 3600.0


def _cluster_process_count() -> int:
    """Process count of a cluster JAX can auto-detect (SLURM, Open MPI, k8s...); 1 if none."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return 2  # explicitly asked for; the count comes from the cluster or flags
    try:  # private, but it is exactly the detection `jax.distributed.initialize` uses
        from jax._src import clusters
    except ImportError:
        return 1
    for env in clusters.ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return int(env.get_process_count())
        except Exception:  # a half-set cluster environment is not a cluster
            continue
    return 1


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
) -> bool:
    """Starts JAX's distributed runtime if asked to, or if a multi-process cluster is
    detected; must run before anything touches JAX's devices.

    CPU collectives use gloo, so CPU-emulated devices in several processes (tests,
    loopback experiments) run the same cross-process collectives as GPUs.

    Args:
      coordinator: "host:port" of process 0's coordinator service.
      num_processes, process_id: this job's size and this process's rank.
      timeout_s: how long to wait for every process to connect.

    Returns:
      True if the runtime was started (this is a multi-process job).

    Raises:
      ValueError: only some of the three were given, or they are inconsistent.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError(
            "--coordinator, --num_processes and --process_id go together (or none of them,"
            f" to auto-detect a cluster); got coordinator={coordinator!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if all(given):
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process_id={process_id} must lie in [0, --num_processes={num_processes})"
            )
    elif _cluster_process_count() < 2:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )
    return True


def owner(cell: Cell) -> int:
    """The process that holds `cell`.

    Raises:
      ValueError: the cell's devices belong to several processes (the cell size must
        divide every process's local device count).
    """
    processes = {d.process_index for d in cell.devices}
    if len(processes) != 1:
        raise ValueError(
            f"cell {cell.index} spans processes {sorted(processes)}: config.cells.size must "
            "divide each process's local device count"
        )
    return processes.pop()


def local_cells(cells: Sequence[Cell]) -> list[Cell]:
    """The cells this process holds, in cell order."""
    return [c for c in cells if owner(c) == jax.process_index()]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One of process 0's decisions: `seq` counts from 0, `kind` names it."""

    seq: int
    kind: str
    payload: dict


class Decisions:
    """Process 0 publishes numbered decisions; every other process reads them in order.

    Also the side channel for per-step data: JSON records and byte blobs by key, and an
    atomic counter (`claim`) shared by all processes.

    Args:
      namespace: key prefix, so two channels (or two runs on one coordinator) never mix.
      timeout_s: how long a read waits before raising TimeoutError-like errors.
    """

    def __init__(self, namespace: str = "gyrejax", timeout_s: float = DEFAULT_TIMEOUT_S):
        from jax._src.distributed import global_state  # the public API has no KV store

        if global_state.client is None:
            raise RuntimeError("the distributed runtime is not initialised (initialize())")
        self._client = global_state.client
        self._namespace = namespace
        self._timeout_ms = int(timeout_s * 1000)
        self._published = 0
        self._read = 0

    def _key(self, key: str) -> str:
        return f"{self._namespace}/{key}"

    def publish(self, kind: str, **payload) -> int:
        """Process 0: appends a decision; returns its sequence number."""
        if jax.process_index() != 0:
            raise RuntimeError(f"process {jax.process_index()} cannot publish decisions")
        seq = self._published
        record = json.dumps({"kind": kind, "payload": payload})
        self._client.key_value_set(self._key(f"decision/{seq}"), record)
        self._published += 1
        return seq

    def next(self) -> Decision:
        """Followers: blocks for the next decision, in publication order."""
        seq = self._read
        record = json.loads(
            self._client.blocking_key_value_get(self._key(f"decision/{seq}"), self._timeout_ms)
        )
        self._read += 1
        return Decision(seq, record["kind"], record["payload"])

    def put_json(self, key: str, value) -> None:
        self._client.key_value_set(self._key(key), json.dumps(value))

    def get_json(self, key: str):
        return json.loads(self._client.blocking_key_value_get(self._key(key), self._timeout_ms))

    def put_bytes(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(self._key(key), value)

    def get_bytes(self, key: str) -> bytes:
        return self._client.blocking_key_value_get_bytes(self._key(key), self._timeout_ms)

    def claim(self, key: str) -> int:
        """Atomically takes the next number (0, 1, 2, ...) of counter `key`, across all
        processes: the shared micro-step queue."""
        return self._client.key_value_increment(self._key(key), 1) - 1

    def claimed(self, key: str) -> int:
        """How many numbers of counter `key` have been taken so far (0 if none)."""
        try:
            return int(self._client.key_value_try_get(self._key(key)))
        except jax.errors.JaxRuntimeError:  # NOT_FOUND: nobody claimed yet
            return 0

    def delete(self, key: str) -> None:
        """Removes `key` (or every key under the directory `key/`)."""
        self._client.key_value_delete(self._key(key))
