"""Tree attention kernels (gyrejax/model/attention_kernel.py) against the dense mask.

The kernels run in Mosaic GPU's interpret mode on CPU (with its race detector on), and
are lowered for CUDA by jax.export: the Python side of the GPU compile; the PTX compile
itself needs a GPU.
"""

import faulthandler
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.model import attention
from gyrejax.model import attention_kernel as kernel

_NEG = np.float32(-1e30)  # the lse of a query that sees nothing


@pytest.fixture(scope="module", autouse=True)
def _reuse_interpreter_programs():
    """Compiles each interpreted warpgroup program once per test module.

    GPU interpret mode (JAX 0.10) runs a CTA's warpgroups as threads, each compiling its
    program anew for every grid point (a fresh jit closure per call): measured here,
    compiling was 6x the running. Keyed by the program object, which one kernel call
    reuses for all its grid points. Later JAX caches these itself; skipped if the hook
    moved.
    """
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        yield
        return
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None:
        yield
        return
    compiled, lock = {}, threading.Lock()

    def run(jaxpr, consts, *args):
        key = (id(jaxpr), *((np.shape(x), np.result_type(x)) for x in (*consts, *args)))
        with lock:
            entry = compiled.get(key)
        if entry is None:  # the entry holds the program, so its id stays unique
            program = jax.jit(lambda consts, *args: jax.core.eval_jaxpr(jaxpr, consts, *args))
            entry = (jaxpr, program.lower(consts, *args).compile())
            with lock:
                compiled[key] = entry
        entry[1](consts, *args)

    thread_map._run_jaxpr = run
    yield
    thread_map._run_jaxpr = original


