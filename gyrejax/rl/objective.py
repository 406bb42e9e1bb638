"""The training objective of one micro-step of packed tree rows.

Each token's log-prob is read from the logits at its `pred_index` (for the first token of
a child node that is the parent node's last token, not i-1), so a prefix-shared tree
trains every token under its exact original context. The micro-step loss is
`sum(loss_weight * per_token_loss)`: the packed batch's weights already implement the
per-execution mean then the mean over executions, so summing micro-steps gives the
batch loss whatever the number of rows, paths or cells.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gyrejax.config import RLConfig
from gyrejax.model.sampling import truncation_threshold
from gyrejax.model.transformer import Transformer
from gyrejax.rl.losses import TokenTerms, get_kl_estimator, get_loss
from gyrejax.trajectory.rows import MICRO_STEP_FIELDS  # noqa: F401 (the fields `rows` holds)

# Metrics combined across micro-steps and cells by max; all others are summed, then
# `finish_metrics` turns the mismatch sums into means and a p99.
MAX_METRICS = ("ratio_max", "staleness_max", "mismatch_abs_max")
# The histogram of |trainer - engine| log-prob differences the mismatch p99 is read from:
# bin i counts differences in [edge[i - 1], edge[i]) (bin 0 below 1e-7, the last above
# 10), 8 bins a decade, so the p99 is known within a factor 10^(1/8) = 1.33.
MISMATCH_EDGES = tuple(float(x) for x in np.logspace(-7, 1, 8 * 8 + 1))
_MISMATCH_BIN = "mismatch_bin_{:02d}"


class TokenLogprobs(NamedTuple):
    """What the head gives per token, each float32 or bool [R, L].

    Attributes:
      logprob: log-prob of the token under the distribution it was sampled from
        (tempered, truncated to the top-k/top-p set and renormalised), differentiable;
        finite everywhere.
      entropy: that distribution's entropy (no gradient: a metric).
      unreproduced: the trainer cannot reproduce the distribution the token was sampled
        from, so its ratio means nothing: the token lies outside the top-k/top-p set the
        trainer cuts (the engine's logits differed at the boundary), or its tempered
        logits could overflow float32 (a temperature near 0). Their `logprob` is 0 and
        their logits are computed at temperature 1, so nothing non-finite enters the
        backward.
    """

    logprob: jax.Array
    entropy: jax.Array
    unreproduced: jax.Array


def token_logprobs(
    model: Transformer,
    rows: dict[str, jax.Array],
    *,
    remat: str = "none",
    chunk_tokens: int = 0,
) -> TokenLogprobs:
    """Log-prob and entropy of the distribution each token was sampled from.

    The logits are divided by the row's per-token `temperature` and cut to its `top_k`
    and `top_p` set exactly as the engine cut them (`sampling.truncation_threshold`),
    so the trainer's log-prob of an unchanged policy equals the behaviour log-prob. The
    cut sorts the vocabulary; it is skipped when no token of the micro-step was cut.

    Args:
      model: the policy.
      rows: the packed fields of `MICRO_STEP_FIELDS` (gyrejax.trajectory.rows), each [R, L].
      remat: what each decoder layer keeps for its backward (`train.remat`).
      chunk_tokens: > 0: the head runs over chunks of this many positions of every row,
        each chunk's float32 [R, chunk, vocab] logits recomputed in the backward, so no
        [R, L, vocab] buffer exists (`train.loss_chunk_tokens`); 0: all at once.

    Returns:
      `TokenLogprobs`; arbitrary (finite) where `pred_index` is -1.
    """
    hidden = model.hidden_states(rows["tokens"], rows["positions"], rows["subtree_end"], remat)
    source = jnp.maximum(rows["pred_index"], 0)
    predicting = jnp.take_along_axis(hidden, source[..., None], axis=1)  # [R, L, E]
    weights = model.output_matrix()  # float32 [E, V]
    per_token = (
        rows["tokens"],
        rows["temperature"].astype(jnp.float32),
        rows["top_k"].astype(jnp.int32),
        rows["top_p"].astype(jnp.float32),
    )
    truncating = jnp.any((per_token[2] > 0) | (per_token[3] < 1))
    # Once per micro-step, not per chunk (and not again in each chunk's recompute).
    column = jax.lax.stop_gradient(jnp.max(jnp.linalg.norm(weights, axis=0)))
    length = per_token[0].shape[1]
    if not 0 < chunk_tokens < length:
        return TokenLogprobs(*_head(predicting, *per_token, weights, column, truncating))
    # Chunks along the row, so the rows' own (fsdp) split is kept; the row is padded to
    # a whole number of chunks and the padding's outputs dropped.
    chunks = -(-length // chunk_tokens)
    pad = chunks * chunk_tokens - length
    padded = (predicting, *per_token)
    padded = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in padded]
    for i in (2, 4):  # the padding's temperature and top_p: 1, a valid distribution
        padded[i] = padded[i].at[:, length:].set(1.0)
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], chunks, chunk_tokens, *x.shape[2:]), 1, 0)
    # Under checkpoint a chunk keeps only its inputs: its logits exist one chunk at a time,
    # in the forward and again in the backward.
    head = jax.checkpoint(lambda *c: _head(*c, weights, column, truncating))
    outputs = jax.lax.map(lambda c: head(*c), tuple(split(x) for x in padded))
    unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1)[:, :length]
    return TokenLogprobs(*(unsplit(x) for x in outputs))


def _head(hidden, tokens, temperature, top_k, top_p, weights, column, truncating):
    """Per token of hidden states float[..., T, E]: the log-prob of `tokens` int32[..., T]
    under the logits (output matrix float32[E, V]) divided by `temperature` float32[..., T]
    and cut to `top_k` int32[..., T] / `top_p` float32[..., T] when `truncating`; the
    entropy of that distribution (no gradient); whether it is `unreproduced`. `column`:
    the largest column norm of the output matrix (no gradient)."""
    hidden = hidden.astype(jnp.float32)
    # Tempered before the matmul, so the logits are one [..., V] buffer. |logit| <=
    # |h| * the largest column norm of W (`column`): where that bound over the
    # temperature is not finite the logits could overflow, so the token is computed at
    # temperature 1.
    bound = jnp.linalg.norm(hidden, axis=-1) * column
    overflow = jax.lax.stop_gradient(~jnp.isfinite(bound / temperature))
    logits = (hidden / jnp.where(overflow, 1.0, temperature)[..., None]) @ weights
    fixed = jax.lax.stop_gradient(logits)  # the cut is a set: no gradient flows through it
    threshold = jax.lax.cond(
        truncating,
        _blocked_threshold,
        lambda x, k, p: jnp.full(x.shape[:1], -jnp.inf, x.dtype),
        fixed.reshape(-1, fixed.shape[-1]),
        top_k.reshape(-1),
        top_p.reshape(-1),
    ).reshape(fixed.shape[:-1])
    # The cut as an added -inf with no gradient: the backward then keeps one float32
    # [..., V] buffer, as without a cut (a select would keep its mask or a second copy).
    cut = logits + jax.lax.stop_gradient(jnp.where(fixed >= threshold[..., None], 0.0, -jnp.inf))
    token_logit = jnp.take_along_axis(cut, tokens[..., None], axis=-1)[..., 0]  # -inf if cut
    log_norm = jax.nn.logsumexp(cut, axis=-1)
    fixed_cut, fixed_norm = jax.lax.stop_gradient((cut, log_norm))  # the entropy is a metric
    # exp(-inf) = 0 drops the cut tokens; the maximum keeps 0 * -inf from making a NaN.
    mass = jnp.exp(fixed_cut - fixed_norm[..., None]) * jnp.maximum(fixed_cut, -1e30)
    entropy = fixed_norm - jnp.sum(mass, axis=-1)
    outside = jax.lax.stop_gradient(token_logit) == -jnp.inf
    logprob = jnp.where(outside | overflow, 0.0, token_logit - log_norm)  # finite everywhere
    return logprob, entropy, outside | overflow


# Tokens whose vocabulary is sorted at once when the cut is reproduced: XLA reserves the
# sort's buffers whether or not the branch runs, so they are bounded to a few
# [block, vocab] copies, not the micro-step's (or the chunk's) [tokens, vocab].
THRESHOLD_BLOCK = 256


def _blocked_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`truncation_threshold` of logits float32[T, V], THRESHOLD_BLOCK tokens at a time
    (the last block overlaps the one before rather than padding: no [T, V] copy)."""
    n = logits.shape[0]
    block = min(THRESHOLD_BLOCK, n)

    def one(i, out):
        start = jnp.minimum(i * block, n - block)
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block)
        threshold = truncation_threshold(cut(logits), cut(top_k), cut(top_p))
        return jax.lax.dynamic_update_slice_in_dim(out, threshold, start, 0)

    return jax.lax.fori_loop(0, -(-n // block), one, jnp.full((n,), -jnp.inf, logits.dtype))


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

    A trained token whose ratio means nothing is dropped, not the step: one the head
    marks `unreproduced`, or one whose log-prob or reference log-prob is not finite.
    Its loss weight stays out of the sum (the step's loss is that much smaller) and it
    is counted in `dropped_tokens`.

    Args:
      model: the policy (its parameters are what gradients are taken against).
      rows: packed fields, each [R, L].
      config: loss name and coefficients.
      trainer_version: the policy version being trained (for staleness).
      ref_logprob: float32[R, L] reference log-probs under the same sampling settings;
        required when `config.kl_coef > 0`.
      remat, chunk_tokens: memory for compute (`token_logprobs`); the loss is the same.
    """
    weight = rows["loss_weight"].astype(jnp.float32)
    trained = weight > 0
    head = token_logprobs(model, rows, remat=remat, chunk_tokens=chunk_tokens)
    behaviour = rows["behavior_logprob"].astype(jnp.float32)
    usable = trained & ~head.unreproduced & jnp.isfinite(jax.lax.stop_gradient(head.logprob))
    if ref_logprob is not None:
        usable &= jnp.isfinite(ref_logprob)
    # Dropped tokens read the behaviour log-prob (ratio 1), so nothing non-finite enters
    # the loss or its gradient.
    logprob = jnp.where(usable, head.logprob, behaviour)
    terms = TokenTerms(
        logprob=logprob,
        behavior_logprob=behaviour,
        advantage=rows["advantage"].astype(jnp.float32),
        log_ratio_clamp=config.log_ratio_clamp,
    )  # the proximal policy is the weights being differentiated (one update per batch)
    per_token, clipped = get_loss(config.loss)(terms, config)
    metrics = {}
    if config.kl_coef > 0:
        if ref_logprob is None:
            raise ValueError("rl.kl_coef > 0 needs reference log-probs")
        reference = jnp.where(usable, ref_logprob, logprob)
        kl = jnp.where(usable, get_kl_estimator(config.kl_estimator)(logprob, reference), 0.0)
        per_token = per_token + config.kl_coef * kl
        metrics["kl"] = jnp.sum(weight * kl)
    loss = jnp.sum(jnp.where(usable, weight * per_token, 0.0))

    ratio = jax.lax.stop_gradient(terms.ratio)
    staleness = (trainer_version - rows["version"]).astype(jnp.float32)
    kept = lambda x: jnp.sum(jnp.where(usable, weight * x, 0.0))  # over the kept tokens
    metrics.update(
        loss=jax.lax.stop_gradient(loss),
        clip_fraction=kept(clipped),
        ratio_mean=kept(ratio),
        ratio_max=jnp.max(jnp.where(usable, ratio, 0.0)),
        entropy=kept(head.entropy),
        tokens=jnp.sum(trained).astype(jnp.float32),
        dropped_tokens=jnp.sum(trained & ~usable).astype(jnp.float32),
        staleness_mean=jnp.sum(weight * staleness),
        staleness_max=jnp.max(jnp.where(trained, staleness, 0.0)),
    )
    # Train/inference mismatch: on tokens the current weights sampled, any difference of
    # the trainer's log-prob from the engine's is numerics, not learning.
    current = usable & (rows["version"] == trainer_version)
    d = jnp.clip(jax.lax.stop_gradient(logprob) - behaviour, -20.0, 20.0)
    gap = jnp.where(current, jnp.abs(d), 0.0)
    bins = jnp.searchsorted(jnp.asarray(MISMATCH_EDGES, jnp.float32), gap, side="right")
    counts = jnp.zeros(len(MISMATCH_EDGES) + 1).at[bins].add(current.astype(jnp.float32))
    metrics.update(
        mismatch_tokens=jnp.sum(current).astype(jnp.float32),
        mismatch_abs_sum=jnp.sum(gap),
        mismatch_abs_max=jnp.max(gap),
        # k3 estimate of KL(engine || trainer) from the engine's samples: e^d - 1 - d.
        mismatch_kl_sum=jnp.sum(jnp.where(current, jnp.expm1(d) - d, 0.0)),
        **{_MISMATCH_BIN.format(i): c for i, c in enumerate(counts)},
    )
    return loss, metrics


def finish_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's combined metrics with the mismatch sums turned into figures: the mean,
    p99 (the upper edge of its `MISMATCH_EDGES` bin) and max absolute log-prob difference
    of trainer and engine, and the mismatch KL, over the tokens the current weights
    sampled (`mismatch_tokens`; the figures are absent when there were none)."""
    out = {k: v for k, v in metrics.items() if not k.startswith("mismatch_bin_")}
    count = out.get("mismatch_tokens", 0.0)
    abs_sum, kl_sum = out.pop("mismatch_abs_sum", 0.0), out.pop("mismatch_kl_sum", 0.0)
    if not count:
        out.pop("mismatch_abs_max", None)
        return out
    bins = [metrics[_MISMATCH_BIN.format(i)] for i in range(len(MISMATCH_EDGES) + 1)]
    below = np.searchsorted(np.cumsum(bins), 0.99 * count)
    edges = (*MISMATCH_EDGES, float("inf"))
    out.update(
        mismatch_abs_mean=abs_sum / count,
        mismatch_abs_p99=min(edges[below], out["mismatch_abs_max"]),
        mismatch_kl=kl_sum / count,
    )
    return out
