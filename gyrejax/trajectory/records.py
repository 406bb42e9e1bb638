"""Execution records: what the proxy records per model call, and per execution.

A `ModelCall` is one token-in/token-out request as the policy saw it; an `Execution` is
one harness run of one task (many calls, one reward). Both are frozen; their token
arrays are stored read-only. Roles rank leaves for admission (lower number = higher
priority) and are extensible with `register_role`.

Validation lives here too, split in two: `validate_calls` checks what a record must
satisfy to be stored at all (shapes, roles, finiteness, unique call ids), and
`validate_for_training` adds what training needs (a known status, a reward).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)

# Lower number = higher admission priority.
_ROLE_PRIORITY: dict[str, int] = {
    "main": 0,
    "main_summary": 1,
    "sub_agent": 2,
    "sub_agent_summary": 3,
}

# failed: the agent itself crashed (an external agent process exiting non-zero); its
# record keeps the calls and the stderr tail (`error`) but it is never trained.
STATUSES = ("finished", "timed_out", "eval_failed", "no_artifact", "failed")


def register_role(name: str, priority: int) -> None:
    """Registers a call role with its admission priority (lower = admitted first).

    Args:
      name: the role string recorded on `ModelCall.role`.
      priority: an integer rank; built-ins are main=0, main_summary=1, sub_agent=2,
        sub_agent_summary=3. Re-registering a role with another priority is an error.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"role name must be a non-empty string, got {name!r}")
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
        raise ValueError(f"role priority must be an int, got {priority!r}")
    old = _ROLE_PRIORITY.get(name)
    if old is not None and old != int(priority):
        raise ValueError(f"role {name!r} is already registered with priority {old}")
    _ROLE_PRIORITY[name] = int(priority)


