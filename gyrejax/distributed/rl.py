"""The RL loop across processes: what each process adds to a one-process run.

Process 0 runs the RL loop (`gyrejax.loop.Runtime`: scheduling policy, harness, proxy,
trajectory processing, and the core cell with the optimizer state) over the cells of
every process, with `RemoteCellEngines` for the cells' engines and a trainer whose
transport is `MultiProcessTransport`. Every other process serves an engine per cell it
holds over HTTP (`EngineServer`) and keeps a satellite of the same trainer on each,
following process 0's steps (`serve_and_follow`):

  * rollout role: process 0's proxy reaches the engine by URL (`HttpEngine`), so a
    remote cell takes part in routing, draining (export + re-submit across hosts),
    failure retry and the records exactly like a local one (a dead follower, though,
    ends the job: JAX's distributed runtime stops every process; the same command
    resumes it);
  * rollout -> training: process 0 drains the remote engine, frees its memory over HTTP
    and joins the cell to the trainer; the follower's satellite pulls the core's weights
    (a collective at a step boundary, the Orbax snapshot when it joins a running step)
    and claims micro-steps from the shared queue;
  * training -> rollout, and each burst's publication: the Runtime exports the weights
    once per version as an HF checkpoint (`workdir/published/version_<v>`) and remote
    engines reload it by path (as external vLLM servers do), so `workdir` must be on
    storage that every host reads (it holds the snapshots for the same reason).

Start: every process builds the same initial model (the seed, or `model.hf_checkpoint`).
With a warm start, process 0 runs it on its own cells while the others wait, then hands
them the weights as an Orbax snapshot (`workdir/snapshots/start`).

Engine access: process 0 draws one token per run (`secrets`) and keeps it; its
`HttpEngine`s send it. The others get only its SHA-256 digest, on the coordinator's
key-value store, and their engine servers check every request against that digest and
load weights only from `workdir/published` (symlinks resolved). JAX's coordinator
service has no authentication, so whoever reaches its port can read the store: they
find the digest, which admits nobody. (They could still write to the store or stop the
job: the coordinator port must be reachable by the job's hosts only.) The token is
never logged.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from pathlib import Path

import jax
from absl import logging
from flax import nnx

from gyrejax.cells import Cell
from gyrejax.config import Config, RolloutConfig
from gyrejax.distributed.runtime import Decisions, local_cells, owner
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine
from gyrejax.rollout.factory import make_engine
from gyrejax.serve.engine_server import EngineServer
from gyrejax.serve.http import token_digest
from gyrejax.serve.http_engine import HttpEngine
from gyrejax.train.checkpoint import abstract_like, restore_weights, save_weights
from gyrejax.train.trainer import ElasticTrainer

# Followers may wait this long for process 0 (a warm start, hours of rollout between
# two steps); if process 0 dies, the coordinator goes with it and the wait fails at once.
FOLLOWER_TIMEOUT_S = 7 * 24 * 3600.0


def engine_key(index: int) -> str:
    """Where a follower posts the URL of cell `index`'s engine."""
    return f"engine/{index}"


def advertised_host() -> str:
    """The address other hosts reach this one at: the interface that routes to the
    coordinator (127.0.0.1 for a job on loopback)."""
    from jax._src.distributed import global_state  # the public API does not expose it

    host = global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent, only the route is chosen
        return probe.getsockname()[0]


# --- the start weights ------------------------------------------------------------------


def share_start_weights(model: Transformer, workdir: Path, start: Decisions) -> None:
    """Process 0: makes `model` (after the warm start) the starting point of every process."""
    path = save_weights(workdir / "snapshots" / "start", nnx.to_pure_dict(nnx.state(model)))
    start.put_json("weights", str(path))


def announce_no_start_weights(start: Decisions) -> None:
    """Process 0: every process starts from the model it built itself."""
    start.put_json("weights", None)


