"""Objective benchmark: ratios under real sampling, the decoupled objective's cost, and
the train/inference mismatch in bfloat16.

  python benchmarks/objective_bench.py [--quick] [--no-vllm] [--json PATH]

Three parts, each on the weights the engine sampled with, so every importance ratio
should be exactly 1 and any departure is the trainer misreading the sample:
  1. ratios: a JAX engine (and vLLM where installed) samples under several
     (temperature, top_p, top_k) settings; each token's ratio is read by the trainer as
     it did before (temperature 1, no cut) and as it does now (the distribution
     sampled), float32. Reported: the share of tokens outside PPO's clip band
     [1 - 0.2, 1 + 0.28], the largest ratio, and the largest |ratio - 1| now.
  2. cost: one trainer step of `ppo`, `decoupled_ppo` and `tis` on the same packed batch
     (a 4-layer model, 2048-token rows), interleaved rounds, median step seconds and
     the ratio to ppo. The decoupled objective's proximal log-probs are the forward's own
     (one update per batch), so it should cost what ppo costs.
  3. mismatch: a bfloat16 model samples (JAX engine, and vLLM where installed), then
     one trainer step at that version reports the mismatch metrics (mean, p99 and max
     |trainer - engine| log-prob, the k3 mismatch KL) and how many tokens were dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time

import jax
import numpy as np

from gyrejax.cells import split_into_cells
from gyrejax.config import CellsConfig, ModelConfig, RLConfig, TrainConfig
from gyrejax.model.transformer import init_model
from gyrejax.rl.parity import recorded_calls, trained_ratios
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.types import Request, SamplingParams
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory import Execution, generate_executions, process

SETTINGS = [(0.6, 1.0, 0), (0.6, 0.95, 20), (1.0, 1.0, 0), (1.0, 0.95, 20), (1.3, 1.0, 0)]
BAND = (0.8, 1.28)
VOCAB = 256
SMALL = ModelConfig(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, attention="blocked", attention_block_size=128,
)  # fmt: skip
COST_MODEL = ModelConfig(
    vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=64, attention="blocked", attention_block_size=512,
)  # fmt: skip


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(4, 24))).tolist() for _ in range(n)]


def sample(engine, requests) -> list:
    async def run():
        try:
            return await asyncio.gather(*(engine.submit(r) for r in requests))
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def requests_for(settings, per_setting: int, new_tokens: int):
    """(prompts, settings, requests): `per_setting` requests of each setting."""
    ps, ss, rs = [], [], []
    for j, setting in enumerate(settings):
        for prompt in prompts(per_setting, seed=j):
            ps.append(prompt)
            ss.append(setting)
            sampling = SamplingParams(*setting, max_new_tokens=new_tokens, seed=len(rs))
            rs.append(Request(f"r{len(rs)}", prompt, sampling))
    return ps, ss, rs


def ratio_rows(engine_name, model, completions, ps, ss) -> list[dict]:
    calls = recorded_calls(completions, ps, ss)
    before = trained_ratios(model, calls, as_sampled=False)
    now = trained_ratios(model, calls)
    rows = []
    for setting in dict.fromkeys(ss):
        t, p, k = (np.float32(x) for x in setting)
        sel = (now["temperature"] == t) & (now["top_p"] == p) & (now["top_k"] == k)
        out_before = (before["ratio"][sel] < BAND[0]) | (before["ratio"][sel] > BAND[1])
        out_now = (now["ratio"][sel] < BAND[0]) | (now["ratio"][sel] > BAND[1])
        rows.append(
            dict(
                engine=engine_name,
                setting=list(setting),
                tokens=int(sel.sum()),
                outside_band_before=float(out_before.mean()),
                max_ratio_before=float(before["ratio"][sel].max()),
                outside_band_now=float(out_now.mean()),
                max_abs_ratio_minus_1_now=float(np.abs(now["ratio"][sel] - 1).max()),
                unreproduced_now=int(now["unreproduced"][sel].sum()),
            )
        )
    return rows


def write_checkpoint(directory: str, seed: int = 0) -> str:
    """A random tiny Qwen3 (SMALL's shapes) written by transformers, for vLLM."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.08,
    )  # fmt: skip
    Qwen3ForCausalLM(config).eval().save_pretrained(directory)
    return directory


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def part_ratios(quick: bool, with_vllm: bool) -> list[dict]:
    per, new = (2, 32) if quick else (6, 64)
    model = init_model(SMALL, seed=0)
    ps, ss, rs = requests_for(SETTINGS, per, new)
    engine = JaxEngine("jax", model, max_seq_len=256, max_slots=8)
    rows = ratio_rows("jax", model, sample(engine, rs), ps, ss)
    if with_vllm:
        from gyrejax.model.hf_io import load_hf
        from gyrejax.rollout.vllm_engine import VllmEngine

        with tempfile.TemporaryDirectory() as d:
            path = write_checkpoint(d)
            engine = VllmEngine(
                "vllm", path, max_slots=8, max_seq_len=256, kv_cache_memory_bytes=64 << 20
            )
            rows += ratio_rows("vllm", load_hf(path), sample(engine, rs), ps, ss)
    return rows


