"""One command that checks a GPU host: every GPU-only path of gyrejax, measured, in one JSON.

  PYTHONPATH=. python benchmarks/gpu_check.py [--wheels DIR] [--json PATH] [--budget_s S]
  python benchmarks/gpu_check.py --cpu_dry_run [--json PATH]

Written for a machine with one GPU and no package registry, where JAX (CUDA), flax, optax,
orbax, transformers and tokenizers are installed: the repository goes on PYTHONPATH (no
pip install), and small packages missing there (ml-collections) come from a folder of
wheels (`--wheels DIR`: `pip install --no-index --no-deps --target` a temporary folder,
put first on sys.path). Within `--budget_s` (default 480: 8 minutes) it runs, each part on
its own (a failure is recorded with its message, and the rest still run; a part that would
start with too little of the budget left is skipped and says so), writing the JSON after
each part:

  * `attention`: tree attention forward + backward (q, k, v gradients) at 8k and 32k
    tokens, bfloat16, Qwen3-0.6B's heads (16 query, 8 key/value, head_dim 128), on an
    agent-shaped tree row (trunks of 1-2k tokens with forks): the Pallas kernel
    (`model.attention = "pallas"`) and the XLA live-pair loop ("blocked"), against cuDNN
    flash attention (`jax.nn.dot_product_attention(..., implementation="cudnn")`, causal)
    on the same tokens. Time per live block (128 x 128) and the kernel's ratio to cuDNN's
    (goal: at most 1.5); and at 2k tokens the kernel's values and gradients against the
    dense mask (relative error);
  * `train_step`: ElasticTrainer steps of a random Qwen3-0.6B-shaped model (bfloat16,
    float32 masters, remat "matmuls", the loss head in chunks of 4096) on one GPU at 8k
    and 16k-token rows: compile time, tokens/s, MFU (6 x parameters per token plus the
    tree attention's visible pairs, against the device's dense bfloat16 peak), and the
    memory: XLA's analysis of the compiled micro-step and the device's peak bytes in use
    against memory.py's estimate;
  * `engine`: the JAX engine's decode tokens/s with 1, 8 and 64 busy slots (128-token
    prompts, 128 new tokens, greedy), and the trainer's log-probs of sampled completions
    against the engine's, in bfloat16 on the same tokens (max and mean |difference|);
  * `rl`: two RL steps of configs/tiny_cpu.py:smoke on one GPU (one cell, the JAX engine,
    the colocate policy), end to end through `gyrejax.run.run`;
  * `vllm`: where vLLM is installed, a VllmEngine on the GPU beside JAX (the memory
    hand-off preflight's verdict first) generating greedily, and its log-probs against the
    trainer's; else skipped with the reason.

`--cpu_dry_run` runs every part at tiny sizes on CPU (the kernel in the GPU interpret
mode, XLA attention in place of cuDNN) in under 3 minutes: tests/test_gpu_check.py runs it,
so the script cannot rot. Its figures say nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Dense bfloat16 matrix throughput by device kind (FLOP/s), for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs at: the GPU's sizes, or tiny ones for the CPU dry run."""

    attention_lengths: tuple[int, ...]
    equality_length: int
    heads: tuple[int, int, int]  # query heads, key/value heads, head_dim
    block: int
    dtype: str
    reps: int
    train_rows: tuple[int, ...]
    model: dict  # ModelConfig fields of the trained / served model
    loss_chunk_tokens: int
    busy_slots: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int


QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
    num_kv_heads=8, head_dim=128, qk_norm=True, tie_embeddings=True, dtype="bfloat16",
)  # fmt: skip
GPU = Sizes(
    attention_lengths=(8192, 32768), equality_length=2048, heads=(16, 8, 128), block=128,
    dtype="bfloat16", reps=5, train_rows=(8192, 16384), model=QWEN3_06B,
    loss_chunk_tokens=4096, busy_slots=(1, 8, 64), prompt_tokens=128, new_tokens=128,
)  # fmt: skip
DRY = Sizes(
    attention_lengths=(192,), equality_length=128, heads=(2, 1, 64), block=64,
    dtype="float32", reps=1, train_rows=(256,),
    model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
               num_heads=2, num_kv_heads=1, head_dim=64, dtype="bfloat16"),
    loss_chunk_tokens=64, busy_slots=(1, 4), prompt_tokens=16, new_tokens=8,
)  # fmt: skip
# Seconds each part needs at least, on the GPU, to be worth starting.
PART_MIN_S = {"attention": 90, "train_step": 150, "engine": 60, "rl": 90, "vllm": 60}


