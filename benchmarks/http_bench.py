"""HTTP engines benchmark: each engine in-process vs reached over HTTP on loopback.

  python benchmarks/http_bench.py [--quick] [--json PATH]

The workload and tiny model of rollout_bench.py (32 requests, 64-token prompts, 128 new
tokens, greedy), side by side in one run, after a warm-up run of each:
  * the JAX engine in this process vs the same engine behind `EngineServer`, reached by
    `HttpEngine` (one long-poll per request);
  * vLLM in this process (`VllmEngine`) vs vLLM's own server in a subprocess, reached by
    `VllmServerEngine` (one token stream per request); skipped if vllm is not installed.
Reports tokens/s (new tokens over wall time, median of the runs), the HTTP / in-process
ratio and whether the greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import tempfile
import time

from rollout_bench import TINY, throughput, workload  # also sets 2 CPU devices

from gyrejax.model.hf_io import export_hf
from gyrejax.model.transformer import init_model
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.serve.engine_server import EngineServer
from gyrejax.serve.http_engine import HttpEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(local: dict, remote: dict) -> dict:
    same = sum(x == y for x, y in zip(local.pop("outputs"), remote.pop("outputs"), strict=True))
    return {
        "in_process": local,
        "http": remote,
        "http_over_in_process": remote["tokens_per_s"] / local["tokens_per_s"],
        "identical": same,
    }


async def jax_pair(model, prompts, new_tokens, reps) -> dict:
    def engine():
        return JaxEngine("jax", model, max_slots=len(prompts), max_seq_len=256, decode_steps=8)

    local = engine()
    try:
        in_process = await throughput(local, prompts, new_tokens, reps)
    finally:
        await local.shutdown()
    served = engine()
    token = secrets.token_urlsafe(32)  # authenticated, as every engine server is
    server = EngineServer(served, token=token)
    url = await server.start("127.0.0.1", 0)
    remote = await HttpEngine.connect(url, token=token)
    try:
        over_http = await throughput(remote, prompts, new_tokens, reps)
    finally:
        await remote.shutdown()
        await server.stop()
        await served.shutdown()
    return compare(in_process, over_http)


async def vllm_pair(model, prompts, new_tokens, reps) -> dict:
    try:
        from gyrejax.rollout.vllm_engine import VllmEngine
        from gyrejax.serve.vllm_server_engine import (
            VllmServerEngine,
            kill_server_process,
            server_command,
            start_server_process,
            wait_until_healthy,
        )
    except ImportError as e:
        return {"skipped": f"vllm not installed ({e})"}
    with tempfile.TemporaryDirectory() as directory:
        export_hf(model, directory)
        local = VllmEngine("vllm", directory, max_slots=len(prompts), max_seq_len=256)
        try:
            in_process = await throughput(local, prompts, new_tokens, reps)
        finally:
            await local.shutdown()
        port = free_port()
        command, env = server_command(directory, port, max_model_len=256, max_num_seqs=len(prompts))
        with open(os.path.join(directory, "server.log"), "w") as log:
            process = start_server_process(command, env, log)
        try:
            url = f"http://127.0.0.1:{port}"
            start = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(None, wait_until_healthy, url, process)
            startup_s = time.perf_counter() - start
            remote = await VllmServerEngine.connect(url, name="vllm-server")
            try:
                over_http = await throughput(remote, prompts, new_tokens, reps)
            finally:
                await remote.shutdown()
        finally:
            kill_server_process(process)
    result = compare(in_process, over_http)
    result["server_startup_s"] = startup_s
    return result


async def main_async(args) -> dict:
    model = init_model(TINY)
    prompts = workload(8 if args.quick else 32, 64)
    new_tokens = 32 if args.quick else 128
    reps = 1 if args.quick else 3
    results: dict = {"requests": len(prompts), "prompt_tokens": 64, "new_tokens": new_tokens}
    results["jax"] = await jax_pair(model, prompts, new_tokens, reps)
    results["vllm"] = await vllm_pair(model, prompts, new_tokens, reps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    results = asyncio.run(main_async(args))
    print(
        f"{results['requests']} requests x {results['prompt_tokens']}-token prompts x "
        f"{results['new_tokens']} new tokens, greedy, tiny model; tokens/s"
    )
    print(f"  {'engine':<6} {'in-process':>11} {'over HTTP':>10} {'ratio':>6}  greedy identical")
    for name in ("jax", "vllm"):
        row = results[name]
        if "skipped" in row:
            print(f"  {name:<6} skipped: {row['skipped']}")
            continue
        local, remote = row["in_process"]["tokens_per_s"], row["http"]["tokens_per_s"]
        print(
            f"  {name:<6} {local:>11.0f} {remote:>10.0f} {remote / local:>5.2f}x  "
            f"{row['identical']}/{results['requests']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
