"""Long rows: context-parallel tree attention over a `sequence` mesh axis.

  python benchmarks/long_row_bench.py [--quick] [--json PATH]

On 8 CPU-emulated devices, a packed row of agent-shaped trees (trunks of 1-2k tokens
with a few branches, as the trajectory processor emits) is split over S = 1, 2, 4, 8
sequence shards (S = 1: the single-device blocked attention; S > 1: the ring):
  * compiled memory per device of the attention forward + backward (q, k, v gradients
    of sum(out * w)) against row length, 8k to 128k (--quick: 8k, 16k): XLA's temporary
    buffers, and the total with arguments and outputs (q, k, v, w, the gradients), which
    fall as 1/S by construction. Compile only: nothing is run.
  * the same for a training step of a tiny model (hidden 64, 2 layers, 2 heads of 64,
    1 key/value head), the gradient of the token loss w.r.t. the parameters, with the
    model's `length` axis mapped to `sequence`.
  * forward + backward time of the tree row against a plain causal row of the same
    tokens (subtree_end = L), and the share of (query, key) blocks each computes, at 8k
    (--quick: 4k). The emulated devices share this machine's cores, so a time
    is the sum of the shards' work, not a parallel step: judge by memory.
Times are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# The emulated devices must be set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from model_bench import forest_row, median_time  # noqa: E402  (same vocabulary, 512)

from gyrejax.config import TRAIN_SHARDING_RULES, ModelConfig  # noqa: E402
from gyrejax.model import attention, sharding  # noqa: E402
from gyrejax.model.transformer import init_model  # noqa: E402

TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    rope_theta=10_000.0,
    attention="blocked",
    attention_block_size=512,
    max_position_embeddings=131072,
)
SHARDS = (1, 2, 4, 8)


def live_block_share(subtree_end: np.ndarray, block: int) -> float:
    """Share of (query block, key block) pairs the blocked attention computes."""
    length = subtree_end.shape[-1]
    n = length // block
    starts = np.arange(n) * block
    reach = subtree_end.reshape(-1, n, block).max(axis=(0, 2))
    live = (starts[None, :] <= starts[:, None]) & (reach[None, :] > starts[:, None])
    return float(live.sum() / (n * n))


def ring_hops(subtree_end: np.ndarray, shards: int) -> int:
    """Ring steps that move K/V: the most shards any key's subtree reaches past its own."""
    per_shard = subtree_end.shape[-1] // shards
    own = np.arange(subtree_end.shape[-1]) // per_shard
    return int(((subtree_end - 1) // per_shard - own).max())


def mesh_of(shards: int) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (shards,), ("sequence",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:shards]
    )


def attention_fn(shards: int):
    """(q, k, v, subtree_end, w) -> (dq, dk, dv) of sum(attention * w), and the row
    sharding of its arguments (None on one device)."""
    block = TINY.attention_block_size
    if shards == 1:
        attend = lambda q, k, v, e: attention.blocked_tree_attention(q, k, v, e, block)
        row = None
    else:
        mesh = mesh_of(shards)
        layout = attention.SequenceLayout(mesh)
        attend = lambda q, k, v, e: attention.context_parallel_tree_attention(
            q, k, v, e, layout, block
        )
        row = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    loss = lambda q, k, v, e, w: jnp.sum(attend(q, k, v, e) * w)
    return jax.jit(jax.grad(loss, (0, 1, 2))), row


def attention_shapes(length: int, row) -> tuple:
    c = TINY
    shape = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt, sharding=row)
    q = shape(1, length, c.num_heads, c.head_dim)
    kv = shape(1, length, c.num_kv_heads, c.head_dim)
    return q, kv, kv, shape(1, length, dt=jnp.int32), q


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    mib = lambda n: n / 2**20
    return {
        "temp_mib": mib(m.temp_size_in_bytes),
        "total_mib": mib(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes),
    }


def attention_memory(length: int, shards: int) -> dict:
    fn, row = attention_fn(shards)
    start = time.perf_counter()
    compiled = fn.lower(*attention_shapes(length, row)).compile()
    return {
        "length": length,
        "shards": shards,
        **memory(compiled),
        "compile_s": time.perf_counter() - start,
    }


