"""Losses against NumPy formulas; the registry matches what the config accepts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.config import LOSSES, RLConfig
from gyrejax.rl.losses import TokenTerms, get_loss, kl_to_reference, registered_losses

CONFIG = RLConfig(clip_low=0.2, clip_high=0.28, tis_cap=1.5)


def terms(seed=0, shape=(3, 50)):
    rng = np.random.default_rng(seed)
    behavior = rng.uniform(-4, -0.1, shape).astype(np.float32)
    logprob = (behavior + rng.normal(0, 0.4, shape)).astype(np.float32)
    advantage = rng.normal(0, 1, shape).astype(np.float32)
    return logprob, behavior, advantage


def evaluate(name, logprob, behavior, advantage, config=CONFIG):
    fn = get_loss(name)

    def total(lp):
        loss, _ = fn(TokenTerms(lp, jnp.asarray(behavior), jnp.asarray(advantage)), config)
        return loss.sum(), loss

    (_, loss), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(logprob))
    _, clipped = fn(
        TokenTerms(jnp.asarray(logprob), jnp.asarray(behavior), jnp.asarray(advantage)), config
    )
    return np.asarray(loss), np.asarray(grad), np.asarray(clipped)


def numpy_clipped(logprob, behavior, advantage, low, high):
    ratio = np.exp(logprob.astype(np.float64) - behavior)
    unclipped, clipped = ratio * advantage, np.clip(ratio, 1 - low, 1 + high) * advantage
    loss = -np.minimum(unclipped, clipped)
    # d/dlogprob: ratio * A where the unclipped branch is active, else 0.
    grad = np.where(unclipped <= clipped, -ratio * advantage, 0.0)
    return loss, grad, clipped < unclipped


@pytest.mark.parametrize(("name", "high"), [("ppo", 0.28), ("grpo", 0.2)])
def test_clipped_surrogates(name, high):
    lp, b, a = terms(1)
    loss, grad, clipped = evaluate(name, lp, b, a)
    want_loss, want_grad, want_clipped = numpy_clipped(lp, b, a, 0.2, high)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert np.array_equal(clipped.astype(bool), want_clipped)
    assert 0 < want_clipped.mean() < 1  # both branches exercised


def test_truncated_importance_sampling():
    lp, b, a = terms(2)
    loss, grad, capped = evaluate("tis", lp, b, a)
    weight = np.minimum(np.exp(lp.astype(np.float64) - b), 1.5)
    np.testing.assert_allclose(loss, -weight * a * lp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, -weight * a, rtol=1e-5, atol=1e-6)  # weight is constant
    assert np.array_equal(capped.astype(bool), np.exp(lp.astype(np.float64) - b) > 1.5)


def test_sft_is_negative_log_likelihood():
    lp, b, a = terms(3)
    loss, grad, _ = evaluate("sft", lp, b, a)
    np.testing.assert_allclose(loss, -lp)
    np.testing.assert_allclose(grad, -np.ones_like(lp))


def test_kl_k3_estimator():
    lp, b, _ = terms(4)
    kl = np.asarray(kl_to_reference(jnp.asarray(lp), jnp.asarray(b)))
    d = b.astype(np.float64) - lp
    np.testing.assert_allclose(kl, np.exp(d) - d - 1, rtol=1e-5, atol=1e-7)
    assert (kl >= 0).all()
    assert np.allclose(np.asarray(kl_to_reference(jnp.asarray(lp), jnp.asarray(lp))), 0)


def test_registry_matches_config_and_rejects_unknown_names():
    assert registered_losses() == tuple(sorted(LOSSES))
    with pytest.raises(ValueError, match="unknown loss 'dpo'; known: grpo, ppo, sft, tis"):
        get_loss("dpo")
