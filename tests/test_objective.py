"""The central claim: loss and gradients on a tree-packed batch equal a naive computation
that runs every call as its own causal sequence with the same per-token weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gyrejax.config import ModelConfig, RLConfig
from gyrejax.model.transformer import init_model
from gyrejax.rl.losses import TokenTerms, get_loss
from gyrejax.rl.objective import MICRO_STEP_FIELDS, micro_step_loss
from gyrejax.trajectory import Execution, generate_executions, process

VOCAB = 64
MODEL = ModelConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, attention="blocked", attention_block_size=32,
)  # fmt: skip
PAD_TO = 160  # every call is run causally, right-padded to one length (one compile)


def call_logprobs(model, call) -> np.ndarray:
    """The model's log-probs of a call's output tokens (run causally on its own)."""
    seq = np.concatenate([call.prompt_ids, call.output_ids])
    padded = np.zeros((1, PAD_TO), np.int32)
    padded[0, : len(seq)] = seq
    lp = np.asarray(_causal(model, jnp.asarray(padded)))[0]
    p = len(call.prompt_ids)
    return lp[p - 1 : len(seq) - 1]


@nnx.jit
def _causal(model, tokens):
    return causal_logprobs_traced(model, tokens)


def executions_near_policy(model, seed):
    """Synthetic agent traces whose behaviour log-probs are the model's own plus noise,
    so importance ratios straddle the clip range."""
    raw = generate_executions(
        2, 3, seed=seed, turns=(3, 6), vocab_size=VOCAB, system_prompt_tokens=12,
        task_tokens=(3, 6), tool_output_tokens=(2, 8), model_output_tokens=(2, 8),
        summary_tokens=(2, 5), compaction_budget=90, sub_agent_prob=0.3, sub_agent_turns=(1, 3),
        retry_prob=0.3, max_call_tokens=PAD_TO,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    out = []
    for ex in raw:
        calls = []
        for c in ex.calls:
            lp = call_logprobs(model, c) + rng.normal(0, 0.3, len(c.output_ids))
            calls.append(dataclasses.replace(c, logprobs=lp.astype(np.float32)))
        out.append(dataclasses.replace(ex, calls=calls))
    return out


def naive_plan(executions: list[Execution]) -> dict[str, np.ndarray]:
    """Every call as its own causal row; each distinct generated token (execution, prefix)
    once, weighted by 1 / (its execution's token count) / (executions with tokens)."""
    by_group: dict[str, list[float]] = {}
    for ex in executions:
        by_group.setdefault(ex.group_id, []).append(ex.reward or 0.0)
    rows, token_row, token_pos, behaviour, advantage, execution = [], [], [], [], [], []
    for e, ex in enumerate(executions):
        seen = set()
        for c in sorted(ex.calls, key=lambda c: c.call_id):
            seq = np.concatenate([c.prompt_ids, c.output_ids])
            p = len(c.prompt_ids)
            padded = np.zeros(PAD_TO, np.int32)
            padded[: len(seq)] = seq
            for j in range(len(c.output_ids)):
                key = tuple(seq[: p + j + 1].tolist())
                if key in seen:
                    continue
                seen.add(key)
                token_row.append(len(rows))
                token_pos.append(p + j - 1)  # causal_logprobs index of output token j
                behaviour.append(c.logprobs[j])
                advantage.append((ex.reward or 0.0) - np.mean(by_group[ex.group_id]))
                execution.append(e)
            rows.append(padded)
    execution = np.asarray(execution)
    counts = np.bincount(execution, minlength=len(executions))
    weight = 1.0 / counts[execution] / np.count_nonzero(counts)
    return {
        "tokens": np.stack(rows),
        "token_row": np.asarray(token_row),
        "token_pos": np.asarray(token_pos),
        "behavior_logprob": np.asarray(behaviour, np.float32),
        "advantage": np.asarray(advantage, np.float32),
        "weight": weight.astype(np.float32),
    }


def naive_loss(params, graphdef, plan, rl: RLConfig):
    model = nnx.merge(graphdef, params)
    logprobs = causal_logprobs_traced(model, plan["tokens"])  # [calls, PAD_TO - 1]
    logprob = logprobs[plan["token_row"], plan["token_pos"]]
    terms = TokenTerms(logprob, plan["behavior_logprob"], plan["advantage"])
    per_token, _ = get_loss(rl.loss)(terms, rl)
    return jnp.sum(plan["weight"] * per_token)


def causal_logprobs_traced(model, tokens):
    n = tokens.shape[1]
    b = tokens.shape[0]
    logits = model(tokens, jnp.broadcast_to(jnp.arange(n), (b, n)), jnp.full((b, n), n))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def packed_loss(params, graphdef, micro_steps, rl: RLConfig):
    model = nnx.merge(graphdef, params)
    total = 0.0
    for rows in micro_steps:
        loss, _ = micro_step_loss(model, rows, rl, 0)
        total = total + loss
    return total


@pytest.mark.parametrize("loss", ["ppo", "tis"])
def test_tree_packed_loss_and_gradients_equal_naive_per_call(loss):
    rl = RLConfig(loss=loss, advantage="mean_centered")
    model = init_model(MODEL, seed=0)
    executions = executions_near_policy(model, seed=1)
    batch = process(
        executions, row_length=256, j_max=None, advantage="mean_centered", vocab_size=VOCAB
    )
    assert batch.num_micro_steps >= 2 and batch.stats.naive_over_unique > 2
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    plan = naive_plan(executions)
    assert len(plan["weight"]) == batch.stats.admitted_trainable_tokens
    micro_steps = [
        {f: v for f, v in batch.micro_step(m).items() if f in MICRO_STEP_FIELDS}
        for m in range(batch.num_micro_steps)
    ]
    grad = lambda fn: jax.jit(jax.value_and_grad(fn), static_argnums=(1, 3))
    want, want_grads = grad(naive_loss)(params, graphdef, plan, rl)
    got, got_grads = grad(packed_loss)(params, graphdef, micro_steps, rl)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    assert scale > 0
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale
        ),
        got_grads,
        want_grads,
    )


