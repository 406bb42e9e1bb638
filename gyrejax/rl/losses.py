"""Per-token policy losses, registered by name (`config.rl.loss`).

Each loss maps per-token terms (current log-prob, behaviour log-prob, advantage) to a
per-token loss; the trainer multiplies by the packed batch's `loss_weight` (per-execution
mean, then mean over executions) and sums. Ratios are importance weights
`exp(logprob - behavior_logprob)` of the policy being trained over the policy that
sampled the token, so staleness and mid-request weight updates are corrected exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gyrejax.config import RLConfig


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """Per-token inputs of a loss; every array float32[R, L].

    Attributes:
      logprob: log-prob of the token under the policy being trained (differentiable).
      behavior_logprob: log-prob under the policy that sampled it.
      advantage: the execution's group-relative advantage.
    """

    logprob: jax.Array
    behavior_logprob: jax.Array
    advantage: jax.Array

    @property
    def ratio(self) -> jax.Array:
        return jnp.exp(self.logprob - self.behavior_logprob)


# loss(terms, config) -> (per-token loss [R, L], per-token "clipped" indicator [R, L]).
LossFn = Callable[[TokenTerms, RLConfig], tuple[jax.Array, jax.Array]]
_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Registers a loss under `name` (the value of `config.rl.loss`)."""

    def register(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return register


def get_loss(name: str) -> LossFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def registered_losses() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _clipped_surrogate(terms: TokenTerms, low: float, high: float):
    ratio = terms.ratio
    unclipped = ratio * terms.advantage
    clipped = jnp.clip(ratio, 1.0 - low, 1.0 + high) * terms.advantage
    # Pessimistic bound: the clipped branch binds (and stops the gradient) when smaller.
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


@register_loss("ppo")
def ppo(terms: TokenTerms, config: RLConfig):
    """PPO clipped surrogate with separate low/high clip ("clip-higher")."""
    return _clipped_surrogate(terms, config.clip_low, config.clip_high)


@register_loss("grpo")
def grpo(terms: TokenTerms, config: RLConfig):
    """GRPO: the clipped surrogate with a symmetric clip of `clip_low`.

    (The group-relative advantage comes from the trajectory processor; the KL to the
    reference, when `kl_coef > 0`, is added by the objective for every loss.)
    """
    return _clipped_surrogate(terms, config.clip_low, config.clip_low)


@register_loss("tis")
def truncated_importance_sampling(terms: TokenTerms, config: RLConfig):
    """REINFORCE with a truncated importance weight: -min(ratio, cap) * A * logprob.

    The weight is a constant (no gradient through it); only the log-prob is trained.
    """
    ratio = terms.ratio
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, config.tis_cap))
    loss = -weight * terms.advantage * terms.logprob
    return loss, (ratio > config.tis_cap).astype(jnp.float32)


@register_loss("sft")
def sft(terms: TokenTerms, config: RLConfig):
    """Negative log-likelihood (warm starts); ignores advantages and ratios."""
    del config
    return -terms.logprob, jnp.zeros_like(terms.logprob)


def kl_to_reference(logprob: jax.Array, ref_logprob: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1, d = ref - logprob.

    Non-negative, unbiased for samples from the policy, and low-variance.
    """
    d = ref_logprob - logprob
    return jnp.exp(d) - d - 1.0
