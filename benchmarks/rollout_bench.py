"""Rollout benchmark: JAX engine vs vLLM engine throughput; migration latency.

  python benchmarks/rollout_bench.py [--quick] [--json PATH] [--door_only] [--width_only]

On the tiny model of configs/tiny_cpu.py (float32, head_dim 64, so vLLM's CPU attention
serves it), side by side in one run:
  * throughput: the same workload (32 requests, 64-token prompts, 128 new tokens,
    greedy) on the JAX engine and on the vLLM engine (skipped with a note if vllm is not
    installed), after a warm-up run of each; tokens/s is new tokens over wall time;
  * decode width: tokens/s of one JAX engine of 32 slots with 1, 4, 8 or 32 of them
    busy (the same workload shape), decoding only as wide as the busy slots (a power of
    four: 1, 4, 16, 32) vs every slot in every call (`narrow=False`, the engine before
    widths), the two side by side; the tokens must be the same;
  * migration latency as the context grows (1k, 4k, 16k tokens): from the start of an
    export on one JAX engine until the request's next token on another, with the KV
    cache copied device to device vs re-submitted (prompt + tokens so far re-prefilled);
  * the OpenAI door's overhead per call (`rl.agent = command`): 1, 8 and 32 concurrent
    agents, each making calls one after another (128-token prompts, 32 new tokens,
    greedy) on one JAX engine, through the door over loopback HTTP (aiohttp client,
    /v1/completions with token ids) vs `Proxy.generate` in process, the two modes
    interleaved. Two measures (goal < 5% of the call time):
      - added: each door call's time minus the proxy time inside that same call, so the
        engine's batching (which moves call times by +-15% between runs) cancels out;
        its median over the median proxy call;
      - total: median door call / median proxy call - 1 per repetition, which also
        holds what the door costs the engine indirectly (its Python work shares the
        cores and the GIL with the engine thread), and the batching noise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402

from gyrejax.config import ModelConfig  # noqa: E402
from gyrejax.model.hf_io import export_hf  # noqa: E402
from gyrejax.model.transformer import init_model  # noqa: E402
from gyrejax.rollout.jax_engine import JaxEngine  # noqa: E402
from gyrejax.rollout.types import Request, SamplingParams  # noqa: E402

TINY = ModelConfig(
    vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=64, rope_theta=10_000.0, attention="blocked",
    attention_block_size=512,
)  # fmt: skip


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, prompt_len).tolist() for _ in range(n)]


async def run_workload(engine, prompts, new_tokens: int, tag: str) -> tuple[float, list]:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    futures = [engine.submit(Request(f"{tag}{i}", p, sampling)) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*futures)
    return time.perf_counter() - start, results


async def throughput(engine, prompts, new_tokens: int, reps: int) -> dict:
    await run_workload(engine, prompts, new_tokens, "warm")  # compiles / warm caches
    times, outputs = [], None
    for rep in range(reps):
        seconds, results = await run_workload(engine, prompts, new_tokens, f"r{rep}-")
        times.append(seconds)
        outputs = [r.output_ids.tolist() for r in results]
    seconds = statistics.median(times)
    return {
        "seconds": seconds,
        "tokens_per_s": len(prompts) * new_tokens / seconds,
        "outputs": outputs,
    }


async def migration_latency(model, context: int, reps: int) -> dict:
    """Export after a few tokens, import elsewhere; time to the next token there."""
    max_len = context + 64
    a = JaxEngine("a", model, max_slots=1, max_seq_len=max_len, decode_steps=1)
    b = JaxEngine("b", model, max_slots=1, max_seq_len=max_len, decode_steps=1)
    prompt = workload(1, context - 8, seed=context)[0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    out = {"context": context}
    try:
        for mode in ("kv_copy", "resubmit", "kv_copy", "resubmit")[: 2 * reps]:
            future = a.submit(Request(f"{mode}{time.time()}", prompt, sampling))
            base = a.tokens_generated
            while a.tokens_generated < base + 4:
                await asyncio.sleep(0.001)
            start = time.perf_counter()
            live = await a.export(future_request_id(a))
            future.cancel()
            if mode == "resubmit":
                live = dataclasses.replace(live, kv=None)
            before = b.tokens_generated
            moved = b.import_request(live)
            while b.tokens_generated == before:
                await asyncio.sleep(0.0005)
            out.setdefault(mode, []).append(time.perf_counter() - start)
            b.cancel(live.request.request_id)
            await moved
    finally:
        await a.shutdown()
        await b.shutdown()
    # The first try of each mode includes compiles for this context length: report the
    # last (warm) one when there are several.
    return {k: (v[-1] if isinstance(v, list) else v) for k, v in out.items()}


async def decode_width(model, quick: bool) -> list[dict]:
    """Tokens/s with `busy` of 32 slots in use: narrow decode vs every slot (docstring)."""
    new_tokens, reps = (32, 1) if quick else (128, 3)
    rows = []
    for busy in (1, 8) if quick else (1, 4, 8, 32):
        prompts = workload(busy, 64, seed=busy)
        row, outputs = {"busy": busy}, []
        for mode in ("full", "narrow"):
            engine = JaxEngine(mode, model, max_slots=32, max_seq_len=256, narrow=mode == "narrow")
            try:
                result = await throughput(engine, prompts, new_tokens, reps)
                row[mode], width = result["tokens_per_s"], engine.decode_widths
                outputs.append(result["outputs"])
            finally:
                await engine.shutdown()
        row["narrow_width"] = max(width, key=width.get)
        row["speedup"] = row["narrow"] / row["full"]
        row["same_tokens"] = outputs[0] == outputs[1]
        rows.append(row)
    return rows


def print_width(rows: list[dict]) -> None:
    print("\ndecode width: one engine of 32 slots, 64-token prompts, greedy, tiny model")
    print(f"  {'busy':>4} {'width':>5} {'every slot tok/s':>16} {'narrow tok/s':>12} "
          f"{'speedup':>7} {'same tokens':>11}")  # fmt: skip
    for r in rows:
        print(f"  {r['busy']:>4} {r['narrow_width']:>5} {r['full']:>16.0f} {r['narrow']:>12.0f} "
              f"{r['speedup']:>6.2f}x {r['same_tokens']!s:>11}")  # fmt: skip


def future_request_id(engine) -> str:
    (request_id,) = engine.request_ids()
    return request_id


async def main_async(args) -> dict:
    model = init_model(TINY)
    prompts = workload(8 if args.quick else 32, 64)
    new_tokens = 32 if args.quick else 128
    reps = 1 if args.quick else 3
    results: dict = {"requests": len(prompts), "prompt_tokens": 64, "new_tokens": new_tokens}

    engine = JaxEngine("jax", model, max_slots=len(prompts), max_seq_len=256, decode_steps=8)
    try:
        results["jax"] = await throughput(engine, prompts, new_tokens, reps)
    finally:
        await engine.shutdown()

    try:
        from gyrejax.rollout.vllm_engine import VllmEngine
    except ImportError as e:
        results["vllm"] = {"skipped": f"vllm not installed ({e})"}
    else:
        with tempfile.TemporaryDirectory() as directory:
            export_hf(model, directory)
            start = time.perf_counter()
            vllm_engine = VllmEngine("vllm", directory, max_slots=len(prompts), max_seq_len=256)
            startup_s = time.perf_counter() - start
            try:
                results["vllm"] = await throughput(vllm_engine, prompts, new_tokens, reps)
                results["vllm"]["startup_s"] = startup_s
            finally:
                await vllm_engine.shutdown()
        same = sum(
            x == y
            for x, y in zip(results["jax"]["outputs"], results["vllm"]["outputs"], strict=True)
        )
        results["greedy_outputs_identical"] = f"{same}/{len(prompts)}"

    contexts = (1024,) if args.quick else (1024, 4096, 16384)
    results["migration"] = [
        await migration_latency(model, c, 1 if args.quick else 2) for c in contexts
    ]
    return results


DOOR_KEY = "bench-admin-key-" + "x" * 16


async def door_overhead(quick: bool) -> list[dict]:
    """Per-call time through the door vs the proxy alone (see the module docstring)."""
    import aiohttp

    from gyrejax.harness import tokenizer as tok
    from gyrejax.rollout.proxy import Proxy
    from gyrejax.serve.openai_server import OpenAIServer

    # The tiny model over the byte tokenizer's vocabulary: the door's default template.
    model = init_model(dataclasses.replace(TINY, vocab_size=tok.VOCAB_SIZE))
    engine = JaxEngine("jax", model, max_slots=32, max_seq_len=256, decode_steps=8)
    proxy = Proxy([engine])
    # Every proxy call's own duration, by execution in call order: a door call's time
    # minus the proxy time inside it is what the door added to that very call (paired,
    # so the engine's batching, which swings call times by +-15% here, cancels out).
    inner: dict[str, list[float]] = {}
    generate = proxy.generate

    async def timed_generate(execution_id, *args, **kwargs):
        start = time.perf_counter()
        try:
            return await generate(execution_id, *args, **kwargs)
        finally:
            inner.setdefault(execution_id, []).append(time.perf_counter() - start)

    proxy.generate = timed_generate
    door = OpenAIServer(proxy, api_key=DOOR_KEY, max_open_executions=1024)
    url = await door.start("127.0.0.1", 0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, 128).tolist() for _ in range(32)]
    new_tokens, calls = 32, (3 if quick else 6)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    rows = []
    async with aiohttp.ClientSession() as session:

        async def via_proxy(i: int, tag: str) -> list[float]:
            times = []
            proxy.dispatch(f"{tag}{i}")
            for _ in range(calls):
                start = time.perf_counter()
                await proxy.generate(f"{tag}{i}", "main", "main", np.asarray(prompts[i]), sampling)
                times.append(time.perf_counter() - start)
            proxy.finish(f"{tag}{i}")
            return times

        async def via_door(i: int, tag: str) -> list[float]:
            times = []
            key = door.open_execution(f"{tag}{i}")
            headers = {"Authorization": f"Bearer {key}"}
            body = {"model": "m", "prompt": prompts[i], "max_tokens": new_tokens}
            body |= {"temperature": 0.0}
            for _ in range(calls):
                start = time.perf_counter()
                async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.json()
                times.append(time.perf_counter() - start)
            await door.close_execution(f"{tag}{i}")
            return times

        for agents in (1, 8, 32):
            samples = {"proxy": [], "door": []}
            added, ratios = [], []  # door time - its proxy time, per call; per-rep ratios
            for rep in range(3 if quick else 6):  # interleaved; rep 0 warms up
                medians = {}
                for mode, run in (("proxy", via_proxy), ("door", via_door)):
                    tag = f"{mode}-{agents}-{rep}-"
                    times = await asyncio.gather(*(run(i, tag) for i in range(agents)))
                    medians[mode] = statistics.median(t for ts in times for t in ts)
                    if rep:
                        samples[mode] += [t for ts in times for t in ts]
                    if rep and mode == "door":
                        for i, ts in enumerate(times):
                            added += [t - p for t, p in zip(ts, inner[f"{tag}{i}"], strict=True)]
                if rep:
                    ratios.append(medians["door"] / medians["proxy"] - 1)
            proxy_s = statistics.median(samples["proxy"])
            door_s = statistics.median(samples["door"])
            added_s = statistics.median(added)
            rows.append(
                {"agents": agents, "proxy_ms": proxy_s * 1e3, "door_ms": door_s * 1e3,
                 "overhead": door_s / proxy_s - 1,
                 "rep_overheads": ratios,
                 "added_ms": added_s * 1e3,
                 "added_p90_ms": float(np.percentile(added, 90)) * 1e3,
                 "added_share": added_s / proxy_s}
            )  # fmt: skip
    await door.stop()
    await engine.shutdown()
    return rows


def print_door(rows: list[dict]) -> None:
    print("\nOpenAI door overhead per call (128-token prompt, 32 new tokens, tiny model):")
    print("  added = a door call's time minus the proxy time inside that same call (paired);")
    print("  total = median door call / median proxy call - 1, per interleaved repetition")
    print(f"  {'agents':>6} {'proxy ms':>9} {'door ms':>9} {'added ms':>9} {'p90 ms':>7} "
          f"{'added':>7} {'total: median [min, max] over reps':>36}")  # fmt: skip
    for row in rows:
        reps = row["rep_overheads"]
        total = f"{statistics.median(reps):+.1%} [{min(reps):+.1%}, {max(reps):+.1%}]"
        print(f"  {row['agents']:>6} {row['proxy_ms']:>9.1f} {row['door_ms']:>9.1f} "
              f"{row['added_ms']:>9.2f} {row['added_p90_ms']:>7.2f} {row['added_share']:>7.2%} "
              f"{total:>36}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--door_only", action="store_true", help="only the door's overhead")
    parser.add_argument("--width_only", action="store_true", help="only the decode width")
    args = parser.parse_args()
    if args.width_only:
        width = asyncio.run(decode_width(init_model(TINY), args.quick))
        print_width(width)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"decode_width": width}, f, indent=2)
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    door = asyncio.run(door_overhead(args.quick))
    if args.door_only:
        print_door(door)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"door": door}, f, indent=2)
        return
    results = asyncio.run(main_async(args))
    results["door"] = door
    results["decode_width"] = asyncio.run(decode_width(init_model(TINY), args.quick))

    print(
        f"throughput: {results['requests']} requests x {results['prompt_tokens']}-token prompts "
        f"x {results['new_tokens']} new tokens, greedy, tiny model"
    )
    jax_tps = results["jax"]["tokens_per_s"]
    print(f"  jax engine   {jax_tps:9.0f} tok/s  ({results['jax']['seconds']:.2f} s)")
    vllm = results["vllm"]
    if "skipped" in vllm:
        print(f"  vllm engine  skipped: {vllm['skipped']}")
    else:
        print(
            f"  vllm engine  {vllm['tokens_per_s']:9.0f} tok/s  ({vllm['seconds']:.2f} s; "
            f"startup {vllm['startup_s']:.1f} s)"
        )
        print(f"  jax / vllm   {jax_tps / vllm['tokens_per_s']:9.2f}x; greedy outputs identical: "
              f"{results['greedy_outputs_identical']}")  # fmt: skip
    print("\nmigration latency (export until the next token on the other engine):")
    print(f"  {'context':>8} {'KV copy ms':>11} {'re-submit ms':>13} {'ratio':>6}")
    for row in results["migration"]:
        kv, resubmit = row["kv_copy"] * 1e3, row["resubmit"] * 1e3
        print(f"  {row['context']:>8} {kv:>11.1f} {resubmit:>13.1f} {resubmit / kv:>5.1f}x")
    print_width(results["decode_width"])
    print_door(door)
    if args.json:
        for engine in ("jax", "vllm"):
            results[engine].pop("outputs", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
