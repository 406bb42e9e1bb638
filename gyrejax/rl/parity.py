"""Trainer-vs-engine parity: what the trainer makes of calls an engine recorded.

Replays recorded calls through the real training path (tree, packing, the trainer's
head) and returns, per trained token, the importance ratio of the trainer's log-prob to
the engine's. With the weights the engine sampled with, every ratio should be 1; how far
it is not is the train/inference mismatch. Used by the parity tests and
`benchmarks/objective_bench.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gyrejax.model.transformer import Transformer
from gyrejax.rl.objective import token_logprobs
from gyrejax.rollout.types import Completion
from gyrejax.trajectory import Execution, ModelCall, process

# (temperature, top_p, top_k) of one call.
Setting = tuple[float, float, int]


def recorded_calls(
    completions: Sequence[Completion],
    prompts: Sequence[Sequence[int]],
    settings: Sequence[Setting],
) -> list[ModelCall]:
    """One execution's calls, one per (completion, prompt, setting), as the proxy records
    them (sampling settings included); each its own agent, so each its own tree root."""
    calls = []
    for i, (c, prompt, (t, p, k)) in enumerate(zip(completions, prompts, settings, strict=True)):
        call = ModelCall(
            execution_id="parity", call_id=i, agent_id=f"a{i}", role="main",
            prompt_ids=np.asarray(prompt, np.int32), output_ids=c.output_ids,
            logprobs=c.logprobs, versions=c.versions, finish_reason=c.finish_reason,
            temperature=t, top_p=p, top_k=k,
        )  # fmt: skip
        calls.append(call)
    return calls


def trained_ratios(
    model: Transformer, calls: Sequence[ModelCall], row_length: int = 256, as_sampled: bool = True
) -> dict[str, np.ndarray]:
    """Per trained token of `calls` (one execution), in packed order: `ratio` exp(trainer
    log-prob - behaviour log-prob), `unreproduced` (the trainer could not reproduce the
    distribution), and the row's `temperature`, `top_p` and `top_k` there.

    Args:
      model: the trainer's model (the weights the calls were sampled with, for parity).
      calls: one execution's calls; each must fit in `row_length`.
      as_sampled: False reads every token at temperature 1 without a cut, as the trainer
        did before it took the sampling settings into account (for comparison).
    """
    batch = process(
        [Execution("parity", "task", "group", list(calls), reward=1.0)],
        row_length=row_length,
        j_max=None,
    )
    out: dict[str, list[np.ndarray]] = {
        k: [] for k in ("ratio", "unreproduced", "temperature", "top_p", "top_k")
    }
    for m in range(batch.num_micro_steps):
        rows = dict(batch.micro_step(m))
        if not as_sampled:
            rows["temperature"] = np.ones_like(rows["temperature"])
            rows["top_p"] = np.ones_like(rows["top_p"])
            rows["top_k"] = np.zeros_like(rows["top_k"])
        head = token_logprobs(model, rows)
        trained = rows["loss_weight"] > 0
        log_ratio = np.asarray(head.logprob, np.float64) - rows["behavior_logprob"]
        out["ratio"].append(np.exp(log_ratio)[trained])
        out["unreproduced"].append(np.asarray(head.unreproduced)[trained])
        for name in ("temperature", "top_p", "top_k"):
            out[name].append(rows[name][trained])
    return {k: np.concatenate(v) for k, v in out.items()}