WHEELS: list[str] = []  # folders `install_wheels` filled: on sys.path here and in children


def install_wheels(directory: str) -> str:
    """Installs every wheel in `directory` (no index, no dependencies) into a temporary
    folder put first on sys.path (and on the PYTHONPATH of the processes this starts);
    returns the folder."""
    wheels = sorted(str(p) for p in Path(directory).glob("*.whl"))
    target = tempfile.mkdtemp(prefix="gyrejax-wheels-")
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--target", target, *wheels],
            check=True,
        )  # fmt: skip
    sys.path.insert(0, target)
    WHEELS.append(target)
    return target


def median_time(fn, reps: int, warm_up: bool = True) -> float:
    """Median wall seconds of `fn()` (which blocks until its results are ready), after
    one untimed call (compiles) unless `warm_up` is False."""
    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forest_ends(length: int, seed: int = 0):
    """subtree_end int32[1, length] of an agent-shaped tree row: trunks of 1-2k tokens
    (an eighth of the row at most), each with 3 branches forking at its end."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ends = np.zeros(length, np.int32)
    start, most = 0, max(64, length // 8)
    while start < length:
        size = min(int(rng.integers(min(1024, most // 2), min(2048, most) + 1)), length - start)
        end, trunk = start + size, start + int(size * 0.6)
        ends[start:trunk] = end
        branch = max(1, -(-(end - trunk) // 3))
        for a in range(trunk, end, branch):
            ends[a : min(a + branch, end)] = min(a + branch, end)
        start = end
    return ends[None]


def part_attention(sizes: Sizes, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gyrejax.model import attention, attention_kernel

    heads, kv_heads, d = sizes.heads
    dtype = jnp.dtype(sizes.dtype)
    rng = np.random.default_rng(0)

    def inputs(length):
        shape = lambda h: (1, length, h, d)
        q, k, v, w = (
            jnp.asarray(rng.normal(size=shape(h)), dtype)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        return q, k, v, w

    def fwd_bwd(attend):
        loss = lambda q, k, v, w: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def timed(length: int) -> dict:
        q, k, v, w = inputs(length)
        ends = jnp.asarray(forest_ends(length))
        block = sizes.block
        live = int(attention.live_block_schedule(ends, block).count)
        causal = (length // block) * (length // block + 1) // 2
        variants = {
            "pallas": lambda q, k, v: attention_kernel.pallas_tree_attention(q, k, v, ends, block),
            "blocked": lambda q, k, v: attention.blocked_tree_attention(q, k, v, ends, block),
            # cuDNN's flash attention on the GPU; on the CPU dry run XLA's (no cuDNN there).
            "cudnn_causal": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=None if dry else "cudnn"
            ),
        }
        row = {"tokens": length, "live_blocks": live, "causal_blocks": causal, "block": block}
        for name, attend in variants.items():
            step = fwd_bwd(attend)
            run = lambda step=step: jax.block_until_ready(step(q, k, v, w))
            try:
                seconds = median_time(run, sizes.reps, warm_up=not dry)
            except Exception as e:  # one variant's failure is that variant's result
                row[name] = {"error": _one_line(e)}
                continue
            blocks = causal if name == "cudnn_causal" else live
            row[name] = {"fwd_bwd_s": seconds, "us_per_live_block": 1e6 * seconds / blocks}
        if all("us_per_live_block" in row.get(n, {}) for n in ("pallas", "cudnn_causal")):
            ours, cudnn = row["pallas"], row["cudnn_causal"]
            row["pallas_over_cudnn_per_live_block"] = (
                ours["us_per_live_block"] / cudnn["us_per_live_block"]
            )
            row["pallas_over_cudnn_whole_row"] = ours["fwd_bwd_s"] / cudnn["fwd_bwd_s"]
        return row

    rows = [timed(length) for length in sizes.attention_lengths]

    # Equality with the dense mask (float32 reference from the same inputs).
    length = sizes.equality_length
    q, k, v, w = inputs(length)
    ends = jnp.asarray(forest_ends(length, seed=1))
    dense = fwd_bwd(lambda q, k, v: attention.dense_tree_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), ends))  # fmt: skip
    ours = fwd_bwd(
        lambda q, k, v: attention_kernel.pallas_tree_attention(q, k, v, ends, sizes.block)
    )
    (want, want_grads), (got, got_grads) = dense(q, k, v, w), ours(q, k, v, w)
    relative = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    equality = {
        "tokens": length,
        "loss_relative_error": abs(float(got) - float(want)) / abs(float(want)),
        "grad_relative_error": {
            n: relative(a, b) for n, a, b in zip("qkv", got_grads, want_grads, strict=True)
        },
    }
    return {"dtype": sizes.dtype, "heads": sizes.heads, "rows": rows, "equality": equality}


def _executions(vocab_size: int, row: int, seed: int = 0):
    """Synthetic agent executions whose trees fill rows of `row` tokens (calls of up to a
    row, histories compacted at half of one)."""
    from gyrejax.trajectory import generate_executions

    scale = max(1, row // 2048)
    part = lambda low, high: (min(low, row // 32), min(high, row // 16))
    return generate_executions(
        2, 4, seed=seed, turns=(10 * scale, 20 * scale), vocab_size=vocab_size,
        system_prompt_tokens=min(100, row // 16), task_tokens=part(20, 60),
        tool_output_tokens=part(10, 120), model_output_tokens=part(10, 60),
        summary_tokens=part(30, 80), compaction_budget=row // 2, sub_agent_turns=(2, 5),
        max_call_tokens=row,
    )  # fmt: skip


def _peak_flops(device) -> float | None:
    kind = device.device_kind
    return next((f for name, f in PEAK_FLOPS.items() if name in kind), None)


def _visible_pairs(batch) -> int:
    """(query, key) pairs the tree mask lets attention compute, over the batch's rows."""
    import numpy as np

    ends = batch.subtree_end.astype(np.int64)
    keys = np.arange(ends.shape[1])[None, :]
    return int(np.maximum(ends - keys, 0).sum())


