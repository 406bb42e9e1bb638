"""JSON forms of what crosses the engine interface, and validation that names the field.

Everything an HTTP peer sends is checked here before it reaches an engine or the proxy,
so a malformed request becomes a `FieldError` ("sampling.top_p: 1.5 is not in (0, 1]")
and an HTTP 400, never an exception deep inside an engine thread. Token arrays travel
as JSON lists of ints; float32 log-probs survive the round trip exactly (a float32 is
exactly representable as a JSON double). KV caches never travel: a `LiveRequest` crosses
hosts as prompt + tokens so far + sampling state (re-submit migration).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gyrejax.rollout.types import Completion, LiveRequest, Request, SamplingParams
from gyrejax.trajectory import Execution, ModelCall

_MISSING = object()
ENGINE_PREFIX = "/v1/engine"  # where an EngineServer serves the engine interface


class FieldError(ValueError):
    """A request field is missing or invalid; `field` is its dotted path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def get(body: Mapping, key: str, prefix: str = "", default: Any = _MISSING) -> Any:
    """`body[key]`, or `default`; a FieldError naming `prefix + key` when required."""
    if not isinstance(body, Mapping):
        raise FieldError(prefix.rstrip(".") or "body", f"expected a JSON object, got {_kind(body)}")
    if key in body and body[key] is not None:
        return body[key]
    if default is _MISSING:
        raise FieldError(prefix + key, "required")
    return default


def as_int(value: Any, field: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """An int in [lo, hi) (bools and floats refused: 1.5 tokens is a client bug)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"expected an integer, got {_shown(value)}")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        bounds = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi})"
        raise FieldError(field, f"{value} is not in {bounds}")
    return value


def as_float(value: Any, field: str) -> float:
    """A finite number (an integer too large for a float is refused, not an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(field, f"expected a finite number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise FieldError(
            field, "expected a finite number, got an integer beyond float range"
        ) from None
    if not math.isfinite(number):
        raise FieldError(field, f"expected a finite number, got {value!r}")
    return number


def as_str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"expected a string, got {_kind(value)}")
    return value


def as_list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise FieldError(field, f"expected a list, got {_kind(value)}")
    return value


def token_ids(value: Any, field: str, vocab_size: int | None = None) -> np.ndarray:
    """int32[n] token ids, each in [0, vocab_size)."""
    items = as_list(value, field)
    for i, t in enumerate(items):
        as_int(t, f"{field}[{i}]", lo=0, hi=vocab_size if vocab_size else 2**31)
    return np.asarray(items, np.int32).reshape(-1)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any, limit: int = 80) -> str:
    """A value for an error message: scalars by repr (cut at `limit`), containers by kind
    (a refused field may hold megabytes)."""
    if isinstance(value, list | dict):
        return _kind(value)
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({_kind(value)})"


# --- engine types -----------------------------------------------------------------------


def sampling_to_json(sampling: SamplingParams) -> dict:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_ids": list(sampling.stop_ids),
        "seed": sampling.seed,
    }


def sampling_from_json(body: Mapping, prefix: str = "sampling.") -> SamplingParams:
    """SamplingParams from JSON; every range is checked here, naming the field."""
    default = SamplingParams()
    temperature = as_float(
        get(body, "temperature", prefix, default.temperature), prefix + "temperature"
    )
    if temperature < 0:
        raise FieldError(prefix + "temperature", f"{temperature} is negative; expected >= 0")
    top_p = as_float(get(body, "top_p", prefix, default.top_p), prefix + "top_p")
    if not 0 < top_p <= 1:
        raise FieldError(prefix + "top_p", f"{top_p} is not in (0, 1]")
    stop_ids = token_ids(get(body, "stop_ids", prefix, []), prefix + "stop_ids")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=as_int(get(body, "top_k", prefix, 0), prefix + "top_k", lo=0, hi=2**31),
        max_new_tokens=as_int(
            get(body, "max_new_tokens", prefix, default.max_new_tokens),
            prefix + "max_new_tokens",
            lo=1,
            hi=2**31,
        ),
        stop_ids=tuple(int(t) for t in stop_ids),
        seed=as_int(get(body, "seed", prefix, 0), prefix + "seed", lo=0, hi=2**31),
    )


def request_to_json(request: Request) -> dict:
    return {
        "request_id": request.request_id,
        "prompt_ids": request.prompt_ids.tolist(),
        "sampling": sampling_to_json(request.sampling),
    }