def model_memory(length: int, shards: int) -> dict:
    """Compiled memory per device of the tiny model's parameter gradient on one row."""
    model = init_model(TINY)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def loss(params, tokens, positions, subtree_end):
        logits = nnx.merge(graphdef, params)(tokens, positions, subtree_end)
        picked = jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    step = jax.jit(jax.grad(loss))
    start = time.perf_counter()
    if shards == 1:
        row = None
        abstract = lambda s, dt: jax.ShapeDtypeStruct(s, dt)
        inputs = [abstract((1, length), jnp.int32) for _ in range(3)]
        compiled = step.lower(params, *inputs).compile()
    else:
        mesh = mesh_of(shards)
        row = NamedSharding(mesh, PartitionSpec(None, "sequence"))
        replicated = NamedSharding(mesh, PartitionSpec())
        inputs = [jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=row) for _ in range(3)]
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
        )
        with jax.set_mesh(mesh), sharding.axis_rules(TRAIN_SHARDING_RULES):
            compiled = step.lower(params, *inputs).compile()
    return {
        "length": length,
        "shards": shards,
        **memory(compiled),
        "compile_s": time.perf_counter() - start,
    }


def step_time(length: int, shards: int, reps: int) -> dict:
    """Forward + backward seconds of the tree row and of a causal row of the same tokens."""
    fn, row = attention_fn(shards)
    rng = np.random.default_rng(1)
    shapes = attention_shapes(length, row)
    q, k, v, _, w = (rng.standard_normal(s.shape).astype(np.float32) for s in shapes)
    tree_end = forest_row(length)[2]
    causal_end = np.full((1, length), length, np.int32)
    result = {"length": length, "shards": shards, "hops": ring_hops(tree_end, shards)}
    for name, ends in (("tree", tree_end), ("causal", causal_end)):
        args = (q, k, v, ends, w)
        if row is not None:
            args = tuple(jax.device_put(x, row) for x in args)
        else:
            args = tuple(jnp.asarray(x) for x in args)
        result[f"{name}_s"] = median_time(lambda args=args: fn(*args), reps)
        result[f"{name}_blocks"] = live_block_share(ends, TINY.attention_block_size)
    result["speedup"] = result["causal_s"] / result["tree_s"]
    return result


def memory_table(title: str, rows: list[dict], lengths) -> None:
    print(f"\n{title}")
    header = " ".join(f"{'S=' + str(s):>16}" for s in SHARDS)
    print(f"{'length':>7} | {header} | temp vs S=1")
    for length in lengths:
        cells, ratios = [], []
        base = next(r for r in rows if r["length"] == length and r["shards"] == 1)
        for s in SHARDS:
            r = next(r for r in rows if r["length"] == length and r["shards"] == s)
            cells.append(f"{r['temp_mib']:7.1f}/{r['total_mib']:7.1f}")
            ratios.append(f"{r['temp_mib'] / base['temp_mib']:.2f}")
        print(f"{length:>7} | {' '.join(f'{c:>16}' for c in cells)} | {' '.join(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--json", help="write the figures to this path")
    args = parser.parse_args()
    lengths = (8192, 16384) if args.quick else (8192, 16384, 32768, 65536, 131072)
    time_lengths = (4096,) if args.quick else (8192,)
    reps = 1 if args.quick else 3

    print(
        f"devices: {jax.devices()[0].platform} x{len(jax.devices())}; tiny model "
        f"({TINY.num_params} params), block {TINY.attention_block_size}; "
        "memory per device in MiB, temporary/total"
    )
    attention_rows = [attention_memory(n, s) for n in lengths for s in SHARDS]
    memory_table("attention forward + backward:", attention_rows, lengths)
    model_rows = [model_memory(n, s) for n in lengths for s in SHARDS]
    memory_table("tiny model, parameter gradient of one row:", model_rows, lengths)

    print("\nforward + backward time, tree row vs causal row of the same tokens:")
    print(
        f"{'length':>7} {'S':>2} {'hops':>4} | {'tree s':>7} {'blocks':>6} | "
        f"{'causal s':>8} {'blocks':>6} | {'speedup':>7}"
    )
    time_rows = []
    for length in time_lengths:
        for s in SHARDS:
            r = step_time(length, s, reps)
            time_rows.append(r)
            print(
                f"{length:>7} {s:>2} {r['hops']:>4} | {r['tree_s']:>7.2f} "
                f"{r['tree_blocks']:>6.2f} | {r['causal_s']:>8.2f} {r['causal_blocks']:>6.2f} | "
                f"{r['speedup']:>6.2f}x"
            )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "attention_memory": attention_rows,
                    "model_memory": model_rows,
                    "time": time_rows,
                    "quick": args.quick,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
