"""Losses and KL estimators against NumPy formulas; the registries match what the config
accepts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.config import KL_ESTIMATORS, LOSSES, RLConfig
from gyrejax.rl.losses import TokenTerms, get_kl_estimator, get_loss, registered_losses

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


def numpy_clipped(logprob, behavior, advantage, low, high, dual=3.0):
    ratio = np.exp(logprob.astype(np.float64) - behavior)
    unclipped, clipped = ratio * advantage, np.clip(ratio, 1 - low, 1 + high) * advantage
    loss = -np.minimum(unclipped, clipped)
    # d/dlogprob: ratio * A where the unclipped branch is active, else 0.
    grad = np.where(unclipped <= clipped, -ratio * advantage, 0.0)
    capped = (advantage < 0) & (loss > -dual * advantage) if dual else np.zeros(loss.shape, bool)
    loss = np.where(capped, -dual * advantage, loss)
    grad = np.where(capped, 0.0, grad)
    return loss, grad, (clipped < unclipped) | capped


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


RATIOS = np.array([0.1, 2.0, 10.0, 100.0, 1e6])


def hand_weight(ratio, advantage, low, high, dual):
    """The gradient weight w of one token (d loss / d logprob = -w A), by cases: the
    clipped surrogate keeps w = r unless the clip binds (A > 0 above 1 + high, A < 0
    below 1 - low), and dual-clip zeroes it for A < 0 above `dual`."""
    if advantage > 0:
        return ratio if ratio <= 1 + high else 0.0
    if ratio < 1 - low or (dual and ratio > dual):
        return 0.0
    return ratio


@pytest.mark.parametrize("dual", [3.0, 0.0])
@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_gradient_weights_at_extreme_ratios(dual, advantage):
    config = RLConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=dual)
    behavior = np.full(len(RATIOS), -3.0, np.float32)
    logprob = (behavior + np.log(RATIOS)).astype(np.float32)
    a = np.full(len(RATIOS), advantage, np.float32)
    loss, grad, _ = evaluate("ppo", logprob, behavior, a, config)
    weight = -grad / advantage
    want = [hand_weight(r, advantage, 0.2, 0.28, dual) for r in RATIOS]
    np.testing.assert_allclose(weight, want, rtol=1e-4)
    if advantage < 0 and dual:  # the loss is capped where the ratio ran away
        np.testing.assert_allclose(loss[2:], -dual * advantage, rtol=1e-6)


def test_a_huge_log_ratio_is_clamped_to_a_finite_loss_and_no_gradient():
    config = RLConfig(clip_ratio_c=0.0, log_ratio_clamp=20.0)  # no dual-clip: the clamp alone
    behavior = np.full(4, -120.0, np.float32)
    logprob = np.array([-20.0, -20.0, -100.0, -119.0], np.float32)  # log-ratios 100, 100, 20, 1
    a = np.array([-1.0, 1.0, -1.0, -1.0], np.float32)
    for name in ("ppo", "grpo", "tis"):
        loss, grad, _ = evaluate(name, logprob, behavior, a, config)
        assert np.isfinite(loss).all() and np.isfinite(grad).all(), name
    loss, grad, _ = evaluate("ppo", logprob, behavior, a, config)
    np.testing.assert_allclose(loss[0], np.exp(np.float32(20.0)), rtol=1e-6)  # the clamp's
    assert grad[0] == 0.0 and grad[1] == 0.0  # beyond the clamp (and the clip): no pull
    np.testing.assert_allclose(grad[3], np.e, rtol=1e-5)  # inside: w = r = e


@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_decoupled_ppo_clips_around_the_proximal_policy_and_caps_the_staleness_weight(advantage):
    """Gradient weight on the log-prob: min(prox / behaviour, tis_cap) times the clipped
    surrogate's weight of the ratio to the proximal policy (hand formula)."""
    config = RLConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, tis_cap=2.0)
    ratios = RATIOS  # current / proximal
    staleness = np.array([0.5, 1.0, 1.9, 3.0, 50.0])  # proximal / behaviour
    behavior = np.full(len(ratios), -3.0, np.float32)
    proximal = (behavior + np.log(staleness)).astype(np.float32)
    logprob = (proximal + np.log(ratios)).astype(np.float32)
    a = np.full(len(ratios), advantage, np.float32)
    fn = get_loss("decoupled_ppo")

    def total(lp):
        terms = TokenTerms(lp, jnp.asarray(behavior), jnp.asarray(a), proximal_logprob=proximal)
        return fn(terms, config)[0].sum()

    weight = -np.asarray(jax.grad(total)(jnp.asarray(logprob))) / advantage
    want = [
        min(s, 2.0) * hand_weight(r, advantage, 0.2, 0.28, 3.0)
        for r, s in zip(ratios, staleness, strict=True)
    ]
    np.testing.assert_allclose(weight, want, rtol=1e-4)


