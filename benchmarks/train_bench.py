"""Training benchmark: tree-packed steps vs naive call-by-call steps, joins and leaves.

  python benchmarks/train_bench.py [--quick] [--json PATH]

On synthetic agent traces (gyrejax.trajectory.synthetic: multi-turn contexts, compaction,
sub-agents, retries) and the tiny model of configs/tiny_cpu.py:
  (a) tree: the trajectory processor's packed rows (every generated token once, and the
      default j_max=5 admission);
  (b) naive: the same calls trained one by one, each call its own causal sequence (rows
      packed best-fit, as the trajectory processor packs single chains).
Both run through the same ElasticTrainer step on one cell; the table gives the step time
(median), tokens per second, the step time per unique token (U of the tree batch: the
data's distinct tokens, a shared prefix once; the same U for both, since they train the
same calls) and per trained token, and the speed ratio. Then, on 4 cells
of 1 device: compile time per cell, join latency by phase (weight pull, compile, first
micro-step), leave latency (wait for the step boundary) and the cross-cell reduction time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

from gyrejax.cells import split_into_cells  # noqa: E402
from gyrejax.config import CellsConfig, ModelConfig, RLConfig, TrainConfig  # noqa: E402
from gyrejax.model.transformer import init_model  # noqa: E402
from gyrejax.train.trainer import ElasticTrainer  # noqa: E402
from gyrejax.trajectory import Execution, generate_executions, process  # noqa: E402

ROW = 2048
MODEL = ModelConfig(
    vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=64, rope_theta=10_000.0, attention="blocked",
    attention_block_size=512,
)  # fmt: skip
TRAIN = TrainConfig(row_length=ROW, rows_per_micro_step=1, learning_rate=1e-5)


def traces(quick: bool) -> list[Execution]:
    groups, size, turns = (2, 2, (6, 10)) if quick else (2, 4, (20, 40))
    return generate_executions(
        groups, size, seed=0, turns=turns, vocab_size=MODEL.vocab_size,
        system_prompt_tokens=100, task_tokens=(20, 60), tool_output_tokens=(10, 120),
        model_output_tokens=(10, 60), summary_tokens=(30, 80), compaction_budget=1500,
        sub_agent_turns=(2, 5), max_call_tokens=ROW,
    )  # fmt: skip


def call_by_call(executions: list[Execution]) -> list[Execution]:
    """Each call as its own execution: trained as its own causal sequence."""
    out = []
    for ex in executions:
        for call in ex.calls:
            cid = f"{ex.execution_id}/{call.call_id}"
            out.append(
                dataclasses.replace(
                    ex,
                    execution_id=cid,
                    calls=[dataclasses.replace(call, execution_id=cid)],
                    status="finished",
                    reward=ex.reward or 0.0,
                )
            )
    return out


def time_steps(batch, cell, reps: int) -> dict:
    trainer = ElasticTrainer(init_model(MODEL), cell, rl=RLConfig(), train=TRAIN)
    compile_s = trainer.precompile(cell)
    trainer.train_step(batch)  # warm-up (first execution, reduction/update compiles)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    s = batch.stats
    return {
        "rows": int(batch.tokens.shape[0]),
        "packed_tokens": s.packed_tokens,
        "processed_tokens": s.packed_tokens - s.padding_tokens,  # what the step computes
        "trained_tokens": s.admitted_trainable_tokens,
        "naive_tokens": s.naive_tokens,
        "step_s": step_s,
        "packed_tokens_per_s": s.packed_tokens / step_s,
        "step_s_per_trained_token": step_s / max(s.admitted_trainable_tokens, 1),
        "compile_s": compile_s,
    }


def elastic_latencies(batch, reps: int) -> dict:
    cells = split_into_cells(CellsConfig(size=1, fsdp=1, tensor=1))
    trainer = ElasticTrainer(init_model(MODEL), cells[0], rl=RLConfig(), train=TRAIN)
    compile_s = {c.index: trainer.precompile(c) for c in cells}
    joins, leaves, reductions = [], [], []
    for _ in range(reps):
        pending = list(cells[1:])

        def join_some(m, cell, pending=pending):
            if pending and cell.index == 0:
                trainer.join(pending.pop(0))

        report = trainer.train_step(batch, on_micro_step=join_some)
        joins += [dataclasses.asdict(j) for j in report.joins]
        reductions.append({"cells": len(report.cells), "reduction_s": report.reduction_s})
        leaving = [c for c in trainer.training if not c.is_core]

        def release_all(m, cell, leaving=leaving):
            while leaving:
                trainer.release(leaving.pop(0))

        report = trainer.train_step(batch, on_micro_step=release_all)
        leaves += [dataclasses.asdict(r) for r in report.released]
        reductions.append({"cells": len(report.cells), "reduction_s": report.reduction_s})
    return {
        "compile_s_per_cell": compile_s,
        "rejoin_compiles": trainer.compile_count,
        "joins": joins,
        "leaves": leaves,
        "reductions": reductions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    reps = 1 if args.quick else 3
    executions = traces(args.quick)
    core = split_into_cells(CellsConfig(size=1, fsdp=1, tensor=1))[0]

    batches = {
        "tree (all tokens)": process(executions, row_length=ROW, j_max=None),
        "tree (j_max=5)": process(executions, row_length=ROW, j_max=5),
        "naive call-by-call": process(call_by_call(executions), row_length=ROW, j_max=None),
    }
    calls = sum(len(e.calls) for e in executions)
    print(f"{len(executions)} executions, {calls} calls; tiny model; row length {ROW}; 1 device")
    results = {name: time_steps(b, core, reps) for name, b in batches.items()}
    naive = results["naive call-by-call"]
    unique = batches["tree (all tokens)"].stats.unique_tokens  # U: the same for every layout
    for r in results.values():
        r["step_s_per_unique_token"] = r["step_s"] / unique
    print(
        f"{'':<20} {'rows':>6} {'trained tok':>12} {'computed tok':>13} {'packed tok':>11} "
        f"{'step s':>8} {'packed tok/s':>13} {'us/unique':>10} {'us/trained':>11} "
        f"{'speed-up':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:<20} {r['rows']:>6} {r['trained_tokens']:>12,} {r['processed_tokens']:>13,} "
            f"{r['packed_tokens']:>11,} {r['step_s']:>8.2f} {r['packed_tokens_per_s']:>13.0f} "
            f"{r['step_s_per_unique_token'] * 1e6:>10.1f} "
            f"{r['step_s_per_trained_token'] * 1e6:>11.1f} "
            f"{naive['step_s'] / r['step_s']:>8.1f}x"
        )
    print(
        f"computed tok: packed minus padding; us/unique: step time per unique token of the "
        f"data (U = {unique:,}, the tree batch's); us/trained: per trained token"
    )

    elastic = elastic_latencies(batches["tree (all tokens)"], reps)
    print("\nelastic (4 cells of 1 device):")
    print(
        "  compile per cell (s): "
        + ", ".join(f"{i}: {s:.2f}" for i, s in elastic["compile_s_per_cell"].items())
    )
    for phase in ("weight_pull_s", "compile_s", "first_micro_step_s"):
        values = [j[phase] for j in elastic["joins"] if j[phase] is not None]
        if values:
            print(f"  join {phase:<20} median {statistics.median(values) * 1e3:8.1f} ms "
                  f"(n={len(values)})")  # fmt: skip
    waits = [r["wait_s"] for r in elastic["leaves"]]
    if waits:
        median_ms = statistics.median(waits) * 1e3
        print(f"  leave wait for boundary  median {median_ms:8.1f} ms (n={len(waits)})")
    for n in sorted({r["cells"] for r in elastic["reductions"]}):
        values = [r["reduction_s"] for r in elastic["reductions"] if r["cells"] == n]
        print(f"  reduction over {n} cell(s)  median {statistics.median(values) * 1e3:8.1f} ms")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": results, "elastic": elastic, "quick": args.quick}, f, indent=2)


if __name__ == "__main__":
    main()
