"""JAX engine: continuous batching equals plain generation; migration, limits, updates."""

import asyncio
import dataclasses
import threading

import jax
import numpy as np
import pytest
from conftest import SAMPLING_GRID, HoldAfterTokens, settings
from flax import nnx

from gyrejax.cells import split_into_cells
from gyrejax.config import TRAIN_SHARDING_RULES, CellsConfig, ModelConfig, RolloutConfig
from gyrejax.model import sharding
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import init_model
from gyrejax.rl.parity import recorded_calls, trained_ratios
from gyrejax.rollout.factory import make_engine
from gyrejax.rollout.jax_engine import (
    JaxEngine,
    length_buckets,
    runnable_bucket,
    width_buckets,
)
from gyrejax.rollout.types import EngineError, Request, RequestMigrated, SamplingParams

CONFIG = ModelConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


async def with_engines(model, fn, n=1, **kwargs):
    engines = [JaxEngine(f"e{i}", model, max_seq_len=256, **kwargs) for i in range(n)]
    try:
        return await fn(*engines)
    finally:
        for engine in engines:
            await engine.shutdown()


def test_continuous_batching_equals_plain_generation(model):
    ps = prompts(7)  # more requests than slots: some wait for a free slot
    want = generate(model, ps, max_new_tokens=24)

    async def body(engine):
        futures = [engine.submit(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(ps)]
        assert engine.load == 7
        return await asyncio.gather(*futures)

    results = run(with_engines(model, body, max_slots=3, decode_steps=5))
    for got, expected in zip(results, want, strict=True):
        assert got.output_ids.tolist() == expected.token_ids
        np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)
        assert got.finish_reason == "length" and got.engines == ("e0",)
        assert (got.versions == 0).all()


def ratios_over_the_grid(model, new_tokens):
    """One request per SAMPLING_GRID setting through a JAX engine, then every trained
    token's ratio of trainer to engine log-prob (`rl/parity.py`)."""
    ps = prompts(len(SAMPLING_GRID), seed=3)
    requests = [
        Request(f"s{i}", p, SamplingParams(t, tp, k, max_new_tokens=new_tokens, seed=i))
        for i, (p, (t, tp, k)) in enumerate(zip(ps, SAMPLING_GRID, strict=True))
    ]

    async def body(engine):
        return await asyncio.gather(*(engine.submit(r) for r in requests))

    completions = run(with_engines(model, body, max_slots=4))
    return trained_ratios(model, recorded_calls(completions, ps, SAMPLING_GRID))


def test_the_trainer_reproduces_every_sampling_setting(model):
    """Same weights, so every trained token's importance ratio must be 1: the trainer
    takes its log-probs under the distribution each call sampled from (temperature,
    top-k/top-p cut, renormalised), as recorded by the engine (float32)."""
    got = ratios_over_the_grid(model, new_tokens=24)
    np.testing.assert_allclose(got["ratio"], 1.0, atol=1e-4)
    assert not got["unreproduced"].any()
    trained = {(float(t), float(p), int(k)) for t, p, k in zip(*settings(got), strict=True)}
    assert trained == {(float(np.float32(t)), float(np.float32(p)), k) for t, p, k in SAMPLING_GRID}


# Measured max |trainer - engine| log-prob over these 576 tokens in bfloat16: 2.0e-3
# (mean 3.5e-4); in float32, 4.8e-7. The bound leaves 2.5x for other CPUs' rounding.
BF16_LOGPROB_ATOL = 5e-3


def test_bfloat16_trainer_and_engine_log_probs_agree_within_the_measured_tolerance():
    """bfloat16 weights and activations on both sides: the engine's KV-cache decode and
    the trainer's packed forward round differently, within BF16_LOGPROB_ATOL."""
    bf16 = init_model(dataclasses.replace(CONFIG, dtype="bfloat16"), seed=0)
    got = ratios_over_the_grid(bf16, new_tokens=48)
    gap = np.abs(np.log(got["ratio"]))
    assert not got["unreproduced"].any()
    assert 1e-5 < gap.max() <= BF16_LOGPROB_ATOL  # bfloat16 rounding, and no more