def role_priority(name: str) -> int:
    """Returns the admission priority of a registered role (ValueError if unknown)."""
    try:
        return _ROLE_PRIORITY[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; known roles: {known_roles()}") from None


def known_roles() -> dict[str, int]:
    """Returns a copy of the role -> priority registry."""
    return dict(_ROLE_PRIORITY)


def _frozen_array(value: Any, dtype: type, field: str, owner: str) -> np.ndarray:
    """Converts `value` to a read-only 1-D array of `dtype`, refusing lossy casts.

    An input that already is a read-only 1-D array of the right dtype is kept as is (no
    copy): the synthetic generator hands out prompt views of one context buffer.
    """
    if isinstance(value, np.ndarray) and value.dtype == dtype and not value.flags.writeable:
        arr = value
    else:
        src = np.asarray(value)
        if src.size == 0:
            src = src.reshape(-1).astype(dtype)
        if dtype == np.int32 and src.dtype != np.int32:
            if src.dtype.kind == "f":
                if not np.all(np.isfinite(src)) or np.any(src != np.round(src)):
                    raise ValueError(f"{owner}: {field} must hold integers, got {src!r}")
            elif src.dtype.kind not in "iub":
                raise ValueError(f"{owner}: {field} must hold integers, got dtype {src.dtype}")
            if src.size and (src.min() < _INT32_MIN or src.max() > _INT32_MAX):
                bad = src[(src < _INT32_MIN) | (src > _INT32_MAX)][0]
                raise ValueError(f"{owner}: {field} value {bad} does not fit in int32")
        arr = np.array(src, dtype=dtype, copy=True)
        arr.flags.writeable = False
    if arr.ndim != 1:
        raise ValueError(f"{owner}: {field} must be 1-D, got shape {arr.shape}")
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class ModelCall:
    """One model call, token-in/token-out, as recorded by the proxy.

    Attributes:
      execution_id: the execution this call belongs to.
      call_id: unique within the execution; calls are replayed in call_id order.
      agent_id: which agent loop made the call ("main", "sub-3", ...).
      role: a registered role (main, main_summary, sub_agent, sub_agent_summary, ...).
      prompt_ids: int32[P] the exact tokens the policy conditioned on.
      output_ids: int32[O] the tokens the policy generated.
      logprobs: float32[O] behaviour log-probability of each output token.
      versions: int32[O] policy version each output token was sampled with.
      finish_reason: e.g. "stop", "length", "abort".
      engines: the engines that served the call (several if it migrated).
      started_at: unix seconds.
      finished_at: unix seconds.
      temperature, top_p, top_k: the distribution the outputs were sampled from (as
        `rollout.types.SamplingParams`: temperature 0 is greedy, top_p 1 and top_k 0
        keep every token). The trainer's log-probs are taken under the same
        distribution, so the importance ratio of an unchanged policy is exactly 1; a
        greedy call's tokens are context, never trained. Records stored before these
        fields existed read as 1 / 1 / 0, what the trainer then assumed.
    """

    execution_id: str
    call_id: int
    agent_id: str
    role: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    engines: tuple[str, ...] = ()
    started_at: float = 0.0
    finished_at: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        owner = f"execution {self.execution_id!r} call {self.call_id!r}"
        if isinstance(self.call_id, bool) or not isinstance(self.call_id, int | np.integer):
            raise ValueError(f"{owner}: call_id={self.call_id!r}: expected an int")
        object.__setattr__(self, "call_id", int(self.call_id))
        for name, dtype in (
            ("prompt_ids", np.int32),
            ("output_ids", np.int32),
            ("logprobs", np.float32),
            ("versions", np.int32),
        ):
            object.__setattr__(self, name, _frozen_array(getattr(self, name), dtype, name, owner))
        if isinstance(self.engines, str):  # tuple("cell0") would be ("c", "e", ...)
            raise ValueError(f"{owner}: engines={self.engines!r}: expected a sequence of names")
        object.__setattr__(self, "engines", tuple(self.engines))
        for name in ("started_at", "finished_at", "temperature", "top_p"):
            object.__setattr__(self, name, _as_float(getattr(self, name), name, owner))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer):
            raise ValueError(f"{owner}: top_k={self.top_k!r}: expected an int")
        object.__setattr__(self, "top_k", int(self.top_k))
        check_sampling(self.temperature, self.top_p, self.top_k, owner)

    @property
    def sampled(self) -> bool:
        """Whether the outputs were sampled (temperature > 0), so they may be trained."""
        return self.temperature > 0

    @property
    def length(self) -> int:
        """Context length of the call: len(prompt_ids) + len(output_ids)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelCall):
            return NotImplemented
        return all(
            _field_equal(getattr(self, f.name), getattr(other, f.name)) for f in _fields(self)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass(frozen=True, eq=False)
class Execution:
    """One harness execution of one task.

    Attributes:
      execution_id: unique id.
      task_id: the task this execution attempted.
      group_id: executions sharing a group_id form one group for advantages.
      calls: the model calls (any order; replayed in call_id order).
      status: finished | timed_out | eval_failed | no_artifact | failed.
      reward: the workspace score; None until scored (eval_failed may stay None).
      eval_attempts: how many times scoring was attempted.
      error: why it failed (an external agent's stderr tail); "" otherwise.
    """

    execution_id: str
    task_id: str
    group_id: str
    calls: Sequence[ModelCall]
    status: str = "finished"
    reward: float | None = None
    eval_attempts: int = 0
    error: str = ""

    def __post_init__(self) -> None:
        owner = f"execution {self.execution_id!r}"
        if not isinstance(self.error, str):
            raise ValueError(f"{owner}: error={self.error!r}: expected a string")
        object.__setattr__(self, "calls", tuple(self.calls))
        if self.reward is not None:
            object.__setattr__(self, "reward", _as_float(self.reward, "reward", owner))
        attempts = self.eval_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int | np.integer):
            raise ValueError(f"{owner}: eval_attempts={attempts!r}: expected an int")
        object.__setattr__(self, "eval_attempts", int(attempts))

    def sorted_calls(self) -> list[ModelCall]:
        """The calls in call_id order (the order the tree replays them)."""
        return sorted(self.calls, key=lambda c: c.call_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Execution):
            return NotImplemented
        return all(
            _field_equal(getattr(self, f.name), getattr(other, f.name)) for f in _fields(self)
        )

    __hash__ = None  # type: ignore[assignment]


def check_sampling(temperature: float, top_p: float, top_k: int, owner: str) -> None:
    """Raises ValueError naming `owner` and the field unless the settings describe a
    distribution (the ranges of `rollout.types.SamplingParams`)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{owner}: temperature={temperature!r}: expected a finite number >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"{owner}: top_p={top_p!r}: expected in (0, 1]")
    if not 0 <= top_k < 2**31:
        raise ValueError(f"{owner}: top_k={top_k!r}: expected an int32 >= 0 (0 is off)")


