"""The engine interface that the JAX engine and the vLLM engine implement.

Engines are asyncio-friendly: `submit` returns an `asyncio.Future` on the caller's event
loop; the engine does its work elsewhere (a thread, or vLLM's own loop). A request that
is exported resolves its future with `RequestMigrated(live)`; the proxy then imports the
live state into another engine. An engine that fails resolves its futures with
`EngineError`.
"""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import Mapping
from typing import Any

from gyrejax.rollout.types import Completion, LiveRequest, Request

# What `Engine.update_weights` takes. One of:
HfCheckpoint = str | os.PathLike
"""An HF checkpoint directory (config.json + safetensors, as `hf_io.export_hf` writes
it), read by the engine's own host: how weights reach an engine in another process."""
Params = Mapping[str, Any]
"""Parameters in this process: an nnx pure dict of arrays laid out like the engine's
model (a trainer's `params`), or an nnx State (a mapping too)."""
Weights = Params | HfCheckpoint


class Engine(abc.ABC):
    """A rollout engine serving one cell (or a remote host)."""

    name: str
    # Whether `export` includes the KV cache (a JAX engine can; vLLM re-submits).
    exports_kv: bool = False
    # Whether `update_weights` takes only an `HfCheckpoint`: an engine reached by URL, or
    # one that loads from disk; arrays of this process do not reach it. The RL loop
    # then hands it an HF export per version (`gyrejax.loop.PublishedWeights`).
    weights_by_path: bool = False

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Requests it can run concurrently."""

    @property
    @abc.abstractmethod
    def load(self) -> int:
        """Requests it holds now (running or waiting)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights it samples with."""

    @abc.abstractmethod
    def submit(self, request: Request) -> asyncio.Future[Completion]:
        """Starts a request; the future resolves with its completion."""

    @abc.abstractmethod
    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        """Continues a request exported from another engine."""

    @abc.abstractmethod
    async def export(self, request_id: str) -> LiveRequest:
        """Takes a request out; its original future raises `RequestMigrated`."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Ends a request; its future resolves with finish_reason "cancelled"."""

    @abc.abstractmethod
    async def update_weights(self, weights: Weights, version: int) -> None:
        """Loads new weights between decode steps; later tokens carry `version`.

        Raises:
          TypeError: `weights` is a kind this engine does not take (`weights_by_path`).
          ValueError: they do not fit the engine's model.
        """

    @abc.abstractmethod
    async def release_memory(self) -> None:
        """Frees the engine's device memory (no requests may be in flight)."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Re-allocates what `release_memory` freed."""

    @abc.abstractmethod
    def request_ids(self) -> list[str]:
        """The requests it holds now."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stops the engine; pending requests fail with `EngineError`."""

    async def precompiled(self) -> None:  # noqa: B027 (a default: nothing to wait for)
        """Returns once the engine compiled what it compiles ahead of need (at once for
        an engine that compiles nothing here)."""

    async def generate(self, request: Request) -> Completion:
        """Submits and awaits one request."""
        return await self.submit(request)
