"""Tree attention: blocked == dense, values and gradients, against a NumPy reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyrejax.model import attention


def random_forest_subtree_end(rng: np.random.Generator, length: int) -> np.ndarray:
    """subtree_end of a random forest laid out in DFS pre-order."""
    parent = np.full(length, -1)
    stack: list[int] = []
    for i in range(length):
        while stack and rng.random() < 0.3:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    end = np.arange(1, length + 1)
    for i in reversed(range(length)):
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return end


def numpy_tree_attention(q, k, v, subtree_end):
    """Independent reference: explicit loops over rows and queries."""
    b, length, h, d = q.shape
    groups = h // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for row in range(b):
        for i in range(length):
            keys = [j for j in range(length) if j <= i < subtree_end[row, j]]
            for head in range(h):
                kv = head // groups
                s = np.array([q[row, i, head] @ k[row, j, kv] for j in keys]) / np.sqrt(d)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[row, i, head] = p @ v[row, keys, kv]
    return out


def make_inputs(seed, b=2, length=37, h=4, kv=2, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, h, d)).astype(np.float32)
    k = rng.standard_normal((b, length, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, length, kv, d)).astype(np.float32)
    ends = np.stack([random_forest_subtree_end(rng, length) for _ in range(b)]).astype(np.int32)
    return q, k, v, ends


def test_tree_mask_matches_definition():
    _, _, _, ends = make_inputs(0, length=12)
    mask = np.asarray(attention.tree_mask(jnp.asarray(ends)))
    for b in range(ends.shape[0]):
        for qi in range(12):
            for ki in range(12):
                assert mask[b, qi, ki] == (ki <= qi < ends[b, ki])


def test_dense_matches_numpy_loop():
    q, k, v, ends = make_inputs(1)
    ours = attention.dense_tree_attention(*map(jnp.asarray, (q, k, v, ends)))
    np.testing.assert_allclose(np.asarray(ours), numpy_tree_attention(q, k, v, ends), atol=1e-5)


@pytest.mark.parametrize("block_size", [4, 8, 16, 64])
def test_blocked_equals_dense(block_size):
    q, k, v, ends = make_inputs(2)
    args = tuple(map(jnp.asarray, (q, k, v, ends)))
    dense = attention.dense_tree_attention(*args)
    blocked = attention.blocked_tree_attention(*args, block_size=block_size)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(dense), atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_blocked_gradients_equal_dense(block_size):
    q, k, v, ends = make_inputs(3)
    ends = jnp.asarray(ends)
    weights = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    dense = jax.grad(loss(lambda q, k, v: attention.dense_tree_attention(q, k, v, ends)), (0, 1, 2))
    blocked = jax.jit(
        jax.grad(
            loss(lambda q, k, v: attention.blocked_tree_attention(q, k, v, ends, block_size)),
            (0, 1, 2),
        )
    )
    args = tuple(map(jnp.asarray, (q, k, v)))
    for got, want in zip(blocked(*args), dense(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_blocked_causal_rows_and_separate_trees():
    """A plain causal row, and a row of two independent sequences, both match dense."""
    q, k, v, _ = make_inputs(5, b=2, length=32)
    causal = np.full((1, 32), 32, np.int32)
    two_trees = np.concatenate([np.full(20, 20), np.full(12, 32)])[None].astype(np.int32)
    ends = jnp.asarray(np.concatenate([causal, two_trees]))
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ends)
    np.testing.assert_allclose(
        np.asarray(attention.blocked_tree_attention(*args, block_size=8)),
        np.asarray(attention.dense_tree_attention(*args)),
        atol=1e-5,
    )


def test_decode_attention_matches_dense_over_valid_prefix():
    rng = np.random.default_rng(6)
    slots, max_len, h, kv, d = 3, 10, 4, 2, 8
    q = rng.standard_normal((slots, h, d)).astype(np.float32)
    k = rng.standard_normal((slots, max_len, kv, d)).astype(np.float32)
    v = rng.standard_normal((slots, max_len, kv, d)).astype(np.float32)
    lengths = np.array([1, 7, 10], np.int32)
    heads_major = (np.swapaxes(k, 1, 2), np.swapaxes(v, 1, 2))  # the cache layout
    out = np.asarray(attention.decode_attention(*map(jnp.asarray, (q, *heads_major, lengths))))
    for s, n in enumerate(lengths):
        ends = np.full((1, n), n, np.int32)
        qs = np.zeros((1, n, h, d), np.float32)
        qs[0, n - 1] = q[s]
        ref = numpy_tree_attention(qs, k[s : s + 1, :n], v[s : s + 1, :n], ends)[0, n - 1]
        np.testing.assert_allclose(out[s], ref, atol=1e-5)


# --- context parallel: rows split over a `sequence` mesh axis -------------------------


def packed_row(rng, length, max_tree, long_tree=0, padding=0, shard=None):
    """subtree_end int32[length] of a packed row: a first tree of `long_tree` tokens under
    one root (if any), then random forests of up to `max_tree` tokens (none crossing a
    multiple of `shard`, if given), then `padding` tokens that see only themselves."""
    ends = np.arange(1, length + 1)
    if long_tree:
        ends[:long_tree] = random_forest_subtree_end(rng, long_tree)
        ends[0] = long_tree
    start, body_end = long_tree, length - padding
    while start < body_end:
        size = min(int(rng.integers(1, max_tree + 1)), body_end - start)
        if shard:
            size = min(size, shard - start % shard)
        ends[start : start + size] = start + random_forest_subtree_end(rng, size)
        start += size
    return ends.astype(np.int32)


def ring_hops(ends, shards):
    """Ring steps that move K/V: the most shards any key's subtree reaches past its own."""
    per_shard = ends.shape[-1] // shards
    own = np.arange(ends.shape[-1]) // per_shard
    return int(((ends - 1) // per_shard - own).max())


def sequence_mesh(shape=(8,), names=("sequence",)):
    count = int(np.prod(shape))
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, auto, devices=jax.devices()[:count])


BLOCK = 8  # block length of every equality test below


def blocked(q, k, v, ends):
    return attention.blocked_tree_attention(q, k, v, ends, BLOCK)


def ring(q, k, v, ends, *, layout):
    return attention.context_parallel_tree_attention(q, k, v, ends, layout, BLOCK)


@functools.partial(jax.jit, static_argnums=0)
def out_and_grads(attend, q, k, v, ends, weights):
    """attend(q, k, v, ends) and the gradients of sum(attend * weights) w.r.t. q, k, v.

    Jitted once per `attend` and shape, so the single-device references compile once
    for all the tests that share a shape."""

    def loss(q, k, v):
        out = attend(q, k, v, ends)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def assert_ring_equals_blocked(q, k, v, ends, layout):
    """Forward and q/k/v gradients of the ring equal the single-device blocked attention
    and the dense reference within 1e-5."""
    weights = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    args = tuple(map(jnp.asarray, (q, k, v, ends, weights)))
    got = out_and_grads(functools.partial(ring, layout=layout), *args)
    for reference in (blocked, attention.dense_tree_attention):
        want = out_and_grads(reference, *args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_context_parallel_equals_blocked(shards):
    """Rows of several trees plus padding, and a row whose first tree spans most of it
    (so K/V travel the whole ring), split over 2, 4 and 8 devices."""
    rng = np.random.default_rng(shards)
    q, k, v, _ = make_inputs(10 + shards, length=128)
    ends = np.stack(
        [
            packed_row(rng, 128, max_tree=40, padding=16),
            packed_row(rng, 128, max_tree=3, long_tree=114, padding=10),
        ]
    )
    assert ring_hops(ends, shards) == shards - 1
    layout = attention.SequenceLayout(sequence_mesh((shards,)))
    assert_ring_equals_blocked(q, k, v, ends, layout)


@pytest.mark.parametrize(("shards", "hops"), [(4, 0), (8, 1)])
def test_context_parallel_skips_steps_past_the_trees_reach(shards, hops):
    """Rows of short trees: K/V need to travel `hops` shards at most, and the ring skips
    every later step (compute and transfers) with the same result."""
    rng = np.random.default_rng(20 + shards)
    q, k, v, _ = make_inputs(30 + shards, length=128)
    per_shard = 128 // shards
    if hops == 0:  # every tree inside one shard
        rows = [packed_row(rng, 128, max_tree=10, padding=5, shard=per_shard) for _ in range(2)]
    else:
        rows = [packed_row(rng, 128, max_tree=per_shard, padding=7) for _ in range(2)]
    ends = np.stack(rows)
    assert ring_hops(ends, shards) == hops
    layout = attention.SequenceLayout(sequence_mesh((shards,)))
    assert_ring_equals_blocked(q, k, v, ends, layout)


def test_context_parallel_with_batch_and_heads_sharded_too():
    """A (fsdp 2 x tensor 2 x sequence 2) mesh: rows over fsdp, heads over tensor."""
    rng = np.random.default_rng(40)
    q, k, v, _ = make_inputs(41, length=128)
    ends = np.stack([packed_row(rng, 128, max_tree=60, padding=12) for _ in range(2)])
    mesh = sequence_mesh((2, 2, 2), ("fsdp", "tensor", "sequence"))
    layout = attention.SequenceLayout(mesh, batch="fsdp", heads="tensor")
    assert_ring_equals_blocked(q, k, v, ends, layout)


def test_context_parallel_pads_rows_the_shards_do_not_divide():
    rng = np.random.default_rng(50)
    q, k, v, _ = make_inputs(51, length=100)
    ends = np.stack([packed_row(rng, 100, max_tree=30, long_tree=60, padding=9)] * 2)
    layout = attention.SequenceLayout(sequence_mesh((4,)))
    assert_ring_equals_blocked(q, k, v, ends, layout)


def test_context_parallel_never_builds_a_row_by_row_tensor():
    """Forward + backward compiled for 4 shards of a 4096-token row: no array in the
    program has (L / 4)^2 elements, let alone L^2, and the temporary memory per device
    is less than one float32 [L / 4, L / 4] tensor."""
    length, shards, block = 4096, 4, 128
    mesh = sequence_mesh((shards,))
    layout = attention.SequenceLayout(mesh)
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
    shape = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype, sharding=row)
    q, kv = shape(1, length, 4, 8), shape(1, length, 2, 8)

    def loss(q, k, v, ends, weights):
        out = attention.context_parallel_tree_attention(q, k, v, ends, layout, block)
        return jnp.sum(out * weights)

    compiled = (
        jax.jit(jax.grad(loss, (0, 1, 2)))
        .lower(q, kv, kv, shape(1, length, dtype=jnp.int32), q)
        .compile()
    )
    per_shard = length // shards
    sizes = [
        int(np.prod([int(n) for n in dims.split(",") if n]))
        for dims in re.findall(r"(?:f32|s32|pred)\[([0-9,]*)\]", compiled.as_text())
    ]
    assert max(sizes) < per_shard * per_shard
    assert compiled.memory_analysis().temp_size_in_bytes < per_shard * per_shard * 4


# --- the live-pair schedule and the loop over it --------------------------------------


def brute_force_pairs(ends, block, num_query_blocks, q_offset=0, k_offset=0, key_major=False):
    """Every (query block, key block) pair in which some query of some row sees some key
    (by the mask's definition, token by token), query-major or key-major."""
    pairs = []
    for i in range(num_query_blocks):
        queries = q_offset + i * block + np.arange(block)
        for j in range(ends.shape[1] // block):
            keys = k_offset + j * block + np.arange(block)
            key_ends = ends[:, j * block : (j + 1) * block]  # [B, block]
            causal = keys[None, None, :] <= queries[None, :, None]
            inside = queries[None, :, None] < key_ends[:, None, :]
            if (causal & inside).any():
                pairs.append((i, j))
    return sorted(pairs, key=lambda p: (p[1], p[0])) if key_major else pairs


def schedule_pairs(schedule):
    """The live pairs of a schedule, in order, and its padding entries."""
    pairs = list(zip(*(np.asarray(x).tolist() for x in schedule[:2]), strict=True))
    count = int(schedule.count)
    return pairs[:count], pairs[count:]


def assert_schedule_is_brute_force(ends, block, nq=None, q_offset=0, k_offset=0, valid=True):
    """Both orders equal the brute-force pairs; padding repeats the last live pair.
    Returns the number of live pairs."""
    nq = ends.shape[1] // block if nq is None else nq
    for key_major in (False, True):
        want = brute_force_pairs(ends, block, nq, q_offset, k_offset, key_major) if valid else []
        schedule = attention.live_block_schedule(
            jnp.asarray(ends), block, nq, q_offset, k_offset, key_major=key_major, valid=valid
        )
        live, padding = schedule_pairs(schedule)
        assert live == want
        assert all(p == (want[-1] if want else (0, 0)) for p in padding)
    return len(want)


def test_schedule_of_rows_of_several_trees_is_the_union_over_rows():
    """Two rows of different forests (short trees + padding; one long tree): the
    schedule is the pairs live in either row."""
    rng = np.random.default_rng(60)
    short = packed_row(rng, 96, max_tree=12, padding=10)
    long = packed_row(rng, 96, max_tree=5, long_tree=70, padding=4)
    ends = np.stack([short, long])
    both = assert_schedule_is_brute_force(ends, 8)
    alone = [assert_schedule_is_brute_force(row[None], 8) for row in ends]
    assert max(alone) < both < 12 * 13 // 2
    assert_schedule_is_brute_force(np.stack([random_forest_subtree_end(rng, 96)] * 2), 16)


def test_schedule_of_a_causal_row_is_every_causal_pair_and_no_padding():
    n = 8
    ends = np.full((1, n * 4), n * 4, np.int32)
    assert assert_schedule_is_brute_force(ends, 4) == n * (n + 1) // 2
    schedule = attention.live_block_schedule(jnp.asarray(ends), 4)
    assert schedule.query_block.shape == (n * (n + 1) // 2,)  # static size: causal pairs


def test_schedule_of_ring_steps_with_traced_offsets():
    """A 128-token row over 4 shards of 32: query shard s against key shard s - r, with
    offsets traced (as in the ring) and steps before the first shard invalid."""
    rng = np.random.default_rng(61)
    ends = np.stack([packed_row(rng, 128, max_tree=40, padding=6) for _ in range(2)])
    per_shard, block = 32, 8
    nq = per_shard // block
    build = jax.jit(
        attention.live_block_schedule, static_argnums=(1, 2), static_argnames="key_major"
    )
    counts = []
    for shard in range(4):
        for step in range(4):
            origin = max(shard - step, 0)
            key_ends = ends[:, origin * per_shard : (origin + 1) * per_shard]
            valid = step <= shard
            offsets = (shard * per_shard, origin * per_shard)
            for key_major in (False, True):
                schedule = build(
                    jnp.asarray(key_ends), block, nq, *map(jnp.int32, offsets),
                    key_major=key_major, valid=jnp.bool_(valid),
                )  # fmt: skip
                assert schedule.query_block.shape == (nq * nq,)
                want = brute_force_pairs(key_ends, block, nq, *offsets, key_major)
                live, padding = schedule_pairs(schedule)
                assert live == (want if valid else [])
                assert all(p == (live[-1] if live else (0, 0)) for p in padding)
            counts.append(len(live))
    assert 0 < min(c for c in counts if c) and max(counts) < nq * nq  # nontrivial steps


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (loop bodies, branches,
    shard_map and custom-VJP bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from equations(sub)


def pair_loops(fn, *args):
    """The while loops of fn's jaxpr that compute attention (hold a dot product), and
    the names of the primitives inside each."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    loops = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name == "while":
            inside = {e.primitive.name for e in equations(eqn.params["body_jaxpr"].jaxpr)}
            if "dot_general" in inside:
                loops.append(inside)
    return jaxpr, loops


def test_blocked_attention_is_one_loop_per_pass_with_no_conditional():
    """Forward + backward of the blocked attention: one while loop per pass, no
    conditional or scan anywhere in the program (jaxpr and compiled HLO)."""
    q, k, v, ends = map(jnp.asarray, make_inputs(62, length=64))

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(blocked(*a, ends) ** 2), (0, 1, 2))(q, k, v)

    jaxpr, loops = pair_loops(grads, q, k, v)
    assert len(loops) == 2
    names = {e.primitive.name for e in equations(jaxpr)}
    assert not names & {"cond", "scan"}
    hlo = jax.jit(grads).lower(q, k, v).compile().as_text()
    assert len(re.findall(r"\bwhile\(", hlo)) == 2
    assert not re.findall(r"\bconditional\(", hlo)


def test_ring_pair_loops_have_no_conditional():
    """In the ring, conditionals are per ring step (a shared predicate); the loops over
    block pairs (own shard and arriving shard, forward and backward) have none."""
    rng = np.random.default_rng(63)
    q, k, v, _ = make_inputs(64, length=64)
    ends = np.stack([packed_row(rng, 64, max_tree=30, padding=4) for _ in range(2)])
    layout = attention.SequenceLayout(sequence_mesh((4,)))
    args = tuple(map(jnp.asarray, (q, k, v)))

    def grads(q, k, v):
        loss = lambda *a: jnp.sum(ring(*a, jnp.asarray(ends), layout=layout) ** 2)
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    jaxpr, loops = pair_loops(grads, *args)
    assert len(loops) == 4
    assert all(not inside & {"cond", "scan", "while"} for inside in loops)
    assert "cond" in {e.primitive.name for e in equations(jaxpr)}  # the ring's own


@pytest.mark.parametrize("shape", ["forest", "causal", "ring_step"])
def test_pair_loops_run_exactly_the_live_pairs(shape):
    """The forward and backward loops' own iteration counters equal the brute-force
    number of live pairs (below the number of all pairs), in the single-device case
    and for a ring step (traced offsets), and are 0 for an invalid ring step."""
    rng = np.random.default_rng(65)
    block, length = 8, 64
    q, k, v, _ = make_inputs(66, length=length)
    if shape == "causal":
        ends = np.full((2, length), length, np.int32)
    else:  # a ring step: the queries of rows 64..127 against the keys of rows 0..63
        rows = 2 * length if shape == "ring_step" else length
        ends = np.stack([packed_row(rng, rows, max_tree=40, padding=5) for _ in range(2)])
        ends = ends[:, :length]
    offsets = (length, 0) if shape == "ring_step" else (0, 0)
    q = attention._group(jnp.asarray(q), k.shape[2])
    k, v, ends_j = jnp.asarray(k), jnp.asarray(v), jnp.asarray(ends)
    lse = jnp.zeros(q.shape[:1] + q.shape[2:4] + q.shape[1:2], jnp.float32)

    @jax.jit
    def pairs(q_offset, k_offset, valid):
        state = attention._softmax_state(q)
        _, forward = attention._attend(q, k, v, ends_j, q_offset, k_offset, state, block, valid)
        grads = attention._zero_grads(q, k, q)
        _, backward = attention._attend_bwd(
            q, q, lse, lse, k, v, ends_j, q_offset, k_offset, grads, block, valid=valid
        )
        return forward, backward

    n = length // block
    want = len(brute_force_pairs(ends, block, n, *offsets))
    assert 0 < want < n * n
    assert shape != "causal" or want == n * (n + 1) // 2
    assert tuple(map(int, pairs(*map(jnp.int32, offsets), jnp.bool_(True)))) == (want, want)
    assert tuple(map(int, pairs(*map(jnp.int32, offsets), jnp.bool_(False)))) == (0, 0)