def test_decode_narrows_as_requests_finish(model):
    """Requests finishing at different times: the busy slots move first, each decode is
    only as wide as they are (down to a batch-1 tail), and every token equals plain
    generation's."""
    ps = prompts(5, seed=5)
    budgets = [40, 8, 30, 4, 56]
    want = generate(model, ps, max_new_tokens=max(budgets))

    async def body(engine):
        futures = [
            engine.submit(Request(f"r{i}", p, dataclasses.replace(GREEDY, max_new_tokens=n)))
            for i, (p, n) in enumerate(zip(ps, budgets, strict=True))
        ]
        return await asyncio.gather(*futures), dict(engine.decode_widths)

    results, widths = run(with_engines(model, body, max_slots=8, decode_steps=4))
    for got, expected, n in zip(results, want, budgets, strict=True):
        assert got.output_ids.tolist() == expected.token_ids[:n]
        np.testing.assert_allclose(got.logprobs, expected.logprobs[:n], atol=1e-5)
    # 5 busy: width 8; then 4, 3, 2 (width 4) and the last one alone, moved to slot 0.
    assert set(widths) == {8, 4, 1}, widths
    assert widths[1] >= (56 - 40) // 4

    # rollout.narrow=False (through the factory, as the RL loop builds engines): every
    # decode is full width, with the same tokens.
    config = RolloutConfig(max_slots=8, max_seq_len=256, narrow=False)

    async def wide():
        engine = make_engine(split_into_cells(CellsConfig(size=1))[0], model, config)
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    full, widths = run(wide())
    assert set(widths) == {8}, widths
    for got, narrow in zip(full, results, strict=True):
        assert got.output_ids.tolist() == narrow.output_ids.tolist()


def test_seeded_sampling_is_independent_of_batch_and_engine(model):
    ps = prompts(4, seed=1)
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_new_tokens=16)

    async def body(a, b):
        together = await asyncio.gather(
            *(a.submit(Request(f"t{i}", p, sampling)) for i, p in enumerate(ps))
        )
        alone = [await b.submit(Request(f"a{i}", p, sampling)) for i, p in enumerate(ps)]
        return together, alone

    together, alone = run(with_engines(model, body, n=2, max_slots=4, decode_steps=3))
    for x, y in zip(together, alone, strict=True):
        assert x.output_ids.tolist() == y.output_ids.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert any(len(set(x.output_ids.tolist())) > 1 for x in together)


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3, max_new_tokens=40)]
)
def test_kv_migration_continues_exactly(model, sampling):
    prompt = prompts(1, seed=2)[0]
    budget = 256 - 40  # "m" is exported 10 tokens in (the engine held there)
    sampling = SamplingParams(**{**sampling.__dict__, "max_new_tokens": budget})

    async def body(a, b):
        reference = await a.submit(Request("ref", prompt, sampling))
        hold = HoldAfterTokens(a, 10)
        future = a.submit(Request("m", prompt, sampling))
        await hold.reached()
        live = await hold.meanwhile(a.export("m"))
        with pytest.raises(RequestMigrated):
            await future
        assert live.kv is not None and 0 < len(live.output_ids) < budget
        assert a.load == 0
        return reference, await b.import_request(live)

    reference, moved = run(with_engines(model, body, n=2, max_slots=2, decode_steps=2))
    assert moved.output_ids.tolist() == reference.output_ids.tolist()
    np.testing.assert_allclose(moved.logprobs, reference.logprobs, atol=1e-5)
    assert moved.engines == ("e0", "e1")


def test_resubmit_migration_without_kv(model):
    prompt = prompts(1, seed=3)[0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=256 - 40)

    async def body(a, b):
        reference = await a.submit(Request("ref", prompt, sampling))
        hold = HoldAfterTokens(a, 8)  # "m" is exported 8 tokens in
        future = a.submit(Request("m", prompt, sampling))
        await hold.reached()
        live = await hold.meanwhile(a.export("m"))
        with pytest.raises(RequestMigrated):
            await future
        return reference, await b.import_request(dataclasses.replace(live, kv=None))

    reference, moved = run(with_engines(model, body, n=2, max_slots=2, decode_steps=2))
    assert moved.output_ids.tolist() == reference.output_ids.tolist()
    np.testing.assert_allclose(moved.logprobs, reference.logprobs, atol=1e-4)