def part_train_step(sizes: Sizes, dry: bool) -> dict:
    import jax

    from gyrejax import memory
    from gyrejax.cells import split_into_cells
    from gyrejax.config import (
        CellsConfig,
        Config,
        HarnessConfig,
        ModelConfig,
        RLConfig,
        RolloutConfig,
        TrainConfig,
    )
    from gyrejax.model.transformer import count_params, init_model
    from gyrejax.train.trainer import ElasticTrainer
    from gyrejax.trajectory import process

    model_config = ModelConfig(**sizes.model, attention="blocked", attention_block_size=512)
    cell = split_into_cells(CellsConfig(size=1), jax.devices()[:1])[0]
    device = cell.devices[0]

    def measure(row: int) -> dict:
        train = TrainConfig(
            row_length=row, remat="matmuls", loss_chunk_tokens=sizes.loss_chunk_tokens,
            learning_rate=1e-6,
        )  # fmt: skip
        budgets = dict(
            context_budget_tokens=row // 2, max_new_tokens=row // 8,
            max_observation_tokens=row // 16,
        )  # fmt: skip
        config = Config(
            model=model_config, train=train, rollout=RolloutConfig(max_seq_len=row),
            harness=HarnessConfig(**budgets),
        )  # fmt: skip
        batch = process(_executions(model_config.vocab_size, row), row_length=row, j_max=None)
        trainer = ElasticTrainer(init_model(model_config), cell, rl=RLConfig(), train=train)
        compile_s = trainer.precompile(cell)
        analysis = trainer.compiled_micro_step(cell).memory_analysis()
        step_s = median_time(lambda: trainer.train_step(batch), max(1, sizes.reps // 2), not dry)
        stats = batch.stats
        tokens = stats.packed_tokens - stats.padding_tokens
        m = model_config
        attention_flops = 12 * m.num_layers * m.num_heads * m.head_dim * _visible_pairs(batch)
        flops = 6 * params * tokens + attention_flops
        peak = _peak_flops(device)
        estimate = memory.estimate(config, memory.H100_BYTES).training
        xla = (
            analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes
        )  # fmt: skip
        return {
            "row_tokens": row, "micro_steps": batch.num_micro_steps, "tokens": tokens,
            "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": None if peak is None else flops / step_s / peak,
            "memory": {
                "xla_micro_step_bytes": xla,
                "estimate_micro_step_bytes": estimate.micro_step_program,
                "xla_over_estimate": xla / estimate.micro_step_program,
                "device_peak_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use"),
                "estimate_total_bytes": estimate.total,
            },
        }  # fmt: skip

    params = count_params(init_model(model_config))
    rows = [measure(row) for row in sizes.train_rows]
    return {"model": "qwen3-0.6b shape" if not dry else "tiny", "params": params, "rows": rows}


def part_engine(sizes: Sizes, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gyrejax.config import ModelConfig
    from gyrejax.model.transformer import init_model
    from gyrejax.rollout.jax_engine import JaxEngine
    from gyrejax.rollout.types import Request, SamplingParams

    model = init_model(ModelConfig(**sizes.model))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    max_len = sizes.prompt_tokens + sizes.new_tokens

    async def generate(engine, prompts, temperature, tag):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=sizes.new_tokens)
        futures = [engine.submit(Request(f"{tag}{i}", p, sampling)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*futures)

    async def measure():
        slots = max(sizes.busy_slots)
        engine = JaxEngine("check", model, max_slots=slots, max_seq_len=max_len, decode_steps=8)
        decode = []
        try:
            for busy in sizes.busy_slots:
                prompts = [rng.integers(1, vocab, sizes.prompt_tokens) for _ in range(busy)]
                await generate(engine, prompts, 0.0, f"warm{busy}-")
                start = time.perf_counter()
                await generate(engine, prompts, 0.0, f"run{busy}-")
                seconds = time.perf_counter() - start
                decode.append({"busy": busy, "tokens_per_s": busy * sizes.new_tokens / seconds})
            prompts = [rng.integers(1, vocab, sizes.prompt_tokens) for _ in range(4)]
            sampled = await generate(engine, prompts, 1.0, "sampled-")
        finally:
            await engine.shutdown()
        return decode, prompts, sampled

    decode, prompts, sampled = asyncio.run(measure())
    differences = []
    for prompt, completion in zip(prompts, sampled, strict=True):
        tokens = np.concatenate([prompt, completion.output_ids]).astype(np.int32)[None]
        n = tokens.shape[1]
        logits = model(
            jnp.asarray(tokens), jnp.arange(n, dtype=jnp.int32)[None], jnp.full((1, n), n)
        )
        logprobs = jax.nn.log_softmax(logits[0, len(prompt) - 1 : n - 1], axis=-1)
        trainer = np.take_along_axis(
            np.asarray(logprobs), completion.output_ids[:, None].astype(np.int64), axis=-1
        )[:, 0]
        differences.append(np.abs(trainer - np.asarray(completion.logprobs)))
    differences = np.concatenate(differences)
    return {
        "dtype": model.config.dtype,
        "decode": decode,
        "logprob_difference": {
            "max": float(differences.max()),
            "mean": float(differences.mean()),
            "tokens": int(differences.size),
        },
    }


def part_rl(sizes: Sizes, dry: bool) -> dict:
    """The smoke run through `python -m gyrejax.launch`, as a user starts it."""
    overrides = dict(
        num_cpu_devices=("cells", 0), size=("cells", 1), fsdp=("cells", 1),
        tensor=("cells", 1), policy=("scheduler", "colocate"), steps=("train", 2),
    )  # fmt: skip
    flags = [f"--config.{section}.{name}={value}" for name, (section, value) in overrides.items()]
    flags.append("--config.compilation_cache_dir=off")
    path = [*WHEELS, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with tempfile.TemporaryDirectory(prefix="gyrejax-gpu-check-") as workdir:
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "gyrejax.launch", "--config", "configs/tiny_cpu.py:smoke",
             "--workdir", workdir, *flags],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            return {"error": f"launch exited {done.returncode}: {tail[0]}"[:500]}
        out = Path(workdir)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "run_summary.json").read_text())
    steps = [m for m in metrics if "step" in m]
    last = {k: steps[-1].get(k) for k in ("step", "reward", "loss", "tokens")} if steps else None
    return {"seconds": seconds, "steps": len(steps), "last_step": last, "rl_summary": summary}