def request_from_json(body: Mapping, prefix: str = "") -> Request:
    request_id = as_str(get(body, "request_id", prefix), prefix + "request_id")
    prompt = token_ids(get(body, "prompt_ids", prefix), prefix + "prompt_ids")
    if prompt.size == 0:
        raise FieldError(prefix + "prompt_ids", "empty; expected at least one token")
    sampling = sampling_from_json(get(body, "sampling", prefix, {}), prefix + "sampling.")
    return Request(request_id, prompt, sampling)


def live_to_json(live: LiveRequest) -> dict:
    """The re-submit form of a live request (its KV cache, if any, stays behind)."""
    return {
        "request": request_to_json(live.request),
        "output_ids": np.asarray(live.output_ids).tolist(),
        "logprobs": np.asarray(live.logprobs, np.float32).tolist(),
        "versions": np.asarray(live.versions).tolist(),
        "engines": list(live.engines),
    }


def live_from_json(body: Mapping, prefix: str = "") -> LiveRequest:
    request = request_from_json(get(body, "request", prefix), prefix + "request.")
    output = token_ids(get(body, "output_ids", prefix, []), prefix + "output_ids")
    logprobs = [
        as_float(x, f"{prefix}logprobs[{i}]")
        for i, x in enumerate(as_list(get(body, "logprobs", prefix, []), "logprobs"))
    ]
    versions = token_ids(get(body, "versions", prefix, []), prefix + "versions")
    if not len(output) == len(logprobs) == len(versions):
        raise FieldError(
            prefix + "output_ids",
            f"{len(output)} tokens but {len(logprobs)} logprobs and {len(versions)} versions",
        )
    engines = tuple(
        as_str(e, f"{prefix}engines[{i}]")
        for i, e in enumerate(as_list(get(body, "engines", prefix, []), "engines"))
    )
    return LiveRequest(request, output, np.asarray(logprobs, np.float32), versions, None, engines)


def completion_to_json(completion: Completion) -> dict:
    return {
        "request_id": completion.request_id,
        "output_ids": np.asarray(completion.output_ids).tolist(),
        "logprobs": np.asarray(completion.logprobs, np.float32).tolist(),
        "versions": np.asarray(completion.versions).tolist(),
        "finish_reason": completion.finish_reason,
        "engines": list(completion.engines),
    }


def completion_from_json(body: Mapping) -> Completion:
    return Completion(
        request_id=as_str(get(body, "request_id"), "request_id"),
        output_ids=np.asarray(get(body, "output_ids"), np.int32).reshape(-1),
        logprobs=np.asarray(get(body, "logprobs"), np.float32).reshape(-1),
        versions=np.asarray(get(body, "versions"), np.int32).reshape(-1),
        finish_reason=as_str(get(body, "finish_reason"), "finish_reason"),
        engines=tuple(get(body, "engines")),
    )


# --- records ----------------------------------------------------------------------------


def call_to_json(call: ModelCall) -> dict:
    return {
        "execution_id": call.execution_id,
        "call_id": call.call_id,
        "agent_id": call.agent_id,
        "role": call.role,
        "prompt_ids": call.prompt_ids.tolist(),
        "output_ids": call.output_ids.tolist(),
        "logprobs": call.logprobs.tolist(),
        "versions": call.versions.tolist(),
        "finish_reason": call.finish_reason,
        "engines": list(call.engines),
        "started_at": call.started_at,
        "finished_at": call.finished_at,
        "temperature": call.temperature,
        "top_p": call.top_p,
        "top_k": call.top_k,
    }


def call_from_json(body: Mapping) -> ModelCall:
    return ModelCall(**{**body, "engines": tuple(body.get("engines", ()))})


def execution_to_json(execution: Execution) -> dict:
    return {
        "execution_id": execution.execution_id,
        "task_id": execution.task_id,
        "group_id": execution.group_id,
        "status": execution.status,
        "reward": execution.reward,
        "eval_attempts": execution.eval_attempts,
        "error": execution.error,
        "calls": [call_to_json(c) for c in execution.calls],
    }


def execution_from_json(body: Mapping) -> Execution:
    fields = {k: v for k, v in body.items() if k != "calls"}
    return Execution(**fields, calls=[call_from_json(c) for c in body["calls"]])


def error_body(message: str, kind: str, field: str | None = None) -> dict:
    """The OpenAI error envelope (its `param` is the offending field)."""
    return {"error": {"message": message, "type": kind, "param": field, "code": None}}


def int_list(values: Sequence[int]) -> list[int]:
    return [int(v) for v in values]