def receive_start_weights(model: Transformer, start: Decisions) -> Transformer:
    """Followers: `model` with process 0's starting weights, on `model`'s sharding."""
    path = start.get_json("weights")
    if path is None:
        return model
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    target = abstract_like(pure, jax.tree.map(lambda x: x.sharding, pure))
    nnx.replace_by_pure_dict(state, restore_weights(path, target))
    logging.info("start weights restored from %s", path)
    return nnx.merge(graphdef, state)


def share_engine_token(start: Decisions) -> str:
    """Process 0: draws the run's engine token and hands its digest (never the token) to
    the other processes; returns the token."""
    token = secrets.token_urlsafe(32)
    start.put_json("engine_token_sha256", token_digest(token))
    return token


def receive_engine_token_digest(start: Decisions) -> str:
    """Followers: the digest of the engine token process 0 drew for this run (their
    engine servers check requests against it)."""
    return start.get_json("engine_token_sha256")


def published_dir(workdir: Path) -> Path:
    """Where the Runtime publishes weights for engines reached by URL (`PublishedWeights`)
    and so the only directory remote engines load from."""
    return Path(workdir) / "published"


# --- process 0 --------------------------------------------------------------------------


class RemoteCellEngines:
    """Process 0's cell engines for the RL loop (`gyrejax.loop.CellEngines`): a local
    engine for each of its own cells, an `HttpEngine` for another process's (its URL from
    the key-value store, where the follower posted it; every request carries the run's
    token).

    Args:
      config: the rollout section.
      decisions: the trainer's channel (`MultiProcessTransport.decisions`).
      token: the run's engine token.
    """

    def __init__(self, config: RolloutConfig, decisions: Decisions, token: str):
        self.config = config
        self.decisions = decisions
        self.token = token

    async def __call__(self, cell: Cell, model: Transformer, version: int) -> Engine:
        if owner(cell) == jax.process_index():
            return make_engine(cell, model, self.config, version=version, precompile=True)
        loop = asyncio.get_running_loop()
        url = await loop.run_in_executor(None, self.decisions.get_json, engine_key(cell.index))
        engine = await HttpEngine.connect(url, token=self.token)
        logging.info("cell %d: engine %s at %s", cell.index, engine.name, url)
        return engine


# --- the other processes ----------------------------------------------------------------


def serve_and_follow(
    config: Config,
    cells: list[Cell],
    model: Transformer,
    trainer: ElasticTrainer,
    *,
    token_sha256: str,
    weights_dir: Path,
) -> dict:
    """A follower's whole job: serves an engine per local cell (requiring the token
    whose digest is `token_sha256`, loading weights only from `weights_dir`) and takes
    part in process 0's training steps until it stops; returns what it did."""

    async def serve() -> dict:
        host = advertised_host()
        servers: list[EngineServer] = []
        summary = {"process": jax.process_index(), "steps_followed": 0, "cells": []}
        decisions = trainer.transport.decisions
        try:
            for cell in local_cells(cells):
                engine = make_engine(cell, model, config.rollout, version=trainer.version)
                server = EngineServer(
                    engine, token=None, token_sha256=token_sha256, weights_dir=weights_dir
                )
                servers.append(server)
                url = await server.start(host, 0)
                decisions.put_json(engine_key(cell.index), url)
                summary["cells"].append(cell.index)
                logging.info(
                    "cell %d: serving engine %s at %s (token required; weights from %s only)",
                    cell.index,
                    engine.name,
                    url,
                    server.weights_dir,
                )
            loop = asyncio.get_running_loop()
            summary["steps_followed"] = await loop.run_in_executor(
                None, follow_until_stopped, trainer
            )
        finally:
            for server in servers:
                await server.stop()
                await server.engine.shutdown()
        return summary

    return asyncio.run(serve())


def follow_until_stopped(trainer: ElasticTrainer) -> int:
    """Takes part in process 0's steps until it stops; returns the steps taken part in."""
    steps = 0
    while (done := trainer.follow()) is not None:
        steps += bool(done["cells"])
    return steps
