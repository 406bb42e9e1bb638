"""Sampling: log-probs under the distribution used, seeds, stop ids, bad prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.config import ModelConfig
from gyrejax.model.sampling import bucket_length, generate, sample_per_slot, sample_tokens
from gyrejax.model.transformer import init_model

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_greedy_logprob_is_under_the_model_distribution():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 10)), jnp.float32)
    tokens, logprobs = sample_tokens(logits, jax.random.key(0), 0.0)
    ref = jax.nn.log_softmax(logits)
    assert np.array_equal(tokens, np.argmax(logits, -1))
    np.testing.assert_allclose(logprobs, ref[np.arange(3), tokens], atol=1e-6)


def test_sampled_tokens_follow_the_tempered_distribution():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    temperature = 0.7
    keys = jax.random.split(jax.random.key(1), 20_000)
    tokens, logprobs = jax.vmap(lambda k: sample_tokens(logits, k, temperature))(keys)
    probs = np.asarray(jax.nn.softmax(logits[0] / temperature))
    counts = np.bincount(np.asarray(tokens)[:, 0], minlength=4) / len(keys)
    np.testing.assert_allclose(counts, probs, atol=0.015)  # ~4 standard errors
    np.testing.assert_allclose(
        np.exp(np.asarray(logprobs)[:, 0]), probs[np.asarray(tokens)[:, 0]], rtol=1e-5
    )


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = init_model(CONFIG)
    runs = [
        generate(model, [[1, 2, 3]], max_new_tokens=12, temperature=1.0, seed=s)[0]
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1]
    assert runs[0].token_ids != runs[2].token_ids


def test_stop_id_ends_one_sequence_but_not_the_others():
    model = init_model(CONFIG)
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, max_new_tokens=8)
    stop = free[0].token_ids[2]
    first = free[0].token_ids.index(stop)
    stopped = generate(model, prompts, max_new_tokens=8, stop_ids=[stop])
    assert stopped[0].token_ids == free[0].token_ids[: first + 1]
    assert stopped[0].finish_reason == "stop"
    if stop not in free[1].token_ids:
        assert stopped[1].token_ids == free[1].token_ids and stopped[1].finish_reason == "length"


@pytest.mark.parametrize(
    ("prompts", "message"), [([[]], "at least one token"), ([[1, 64]], "token 64 outside")]
)
def test_bad_prompts(prompts, message):
    with pytest.raises(ValueError, match=message):
        generate(init_model(CONFIG), prompts, max_new_tokens=2)


def numpy_processed_logprobs(logits, temperature, top_k, top_p):
    """Reference: tempered, top-k then top-p restricted, renormalised log-probs (-inf out)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros_like(scaled, bool)
    k = top_k if top_k > 0 else len(scaled)
    probs = np.exp(scaled[order[:k]] - scaled[order[:k]].max())
    probs /= probs.sum()
    mass = 0.0
    for rank, index in enumerate(order[:k]):
        if mass >= top_p:
            break
        keep[index] = True
        mass += probs[rank]
    out = np.full_like(scaled, -np.inf)
    z = np.log(np.exp(scaled[keep] - scaled[keep].max()).sum()) + scaled[keep].max()
    out[keep] = scaled[keep] - z
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.8)]
)
def test_per_slot_sampling_uses_the_processed_distribution(temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 20)).astype(np.float32) * 2
    ref = numpy_processed_logprobs(logits[0], temperature, top_k, top_p)
    n = 4000
    tokens, logprobs = sample_per_slot(
        jnp.asarray(np.repeat(logits, n, 0)),
        jnp.full(n, temperature, jnp.float32),
        jnp.full(n, top_k, jnp.int32),
        jnp.full(n, top_p, jnp.float32),
        jnp.full(n, 3, jnp.int32),
        jnp.arange(n, dtype=jnp.int32),
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert np.isfinite(ref[tokens]).all()  # never outside the allowed set
    np.testing.assert_allclose(logprobs, ref[tokens], atol=1e-5)
    counts = np.bincount(tokens, minlength=20) / n
    np.testing.assert_allclose(counts, np.exp(ref), atol=0.03)


def test_per_slot_sampling_depends_only_on_seed_and_index():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((3, 30)), jnp.float32)
    args = dict(
        temperature=jnp.asarray([1.0, 0.0, 0.8]),
        top_k=jnp.asarray([0, 0, 6], jnp.int32),
        top_p=jnp.asarray([1.0, 1.0, 0.9]),
        seed=jnp.asarray([11, 12, 13], jnp.int32),
        index=jnp.asarray([4, 0, 9], jnp.int32),
    )
    batch_tokens, batch_logprobs = sample_per_slot(logits, **args)
    for i in range(3):  # each slot alone gives the same result
        alone = {k: v[i : i + 1] for k, v in args.items()}
        token, logprob = sample_per_slot(logits[i : i + 1], **alone)
        assert int(token[0]) == int(batch_tokens[i])
        np.testing.assert_allclose(float(logprob[0]), float(batch_logprobs[i]), atol=1e-6)
    assert int(batch_tokens[1]) == int(jnp.argmax(logits[1]))  # temperature 0: greedy