def test_stop_ids_budgets_and_the_context_limit(model):
    prompt = prompts(1, seed=4)[0]
    free = generate(model, [prompt], max_new_tokens=30)[0].token_ids
    stop = free[5]

    async def body(engine):
        stopped = await engine.submit(
            Request("s", prompt, SamplingParams(temperature=0, stop_ids=(stop,), max_new_tokens=30))
        )
        one = await engine.submit(
            Request("o", prompt, SamplingParams(temperature=0, max_new_tokens=1))
        )
        long_prompt = list(range(1, 60))
        limited = await engine.submit(
            Request("l", long_prompt, SamplingParams(temperature=0, max_new_tokens=500))
        )
        return stopped, one, limited

    engines = [JaxEngine("e0", model, max_slots=2, max_seq_len=64, decode_steps=4)]

    async def main():
        try:
            return await body(engines[0])
        finally:
            await engines[0].shutdown()

    stopped, one, limited = run(main())
    assert (
        stopped.output_ids.tolist() == free[: free.index(stop) + 1]
        and stopped.finish_reason == "stop"
    )
    assert one.output_ids.tolist() == free[:1] and one.finish_reason == "length"
    # 59 prompt tokens in a 64-token cache: 64 - 59 + 1 tokens fit, the last one unwritten.
    assert limited.finish_reason == "length" and len(limited.output_ids) == 64 - 59 + 1


def test_cancel_bad_requests_and_shutdown(model):
    async def body(engine):
        hold = HoldAfterTokens(engine, 5)
        running = engine.submit(Request("c", [1, 2, 3], SamplingParams(max_new_tokens=10_000)))
        await hold.reached()
        engine.cancel("c")
        hold.release()
        cancelled = await running
        with pytest.raises(ValueError, match="token 500 outside"):
            engine.submit(Request("bad", [1, 500], GREEDY))
        with pytest.raises(ValueError, match="does not fit"):
            engine.submit(Request("big", list(range(300)), GREEDY))
        pending = engine.submit(Request("p", [1, 2], SamplingParams(max_new_tokens=10_000)))
        await engine.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            await pending
        return cancelled

    cancelled = run(with_engines(model, body, max_slots=2))
    assert cancelled.finish_reason == "cancelled" and len(cancelled.output_ids) >= 5


def test_weight_update_between_decode_steps(model):
    prompt = prompts(1, seed=5)[0]
    bigger = jax.tree.map(lambda x: x * 1.5, nnx.to_pure_dict(nnx.state(model)))

    async def body(engine):
        hold = HoldAfterTokens(engine, 10)
        future = engine.submit(
            Request("w", prompt, SamplingParams(temperature=0, max_new_tokens=80))
        )
        await hold.reached()
        await hold.meanwhile(engine.update_weights(bigger, version=1))
        during = await future
        after = await engine.submit(Request("x", prompt, GREEDY))
        return during, after

    during, after = run(with_engines(model, body, max_slots=2, decode_steps=2))
    switch = int(np.argmax(during.versions == 1))
    assert (
        10 <= switch
        and (during.versions[:switch] == 0).all()
        and (during.versions[switch:] == 1).all()
    )
    assert (after.versions == 1).all()
    new_model = init_model(CONFIG)
    nnx.update(new_model, bigger)
    assert (
        after.output_ids.tolist() == generate(new_model, [prompt], max_new_tokens=24)[0].token_ids
    )


def test_release_memory_and_resume(model):
    async def body(engine):
        first = await engine.submit(Request("a", [1, 2, 3], GREEDY))
        await engine.release_memory()
        await engine.resume()
        await engine.update_weights(nnx.state(model), version=2)
        second = await engine.submit(Request("b", [1, 2, 3], GREEDY))
        return first, second

    first, second = run(with_engines(model, body, max_slots=2))
    assert first.output_ids.tolist() == second.output_ids.tolist() and (second.versions == 2).all()


