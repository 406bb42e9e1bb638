"""Model benchmark: dense vs blocked tree attention, and KV-cache decoding.

  python benchmarks/model_bench.py [--quick] [--json PATH]

On the tiny model of configs/tiny_cpu.py (4 layers, hidden 128, head_dim 64):
  * forward tokens/s and compiled activation memory of the training forward over a packed
    row (a forest of prefix-shared trees, as the trajectory processor emits) with the
    dense-mask reference vs the blocked attention, at row lengths 1k, 4k, 16k; plus the
    forward+backward (training) figures where they fit;
  * KV-cache decode tokens/s (batch of slots, one token per slot per step) at 1, 8, 32.
Memory is XLA's compiled temporary-buffer size (deterministic, unlike RSS); a case whose
compiled memory exceeds --max_temp_gib is reported but not run. Times are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gyrejax.config import ModelConfig
from gyrejax.model.sampling import _decode_and_sample, _prefill_and_sample
from gyrejax.model.transformer import KVCache, init_model

TINY = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10_000.0,
    attention_block_size=512,
)


def forest_row(length: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """A packed row of agent-shaped trees: chains of ~1-2k tokens with a few forks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, length).astype(np.int32)
    positions = np.zeros(length, np.int32)
    subtree_end = np.zeros(length, np.int32)
    start = 0
    while start < length:
        size = min(int(rng.integers(1024, 2048)), length - start)
        end = start + size
        # A trunk, then up to 3 sibling branches forking at the trunk's end.
        trunk = int(size * 0.6)
        positions[start : start + trunk] = np.arange(trunk)
        subtree_end[start : start + trunk] = end
        branch_len = -(-(size - trunk) // 3)
        for a in range(start + trunk, end, branch_len):
            b = min(a + branch_len, end)
            positions[a:b] = trunk + np.arange(b - a)
            subtree_end[a:b] = b
        start = end
    return tokens[None], positions[None], subtree_end[None]


def median_time(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def attention_case(impl: str, length: int, reps: int, max_temp_bytes: float, train: bool) -> dict:
    config = ModelConfig(**{**TINY.__dict__, "attention": impl})
    model = init_model(config)
    graphdef, state = nnx.split(model)
    row = tuple(jnp.asarray(x) for x in forest_row(length))

    def forward(state, tokens, positions, ends):
        return nnx.merge(graphdef, state).hidden_states(tokens, positions, ends).sum()

    fn = jax.jit(jax.grad(forward) if train else forward)
    compiled = fn.lower(state, *row).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    result = {"impl": impl, "length": length, "train": train, "temp_mib": temp / 2**20}
    if temp > max_temp_bytes:
        result["skipped"] = f"compiled memory {temp / 2**30:.1f} GiB > limit"
        return result
    seconds = median_time(lambda: compiled(state, *row), reps)
    result.update(seconds=seconds, tokens_per_s=length / seconds)
    return result


def decode_case(batch: int, steps: int, reps: int) -> dict:
    model = init_model(TINY)
    graphdef, state = nnx.split(model)
    prompt_len, max_len = 64, 64 + steps * (reps + 2) + 16
    tokens = (
        np.random.default_rng(0).integers(0, TINY.vocab_size, (batch, prompt_len)).astype(np.int32)
    )
    cache = KVCache.create(TINY, batch, max_len)
    key = jax.random.key(0)
    lengths = np.full(batch, prompt_len, np.int32)
    slots = np.arange(batch, dtype=np.int32)
    next_tokens, _, cache = _prefill_and_sample(
        graphdef, state, tokens, lengths, slots, cache, 0.0, key
    )
    active = jnp.ones(batch, bool)
    box = {"tokens": next_tokens, "cache": cache}

    def run_steps():
        for _ in range(steps):
            box["tokens"], _, box["cache"] = _decode_and_sample(
                graphdef, state, box["tokens"], box["cache"], active, 0.0, key
            )
        return box["tokens"]

    seconds = median_time(run_steps, reps)
    return {
        "batch": batch,
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": batch * steps / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--json", help="write the figures to this path")
    parser.add_argument("--max_temp_gib", type=float, default=8.0)
    args = parser.parse_args()
    lengths = (1024, 2048) if args.quick else (1024, 4096, 16384)
    reps = 2 if args.quick else 3
    limit = args.max_temp_gib * 2**30

    platform = jax.devices()[0].platform
    print(f"devices: {platform} x{len(jax.devices())}; model: tiny ({TINY.num_params} params)")
    attention_rows = []
    print("\ntree attention, one packed row (forest of 1-2k-token trees):")
    print(
        f"{'length':>7} {'pass':>5} | {'dense tok/s':>11} {'dense MiB':>10} | "
        f"{'blocked tok/s':>13} {'blocked MiB':>11} | {'speed':>6} {'memory':>7}"
    )
    for length in lengths:
        for train in (False, True):
            if train and length > 4096:
                continue  # fwd+bwd of the 16k dense reference does not fit this machine
            dense = attention_case("dense", length, reps, limit, train)
            blocked = attention_case("blocked", length, reps, limit, train)
            attention_rows += [dense, blocked]
            speed = (
                f"{blocked['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
                if "seconds" in dense and "seconds" in blocked
                else "-"
            )
            print(
                f"{length:>7} {'train' if train else 'fwd':>5} | "
                f"{dense.get('tokens_per_s', float('nan')):>11.0f} {dense['temp_mib']:>10.1f} | "
                f"{blocked.get('tokens_per_s', float('nan')):>13.0f} "
                f"{blocked['temp_mib']:>11.1f} | "
                f"{speed:>6} {dense['temp_mib'] / blocked['temp_mib']:>6.1f}x"
                + (f"  (dense {dense['skipped']})" if "skipped" in dense else "")
            )

    print("\nKV-cache decode (greedy, one token per slot per step):")
    print(f"{'batch':>6} {'tok/s':>9} {'ms/step':>8}")
    decode_rows = []
    for batch in (1, 8, 32):
        row = decode_case(batch, steps=16 if args.quick else 64, reps=reps)
        decode_rows.append(row)
        print(
            f"{batch:>6} {row['tokens_per_s']:>9.0f} {1000 * row['seconds'] / row['steps']:>8.2f}"
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"attention": attention_rows, "decode": decode_rows, "quick": args.quick},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