def part_vllm(sizes: Sizes, dry: bool) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed on this host"}
    import jax
    import numpy as np

    from gyrejax import preflight
    from gyrejax.config import ModelConfig
    from gyrejax.model.hf_io import export_hf
    from gyrejax.model.transformer import init_model
    from gyrejax.rollout.types import Request, SamplingParams
    from gyrejax.rollout.vllm_engine import VllmEngine

    platform_name = jax.devices()[0].platform
    utilization = 0.3
    problem = preflight.memory_handoff_problem("vllm", utilization, platform_name)
    if problem:
        return {"skipped": f"preflight refuses vLLM beside this JAX: {problem}"}
    fields = dict(sizes.model, dtype="float32" if dry else sizes.model["dtype"])
    model = init_model(ModelConfig(**fields))
    prompt = np.arange(1, sizes.prompt_tokens + 1) % model.config.vocab_size

    async def generate(directory):
        engine = VllmEngine(
            "check", directory, max_slots=1,
            max_seq_len=sizes.prompt_tokens + sizes.new_tokens,
            gpu_memory_utilization=utilization,
        )  # fmt: skip
        try:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=sizes.new_tokens)
            return await engine.submit(Request("vllm", prompt, sampling))
        finally:
            await engine.shutdown()

    with tempfile.TemporaryDirectory() as directory:
        export_hf(model, directory)
        start = time.perf_counter()
        completion = asyncio.run(generate(directory))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "new_tokens": len(completion.output_ids)}