def test_kl_term_vanishes_against_itself_and_metrics_are_weighted():
    model = init_model(MODEL, seed=3)
    executions = executions_near_policy(model, seed=4)
    batch = process(executions, row_length=256, j_max=None, vocab_size=VOCAB)
    rows = {f: jnp.asarray(v) for f, v in batch.micro_step(0).items() if f in MICRO_STEP_FIELDS}
    plain, metrics = micro_step_loss(model, rows, RLConfig(), 7)
    from gyrejax.rl.objective import token_logprobs

    ref = token_logprobs(model, rows)[0]
    with_kl, kl_metrics = micro_step_loss(model, rows, RLConfig(kl_coef=0.5), 7, ref)
    np.testing.assert_allclose(float(with_kl), float(plain), rtol=1e-6)
    assert abs(float(kl_metrics["kl"])) < 1e-6
    weight = batch.micro_step(0)["loss_weight"]
    assert float(metrics["tokens"]) == (weight > 0).sum()
    staleness = 7 - batch.micro_step(0)["version"]
    np.testing.assert_allclose(
        float(metrics["staleness_mean"]), (weight * staleness).sum(), rtol=1e-5
    )
    with pytest.raises(ValueError, match="kl_coef > 0 needs reference"):
        micro_step_loss(model, rows, RLConfig(kl_coef=0.5), 7)


def with_sampling(rows, seed):
    """`rows` as jax arrays, each token given random sampling settings (temperature 0.6
    or 1.3, top_k 0 or 20, top_p 1 or 0.95): the head cuts and renormalises per token."""
    rng = np.random.default_rng(seed)
    rows = dict(rows)
    shape = rows["tokens"].shape
    rows["temperature"] = rng.choice(np.float32([0.6, 1.3]), shape)
    rows["top_k"] = rng.choice(np.int32([0, 20]), shape)
    rows["top_p"] = rng.choice(np.float32([1.0, 0.95]), shape)
    return {f: jnp.asarray(v) for f, v in rows.items() if f in MICRO_STEP_FIELDS}


