"""What crosses the engine interface: requests, sampling parameters, results, live state."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
      temperature: 0 is greedy.
      top_p: nucleus mass in (0, 1]; 1 is off.
      top_k: keep the k most likely tokens; 0 is off.
      max_new_tokens: the request ends with finish_reason "length" after this many.
      stop_ids: a generated stop id ends the request ("stop"); it is part of the output.
      seed: the n-th token is sampled with key fold_in(key(seed), n), so a request is
        reproducible whatever it is batched with and wherever it migrates.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sampling.temperature={self.temperature}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p}: expected in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k}: expected >= 0")
        if self.max_new_tokens <= 0:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}: expected > 0")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"sampling.seed={self.seed}: expected in [0, 2**31)")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One generation request (token ids in, token ids out)."""

    request_id: str
    prompt_ids: np.ndarray  # int32[P], P >= 1
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self):
        prompt = np.asarray(self.prompt_ids, dtype=np.int32).reshape(-1)
        if prompt.size == 0:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        object.__setattr__(self, "prompt_ids", prompt)


@dataclasses.dataclass(frozen=True, eq=False)
class Completion:
    """A finished request.

    Attributes:
      output_ids: int32[O] generated tokens.
      logprobs: float32[O] behaviour log-prob of each (under the distribution sampled).
      versions: int32[O] policy version each token was sampled with.
      finish_reason: "stop", "length" (max_new_tokens or the engine's context limit)
        or "cancelled".
      engines: every engine that served the request, in order (several if it migrated).
    """

    request_id: str
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    engines: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class LiveRequest:
    """A request taken out of an engine mid-generation, to continue elsewhere.

    Attributes:
      request: the original request.
      output_ids, logprobs, versions: what was generated so far.
      kv: per layer (k, v) as arrays [KV, m, D] whose first n = prompt + output - 1
        positions hold the cache (m >= n: an exporter may pad to a length bucket, so
        that copies take few shapes), where the engine can export its cache; None means
        the importer re-computes them from prompt + output (re-submit).
      engines: the engines that served it so far.
    """

    request: Request
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    kv: tuple | None
    engines: tuple[str, ...]

    @property
    def remaining_tokens(self) -> int:
        return self.request.sampling.max_new_tokens - len(self.output_ids)


class EngineError(RuntimeError):
    """An engine failed (raised, died or hung); its requests must run elsewhere."""


class RequestMigrated(Exception):
    """Raised to the awaiter of a request that was exported from its engine."""

    def __init__(self, live: LiveRequest):
        super().__init__(f"request {live.request.request_id!r} migrated")
        self.live = live
