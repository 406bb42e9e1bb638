"""Trajectory processor benchmark: prefix-shared tree packing vs call-by-call packing.

Usage:
  python benchmarks/trajectory_bench.py [--quick] [--json PATH] [--reps N]

On seeded synthetic agent traces (full: 8 groups x 8 executions, 100-300 turns each,
with compaction, sub-agents, retries and timeouts; --quick: 2 x 4, 30-60 turns) at
row_length 8192 it prints, for the tree processor (j_max=5 and uncapped) and for a naive
baseline that trains every call as its own sequence (best-fit-decreasing packed):
naive tokens N, unique tokens U, admitted tokens, packed tokens, padding, repeated
context, waste, N/U, N/admitted, and processing time (median of --reps runs, trace
generation excluded) with throughput in naive tokens/s.

It also prints a lower bound on the rows any exact packing of the admitted forests needs
(see `rows_lower_bound`), and the best waste that bound allows: a token is trained only
with its whole context in its row, so paths close to L cannot share rows and a shared
trunk must be repeated in every row its tree spans, whatever the packer does.

Row buckets (a second table): the same traces packed with `row_lengths` (rows of a few
lengths, `max_row_shapes` distinct ones at most) against one length: within one
device's row (L/4, L/2, L) and with a sequence axis (up to 4L), each with and without a
cap on shapes. It reports packed tokens over U (uncapped) or over the admitted tokens
(j_max=5), waste, the fewest packed tokens any exact packing could reach (a lower
bound: admitted tokens + the trunk repeats rows of the longest length force, rounded up
to whole micro-steps; with one length also the pairwise-incompatible paths), and the
shapes used. The goal of issue 18 is packed <= 1.03 x U uncapped.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import time

import numpy as np

from gyrejax.trajectory import (
    Execution,
    admission_rng,
    admit_paths,
    build_tree,
    generate_executions,
    process,
)
from gyrejax.trajectory.buckets import rows_per_micro_step_for

ROW_LENGTH = 8192


def naive_baseline(executions: list[Execution], row_length: int) -> dict[str, float]:
    """Every call is its own sequence; sequences are packed best-fit decreasing.

    Builds the same kind of arrays the tree packer does (tokens, positions, segment id,
    loss weight) so that its time is comparable.
    """
    calls = [c for ex in executions for c in ex.calls]
    lengths = np.asarray([c.length for c in calls], dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    free: list[tuple[int, int]] = []  # sorted (free space, row)
    placement = np.zeros(len(calls), dtype=np.int64)
    offset = np.zeros(len(calls), dtype=np.int64)
    row_fill: list[int] = []
    for i in order.tolist():
        n = int(lengths[i])
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            row = len(row_fill)
            row_fill.append(0)
        else:
            _, row = free.pop(j)
        placement[i], offset[i] = row, row_fill[row]
        row_fill[row] += n
        if row_length - row_fill[row] > 0:
            bisect.insort(free, (row_length - row_fill[row], row))
    rows = len(row_fill)
    tokens = np.zeros((rows, row_length), dtype=np.int32)
    positions = np.zeros((rows, row_length), dtype=np.int32)
    segment = np.full((rows, row_length), -1, dtype=np.int32)
    weight = np.zeros((rows, row_length), dtype=np.float32)
    for i, c in enumerate(calls):
        r, o, p, n = int(placement[i]), int(offset[i]), len(c.prompt_ids), c.length
        tokens[r, o : o + p] = c.prompt_ids
        tokens[r, o + p : o + n] = c.output_ids
        positions[r, o : o + n] = np.arange(n)
        segment[r, o : o + n] = i
        weight[r, o + p : o + n] = 1.0
    naive = int(lengths.sum())
    packed = rows * row_length
    return {
        "rows": rows,
        "naive_tokens": naive,
        "packed_tokens": packed,
        "padding_tokens": packed - naive,
        "waste_fraction": (packed - naive) / packed if packed else 0.0,
    }


def _repeated_trunk_tokens(tree, admitted: np.ndarray, row_length: int) -> int:
    """Copies of trunk tokens any packing of one admitted forest must make.

    A chain of t tokens (from a tree root, or from a child of the root chain's branch
    point, down to the next branch point) is on the path of all b tokens below it.
    Those need k >= ceil(b / (L - d)) rows (d = depth at the chain's end), and every one
    of those rows holds the whole chain: at least (k - 1) * t repeated tokens. The
    chains counted are disjoint, so their repeats add up.
    """
    lens = tree.node_end - tree.node_start
    kids = [[c for c in tree.children[n] if admitted[c]] for n in range(tree.num_nodes)]
    size = np.where(admitted, lens, 0)
    order, stack = [], [0]
    while stack:  # pre-order; a split can give a child a lower id than its parent
        n = stack.pop()
        order.append(n)
        stack.extend(kids[n])
    for n in reversed(order[1:]):
        size[int(tree.node_parent[n])] += size[n]

    def chain(node):  # (chain tokens, depth at its end, branch node)
        t = 0
        while True:
            t += int(lens[node])
            if len(kids[node]) != 1:
                return t, int(tree.node_depth[node] + lens[node]), node
            node = kids[node][0]

    def repeats(t, depth, below):
        return 0 if below <= 0 else (-(-below // (row_length - depth)) - 1) * t

    total = 0
    for root in kids[0]:
        t, depth, branch = chain(root)
        below = int(size[root]) - t
        total += repeats(t, depth, below)
        for c in kids[branch]:
            tc, dc, _ = chain(c)
            total += repeats(tc, dc, int(size[c]) - tc)
    return total


def rows_lower_bound(executions: list[Execution], row_length: int, j_max: int | None, seed: int):
    """A lower bound on the rows any exact packing of the admitted forests needs.

    Two bounds, the larger wins:
      * paths: admitted root-to-leaf paths that pairwise cannot share a row (the union
        of the two is longer than L) each need their own row (greedy set, longest first);
      * volume: rows >= ceil((admitted tokens + unavoidable repeats) / L), with the
        repeats counted by `_repeated_trunk_tokens`.
    """
    paths = []  # (length, execution index, node -> tokens on the path)
    volume = 0
    for e, ex in enumerate(executions):
        if not ex.calls or ex.status == "eval_failed":
            continue
        tree = build_tree(list(ex.calls))
        admitted, leaves = admit_paths(tree, j_max, admission_rng(seed, ex.execution_id))
        lens = tree.node_end - tree.node_start
        a_e = int(lens[admitted].sum())
        volume += a_e + _repeated_trunk_tokens(tree, admitted, row_length)
        for leaf in leaves:
            nodes, n = {}, leaf
            while n > 0:
                nodes[n] = int(lens[n])
                n = int(tree.node_parent[n])
            paths.append((sum(nodes.values()), e, nodes))
    paths.sort(key=lambda p: -p[0])
    chosen: list[tuple[int, int, dict[int, int]]] = []
    for p in paths:
        ok = True
        for q in chosen:
            shared = sum(p[2][n] for n in p[2].keys() & q[2].keys()) if p[1] == q[1] else 0
            if p[0] + q[0] - shared <= row_length:
                ok = False
                break
        if ok:
            chosen.append(p)
    by_volume = -(-volume // row_length)
    bound = max(by_volume, len(chosen))
    return {
        "volume_lower_bound": volume,
        "incompatible_path_lengths": [p[0] for p in chosen],
        "rows_lower_bound": bound,
        "rows_by_volume": by_volume,
        "pairwise_incompatible_paths": len(chosen),
    }


# (name, row lengths as multiples of L, max_row_shapes); None = the default, one length.
BUCKETS = (
    ("one length L", None, None),
    ("L/4..L", (0.25, 0.5, 1), None),
    ("L/4..4L", (0.25, 0.5, 1, 2, 4), None),
    ("L/4..4L, 2 shapes", (0.25, 0.5, 1, 2, 4), 2),
    ("L..4L, 1 shape", (1, 2, 4), 1),
)


def packed_lower_bound(executions, lengths, j_max, seed, rows_per_micro_step=1) -> int:
    """Fewest packed tokens any exact packing with rows of `lengths` could reach.

    The trunk repeats are counted for rows of the longest length (longer rows can only
    repeat less); admitted + repeats is rounded up to the gcd of the micro-step sizes
    (rows per micro-step x length: packed tokens are a sum of them). Also, the
    pairwise-incompatible paths of `rows_lower_bound` (for the longest length) each need
    a row of their own, at least the shortest allowed length that holds them.
    """
    bound = rows_lower_bound(executions, max(lengths), j_max, seed)
    per = {
        n: rows_per_micro_step_for(
            n, row_length=ROW_LENGTH, rows_per_micro_step=rows_per_micro_step
        )
        for n in lengths
    }
    steps = [n * per[n] for n in lengths]
    grain = math.gcd(*steps)
    tokens = -(-bound["volume_lower_bound"] // grain) * grain
    by_paths = sum(min(n for n in lengths if n >= p) for p in bound["incompatible_path_lengths"])
    return max(tokens, -(-by_paths // grain) * grain)


def bucket_table(executions) -> dict[str, dict]:
    """Packs with each `BUCKETS` menu, j_max=5 and uncapped; prints and returns figures."""
    out = {}
    for j_name, j_max in (("j_max=5", 5), ("uncapped", None)):
        for name, menu, cap in BUCKETS:
            lengths = (ROW_LENGTH,) if menu is None else tuple(int(m * ROW_LENGTH) for m in menu)
            t0 = time.perf_counter()
            batch = process(
                executions, row_length=ROW_LENGTH, j_max=j_max, vocab_size=32000,
                row_lengths=None if menu is None else lengths, max_row_shapes=cap,
            )  # fmt: skip
            secs = time.perf_counter() - t0
            s = batch.stats
            base = s.unique_tokens if j_max is None else s.admitted_tokens
            bound = packed_lower_bound(executions, lengths, j_max, 0)
            out[f"{j_name} {name}"] = {
                "row_lengths": list(lengths),
                "max_row_shapes": cap,
                "packed_tokens": s.packed_tokens,
                "base_tokens": base,
                "packed_over_base": s.packed_tokens / base,
                "waste_fraction": s.waste_fraction,
                "padding_tokens": s.padding_tokens,
                "repeated_tokens": s.repeated_tokens,
                "packed_lower_bound": bound,
                "bound_over_base": bound / base,
                "min_waste_fraction": 1 - s.admitted_tokens / bound,
                "shapes": [list(x) for x in batch.shapes],
                "seconds": secs,
            }
    print("\nrow buckets (L = 8192; base = U uncapped, admitted tokens with j_max=5)")
    head = ("", "packed/base", "bound/base", "waste", "min waste", "pad", "repeat", "shapes")
    print(f"{head[0]:<30}" + "".join(f"{h:>12}" for h in head[1:-1]) + f"  {head[-1]}")
    for key, r in out.items():
        shapes = " ".join(f"{n}x{length}" for n, length in r["shapes"])
        print(
            f"{key:<30}{r['packed_over_base']:>12.4f}{r['bound_over_base']:>12.4f}"
            f"{100 * r['waste_fraction']:>11.2f}%{100 * r['min_waste_fraction']:>11.2f}%"
            f"{r['padding_tokens']:>12,}{r['repeated_tokens']:>12,}  {shapes}"
        )
    return out


def timed(fn, reps: int):
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small traces (seconds)")
    parser.add_argument("--json", help="write all figures to this JSON file")
    parser.add_argument("--reps", type=int, default=None, help="timing repetitions")
    parser.add_argument(
        "--compaction_budget",
        type=int,
        default=None,
        help="synthetic agents compact their context past this many tokens (default 7000)",
    )
    args = parser.parse_args()
    groups, size, turns = (2, 4, (30, 60)) if args.quick else (8, 8, (100, 300))
    reps = args.reps or (3 if args.quick else 5)

    t0 = time.perf_counter()
    knobs = {} if args.compaction_budget is None else {"compaction_budget": args.compaction_budget}
    executions = generate_executions(groups, size, seed=0, turns=turns, **knobs)
    gen_s = time.perf_counter() - t0
    calls = sum(len(ex.calls) for ex in executions)
    print(
        f"traces: {len(executions)} executions ({groups} groups x {size}), {calls} calls, "
        f"generated in {gen_s:.1f}s; row_length {ROW_LENGTH}; timing: median of {reps}"
    )

    results: dict[str, dict] = {}
    for name, j_max in (("tree j_max=5", 5), ("tree uncapped", None)):
        batch, secs = timed(
            lambda j=j_max: process(executions, row_length=ROW_LENGTH, j_max=j, vocab_size=32000),
            reps,
        )
        s = batch.stats.as_dict()
        s.update(seconds=secs, naive_tokens_per_s=s["naive_tokens"] / secs)
        s.update(rows_lower_bound(executions, ROW_LENGTH, j_max, 0))
        bound_slots = s["rows_lower_bound"] * ROW_LENGTH
        s["min_waste_fraction"] = 1 - s["admitted_tokens"] / bound_slots if bound_slots else 0.0
        results[name] = s
    base, secs = timed(lambda: naive_baseline(executions, ROW_LENGTH), max(1, reps // 2))
    base.update(seconds=secs, naive_tokens_per_s=base["naive_tokens"] / secs)
    results["call-by-call"] = base

    cols = list(results)
    fmt_int = lambda v: f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v:,}"

    def line(label, fn):
        cells = []
        for c in cols:
            try:
                cells.append(fn(results[c]))
            except KeyError:
                cells.append("-")
        print(f"{label:<28}" + "".join(f"{x:>16}" for x in cells))

    print(f"{'':<28}" + "".join(f"{c:>16}" for c in cols))
    line("naive tokens N", lambda r: fmt_int(r["naive_tokens"]))
    line("unique tokens U", lambda r: fmt_int(r["unique_tokens"]))
    line("admitted tokens", lambda r: fmt_int(r["admitted_tokens"]))
    line("trained tokens", lambda r: fmt_int(r["admitted_trainable_tokens"]))
    line("rows", lambda r: f"{r['rows']:,}")
    line("  lower bound on rows", lambda r: f"{r['rows_lower_bound']:,}")
    line("packed tokens", lambda r: fmt_int(r["packed_tokens"]))
    line("padding", lambda r: fmt_int(r["padding_tokens"]))
    line("repeated context", lambda r: fmt_int(r["repeated_tokens"]))
    line("waste %", lambda r: f"{100 * r['waste_fraction']:.2f}%")
    line("  best possible waste %", lambda r: f"{100 * r['min_waste_fraction']:.2f}%")
    line("N/U", lambda r: f"{r['naive_over_unique']:.1f}x")
    line("N/admitted", lambda r: f"{r['naive_over_admitted']:.1f}x")
    base_packed = results["call-by-call"]["packed_tokens"]
    line("packed vs call-by-call", lambda r: f"{base_packed / r['packed_tokens']:.1f}x less")
    line("processing time", lambda r: f"{r['seconds'] * 1e3:.0f} ms")
    line("throughput (naive tok/s)", lambda r: f"{r['naive_tokens_per_s'] / 1e6:.1f}M")
    buckets = bucket_table(executions)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "row_length": ROW_LENGTH,
                    "executions": len(executions),
                    "calls": calls,
                    "quick": args.quick,
                    "reps": reps,
                    "results": results,
                    "buckets": buckets,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
