"""Rollout: engines that serve the policy (JAX engine; vLLM engine, imported lazily) and
the proxy that records, routes, migrates and retries every model call."""

from gyrejax.rollout.engine import Engine
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.proxy import Counters, DrainReport, NoEngineError, Proxy
from gyrejax.rollout.types import (
    Completion,
    EngineError,
    LiveRequest,
    Request,
    RequestMigrated,
    SamplingParams,
)

__all__ = [
    "Completion",
    "Counters",
    "DrainReport",
    "Engine",
    "EngineError",
    "JaxEngine",
    "LiveRequest",
    "NoEngineError",
    "Proxy",
    "Request",
    "RequestMigrated",
    "SamplingParams",
]