@pytest.fixture(autouse=True)
def _interpreter_state():
    """A hang (a warpgroup that raised leaves the others waiting on barriers forever)
    ends the run with every thread's traceback instead of blocking CI; after a kernel
    error, the interpreter's global state is reset for the next test."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=True)


def _forest_ends(rng: np.random.Generator, length: int, trees: int) -> np.ndarray:
    """subtree_end of `trees` random prefix trees laid out depth-first in one row."""
    ends = np.empty(length, np.int32)

    def lay_out(start: int, stop: int) -> None:  # one node's subtree fills [start, stop)
        run = int(rng.integers(1, min(stop - start, 24) + 1))
        ends[start : start + run] = stop
        pos = start + run
        while pos < stop:
            child = int(rng.integers(1, stop - pos + 1))
            lay_out(pos, pos + child)
            pos += child

    cuts = np.sort(rng.choice(np.arange(1, length), trees - 1, replace=False))
    for start, stop in zip([0, *cuts], [*cuts, length], strict=True):
        lay_out(int(start), int(stop))
    return ends


def _inputs(rng, b, length, heads, kv_heads, d, dtype=jnp.float32):
    shapes = ((b, length, heads, d), (b, length, kv_heads, d), (b, length, kv_heads, d))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def _no_races(capsys):
    assert "RACE DETECTED" not in capsys.readouterr().out


# --- the schedule ----------------------------------------------------------------------


def _brute_force_schedule(ends, q_offset, k_offset, q_len, block_q, block_k):
    """Every (query block, key block) pair tested one by one, with global indices."""
    b, k_len = ends.shape
    nq, nk = q_len // block_q, k_len // block_k
    live = np.zeros((b, nq, nk), bool)
    for row in range(b):
        for i in range(nq):
            first_q = q_offset + i * block_q
            last_q = first_q + block_q - 1
            for j in range(nk):
                key_start = k_offset + j * block_k
                reach = ends[row, j * block_k : (j + 1) * block_k].max()
                live[row, i, j] = key_start <= last_q and reach > first_q
    return live


@pytest.mark.parametrize(
    "q_offset, k_offset, q_len, k_len, block_q, block_k",
    [
        (0, 0, 512, 512, 64, 64),  # one device: both ranges the whole row
        (0, 0, 512, 512, 64, 128),  # the backward pass's blocks
        (256, 0, 256, 256, 128, 64),  # a ring step: keys before the queries
        (256, 256, 256, 256, 64, 128),  # a ring step: a shard against itself
        (0, 256, 256, 256, 64, 64),  # keys after the queries: nothing live
    ],
)
def test_schedule_matches_brute_force(q_offset, k_offset, q_len, k_len, block_q, block_k):
    rng = np.random.default_rng(q_offset + 3 * k_offset + block_q + block_k)
    row_len = max(q_offset + q_len, k_offset + k_len)
    ends = np.stack([_forest_ends(rng, row_len, trees) for trees in (1, 3, 12)])
    ends = ends[:, k_offset : k_offset + k_len]
    live = _brute_force_schedule(ends, q_offset, k_offset, q_len, block_q, block_k)
    schedule = jax.jit(
        kernel.tree_attention_schedule, static_argnames=("q_len", "block_q", "block_k")
    )(ends, jnp.int32(q_offset), jnp.int32(k_offset), q_len=q_len, block_q=block_q,
      block_k=block_k)  # fmt: skip
    blocks, counts, first, count = (np.asarray(x) for x in schedule)
    np.testing.assert_array_equal(counts, live.sum(axis=2))
    nq, nk = live.shape[1:]
    for row in range(ends.shape[0]):
        for i in range(nq):
            expected = np.flatnonzero(live[row, i])
            np.testing.assert_array_equal(blocks[row, i, : len(expected)], expected)
        for j in range(nk):
            expected = np.flatnonzero(live[row, :, j])
            assert count[row, j] == len(expected)
            np.testing.assert_array_equal(first[row, j] + np.arange(count[row, j]), expected)
    # Sound: every visible (query, key) lies in a live pair.
    q_idx = q_offset + np.arange(q_len)[:, None]
    k_idx = k_offset + np.arange(k_len)[None, :]
    visible = (k_idx <= q_idx) & (q_idx < ends[:, None, :])  # [B, Lq, Lk]
    pairs = visible.reshape(-1, nq, block_q, nk, block_k).any(axis=(2, 4))
    assert not (pairs & ~live).any()
    if (q_offset, k_offset, block_q) == (0, 0, block_k):  # aligned equal blocks: exact
        np.testing.assert_array_equal(pairs, live)


# --- values and gradients against the dense mask ---------------------------------------


@pytest.mark.parametrize("block_size, length, rows", [(64, 200, 2), (128, 300, 1)])
def test_matches_dense_tree_attention(block_size, length, rows, capsys):
    """Values and q/k/v gradients, float32, 1e-5: blocks of 64 (one compute warpgroup
    per CTA) on two rows, several trees and one causal tree; blocks of 128 (two) on one
    branched tree. L is not a multiple of the block (padding); GQA, 2 query heads per
    KV head. Some CTA has more live blocks than pipeline slots, so slots are reused
    (under the race detector)."""
    rng = np.random.default_rng(block_size)
    if rows == 2:  # a row of several trees; a row of one tree without branches
        ends = np.stack([_forest_ends(rng, length, 5), np.full(length, length)])
    else:  # one tree: a root over two branches, each holding subtrees
        ends = np.full((1, length), length, np.int32)
        ends[0, 10:150] = _forest_ends(rng, 140, 3) + 10
        ends[0, 150:] = _forest_ends(rng, length - 150, 1) + 150
    ends = jnp.asarray(ends)
    padded = -(-length // block_size) * block_size
    padded_ends = jnp.concatenate(
        [ends, jnp.broadcast_to(jnp.arange(length, padded) + 1, (rows, padded - length))], 1
    )
    schedule = kernel.tree_attention_schedule(
        padded_ends, 0, 0, padded, block_q=block_size, block_k=block_size
    )
    assert schedule.forward_counts.max() > kernel._STAGES  # the slots are reused
    q, k, v = _inputs(rng, rows, length, heads=2, kv_heads=1, d=32)
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def pallas(q, k, v):
        return kernel.pallas_tree_attention(q, k, v, ends, block_size, _interpret())

    out, pallas_vjp = jax.vjp(jax.jit(pallas), q, k, v)
    expected, dense_vjp = jax.vjp(
        lambda q, k, v: attention.dense_tree_attention(q, k, v, ends), q, k, v
    )
    _close(out, expected)
    for grad, expected_grad in zip(pallas_vjp(cotangent), dense_vjp(cotangent), strict=True):
        _close(grad, expected_grad)
    _no_races(capsys)


def test_ring_steps_merge_to_the_dense_attention(capsys):
    """Queries of the second half of a row attend the two halves' keys in two calls, as a
    ring of two shards does: traced offsets, one key range before the query range, with
    queries that see nothing in it. Merged by lse, the outputs and the summed gradients
    equal the dense attention of those queries; a query that sees no key of a range
    gets lse -1e30 and out 0 from it."""
    rng = np.random.default_rng(1)
    length, half = 256, 128
    ends = np.full(length, length, np.int32)
    ends[:100] = 100  # a tree wholly in the first half
    ends[100:160] = 160  # a tree across the halves
    ends[160:] = _forest_ends(rng, length - 160, 4) + 160  # trees of the second half only
    ends = jnp.asarray(ends[None])
    q, k, v = _inputs(rng, 1, length, heads=2, kv_heads=1, d=32)
    d_out = jnp.asarray(rng.standard_normal((1, half, 2, 32)), jnp.float32)
    mine = q[:, half:]
    shards = [(k[:, s : s + half], v[:, s : s + half], ends[:, s : s + half]) for s in (0, half)]

    @jax.jit
    def ring(mine, q_offset, k_offsets):
        steps = [
            kernel.tree_attention_forward(
                mine, *shard, q_offset, k_off, block_q=64, block_k=64, interpret=_interpret()
            )
            for shard, k_off in zip(shards, k_offsets, strict=True)
        ]
        lse = jnp.logaddexp(*(lse for _, lse in steps))
        weights = [jnp.exp(step_lse - lse).transpose(0, 2, 1)[..., None] for _, step_lse in steps]
        out = sum(w * o for w, (o, _) in zip(weights, steps, strict=True))
        delta = jnp.einsum("blhd,blhd->bhl", d_out, out)
        grads = [
            kernel.tree_attention_backward(
                mine, *shard, d_out, lse, delta, q_offset, k_off, block_q=64, block_k=128,
                interpret=_interpret(),
            )
            for shard, k_off in zip(shards, k_offsets, strict=True)
        ]  # fmt: skip
        return steps, out, grads

    steps, out, grads = ring(mine, jnp.int32(half), jnp.array([0, half], jnp.int32))

    mask = attention.tree_mask(ends)[:, half:]  # [1, half, L]: these queries, all keys
    expected, dense_vjp = jax.vjp(
        lambda mine, k, v: attention.dense_attention(mine, k, v, mask), mine, k, v
    )
    _close(out, expected)
    d_mine, dk, dv = dense_vjp(d_out)
    _close(grads[0][0] + grads[1][0], d_mine)
    _close(jnp.concatenate([grads[0][1], grads[1][1]], axis=1), dk)
    _close(jnp.concatenate([grads[0][2], grads[1][2]], axis=1), dv)

    blind = ~np.asarray(mask[0, :, :half]).any(axis=1)  # see nothing of the first half
    assert 0 < blind.sum() < half
    first_out, first_lse = (np.asarray(x) for x in steps[0])
    np.testing.assert_array_equal(first_lse[0][:, blind], _NEG)
    np.testing.assert_array_equal(first_out[0, blind], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0][0])[0, blind], 0.0)
    _no_races(capsys)


# --- the compiled kernels, lowered for a GPU on this CPU host --------------------------


def _lowered_for_cuda(fn, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def test_kernels_lower_for_cuda():
    """Qwen3 shapes (bfloat16, head_dim 128, 16 query heads over 8 KV heads), realistic
    blocks: every kernel lowers to Mosaic GPU, with traced offsets and through the VJP."""
    spec = jax.ShapeDtypeStruct
    b, length, heads, kv_heads, d = 1, 1024, 16, 8, 128
    q = spec((b, length, heads, d), jnp.bfloat16)
    k = spec((b, length, kv_heads, d), jnp.bfloat16)
    ends = spec((b, length), jnp.int32)
    stats = spec((b, heads, length), jnp.float32)
    offset = spec((), jnp.int32)

    def forward(q, k, v, ends, q_offset, k_offset):
        return kernel.tree_attention_forward(
            q, k, v, ends, q_offset, k_offset, block_q=128, block_k=128, interpret=False
        )

    def backward(q, k, v, ends, d_out, lse, delta, q_offset, k_offset):
        return kernel.tree_attention_backward(
            q, k, v, ends, d_out, lse, delta, q_offset, k_offset, block_q=64, block_k=128,
            interpret=False,
        )  # fmt: skip

    def loss(q, k, v, ends):
        out = kernel.pallas_tree_attention(q, k, v, ends, 128, interpret=False)
        return out.astype(jnp.float32).sum()

    modules = {
        "forward": _lowered_for_cuda(forward, q, k, k, ends, offset, offset),
        "backward": _lowered_for_cuda(backward, q, k, k, ends, q, stats, stats, offset, offset),
        "grad": _lowered_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, ends),
    }
    kernels = {name: text.count("custom_call @mosaic_gpu") for name, text in modules.items()}
    assert kernels == {"forward": 1, "backward": 2, "grad": 3}


# --- what the kernels refuse up front --------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(d=96), "head_dim=96"),
        (dict(block_q=96), "block_q=96"),
        (dict(length=320, block_q=64, block_k=128), "key length=320"),
        (dict(dtype=jnp.float32), "dtype float32"),
        (dict(d=256, block_k=128), "shared memory"),
        (dict(heads=3), "query heads 3"),
    ],
)
def test_refuses_unsupported_shapes(change, message):
    config = dict(length=256, heads=2, d=128, block_q=128, block_k=64, dtype=jnp.bfloat16)
    config.update(change)
    spec = jax.ShapeDtypeStruct
    length, heads, d, dtype = config["length"], config["heads"], config["d"], config["dtype"]
    q = spec((1, length, heads, d), dtype)
    k = spec((1, length, 2, d), dtype)
    ends = spec((1, length), jnp.int32)

    def forward(q, k, ends):
        return kernel.tree_attention_forward(
            q, k, k, ends, block_q=config["block_q"], block_k=config["block_k"],
            interpret=False,
        )  # fmt: skip

    with pytest.raises(ValueError, match=message):
        jax.eval_shape(forward, q, k, ends)


def test_interprets_off_gpu():
    on_gpu = jax.default_backend() == "gpu"
    assert (kernel.resolve_interpret(None) is None) == on_gpu
    assert kernel.resolve_interpret(False) is None
    assert kernel.resolve_interpret(True) is not None


# --- on a GPU host only ----------------------------------------------------------------


def _relative_error(actual, expected) -> float:
    actual, expected = (np.asarray(x, np.float32) for x in (actual, expected))
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled kernels")
def test_compiled_kernels_on_gpu():
    """The compiled kernels (bfloat16, head_dim 128, GQA, padding, several trees and a
    causal row) against the dense mask in float32 on the same inputs. bfloat16 rounds P,
    dS and the output (relative 2^-9 each), so errors are compared as norms, at 1e-2."""
    rng = np.random.default_rng(7)
    length = 1000
    ends = jnp.asarray(np.stack([_forest_ends(rng, length, 6), np.full(length, length)]))
    q, k, v = _inputs(rng, 2, length, heads=4, kv_heads=2, d=128, dtype=jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    out, pallas_vjp = jax.vjp(
        jax.jit(lambda q, k, v: kernel.pallas_tree_attention(q, k, v, ends)), q, k, v
    )
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    expected, dense_vjp = jax.vjp(
        lambda q, k, v: attention.dense_tree_attention(q, k, v, ends), *upcast
    )
    assert _relative_error(out, expected) < 1e-2
    grads = pallas_vjp(cotangent)
    for grad, expected_grad in zip(grads, dense_vjp(cotangent.astype(jnp.float32)), strict=True):
        assert _relative_error(grad, expected_grad) < 1e-2


# --- the kernels where the model uses them ---------------------------------------------
#
# The context-parallel ring runs each step through `attention._RING_STEPS[kernel]`: the
# Pallas pair must keep the XLA pair's contract exactly (state merged in place, `valid`,
# the dK/dV `send`). GPU interpret mode cannot run inside a multi-device shard_map on CPU
# (its callbacks are ordered across devices, and each kernel call waits for every
# device's), so the steps are checked here one by one on one device, with the offsets and
# validity of real ring steps; the ring around them is the one tests/test_attention.py
# checks with the XLA steps.


@pytest.mark.parametrize(
    ("q_offset", "k_offset", "valid"),
    # Keys before the queries, then the same keys on a device whose ring buffer holds no
    # shard for this step (`valid` false): what they would give must be discarded.
    [(128, 0, True), (128, 0, False)],
)
def test_a_ring_step_on_the_kernels_equals_the_xla_step(q_offset, k_offset, valid):
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 128, 2, 1, 64)
    # subtree_end on global rows: a forest over both shards, cut into the two shards.
    forest = _forest_ends(rng, 256, 3)[None]
    ends, own_ends = (jnp.asarray(forest[:, o : o + 128]) for o in (k_offset, q_offset))
    xla_attend, xla_bwd = attention._RING_STEPS["xla"]
    ours_attend, ours_bwd = attention._RING_STEPS["pallas"]
    grouped = attention._group(q, 1)
    # Merging into the state of the ring's step 0 (the queries' own shard).
    empty = attention._softmax_state(grouped)
    state, _ = xla_attend(grouped, k * 0.5, v, own_ends, q_offset, q_offset, empty, 64)
    want, _ = xla_attend(grouped, k, v, ends, q_offset, k_offset, state, 64, valid=valid)
    got, _ = ours_attend(grouped, k, v, ends, q_offset, k_offset, state, 64, valid=valid)
    for a, b in zip(attention._finish(got), attention._finish(want), strict=True):
        _close(a, b)
    out, lse = attention._finish(want)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    delta = attention._delta(d_out, out)
    send = lambda blocks: tuple(2 * x for x in blocks)  # where the step's dK/dV go
    grads = attention._zero_grads(grouped, k, d_out)
    args = (grouped, d_out, lse, delta, k, v, ends, q_offset, k_offset, grads, 64)
    (want_grads, _), (got_grads, _) = (
        step(*args, valid=valid, send=send) for step in (xla_bwd, ours_bwd)
    )
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a, b)


def test_the_model_runs_its_attention_on_the_kernels():
    """`model.attention = "pallas"`: a bfloat16 model's training forward and backward on
    the kernels are as close to the float32 dense reference (the same weights) as the
    XLA blocked attention's in bfloat16: loss and every parameter's gradient."""
    import dataclasses

    from flax import nnx

    from gyrejax.config import ModelConfig
    from gyrejax.model.transformer import init_model

    config = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=64, dtype="bfloat16", attention="pallas",
        attention_block_size=64,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 64, (1, 128)), jnp.int32)
    ends = jnp.asarray(_forest_ends(rng, 128, 2)[None])
    positions = jnp.arange(128, dtype=jnp.int32)[None]
    weights = jnp.asarray(rng.standard_normal((1, 128, 64)), jnp.float32)
    start = nnx.state(init_model(config))

    def loss(attention, dtype):
        model = init_model(dataclasses.replace(config, attention=attention, dtype=dtype))
        graphdef, _ = nnx.split(model)

        def value(state):
            hidden = nnx.merge(graphdef, state).hidden_states(tokens, positions, ends)
            return jnp.sum(hidden.astype(jnp.float32) * weights)

        return jax.value_and_grad(value)(jax.tree.map(lambda x: x.astype(dtype), start))

    def errors(got, want):
        loss_error = abs(float(got[0]) - float(want[0]))
        grads = zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True)
        f32 = lambda x: np.asarray(x, np.float32)
        return loss_error, [
            np.linalg.norm(f32(a) - f32(b)) / np.linalg.norm(f32(b)) for a, b in grads
        ]

    reference = loss("dense", "float32")
    blocked_loss, blocked = errors(loss("blocked", "bfloat16"), reference)
    kernel_loss, ours = errors(loss("pallas", "bfloat16"), reference)
    assert kernel_loss <= 2 * blocked_loss + 1e-2 * abs(float(reference[0]))
    for theirs, mine in zip(blocked, ours, strict=True):
        assert mine <= 2 * theirs + 2e-3 and mine < 0.03, (mine, theirs)
