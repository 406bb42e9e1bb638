"""HF export benchmark: the streamed `export_hf` vs the previous one vs the raw write.

  python benchmarks/export_bench.py [--quick] [--json PATH] [--fsync] [--dir DIR]

One bfloat16 model with Qwen3-8B's layer shapes (hidden 4096, MLP 12288, 32 query and
8 key/value heads of 128, qk-norm, untied embeddings) but 4 layers and a 32768-token
vocabulary (2.08 GB; `--quick`: 1 layer, 8192 tokens, 0.52 GB), written side by side in
one run into a temporary directory on one disk (`--dir`, default the system's temp dir),
after a warm-up round, in a shuffled order each round, `--runs` rounds (default 5, `--quick` 2):
  * `old`: `export_hf` as of BASELINE_COMMIT (its source read by `git show`): every
    tensor copied to the host, transposed and cast by NumPy, then `save_file`;
  * `new`: today's `export_hf` (converted on the device, streamed into the files);
  * `raw`: the same bytes from one preallocated buffer, into the same files (same sizes,
    same temporary names and renames) with the same `open(..., "wb").write`;
  * `stream`: (a diagnostic) today's `export_hf` with every tensor converted and on the
    host beforehand: its write path alone, what it costs where the device keeps ahead
    of the disk (an accelerator converts at memory speed);
  * `convert`: (a diagnostic, no file) the new export's device conversions and copies
    to the host alone, what the device side costs when nothing waits for the disk.
Files of at most 1 GiB (`--max_shard_bytes`), so the export has several, as a Qwen3-8B
one (16.4 GB in 2 GiB files) has.

The page cache: `export_hf` never fsyncs, so by default nothing here does: the figures
are writes into the page cache (memory copies; the kernel writes back later), the
strictest test of the export's own overhead. `os.sync()` runs (untimed) before every
timed run so no run pays for the last one's writeback. `--fsync`: every variant's files
(and directory) are fsynced before its clock stops, so all three include the disk.

Reports per variant the median seconds, GB/s (1e9 bytes/s of safetensors data), the
throughput over raw's, and the median CPU seconds of this process (all threads, user
and system: what a variant costs the cores, however busy the machine), then the new/raw
and new/old ratios. On a host without an accelerator the "device" is the CPU cores that
also write the files: the conversions (XLA transposes) and the writes share them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from gyrejax.config import ModelConfig
from gyrejax.model import hf_io
from gyrejax.model.transformer import init_model

# The last commit whose `export_hf` transposes on the host (the baseline).
BASELINE_COMMIT = "3eff77ca68c7203807b9abcce69e42edfd3ef312"
REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("old", "new", "raw", "stream", "convert")

# Qwen3-8B's layers; fewer of them and a smaller vocabulary, so a few GB in all.
QWEN3_8B_LAYER = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    qk_norm=True,
    tie_embeddings=False,
    rope_theta=1_000_000.0,
    dtype="bfloat16",
)


def baseline_export_hf(directory: Path):
    """`export_hf` from BASELINE_COMMIT, loaded as a module of its own (from a copy of
    its source in `directory`)."""
    source = subprocess.run(
        ["git", "show", f"{BASELINE_COMMIT}:gyrejax/model/hf_io.py"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = directory / "hf_io_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hf_io_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.export_hf


def cpu_seconds() -> float:
    """CPU time of this process so far: all threads, user and system (copies into the
    page cache are system time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fsync_directory(directory: Path) -> None:
    """Every file in `directory`, then the directory itself, to the disk."""
    for path in [*sorted(directory.iterdir()), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def raw_write(buffer: np.ndarray, sizes: list[tuple[str, int]], directory: Path) -> None:
    """`buffer`'s bytes into files of these names and sizes, as export_hf writes them."""
    directory.mkdir()
    view = memoryview(buffer)
    offset = 0
    for name, size in sizes:
        tmp = directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(view[offset : offset + size])
        os.replace(tmp, directory / name)
        offset += size


def converted(model) -> Iterator[tuple[str, np.ndarray]]:
    """The new export's device conversions and host copies, each tensor by HF name."""
    dtype = np.dtype(jax.numpy.bfloat16)
    plan = hf_io._export_plan(model, dtype)
    host = hf_io._host_tensors(plan, dtype, hf_io._EXPORT_LOOKAHEAD_BYTES)
    return zip((t.hf_name for t in plan), host, strict=True)


@contextlib.contextmanager
def preconverted(tensors: dict[str, np.ndarray]):
    """`export_hf` with its device conversions replaced by these finished tensors."""
    real = hf_io._host_tensors
    hf_io._host_tensors = lambda plan, dtype, lookahead: (tensors[t.hf_name] for t in plan)
    try:
        yield
    finally:
        hf_io._host_tensors = real


def measure(model, root: Path, runs: int, max_shard_bytes: int, fsync: bool) -> dict:
    """Seconds and CPU seconds of every variant, `runs` rounds after a warm-up round."""
    old_export = baseline_export_hf(root)
    # The files' names and sizes, from one export: what raw writes too.
    reference = hf_io.export_hf(model, root / "reference", max_shard_bytes=max_shard_bytes)
    sizes = [
        (p.name, p.stat().st_size)
        for p in sorted(reference.iterdir())
        if p.name.endswith(".safetensors")
    ]
    shutil.rmtree(reference)
    buffer = np.full(sum(size for _, size in sizes), 0x3C, np.uint8)  # pages touched
    finished = {name: np.array(host) for name, host in converted(model)}  # what stream writes

    def run(variant: str, directory: Path) -> None:
        if variant == "old":
            old_export(model, directory, max_shard_bytes=max_shard_bytes)
        elif variant == "new":
            hf_io.export_hf(model, directory, max_shard_bytes=max_shard_bytes)
        elif variant == "raw":
            raw_write(buffer, sizes, directory)
        elif variant == "stream":
            with preconverted(finished):
                hf_io.export_hf(model, directory, max_shard_bytes=max_shard_bytes)
        else:
            for _ in converted(model):
                pass
        if fsync and variant != "convert":  # (convert writes nothing)
            fsync_directory(directory)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(runs + 1):  # round 0: warm-up (compilation, first touches)
        order = list(VARIANTS)  # shuffled: no variant always runs after the same one
        random.Random(round_).shuffle(order)
        for variant in order:
            directory = root / f"{variant}_{round_}"
            os.sync()
            start, start_cpu = time.perf_counter(), cpu_seconds()
            run(variant, directory)
            elapsed = time.perf_counter() - start
            if round_:
                times[variant].append(elapsed)
                cpu[variant].append(cpu_seconds() - start_cpu)
            shutil.rmtree(directory, ignore_errors=True)
            print(f"  round {round_} {variant:<8} {elapsed:7.2f} s", file=sys.stderr)
    return {"bytes": buffer.nbytes, "files": len(sizes), "seconds": times, "cpu_seconds": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="0.52 GB model, 2 rounds")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--runs", type=int, help="timed rounds (default 5, --quick 2)")
    parser.add_argument("--layers", type=int, help="layers (default 4, --quick 1)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 32768, --quick 8192)")
    parser.add_argument("--max_shard_bytes", type=int, default=1 << 30)
    parser.add_argument("--fsync", action="store_true", help="fsync every file, all variants")
    parser.add_argument("--dir", help="write under this directory (default: the temp dir)")
    args = parser.parse_args()
    runs = args.runs or (2 if args.quick else 5)
    config = ModelConfig(
        vocab_size=args.vocab or (8192 if args.quick else 32768),
        num_layers=args.layers or (1 if args.quick else 4),
        **QWEN3_8B_LAYER,
    )
    model = init_model(config)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(params)
    root = Path(tempfile.mkdtemp(prefix="export_bench_", dir=args.dir))
    try:
        result = measure(model, root, runs, args.max_shard_bytes, args.fsync)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    total = result["bytes"]
    print(
        f"model: Qwen3-8B layers x {config.num_layers}, vocab {config.vocab_size}, bfloat16, "
        f"{sum(x.size for x in params) / 1e9:.2f} B params, {total / 1e9:.2f} GB in "
        f"{result['files']} file(s) on {root.parent}; "
        f"{'fsynced' if args.fsync else 'page cache, no fsync'}; medians of {runs} runs; "
        f"device: {jax.devices()[0].device_kind} ({os.cpu_count()} cores)"
    )
    figures: dict = {
        "model": {**QWEN3_8B_LAYER, "num_layers": config.num_layers, "vocab": config.vocab_size},
        "bytes": total,
        "files": result["files"],
        "fsync": args.fsync,
        "runs": runs,
        "device": jax.devices()[0].device_kind,
        "baseline_commit": BASELINE_COMMIT,
    }
    medians = {v: statistics.median(t) for v, t in result["seconds"].items()}
    print(f"{'variant':<10}{'median s':>10}{'GB/s':>8}{'/ raw':>8}{'cpu s':>8}")
    for variant in VARIANTS:
        cpu_s = statistics.median(result["cpu_seconds"][variant])
        figures[variant] = {
            "seconds": result["seconds"][variant],
            "median_s": medians[variant],
            "gb_per_s": total / medians[variant] / 1e9,
            "over_raw": medians["raw"] / medians[variant],
            "cpu_seconds": result["cpu_seconds"][variant],
            "median_cpu_s": cpu_s,
        }
        f = figures[variant]
        print(
            f"{variant:<10}{f['median_s']:>10.2f}{f['gb_per_s']:>8.2f}"
            f"{f['over_raw']:>8.2f}{cpu_s:>8.2f}"
        )
    figures["new_over_raw"] = figures["new"]["over_raw"]
    figures["new_speedup_over_old"] = medians["old"] / medians["new"]
    print(
        f"new reaches {figures['new_over_raw']:.0%} of the raw write's throughput "
        f"(goal 80%), {figures['new_speedup_over_old']:.1f}x old's"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