def test_engine_on_a_tensor_parallel_cell_equals_one_device(model):
    cell = split_into_cells(CellsConfig(size=2, fsdp=1, tensor=2))[1]
    ps = prompts(3, seed=6)
    want = generate(model, ps, max_new_tokens=24)

    async def body():
        engine = JaxEngine("tp", model, cell, max_slots=4, max_seq_len=128)
        try:
            return await asyncio.gather(
                *(engine.submit(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(ps))
            )
        finally:
            await engine.shutdown()

    for got, expected in zip(run(body()), want, strict=True):
        assert got.output_ids.tolist() == expected.token_ids
        np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-5)


# A compile, or (with the suite's persistent compilation cache) a compiled program
# loaded from disk instead: either would stall the thread that needs it.
COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
)


def test_length_buckets():
    assert length_buckets(640) == [16, 32, 64, 128, 256, 512, 640]
    assert length_buckets(64) == [16, 32, 64] and length_buckets(8) == [8]
    assert width_buckets(16) == [1, 4, 16] and width_buckets(6) == [1, 4, 6]
    assert width_buckets(64) == [1, 4, 16, 64] and width_buckets(1) == [1]


def test_runnable_bucket_until_the_own_one_is_compiled():
    """The cheapest compiled executable that fits; a decode with none as wide runs its
    first slots on the widest one as long (never a stall while one exists)."""
    compiled = [("decode", 64, 1), ("decode", 512, 16), ("decode", 128, 4), ("prefill", 64)]
    assert runnable_bucket(("decode", 64, 4), compiled) == ("decode", 128, 4)
    assert runnable_bucket(("decode", 256, 4), compiled) == ("decode", 512, 16)
    assert runnable_bucket(("decode", 32, 1), compiled) == ("decode", 64, 1)
    assert runnable_bucket(("decode", 640, 4), compiled) is None  # none as long
    compiled.remove(("decode", 512, 16))
    assert runnable_bucket(("decode", 64, 16), compiled) == ("decode", 128, 4)  # narrower
    assert runnable_bucket(("decode", 16, 16), compiled) == ("decode", 128, 4)
    assert runnable_bucket(("prefill", 32), compiled) == ("prefill", 64)
    assert runnable_bucket(("prefill", 128), compiled) is None  # a prompt is never cut


def test_a_precompiled_engine_narrows_only_for_a_lasting_need(model):
    """A precompiled engine decodes at full width first (it fits any batch) and compiles
    a narrower width only once the batch stayed that narrow for NARROW_AFTER_CALLS calls;
    the tokens are plain generation's either way."""
    cell = split_into_cells(CellsConfig(size=1, fsdp=1, tensor=1))[3]  # its own compiles
    prompt = prompts(1, seed=8)[0][:10]
    short, long = (SamplingParams(temperature=0.0, max_new_tokens=n) for n in (6, 50))
    want = generate(model, [prompt], max_new_tokens=50)[0].token_ids

    def decodes(engine):
        return sorted(k for k in list(engine._executables) if k[0] == "decode")

    async def body(engine):
        await engine.precompiled()
        first = await engine.submit(Request("short", prompt, short))  # 5 decode calls
        after_short = decodes(engine)
        second = await engine.submit(Request("long", prompt, long))  # 28 attend 64
        while ("decode", 64, 1) not in engine._executables:  # compiled in the background
            await asyncio.sleep(0.01)
        return first, second, after_short

    async def main():
        engine = JaxEngine(
            "n", model, cell, max_slots=4, max_seq_len=64, decode_steps=1, precompile=True
        )
        try:
            return await asyncio.wait_for(body(engine), 120)
        finally:
            await engine.shutdown()

    first, second, after_short = run(main())
    assert after_short == [("decode", 16, 4)]  # the full width only
    assert first.output_ids.tolist() == want[:6] and second.output_ids.tolist() == want


