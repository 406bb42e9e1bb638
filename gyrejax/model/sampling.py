"""Token sampling and a simple batched generation loop over the KV cache.

`sample_tokens` is the one place that turns logits into tokens and behaviour log-probs;
the rollout engine reuses it. `generate` runs prompts to completion (launch smoke runs,
the `gyrejax.generate` command, parity tests); continuous batching lives in the engine.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyrejax.model.transformer import KVCache, Transformer

_MIN_BUCKET = 16


def bucket_length(n: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum): few distinct shapes, few compiles."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and returns its log-prob under the distribution used.

    Args:
      logits: float32[S, vocab].
      key: PRNG key.
      temperature: 0 means greedy; the log-prob is then under the model's own
        (temperature 1) distribution.

    Returns:
      tokens int32[S] and log-probs float32[S].
    """
    if temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        tokens = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample_per_slot(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per slot with that slot's own parameters.

    The random key of a slot's n-th generated token is `fold_in(key(seed), n)`, so a
    request samples the same tokens whatever else shares the batch and wherever it
    migrates. The log-prob is under the distribution actually sampled from: tempered,
    then restricted to the top-k and top-p set and renormalised. Temperature 0 is
    greedy, with the log-prob under the model's own distribution.

    Args:
      logits: float32[S, V].
      temperature: float32[S]; 0 is greedy.
      top_k: int32[S]; 0 keeps every token.
      top_p: float32[S] in (0, 1]; 1 keeps every token.
      seed: int32[S] per-request seeds.
      index: int32[S] index of the token being sampled within its request's output.

    Returns:
      tokens int32[S] and log-probs float32[S].
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    # Sorting the vocabulary is the costly part: skip it when no slot truncates.
    truncating = jnp.any((top_k > 0) | (top_p < 1))
    allowed = jax.lax.cond(truncating, _truncate, lambda s, k, p: s, scaled, top_k, top_p)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, index)
        sampled = jax.vmap(jax.random.categorical)(keys, allowed).astype(jnp.int32)
        return jnp.where(greedy, argmax, sampled)

    tokens = jax.lax.cond(jnp.all(greedy), lambda: argmax, draw)
    greedy_logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), argmax[:, None], -1)[:, 0]
    logp = jax.nn.log_softmax(allowed, axis=-1)
    sampled_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    return tokens, jnp.where(greedy, greedy_logp, sampled_logp)


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then top-p, set to -inf."""
    threshold = truncation_threshold(scaled, top_k, top_p)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def truncation_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest tempered logit each row keeps under its top-k, then top-p, cut.

    The kept set is every token whose logit is >= the threshold: the k largest
    (ties at the k-th included), then of those the smallest most-likely prefix whose
    probability mass reaches top_p. The engine samples from it and the trainer
    (`gyrejax.rl.objective`) renormalises over it, both through this function, so an
    unchanged policy's importance ratio is exactly 1.

    Args:
      scaled: float32[S, V] logits divided by the temperature.
      top_k: int32[S]; 0 keeps every token.
      top_p: float32[S] in (0, 1]; 1 keeps every token.

    Returns:
      float32[S]. Sorts the vocabulary: skip it (`lax.cond`) when nothing truncates.
    """
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)[:, 0]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    # Nucleus over the top-k set: keep the smallest prefix whose mass reaches top_p.
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = in_top_k & (mass_before < top_p[:, None])
    last_kept = jnp.sum(keep_sorted, axis=-1) - 1
    return jnp.maximum(jnp.take_along_axis(ordered, last_kept[:, None], axis=-1)[:, 0], kth)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(5,))
def _prefill_and_sample(graphdef, state, tokens, lengths, slots, cache, temperature, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(tokens, lengths, slots, cache)
    next_tokens, logprobs = sample_tokens(logits, key, temperature)
    return next_tokens, logprobs, cache


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _decode_and_sample(graphdef, state, tokens, cache, active, temperature, key):
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(tokens, cache, active)
    next_tokens, logprobs = sample_tokens(logits, key, temperature)
    return next_tokens, logprobs, cache


@dataclasses.dataclass(frozen=True)
class Generation:
    """New tokens of one prompt and the behaviour log-prob of each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop id was generated) or "length"


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> list[Generation]:
    """Generates for a batch of prompts with the KV-cache path.

    A generated stop id is included in the output and ends that sequence.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens}, expected > 0")
    vocab = model.config.vocab_size
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"generate: prompt {i} has token {bad[0]} outside [0, {vocab})")
    temperature = float(temperature)
    n = len(prompts)
    longest = max(len(p) for p in prompts)
    bucket = bucket_length(longest)
    cache = KVCache.create(model.config, n, bucket_length(bucket + max_new_tokens))
    tokens = np.zeros((n, bucket), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = prompt
    lengths = np.array([len(p) for p in prompts], np.int32)

    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    key, step_key = jax.random.split(key)
    next_tokens, logprobs, cache = _prefill_and_sample(
        graphdef, state, tokens, lengths, np.arange(n, dtype=np.int32), cache, temperature, step_key
    )
    stops = set(stop_ids)
    outputs: list[list[int]] = [[] for _ in range(n)]
    scores: list[list[float]] = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    reasons = ["length"] * n
    for step in range(max_new_tokens):
        host_tokens, host_logprobs = jax.device_get((next_tokens, logprobs))
        for i in np.flatnonzero(~done):
            outputs[i].append(int(host_tokens[i]))
            scores[i].append(float(host_logprobs[i]))
            if host_tokens[i] in stops:
                done[i], reasons[i] = True, "stop"
        if done.all() or step == max_new_tokens - 1:
            break
        key, step_key = jax.random.split(key)
        next_tokens, logprobs, cache = _decode_and_sample(
            graphdef, state, next_tokens, cache, jnp.asarray(~done), temperature, step_key
        )
    return [Generation(o, s, r) for o, s, r in zip(outputs, scores, reasons, strict=True)]