PARTS = {
    "attention": part_attention,
    "train_step": part_train_step,
    "engine": part_engine,
    "rl": part_rl,
    "vllm": part_vllm,
}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu_dry_run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--wheels", default="", help="a folder of wheels to install first")
    parser.add_argument("--json", default="gpu_check.json", help="where the results go")
    parser.add_argument("--budget_s", type=float, default=480.0, help="seconds for all parts")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.wheels:
        install_wheels(args.wheels)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.cpu_dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    devices = jax.devices()
    dry = args.cpu_dry_run
    if not dry and devices[0].platform != "gpu":
        sys.exit(
            f"gpu_check: JAX sees no GPU ({devices[0].platform}); install JAX's GPU build "
            "(pip install -e '.[gpu]') or pass --cpu_dry_run"
        )
    sizes = DRY if dry else GPU
    report = {
        "cpu_dry_run": dry,
        "device": devices[0].device_kind,
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "budget_s": args.budget_s,
        "parts": {},
    }
    out = Path(args.json)

    def write():
        report["elapsed_s"] = time.perf_counter() - start
        out.write_text(json.dumps(report, indent=1, default=str))

    for name in args.parts.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        if not dry and left < PART_MIN_S[name]:
            report["parts"][name] = {"skipped": f"{left:.0f} s of the budget left"}
            write()
            continue
        part_start = time.perf_counter()
        try:
            result = PARTS[name](sizes, dry)
        except Exception as e:  # recorded; the other parts still run
            result = {"error": _one_line(e), "traceback": traceback.format_exc()[-3000:]}
        result["part_s"] = time.perf_counter() - part_start
        report["parts"][name] = result
        print(f"gpu_check: {name}: {time.perf_counter() - part_start:.1f} s", flush=True)
        write()
    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
