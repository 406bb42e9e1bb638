"""`rollout.engine=vllm`: a tiny RL run with an in-process vLLM engine on each of 2 CPU
cells (colocate: both cells train, then roll out again). Every token's behaviour
log-prob equals a JAX forward pass of the weights of its recorded version: the start
weights for version 0, the run's published export for version 1. On CPU each engine
frees its memory by stopping its engine core and starts again at the weight pull.

Slow (marked): 2.5-6 minutes on 2 shared cores (by their load), mostly vLLM starting (two engines at
once, then each again when its cell returns from training).
"""

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM engine is optional)")

import jax
from conftest import load_config_file, read_jsonl

from gyrejax.cells import split_into_cells
from gyrejax.config import from_dict
from gyrejax.loop import Runtime
from gyrejax.model.hf_io import load_hf
from gyrejax.model.transformer import init_model
from gyrejax.trajectory import ExecutionStore

LOGPROB_ATOL = 1e-4  # float32 on both sides (as tests/test_vllm_engine.py)


def token_logprobs(model, prompt_ids, output_ids) -> np.ndarray:
    """log p(output_ids[i] | prompt + output[:i]) under `model`, one causal forward pass
    at temperature 1 (the harness's; no top-k/top-p)."""
    tokens = np.concatenate([prompt_ids, output_ids]).astype(np.int32)
    n = len(tokens)
    logits = model(tokens[None], np.arange(n, dtype=np.int32)[None], np.full((1, n), n, np.int32))
    logits = np.asarray(jax.device_get(logits), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    start = len(prompt_ids) - 1  # the row that predicts the first output token
    return logp[start + np.arange(len(output_ids)), output_ids]


@pytest.mark.slow
def test_rl_on_two_vllm_cells_keeps_exact_logprobs_per_version(tmp_path):
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4  # two cells
    c.rollout.engine = "vllm"
    c.rollout.max_slots = 4  # a small KV cache (a group of 2 runs at once)
    c.scheduler.policy = "colocate"  # every cell trains, then rolls out again
    c.train.steps = 2
    config = from_dict(c)
    start = init_model(config.model)
    summary = Runtime(config, split_into_cells(config.cells), start, tmp_path).run()
    assert summary["steps"] == 2

    transitions = read_jsonl(tmp_path / "transitions.jsonl")
    kinds = [t["kind"] for t in transitions]
    assert "to_training" in kinds and "to_rollout" in kinds  # released, then woken

    calls = [call for e in ExecutionStore(tmp_path / "executions") for call in e.calls]
    assert all(call.engines and call.engines[0] in ("cell0", "cell1") for call in calls)
    versions = np.concatenate([call.versions for call in calls])
    assert set(versions.tolist()) == {0, 1}  # the woken engines sampled the new version
    models = {0: init_model(config.model), 1: load_hf(tmp_path / "published" / "version_1")}
    checked = {0: 0, 1: 0}
    for call in calls:
        for version, model in models.items():
            mine = call.versions == version
            if not mine.any():
                continue
            want = token_logprobs(model, call.prompt_ids, call.output_ids)
            np.testing.assert_allclose(call.logprobs[mine], want[mine], atol=LOGPROB_ATOL)
            checked[version] += int(mine.sum())
    assert checked[0] > 0 and checked[1] > 0