def cost_batch(quick: bool):
    groups, size, turns = (2, 2, (6, 10)) if quick else (2, 4, (12, 20))
    executions = generate_executions(
        groups, size, seed=0, turns=turns, vocab_size=COST_MODEL.vocab_size,
        system_prompt_tokens=100, task_tokens=(20, 60), tool_output_tokens=(10, 120),
        model_output_tokens=(10, 80), summary_tokens=(10, 40), compaction_budget=1500,
        max_call_tokens=2048,
    )  # fmt: skip
    return process(executions, row_length=2048, j_max=5)


def part_cost(quick: bool) -> list[dict]:
    batch = cost_batch(quick)
    core = split_into_cells(CellsConfig(size=1))[0]
    train = TrainConfig(row_length=2048, rows_per_micro_step=1, learning_rate=1e-6)
    losses = ("ppo", "decoupled_ppo", "tis")
    trainers = {
        name: ElasticTrainer(init_model(COST_MODEL), core, rl=RLConfig(loss=name), train=train)
        for name in losses
    }
    for trainer in trainers.values():
        trainer.train_step(batch)  # compile
    times: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(2 if quick else 5):
        for name in losses:
            start = time.perf_counter()
            trainers[name].train_step(batch)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["ppo"])
    return [
        dict(
            loss=name,
            median_step_s=statistics.median(times[name]),
            over_ppo=statistics.median(times[name]) / base,
            micro_steps=batch.num_micro_steps,
            tokens=int((batch.loss_weight > 0).sum()),
        )
        for name in losses
    ]


def mismatch_row(engine_name, model, completions, ps, ss) -> dict:
    calls = recorded_calls(completions, ps, ss)
    batch = process(
        [Execution("parity", "task", "group", calls, reward=1.0)], row_length=256, j_max=None
    )
    core = split_into_cells(CellsConfig(size=1))[0]
    train = TrainConfig(row_length=256, rows_per_micro_step=1, learning_rate=0.0)
    trainer = ElasticTrainer(model, core, rl=RLConfig(), train=train)
    metrics = trainer.train_step(batch).metrics
    keys = ("mismatch_tokens", "mismatch_abs_mean", "mismatch_abs_p99", "mismatch_abs_max")
    return dict(
        engine=engine_name,
        **{k: metrics.get(k) for k in keys},
        mismatch_kl=metrics.get("mismatch_kl"),
        dropped_tokens=metrics.get("dropped_tokens"),
        tokens=metrics.get("tokens"),
    )


def part_mismatch(quick: bool, with_vllm: bool) -> list[dict]:
    per, new = (2, 32) if quick else (6, 64)
    bf16 = dataclasses.replace(SMALL, dtype="bfloat16")
    ps, ss, rs = requests_for(SETTINGS, per, new)
    model = init_model(bf16, seed=0)
    engine = JaxEngine("jax", model, max_seq_len=256, max_slots=8)
    rows = [mismatch_row("jax bfloat16", model, sample(engine, rs), ps, ss)]
    if with_vllm:
        from gyrejax.model.hf_io import load_hf
        from gyrejax.rollout.vllm_engine import VllmEngine

        with tempfile.TemporaryDirectory() as d:
            path = write_checkpoint(d)
            engine = VllmEngine(
                "vllm", path, max_slots=8, max_seq_len=256, kv_cache_memory_bytes=64 << 20,
                dtype="bfloat16",
            )  # fmt: skip
            model = load_hf(path, dtype="bfloat16")
            rows.append(mismatch_row("vllm bfloat16", model, sample(engine, rs), ps, ss))
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [" | ".join(keys)] + [" | ".join(fmt(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="JAX engine only")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    with_vllm = args.vllm and vllm_available()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} device(s)")
    result = {}
    for name, part in (
        ("ratios", lambda: part_ratios(args.quick, with_vllm)),
        ("cost", lambda: part_cost(args.quick)),
        ("mismatch", lambda: part_mismatch(args.quick, with_vllm)),
    ):
        start = time.perf_counter()
        result[name] = part()
        print(f"\n## {name} ({time.perf_counter() - start:.0f} s)\n{table(result[name])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