def test_a_token_whose_ratio_means_nothing_is_dropped_not_the_step():
    """A trained token outside the top-k set the trainer reproduces (here top_k 1 on a
    token that is not the argmax) and one whose trainer log-prob is not finite (a
    temperature so small the logits overflow) are dropped and counted; the step's loss
    and gradients are finite and equal those with the two tokens' weights set to 0."""
    model = init_model(MODEL, seed=3)
    batch = process(executions_near_policy(model, seed=4), row_length=256, j_max=None)
    rows = {f: np.array(v) for f, v in batch.micro_step(0).items() if f in MICRO_STEP_FIELDS}
    logits = np.asarray(model(rows["tokens"], rows["positions"], rows["subtree_end"]))
    pred = np.take_along_axis(logits, np.maximum(rows["pred_index"], 0)[..., None], 1)
    trained = np.argwhere(rows["loss_weight"] > 0)
    not_top = [(r, c) for r, c in trained if pred[r, c].argmax() != rows["tokens"][r, c]]
    (r0, c0), (r1, c1) = not_top[0], not_top[1]
    broken = {k: v.copy() for k, v in rows.items()}
    broken["top_k"][r0, c0] = 1
    broken["temperature"][r1, c1] = 1e-38
    reference = {k: v.copy() for k, v in rows.items()}
    reference["loss_weight"][r0, c0] = reference["loss_weight"][r1, c1] = 0
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def step(rows):
        fn = lambda p: micro_step_loss(nnx.merge(graphdef, p), rows, RLConfig(), 0)
        return jax.value_and_grad(fn, has_aux=True)(params)

    (loss, metrics), grads = step({k: jnp.asarray(v) for k, v in broken.items()})
    (want, want_metrics), want_grads = step({k: jnp.asarray(v) for k, v in reference.items()})
    assert np.isfinite(float(loss)) and float(metrics["dropped_tokens"]) == 2
    assert float(want_metrics["dropped_tokens"]) == 0
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want_grads
    )


def test_the_cut_computed_in_blocks_equals_the_cut_at_once():
    """The trainer's top-k/top-p threshold, THRESHOLD_BLOCK tokens at a time with an
    overlapping last block (600 tokens: not a whole number of blocks), equals the
    engine's function over all tokens at once."""
    from gyrejax.model.sampling import truncation_threshold
    from gyrejax.rl.objective import THRESHOLD_BLOCK, _blocked_threshold

    rng = np.random.default_rng(0)
    n = 2 * THRESHOLD_BLOCK + 88
    logits = jnp.asarray(rng.normal(0, 2, (n, 64)), jnp.float32)
    top_k = jnp.asarray(rng.choice([0, 5, 20], n), jnp.int32)
    top_p = jnp.asarray(rng.choice([1.0, 0.9, 0.5], n), jnp.float32)
    want = truncation_threshold(logits, top_k, top_p)
    np.testing.assert_array_equal(jax.jit(_blocked_threshold)(logits, top_k, top_p), want)