def _as_float(value: Any, field: str, owner: str) -> float:
    """`value` as a float; a string or bool is refused (float("1e3") or True would pass)."""
    if isinstance(value, str | bytes | bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{owner}: {field}={value!r}: expected a number")
    return float(value)


def _fields(obj: Any) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(obj)


def _field_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_field_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def validate_calls(execution: Execution, vocab_size: int | None = None) -> None:
    """Checks the per-call invariants every stored or trained record must satisfy.

    Output token ids are checked against `vocab_size` here. Prompt tokens are checked
    by the tree builder as it inserts them: a prompt token that matches the tree was
    checked when it was first inserted, so the bulk of N costs no extra pass.

    Raises:
      ValueError naming the execution, the call and the offending value.
    """
    ex = execution.execution_id
    if not isinstance(ex, str):
        raise ValueError(f"execution_id must be a str, got {ex!r}")
    seen: set[int] = set()
    for call in execution.calls:
        where = f"execution {ex!r} call {call.call_id}"
        if call.execution_id != ex:
            raise ValueError(f"{where}: call carries execution_id {call.execution_id!r}")
        if call.call_id in seen:
            raise ValueError(f"{where}: duplicate call_id {call.call_id}")
        seen.add(call.call_id)
        if call.role not in _ROLE_PRIORITY:
            raise ValueError(f"{where}: unknown role {call.role!r}; known roles: {known_roles()}")
        n_out = len(call.output_ids)
        if len(call.logprobs) != n_out:
            raise ValueError(f"{where}: {len(call.logprobs)} logprobs for {n_out} output tokens")
        if len(call.versions) != n_out:
            raise ValueError(f"{where}: {len(call.versions)} versions for {n_out} output tokens")
        if len(call.prompt_ids) == 0:
            raise ValueError(
                f"{where}: empty prompt_ids (nothing would predict the first output token)"
            )
        if n_out and not np.all(np.isfinite(call.logprobs)):
            bad = call.logprobs[~np.isfinite(call.logprobs)][0]
            raise ValueError(f"{where}: non-finite logprob {bad}")
        check_token_range(call.output_ids, vocab_size, where, "output_ids")


def validate_record(execution: Execution) -> None:
    """Checks everything a stored record must satisfy, beyond `validate_calls`: the
    type of every field (ids and names are strings, numbers are finite numbers), a known
    status, and a reward that is None or finite. What the store refuses to write, and
    skips when it reads a record that holds anything else (a record written by other
    code, or edited: its checksum is then valid but its fields are not).

    Raises:
      ValueError naming the execution, the field and the offending value.
    """
    ex = execution.execution_id
    if not isinstance(ex, str):
        raise ValueError(f"execution_id={ex!r}: expected a string")
    owner = f"execution {ex!r}"
    for name in ("task_id", "group_id", "status"):
        value = getattr(execution, name)
        if not isinstance(value, str):
            raise ValueError(f"{owner}: {name}={value!r}: expected a string")
    if execution.status not in STATUSES:
        raise ValueError(f"{owner}: status={execution.status!r}: expected one of {STATUSES}")
    reward = execution.reward
    if reward is not None and not (isinstance(reward, float) and math.isfinite(reward)):
        raise ValueError(f"{owner}: reward={reward!r}: expected a finite number or None")
    attempts = execution.eval_attempts
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
        raise ValueError(f"{owner}: eval_attempts={attempts!r}: expected an int >= 0")
    for call in execution.calls:
        if not isinstance(call, ModelCall):
            raise ValueError(f"{owner}: calls holds {call!r}, expected ModelCall records")
        where = f"{owner} call {call.call_id!r}"
        if not isinstance(call.call_id, int) or isinstance(call.call_id, bool):
            raise ValueError(f"{where}: call_id={call.call_id!r}: expected an int")
        for name in ("agent_id", "role", "finish_reason"):
            value = getattr(call, name)
            if not isinstance(value, str):
                raise ValueError(f"{where}: {name}={value!r}: expected a string")
        if not isinstance(call.engines, tuple) or not all(isinstance(e, str) for e in call.engines):
            raise ValueError(f"{where}: engines={call.engines!r}: expected engine names")
        for name in ("started_at", "finished_at"):
            if not math.isfinite(getattr(call, name)):
                raise ValueError(f"{where}: {name}={getattr(call, name)!r}: expected finite")
    validate_calls(execution)


def check_token_range(
    ids: np.ndarray, vocab_size: int | None, where: str, field: str, offset: int = 0
) -> None:
    """Raises ValueError if any id in `ids` is negative or >= vocab_size.

    Args:
      ids: int32[n] token ids.
      vocab_size: exclusive upper bound, or None to check only for negatives.
      where: "execution ... call ..." for the message.
      field: which array of the call `ids` comes from.
      offset: index of ids[0] within that array, so the message names the right index.
    """
    if ids.size == 0:
        return
    lo = int(ids.min())
    hi = int(ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad_mask = ids < 0 if lo < 0 else ids >= vocab_size
        i = int(np.flatnonzero(bad_mask)[0])
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(
            f"{where}: token id {int(ids[i])} at {field}[{offset + i}] out of range {bound}"
        )


def validate_for_training(execution: Execution, eval_retry_budget: int) -> str:
    """Checks status and reward; returns what `process` does with it.

    Returns:
      "train" (finished / timed_out), "placeholder" (no_artifact: reward 0) or "drop"
      (eval_failed past its retry budget; failed: the agent crashed, so its calls say
      nothing about the policy's reward).

    Raises:
      ValueError for an unknown status, a missing or non-finite reward, or an
      eval_failed execution that still has evaluation retries left.
    """
    ex = execution.execution_id
    status = execution.status
    if status not in STATUSES:
        raise ValueError(f"execution {ex!r}: unknown status {status!r}; expected one of {STATUSES}")
    if status == "eval_failed":
        if execution.eval_attempts >= eval_retry_budget:
            return "drop"
        raise ValueError(
            f"execution {ex!r}: status eval_failed after {execution.eval_attempts} evaluation "
            f"attempt(s) < eval_retry_budget={eval_retry_budget}; re-evaluate it before training"
        )
    if status == "failed":
        return "drop"
    if status == "no_artifact":
        return "placeholder"
    if execution.reward is None:
        raise ValueError(f"execution {ex!r}: status {status!r} with reward None")
    if not math.isfinite(execution.reward):
        raise ValueError(f"execution {ex!r}: non-finite reward {execution.reward}")
    return "train"


def check_unique_ids(executions: Iterable[Execution]) -> None:
    """Raises ValueError naming the first execution id that appears twice."""
    seen: set[str] = set()
    for ex in executions:
        if ex.execution_id in seen:
            raise ValueError(f"duplicate execution id {ex.execution_id!r}")
        seen.add(ex.execution_id)