def test_precompiled_engines_never_compile_after_start(model):
    """What a role switch reaches (a request, an export, an import on another cell, a
    weight pull from the trainer's layout, release and resume) never compiles on an engine
    thread once the engines serve. Engine a compiled every bucket ahead (`compile_all`):
    nothing compiles at all. Engine b compiles a bucket when first needed, in the
    background: the same tokens."""
    cells = split_into_cells(CellsConfig(size=1, fsdp=1, tensor=1))  # distinct devices
    prompt = prompts(1, seed=7)[0][:10]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=50)  # crosses buckets 16, 32, 64
    want = generate(model, [prompt], max_new_tokens=50)[0].token_ids
    # The trainer's weights: FSDP-sharded over two other devices, as a weight pull gets them.
    train_cell = split_into_cells(CellsConfig(size=2, fsdp=2, tensor=1))[2]
    state = nnx.state(model)
    specs = sharding.partition_specs(state, train_cell.mesh, TRAIN_SHARDING_RULES)
    trained = jax.device_put(
        nnx.to_pure_dict(state), sharding.named_shardings(specs, train_cell.mesh)
    )
    bigger = jax.tree.map(lambda x: x * 1.5, trained)
    bigger_model = init_model(CONFIG)
    nnx.update(bigger_model, jax.tree.map(np.asarray, bigger))
    want_bigger = generate(bigger_model, [prompt], max_new_tokens=50)[0].token_ids
    compiles = []  # the threads that compiled

    def listen(event, seconds, **kwargs):
        if event in COMPILE_EVENTS:
            compiles.append(threading.current_thread().name)

    async def body(a, b):
        await asyncio.gather(a.precompiled(), b.precompiled())
        count_a, count_b = a.compile_count, b.compile_count
        assert count_a > 0 and count_b > 0  # different devices: each compiled its own
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            full = await a.submit(Request("full", prompt, greedy))
            hold = HoldAfterTokens(a, 4)
            future = a.submit(Request("moved", prompt, greedy))
            await hold.reached()
            live = await hold.meanwhile(a.export("moved"))
            with pytest.raises(RequestMigrated):
                await future
            # The same state as another kind of engine would export it (rows [KV, n, D],
            # a length b compiled no import for): fitted on the host, not compiled.
            n = len(prompt) + len(live.output_ids) - 1
            exact = tuple((np.asarray(k)[:, :n], np.asarray(v)[:, :n]) for k, v in live.kv)
            copy = dataclasses.replace(
                live, request=dataclasses.replace(live.request, request_id="copy"), kv=exact
            )
            moved, copied = await asyncio.gather(b.import_request(live), b.import_request(copy))
            await b.update_weights(bigger, version=1)
            updated = await b.submit(Request("updated", prompt, greedy))
            await a.release_memory()
            await a.resume()
            await a.update_weights(trained, version=2)
            resumed = await a.submit(Request("resumed", prompt, greedy))

            async def b_compiled():  # b compiled what it needed, in the background
                while b.compile_count == count_b:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(b_compiled(), 120)
            assert set(compiles) == {"engine-b-compile"} and a.compile_count == count_a
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
        return full, live, moved, copied, updated, resumed

    async def main():
        kwargs = dict(max_slots=2, max_seq_len=64, decode_steps=2, precompile=True)
        a = JaxEngine("a", model, cells[1], compile_all=True, **kwargs)
        b = JaxEngine("b", model, cells[2], **kwargs)
        try:
            return await body(a, b)
        finally:
            await a.shutdown()
            await b.shutdown()

    full, live, moved, copied, updated, resumed = run(main())
    assert full.output_ids.tolist() == want
    assert live.kv is not None and 0 < len(live.output_ids) < 50
    for got in (moved, copied):
        assert got.output_ids.tolist() == want and got.engines == ("a", "b")
        np.testing.assert_allclose(got.logprobs, full.logprobs, atol=1e-5)
    assert updated.output_ids.tolist() == want_bigger and (updated.versions == 1).all()
    assert resumed.output_ids.tolist() == want and (resumed.versions == 2).all()
    # The listener does hear compiles (on this thread): the checks above are not vacuous.
    compiles.clear()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.jit(lambda x: x * 3 + 1)(np.arange(5))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [threading.current_thread().name]
