"""A million-token execution end to end: process() and one training step on 8 devices.

  python benchmarks/million_token_bench.py [--row-length 131072] [--naive-tokens 1000000]
      [--sequence 8] [--no-run] [--json PATH]

One synthetic agent execution (`trajectory.synthetic`, scaled to the row length:
compaction at 3/8 of the row length, sub-agents, retries, tool outputs of thousands of
tokens; the fewest turns that reach the naive tokens with a compaction restart) of
about `--naive-tokens` naive tokens N (the sum over calls of prompt + output) goes
through `process()` with rows of `--row-length` (and buckets of 1/8, 1/4, 1/2 of it:
shorter rows, several to a micro-step), then one
training step of the tiny model runs on one cell of the 8 CPU-emulated devices:
fsdp 8/S x tensor 1 x sequence S, every row split over the S sequence shards
(context-parallel tree attention). Reported:
  * process(): seconds and peak host memory (tracemalloc: NumPy's allocations), N/U,
    packed/U, rows;
  * compiled memory per device of the micro-step (XLA's memory_analysis of the
    compiled [1, row length] micro-step: temporary, and with arguments and outputs);
  * compile seconds, and the step's seconds (`--no-run`: compile only).
The emulated devices share this machine's cores: a step time is the sum of the shards'
work, not a parallel step; judge by memory and packed tokens. With one execution the
group-relative advantage is 0, so the gradient is the KL/zero one: the work is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tracemalloc

# The emulated devices must be set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The 8 emulated shards share this machine's cores, so one may reach a ring step's
# collective minutes after another; XLA's CPU collectives abort after 40 s by default.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_collective_call_terminate_timeout_seconds=86400"
    + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=3600"
    + " --xla_cpu_collective_timeout_seconds=86400"
)
import jax

jax.config.update("jax_num_cpu_devices", 8)

from long_row_bench import TINY, memory  # noqa: E402  (the tiny model, max position 128k)

from gyrejax.cells import split_into_cells  # noqa: E402
from gyrejax.config import CellsConfig, RLConfig, TrainConfig  # noqa: E402
from gyrejax.model.transformer import init_model  # noqa: E402
from gyrejax.train.trainer import ElasticTrainer  # noqa: E402
from gyrejax.trajectory import SyntheticConfig, generate_executions, process  # noqa: E402

DEVICES = 8


def trace_config(row_length: int, turns: int) -> SyntheticConfig:
    """Agent-shaped knobs scaled to rows of `row_length` (131072: tool outputs up to
    12k tokens, compaction at 3/8 of the row so that a million naive tokens hold
    restarts: at 3/4 the first one comes only after ~1.7M)."""
    s = row_length / 131072
    scaled = lambda lo, hi: (max(1, int(lo * s)), max(1, int(hi * s)))
    return SyntheticConfig(
        turns=(turns, turns),
        tool_output_tokens=scaled(2000, 12000),
        model_output_tokens=scaled(200, 2000),
        summary_tokens=scaled(500, 2000),
        system_prompt_tokens=max(1, int(3000 * s)),
        task_tokens=scaled(500, 2000),
        sub_agent_prob=0.15,  # a few tens of calls: likelier, so some happen
        sub_agent_turns=(3, 8),
        retry_prob=0.15,
        timeout_prob=0.0,
        vocab_size=TINY.vocab_size,
        max_call_tokens=row_length,
        compaction_budget=3 * row_length // 8,
    )


def naive_tokens(execution) -> int:
    return sum(c.length for c in execution.calls)


def million_token_execution(row_length: int, target: int, seed: int = 0):
    """One execution of at least `target` naive tokens with a compaction restart (the
    fewest turns that reach both)."""
    turns = 1
    while True:  # N grows faster than linearly in turns: step by one (generation is fast)
        cfg = trace_config(row_length, turns)
        (ex,) = generate_executions(1, 1, seed=seed, config=cfg)
        restarted = any(c.role == "main_summary" for c in ex.calls)
        if naive_tokens(ex) >= target and restarted:
            return ex, cfg
        turns += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row-length", type=int, default=131072)
    parser.add_argument("--naive-tokens", type=int, default=1_000_000)
    parser.add_argument("--sequence", type=int, default=8, help="sequence shards S")
    parser.add_argument("--no-run", action="store_true", help="compile only, no step")
    parser.add_argument("--json", help="write the figures to this path")
    args = parser.parse_args()
    length, shards = args.row_length, args.sequence

    ex, cfg = million_token_execution(length, args.naive_tokens)
    contexts = max(c.length for c in ex.calls)
    roles = {c.role for c in ex.calls}
    print(
        f"execution: {len(ex.calls)} calls ({', '.join(sorted(roles))}), longest context "
        f"{contexts}, compaction at {cfg.compaction_budget}"
    )

    tracemalloc.start()
    start = time.perf_counter()
    menu = (length // 8, length // 4, length // 2, length)  # row buckets, sharded alike
    batch = process(
        [ex], row_length=length, row_lengths=menu, j_max=None, vocab_size=TINY.vocab_size
    )
    process_s = time.perf_counter() - start
    process_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    s = batch.stats
    figures = {
        "row_length": length,
        "sequence": shards,
        "calls": s.calls,
        "longest_context": contexts,
        "naive_tokens": s.naive_tokens,
        "unique_tokens": s.unique_tokens,
        "packed_tokens": s.packed_tokens,
        "rows": s.rows,
        "naive_over_unique": s.naive_over_unique,
        "packed_over_unique": s.packed_tokens / s.unique_tokens,
        "process_s": process_s,
        "process_peak_mib": process_peak / 2**20,
    }
    print(
        f"process(): {process_s:.2f} s, peak {process_peak / 2**20:.0f} MiB; N {s.naive_tokens}, "
        f"U {s.unique_tokens}, N/U {figures['naive_over_unique']:.2f}, packed "
        f"{s.packed_tokens} in rows of {sorted(int(x) for x in batch.row_lengths)}, packed/U "
        f"{figures['packed_over_unique']:.3f}"
    )

    cells = CellsConfig(size=DEVICES, fsdp=DEVICES // shards, tensor=1, sequence=shards)
    cell = split_into_cells(cells)[0]
    train = TrainConfig(
        row_length=length, row_lengths=menu[:-1], rows_per_micro_step=1, learning_rate=1e-3
    )
    trainer = ElasticTrainer(init_model(TINY), cell, rl=RLConfig(), train=train)
    compiled, _, compile_s = trainer._compiled_for(cell, (1, length))
    mem = memory(compiled)
    figures.update(compile_s=compile_s, **{f"device_{k}": v for k, v in mem.items()})
    print(
        f"micro-step [1, {length}] on fsdp {cells.fsdp} x tensor 1 x sequence {shards}: "
        f"compiled in {compile_s:.0f} s; per device {mem['temp_mib']:.0f} MiB temporary, "
        f"{mem['total_mib']:.0f} MiB with arguments and outputs"
    )
    if not args.no_run:
        report = trainer.train_step(batch)
        figures.update(step_s=report.step_s, loss=report.metrics["loss"], skipped=report.skipped)
        print(
            f"step: {report.step_s:.1f} s over {batch.num_micro_steps} micro-steps "
            f"({report.step_s / s.unique_tokens * 1e6:.1f} s per million unique tokens), "
            f"loss {report.metrics['loss']:.4f}, skipped {report.skipped}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