def test_decoupled_ppo_with_one_update_per_batch_has_tis_gradients():
    """Without a separate proximal policy (the weights being differentiated are the
    proximal ones, as with one update per batch) the gradient equals `tis`'s."""
    lp, b, a = terms(5)
    _, want, _ = evaluate("tis", lp, b, a, RLConfig(tis_cap=2.0))
    _, got, _ = evaluate("decoupled_ppo", lp, b, a, RLConfig(tis_cap=2.0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def numpy_kl(name, lp, ref):
    d = lp.astype(np.float64) - ref
    return {"k1": d, "k2": d**2 / 2, "k3": np.exp(-d) - 1 + d}[name]


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_kl_estimators_values(name):
    lp, b, _ = terms(4)
    kl = np.asarray(get_kl_estimator(name)(jnp.asarray(lp), jnp.asarray(b)))
    np.testing.assert_allclose(kl, numpy_kl(name, lp, b), rtol=1e-5, atol=1e-6)
    same = get_kl_estimator(name)(jnp.asarray(lp), jnp.asarray(lp))
    assert np.allclose(np.asarray(same), 0)


def test_kl_estimator_gradients_follow_the_directions_their_docstrings_state():
    """On-policy, the expected gradient of each estimator (differentiated through log pi
    at tokens drawn from pi) is, over one categorical: k1 zero, k2 that of KL(pi || ref),
    k3 that of KL(ref || pi). Expectations are exact sums over the vocabulary."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 1.5, 12))
    ref = jax.nn.log_softmax(jnp.asarray(rng.normal(0, 1.5, 12)))
    probs = jax.nn.softmax(logits)  # the sampling distribution (constant)

    def expected(name):
        fn = get_kl_estimator(name)
        return jax.grad(lambda z: jnp.sum(probs * fn(jax.nn.log_softmax(z), ref)))(logits)

    def kl(z, forward):
        logp = jax.nn.log_softmax(z)
        p, r = jnp.exp(logp), jnp.exp(ref)
        return jnp.sum(r * (ref - logp)) if forward else jnp.sum(p * (logp - ref))

    reverse = jax.grad(lambda z: kl(z, False))(logits)
    forward = jax.grad(lambda z: kl(z, True))(logits)
    np.testing.assert_allclose(expected("k1"), 0, atol=1e-6)
    np.testing.assert_allclose(expected("k2"), reverse, atol=1e-5)
    np.testing.assert_allclose(expected("k3"), forward, atol=1e-5)
    assert np.abs(np.asarray(forward - reverse)).max() > 1e-2  # the two directions differ


def test_registry_matches_config_and_rejects_unknown_names():
    assert registered_losses() == tuple(sorted(LOSSES))
    known = "decoupled_ppo, grpo, ppo, sft, tis"
    with pytest.raises(ValueError, match=f"unknown loss 'dpo'; known: {known}"):
        get_loss("dpo")
    for name in KL_ESTIMATORS:
        get_kl_estimator(name)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; known: k1, k2, k3"):
        get_kl_estimator("k4")
