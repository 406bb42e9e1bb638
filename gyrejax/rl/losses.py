"""Per-token policy losses, registered by name (`config.rl.loss`).

Each loss maps per-token terms (current log-prob, behaviour log-prob, advantage) to a
per-token loss; the trainer multiplies by the packed batch's `loss_weight` (per-execution
mean, then mean over executions) and sums. Ratios are importance weights
`exp(logprob - behavior_logprob)` of the policy being trained over the policy that
sampled the token, both under the distribution actually sampled (temperature, top-k,
top-p), so staleness and mid-request weight updates are corrected exactly. The log-ratio
is clamped to +-`rl.log_ratio_clamp` (no gradient beyond), so no single token's ratio
overflows the loss.

KL estimators to a reference policy (`rl.kl_estimator`) are registered here too.
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
      log_ratio_clamp: the log-ratio is clipped to [-clamp, clamp] (a float, not an
        array), so the ratio stays finite; beyond it the ratio has no gradient.
      proximal_logprob: log-prob under the proximal policy, the weights the step's
        update starts from (no gradient); None: the log-prob's own value, which it is
        when one update is taken per batch, as the trainer does.
    """

    logprob: jax.Array
    behavior_logprob: jax.Array
    advantage: jax.Array
    log_ratio_clamp: float = 20.0
    proximal_logprob: jax.Array | None = None

    @property
    def proximal(self) -> jax.Array:
        if self.proximal_logprob is None:
            return jax.lax.stop_gradient(self.logprob)
        return jax.lax.stop_gradient(self.proximal_logprob)

    @property
    def ratio(self) -> jax.Array:
        clamp = self.log_ratio_clamp
        return jnp.exp(jnp.clip(self.logprob - self.behavior_logprob, -clamp, clamp))


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


def _clipped_surrogate(terms: TokenTerms, low: float, high: float, dual: float):
    """-min(r A, clip(r, 1 - low, 1 + high) A), and for A < 0 at most -dual * A.

    Gradient weight on the log-prob (d loss / d logprob = -w A): w = r inside the clip
    band and where the band would raise the objective, 0 where it binds; with A < 0 the
    plain clip leaves w = r unbounded as r grows, so dual-clip (Ye et al. 2020) caps the
    loss at -dual * A: w = 0 for r > dual. dual = 0 turns it off.
    """
    ratio = terms.ratio
    unclipped = ratio * terms.advantage
    clipped = jnp.clip(ratio, 1.0 - low, 1.0 + high) * terms.advantage
    # Pessimistic bound: the clipped branch binds (and stops the gradient) when smaller.
    loss = -jnp.minimum(unclipped, clipped)
    bound = clipped < unclipped
    if dual > 0:
        capped = (terms.advantage < 0) & (loss > -dual * terms.advantage)
        loss = jnp.where(capped, -dual * terms.advantage, loss)
        bound |= capped
    return loss, bound.astype(jnp.float32)


@register_loss("ppo")
def ppo(terms: TokenTerms, config: RLConfig):
    """PPO clipped surrogate with separate low/high clip ("clip-higher") and dual-clip
    (`rl.clip_ratio_c`) for negative advantages."""
    return _clipped_surrogate(terms, config.clip_low, config.clip_high, config.clip_ratio_c)


@register_loss("grpo")
def grpo(terms: TokenTerms, config: RLConfig):
    """GRPO: the clipped surrogate with a symmetric clip of `clip_low` (and dual-clip).

    (The group-relative advantage comes from the trajectory processor; the KL to the
    reference, when `kl_coef > 0`, is added by the objective for every loss.)
    """
    return _clipped_surrogate(terms, config.clip_low, config.clip_low, config.clip_ratio_c)


@register_loss("decoupled_ppo")
def decoupled_ppo(terms: TokenTerms, config: RLConfig):
    """Decoupled PPO (after AReaL): the clipped surrogate of the ratio to the proximal
    policy (the weights the update starts from), not to the behaviour policy, weighted
    by the behaviour-to-proximal importance weight min(pi_prox / mu, tis_cap), a
    constant. The engine's staleness and its numerical mismatch with the trainer then
    only scale a token's pull (capped), and the clip bounds how far one update moves.

    With one update per batch (this trainer), the proximal policy is the one being
    differentiated: its ratio is 1 with gradient grad log pi, the clip never binds, and
    the gradient equals `tis`'s. The two differ once a batch takes several updates.
    """
    clamp = terms.log_ratio_clamp
    proximal = terms.proximal
    staleness = jnp.exp(jnp.clip(proximal - terms.behavior_logprob, -clamp, clamp))
    weight = jnp.minimum(staleness, config.tis_cap)  # a constant: proximal has no gradient
    to_proximal = dataclasses.replace(terms, behavior_logprob=proximal, proximal_logprob=None)
    loss, clipped = _clipped_surrogate(
        to_proximal, config.clip_low, config.clip_high, config.clip_ratio_c
    )
    return weight * loss, clipped


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


# kl(logprob, ref_logprob) -> per-token estimate [R, L] of KL(policy || reference).
KlEstimator = Callable[[jax.Array, jax.Array], jax.Array]
_KL_ESTIMATORS: dict[str, KlEstimator] = {}


def get_kl_estimator(name: str) -> KlEstimator:
    try:
        return _KL_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(_KL_ESTIMATORS))
        raise ValueError(f"unknown KL estimator {name!r}; known: {known}") from None


# Schulman's estimators of KL(pi || ref) from tokens sampled from pi, with
# d = log pi(x) - log ref(x). As a loss term each is differentiated through log pi at
# the sampled tokens (not through the sampling), so what the gradient follows differs
# from what the value estimates; on-policy (tokens from pi):
#   k1 = d:              value unbiased for KL(pi || ref); gradient E[grad log pi] = 0:
#                        optimises nothing in expectation (a metric, or with a score term).
#   k2 = d^2 / 2:        value biased (low variance); gradient E[d grad log pi]
#                        = grad KL(pi || ref): the reverse KL.
#   k3 = e^-d - 1 + d:   value unbiased for KL(pi || ref), >= 0; gradient
#                        E[(1 - ref/pi) grad log pi] = grad KL(ref || pi): the forward KL.
def _k1(logprob: jax.Array, ref_logprob: jax.Array) -> jax.Array:
    return logprob - ref_logprob


def _k2(logprob: jax.Array, ref_logprob: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(logprob - ref_logprob)


def _k3(logprob: jax.Array, ref_logprob: jax.Array) -> jax.Array:
    d = jnp.clip(ref_logprob - logprob, -20.0, 20.0)  # e^d stays finite
    return jnp.exp(d) - d - 1.0


_KL_ESTIMATORS.update(k1=_k1, k2=_k2, k3=_k3)
