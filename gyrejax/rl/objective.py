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


def token_logprobs(
    model: Transformer,
    rows: dict[str, jax.Array],
    *,
    remat: str = "none",
    chunk_tokens: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of the distribution that predicts each token.

    Args:
      model: the policy.
      rows: the packed fields of `MICRO_STEP_FIELDS` (gyrejax.trajectory.rows), each [R, L].
      remat: what each decoder layer keeps for its backward (`train.remat`).
      chunk_tokens: > 0: the head runs over chunks of this many positions of every row,
        each chunk's float32 [R, chunk, vocab] logits recomputed in the backward, so no
        [R, L, vocab] buffer exists (`train.loss_chunk_tokens`); 0: all at once.

    Returns:
      logprob float32[R, L] of `tokens` and entropy float32[R, L] (no gradient: a
      metric); arbitrary (finite) where `pred_index` is -1.
    """
    hidden = model.hidden_states(rows["tokens"], rows["positions"], rows["subtree_end"], remat)
    source = jnp.maximum(rows["pred_index"], 0)
    predicting = jnp.take_along_axis(hidden, source[..., None], axis=1)  # [R, L, E]
    weights = model.output_matrix()  # float32 [E, V]
    tokens = rows["tokens"]
    length = tokens.shape[1]
    if not 0 < chunk_tokens < length:
        return _head(predicting, tokens, weights)
    # Chunks along the row, so the rows' own (fsdp) split is kept; the row is padded to
    # a whole number of chunks and the padding's outputs dropped.
    chunks = -(-length // chunk_tokens)
    pad = chunks * chunk_tokens - length
    predicting = jnp.pad(predicting, ((0, 0), (0, pad), (0, 0)))
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], chunks, chunk_tokens, *x.shape[2:]), 1, 0)
    # Under checkpoint a chunk keeps only its inputs: its logits exist one chunk at a time,
    # in the forward and again in the backward.
    head = jax.checkpoint(lambda h, t: _head(h, t, weights))
    logprob, entropy = jax.lax.map(lambda c: head(*c), (split(predicting), split(tokens)))
    unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)[:, :length]
    return unsplit(logprob), unsplit(entropy)


def _head(hidden: jax.Array, tokens: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-prob float32[..., T] of `tokens` int32[..., T] under the logits of hidden states
    float[..., T, E] and the output matrix float32[E, V], and the entropy (no gradient)."""
    logits = hidden.astype(jnp.float32) @ weights
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    token_logit = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    fixed, fixed_norm = jax.lax.stop_gradient((logits, log_norm))  # the entropy is a metric
    entropy = fixed_norm - jnp.sum(jnp.exp(fixed - fixed_norm[..., None]) * fixed, axis=-1)
    return token_logit - log_norm, entropy


def micro_step_loss(
    model: Transformer,
    rows: dict[str, jax.Array],
    config: RLConfig,
    trainer_version: jax.Array | int,
    ref_logprob: jax.Array | None = None,
    *,
    remat: str = "none",
    chunk_tokens: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted loss of one micro-step and its metrics (sums, or maxes for MAX_METRICS).

    Args:
      model: the policy (its parameters are what gradients are taken against).
      rows: packed fields, each [R, L].
      config: loss name and coefficients.
      trainer_version: the policy version being trained (for staleness).
      ref_logprob: float32[R, L] reference log-probs; required when `config.kl_coef > 0`.
      remat, chunk_tokens: memory for compute (`token_logprobs`); the loss is the same.
    """
    weight = rows["loss_weight"].astype(jnp.float32)
    trained = weight > 0
    logprob, entropy = token_logprobs(model, rows, remat=remat, chunk_tokens=chunk_tokens)
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
        entropy=jnp.sum(weight * entropy),
        tokens=jnp.sum(trained).astype(jnp.float32),
        staleness_mean=jnp.sum(weight * staleness),
        staleness_max=jnp.max(jnp.where(trained, staleness, 0.0)),
    )
    return loss, metrics
