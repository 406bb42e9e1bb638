"""Group-relative advantage estimators, registered by name.

An estimator maps the rewards of one group (float64[n], n >= 1) to one advantage per
execution (float64[n]), given the std convention (`std`: one of `ADVANTAGE_STDS`, the
config's `rl.advantage_std`; estimators that do not divide by a std ignore it). Pick one
by name in `process(..., advantage=name, advantage_std=std)`; add one with
`@register_advantage("name")`. Rewards reach the estimator through `shape_rewards`
(`rl.reward_shaping`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

AdvantageFn = Callable[..., np.ndarray]  # fn(rewards: float64[n], *, std: str) -> float64[n]

GRPO_EPS = 1e-6
# The group std's delta degrees of freedom by name: "unbiased" (ddof=1, as verl and TRL
# normalise GRPO advantages) or "population" (ddof=0).
ADVANTAGE_STDS = {"unbiased": 1, "population": 0}

# What an estimator sees of each reward (rl.reward_shaping): "as_is", or "pass": 1 for an
# execution that reached `PASS_REWARD` (every hidden check, as held-out pass@1 counts it),
# else 0, so partial credit earns no advantage over nothing.
REWARD_SHAPINGS = ("as_is", "pass")
PASS_REWARD = 1.0

_REGISTRY: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering `fn(rewards: float64[n], *, std: str) -> float64[n]` under
    `name`."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def known_advantages() -> list[str]:
    """Names of the registered estimators."""
    return sorted(_REGISTRY)


def get_advantage(name: str) -> AdvantageFn:
    """Looks an estimator up by name (ValueError listing the known names if absent)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {known_advantages()}"
        ) from None


def shape_rewards(rewards: np.ndarray, shaping: str) -> np.ndarray:
    """`rewards` (float64[n]) as the estimators see them under `shaping` (see
    `REWARD_SHAPINGS`)."""
    r = np.asarray(rewards, dtype=np.float64)
    if shaping == "as_is":
        return r
    if shaping == "pass":
        return (r >= PASS_REWARD).astype(np.float64)
    raise ValueError(f"reward shaping {shaping!r}; expected one of {', '.join(REWARD_SHAPINGS)}")


@register_advantage("grpo")
def grpo(rewards: np.ndarray, *, std: str = "unbiased") -> np.ndarray:
    """(r - mean) / (std + eps) over the group; `std` "unbiased" (ddof=1) or "population"
    (ddof=0). A group of one has advantage 0: a lone execution has no group baseline (and
    the unbiased std of one value is undefined)."""
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"advantage std {std!r}; expected one of {', '.join(ADVANTAGE_STDS)}")
    r = np.asarray(rewards, dtype=np.float64)
    if len(r) < 2:
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=ADVANTAGE_STDS[std]) + GRPO_EPS)


@register_advantage("mean_centered")
def mean_centered(rewards: np.ndarray, *, std: str = "unbiased") -> np.ndarray:
    """r - group mean (Dr. GRPO style: no std normalisation; `std` unused)."""
    r = np.asarray(rewards, dtype=np.float64)
    return r - r.mean()


@register_advantage("rloo")
def rloo(rewards: np.ndarray, *, std: str = "unbiased") -> np.ndarray:
    """r_i - mean of the other members' rewards; 0 for a group of one (`std` unused)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = len(r)
    if n < 2:
        return np.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)
