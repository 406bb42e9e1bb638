"""The training objective of one micro-step of packed tree rows.

Each token's log-prob is read from the logits at its `pred_index` (for the first token of
a child node that is the parent node's last token, not i-1), so a prefix-shared tree
trains every token under its exact original context. The micro-step loss is
`sum(loss_weight * per_token_loss)`: the packed batch's weights already implement the
per-execution mean then the mean over executions, so summing micro-steps gives the
batch loss whatever the number of rows, paths or cells.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gyrejax.config import RLConfig
from gyrejax.model.transformer import Transformer
from gyrejax.rl.losses import TokenTerms, get_loss, kl_to_reference
from gyrejax.trajectory.rows import MICRO_STEP_FIELDS  # noqa: F401 (the fields `rows` holds)

# Metrics combined across micro-steps and cells by max; all others are summed.
MAX_METRICS = ("ratio_max", "staleness_max")


def token_logprobs(model: Transformer, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of the distribution that predicts each token.

    Args:
      model: the policy.
      rows: the packed fields of `MICRO_STEP_FIELDS` (gyrejax.trajectory.rows), each [R, L].

    Returns:
      logprob float32[R, L] of `tokens` and entropy float32[R, L]; arbitrary (finite) where
      `pred_index` is -1.
    """
    hidden = model.hidden_states(rows["tokens"], rows["positions"], rows["subtree_end"])
    source = jnp.maximum(rows["pred_index"], 0)
    predicting = jnp.take_along_axis(hidden, source[..., None], axis=1)  # [R, L, E]
    logits = model.logits(predicting)  # float32 [R, L, V]
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    token_logit = jnp.take_along_axis(logits, rows["tokens"][..., None], axis=-1)[..., 0]
    probs = jax.nn.softmax(logits, axis=-1)
    entropy = log_norm - jnp.sum(probs * logits, axis=-1)
    return token_logit - log_norm, entropy


def micro_step_loss(
    model: Transformer,
    rows: dict[str, jax.Array],
    config: RLConfig,
    trainer_version: jax.Array | int,
    ref_logprob: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted loss of one micro-step and its metrics (sums, or maxes for MAX_METRICS).

    Args:
      model: the policy (its parameters are what gradients are taken against).
      rows: packed fields, each [R, L].
      config: loss name and coefficients.
      trainer_version: the policy version being trained (for staleness).
      ref_logprob: float32[R, L] reference log-probs; required when `config.kl_coef > 0`.
    """
    weight = rows["loss_weight"].astype(jnp.float32)
    trained = weight > 0
    logprob, entropy = token_logprobs(model, rows)
    terms = TokenTerms(
        logprob=logprob,
        behavior_logprob=rows["behavior_logprob"].astype(jnp.float32),
        advantage=rows["advantage"].astype(jnp.float32),
    )
    per_token, clipped = get_loss(config.loss)(terms, config)
    metrics = {}
    if config.kl_coef > 0:
        if ref_logprob is None:
            raise ValueError("rl.kl_coef > 0 needs reference log-probs")
        kl = kl_to_reference(logprob, ref_logprob)
        per_token = per_token + config.kl_coef * kl
        metrics["kl"] = jnp.sum(weight * kl)
    loss = jnp.sum(weight * per_token)

    ratio = jax.lax.stop_gradient(terms.ratio)
    staleness = (trainer_version - rows["version"]).astype(jnp.float32)
    metrics.update(
        loss=jax.lax.stop_gradient(loss),
        clip_fraction=jnp.sum(weight * clipped),
        ratio_mean=jnp.sum(weight * ratio),
        ratio_max=jnp.max(jnp.where(trained, ratio, 0.0)),
        entropy=jnp.sum(weight * jax.lax.stop_gradient(entropy)),
        tokens=jnp.sum(trained).astype(jnp.float32),
        staleness_mean=jnp.sum(weight * staleness),
        staleness_max=jnp.max(jnp.where(trained, staleness, 0.0)),
    )
    return loss, metrics