def test_mismatch_metrics_cover_the_current_versions_tokens_only():
    """Mean, max, p99 (within its bin) of |trainer - engine| log-prob and the k3 mismatch
    KL, over the tokens the trainer's own version sampled, against NumPy (float64)."""
    model = init_model(MODEL, seed=3)
    batch = process(executions_near_policy(model, seed=4), row_length=256, j_max=None)
    rows = {f: jnp.asarray(v) for f, v in batch.micro_step(0).items() if f in MICRO_STEP_FIELDS}
    from gyrejax.rl.objective import MISMATCH_EDGES, finish_metrics, token_logprobs

    version = np.asarray(rows["version"])
    trained = np.asarray(rows["loss_weight"]) > 0
    current_version = int(np.bincount(version[trained]).argmax())
    _, raw = micro_step_loss(model, rows, RLConfig(), current_version)
    got = finish_metrics({k: float(v) for k, v in raw.items()})
    assert not any(k.startswith("mismatch_bin") for k in got)
    current = trained & (version == current_version)
    assert 0 < current.sum() < trained.sum()  # other versions' tokens are left out
    d = np.asarray(token_logprobs(model, rows).logprob, np.float64) - np.asarray(
        rows["behavior_logprob"], np.float64
    )
    d = d[current]
    assert got["mismatch_tokens"] == current.sum()
    np.testing.assert_allclose(got["mismatch_abs_mean"], np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_abs_max"], np.abs(d).max(), rtol=1e-5)
    np.testing.assert_allclose(got["mismatch_kl"], np.mean(np.expm1(d) - d), rtol=1e-4)
    p99 = np.quantile(np.abs(d), 0.99, method="inverted_cdf")
    step = MISMATCH_EDGES[1] / MISMATCH_EDGES[0]
    assert p99 <= got["mismatch_abs_p99"] * (1 + 1e-6) and got["mismatch_abs_p99"] <= p99 * step


def test_the_kl_term_reads_only_trained_tokens():
    """A reference log-prob of -inf or NaN at an untrained position (a prompt token) does
    not reach the loss or gradients; the KL equals a NumPy k3 over the trained tokens."""
    model = init_model(MODEL, seed=3)
    batch = process(executions_near_policy(model, seed=4), row_length=256, j_max=None)
    rows = {f: jnp.asarray(v) for f, v in batch.micro_step(0).items() if f in MICRO_STEP_FIELDS}
    from gyrejax.rl.objective import token_logprobs

    logprob = np.asarray(token_logprobs(model, rows).logprob)
    weight = np.asarray(rows["loss_weight"])
    ref = logprob - 0.3
    untrained = np.argwhere((weight == 0) & (np.asarray(rows["pred_index"]) >= 0))
    ref[tuple(untrained[0])] = -np.inf
    ref[tuple(untrained[1])] = np.nan
    graphdef, state = nnx.split(model)
    config = RLConfig(kl_coef=0.1, kl_estimator="k3")
    fn = lambda p: micro_step_loss(nnx.merge(graphdef, p), rows, config, 0, jnp.asarray(ref))
    (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(nnx.to_pure_dict(state))
    assert np.isfinite(float(loss))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    d = np.float64(0.3)
    want = (weight * (weight > 0) * (np.exp(-d) - 1 + d)).sum()
    np.testing.assert_allclose(float(metrics["kl"]), want, rtol=1e-4)


@pytest.mark.parametrize(
    ("remat", "chunk_tokens", "tie"),
    [("none", 100, False), ("layer", 48, True), ("matmuls", 0, False)],
)  # fmt: skip
def test_chunked_head_and_remat_give_the_unchunked_loss_and_gradients(remat, chunk_tokens, tie):
    """Memory for compute, nothing else: a head over chunks of the row (48 and 100 leave
    a partial last chunk of a 256-token row) and rematerialised layers give the same
    loss, metrics and gradients as everything kept (float32, within 1e-6; untied heads
    too: the matrix the chunks share is then a parameter of its own)."""
    model = init_model(dataclasses.replace(MODEL, tie_embeddings=tie), seed=5)
    executions = executions_near_policy(model, seed=6)
    batch = process(executions, row_length=256, j_max=None, vocab_size=VOCAB)
    rows = with_sampling(batch.micro_step(0), seed=7)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def loss(params, **head):
        return micro_step_loss(nnx.merge(graphdef, params), rows, RLConfig(), 0, **head)

    grad = lambda **head: jax.jit(jax.value_and_grad(lambda p: loss(p, **head), has_aux=True))
    (want, want_metrics), want_grads = grad()(params)
    (got, got_metrics), got_grads = grad(remat=remat, chunk_tokens=chunk_tokens)(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for name in want_metrics:
        np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale),
        got_grads,
        want_grads,
    )
