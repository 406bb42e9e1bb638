"""Proxy: records every call; drains, migrations and engine failures are invisible."""

import asyncio
import contextlib

import jax
import numpy as np
import pytest
from conftest import HoldAfterTokens
from flax import nnx

from gyrejax.config import ModelConfig
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import init_model
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.proxy import NoEngineError, Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.rollout.types import Request, SamplingParams

CONFIG = ModelConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
LONG = SamplingParams(temperature=0.0, max_new_tokens=120)
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1)


@pytest.fixture(scope="module")
def reference(model):
    return generate(model, [PROMPT], max_new_tokens=120)[0]


class NoKvJaxEngine(JaxEngine):
    """A JAX engine that cannot take a KV cache (forces re-submit, as vLLM does)."""

    exports_kv = False


def engines(model, n=2, cls=JaxEngine, **kwargs):
    kwargs = {"max_slots": 4, "max_seq_len": 256, "decode_steps": 2, **kwargs}
    return [cls(f"e{i}", model, **kwargs) for i in range(n)]


async def shutdown(proxy):
    for engine in proxy.engines():
        await engine.shutdown()


def assert_matches(completion, reference, atol=1e-5):
    assert completion.output_ids.tolist() == reference.token_ids
    np.testing.assert_allclose(completion.logprobs, reference.logprobs, atol=atol)


def test_calls_are_recorded_and_counted(model, reference):
    async def body():
        proxy = Proxy(engines(model))
        try:
            proxy.dispatch("x1")
            proxy.dispatch("x2")
            first = await proxy.generate("x1", "main", "main", PROMPT, LONG)
            second = await proxy.generate(
                "x1", "sub-1", "sub_agent", [1, 2], SamplingParams(max_new_tokens=3)
            )
            counters = proxy.counters()
            calls = proxy.finish("x1")
            return first, second, counters, calls, proxy.counters()
        finally:
            await shutdown(proxy)

    first, second, counters, calls, after = asyncio.run(body())
    assert_matches(first, reference)
    assert second.output_ids.size == 3
    assert (counters.dispatched, counters.started, counters.finished) == (2, 1, 0)
    assert counters.outstanding == 2 and after.outstanding == 1
    assert [c.call_id for c in calls] == [0, 1]
    assert [(c.agent_id, c.role) for c in calls] == [("main", "main"), ("sub-1", "sub_agent")]
    assert calls[0].prompt_ids.tolist() == PROMPT
    assert calls[0].output_ids.tolist() == reference.token_ids
    np.testing.assert_array_equal(calls[0].logprobs, first.logprobs)
    assert calls[1].output_ids.size == 3 and calls[0].engines == calls[1].engines  # sticky
    assert calls[0].finished_at >= calls[0].started_at > 0


@pytest.mark.parametrize("cls", [JaxEngine, NoKvJaxEngine])
def test_drain_migrates_in_flight_requests_invisibly(model, reference, cls):
    async def body():
        proxy = Proxy(engines(model, cls=cls))
        try:
            source = proxy.engines()[0]
            hold = HoldAfterTokens(source, 30)
            calls = [
                asyncio.create_task(proxy.generate(f"x{i}", "main", "main", PROMPT, LONG))
                for i in range(3)
            ]
            await hold.reached()
            held = proxy.counters().in_flight["e0"]
            report = await hold.meanwhile(proxy.drain("e0"))
            assert proxy.counters().in_flight["e0"] == 0 and source.load == 0
            return (
                await asyncio.gather(*calls),
                report,
                held,
                {x: proxy.finish(x) for x in ("x0", "x1", "x2")},
            )
        finally:
            await shutdown(proxy)

    results, report, held, records = asyncio.run(body())
    assert held >= 1 and report.migrated == held
    if cls is JaxEngine:
        assert report.kv_copies == held
    else:
        assert report.resubmits == held
    moved = [r for r in results if r.engines == ("e0", "e1")]
    assert len(moved) == held
    for result in results:
        assert_matches(result, reference, atol=1e-5 if cls is JaxEngine else 1e-4)
    for calls in records.values():  # the record is the whole, uninterrupted call
        (call,) = calls
        assert call.output_ids.tolist() == reference.token_ids and call.finish_reason == "length"


@pytest.mark.parametrize("failure", ["die", "hang"])
def test_engine_failure_retries_elsewhere(model, reference, failure):
    async def body():
        pool = engines(model)
        # Every program compiled first: the 0.5 s hang timeout that catches the victim
        # would also catch an engine compiling (the survivor, at the retry).
        await asyncio.gather(*(e.submit(Request("warm", PROMPT, LONG)) for e in pool))
        proxy = Proxy(pool, hang_timeout_s=0.5)
        try:
            victim = proxy.engines()[0]
            hold = HoldAfterTokens(victim, 10)
            call = asyncio.create_task(proxy.generate("x", "main", "main", PROMPT, LONG))
            await hold.reached()
            victim.simulate_failure(failure)
            hold.release()
            completion = await asyncio.wait_for(call, timeout=60)
            again = await proxy.generate("y", "main", "main", PROMPT, LONG)
            return completion, again, proxy.counters(), proxy.finish("x")
        finally:
            await shutdown(proxy)

    completion, again, counters, calls = asyncio.run(body())
    assert_matches(completion, reference)  # re-run from the prompt on the survivor
    assert completion.engines == ("e1",) and again.engines == ("e1",)
    assert counters.retries == 1
    (call,) = calls
    assert call.output_ids.tolist() == reference.token_ids and call.engines == ("e1",)


def test_no_engine_left_is_an_error(model):
    async def body():
        proxy = Proxy(engines(model, n=1), max_attempts=2)
        try:
            proxy.engines()[0].simulate_failure("die")
            await asyncio.sleep(0.2)
            with pytest.raises(NoEngineError):
                await proxy.generate("x", "main", "main", PROMPT, LONG)
        finally:
            await shutdown(proxy)

    asyncio.run(body())


def test_calls_wait_while_every_engine_switches_roles(model):
    """All cells in training (none accepts): a call waits for one to come back; with no
    engine back within engine_wait_s it fails with one clear error."""
    reference = generate(model, [PROMPT], max_new_tokens=LONG.max_new_tokens)[0]

    async def body():
        proxy = Proxy(engines(model, n=1), engine_wait_s=0.3)
        try:
            proxy.set_accepting("e0", False)
            with pytest.raises(NoEngineError, match=r"engine_wait_s=0\.3"):
                await proxy.generate("x", "main", "main", PROMPT, LONG)
            proxy.engine_wait_s = 60.0
            call = asyncio.ensure_future(proxy.generate("y", "main", "main", PROMPT, LONG))
            await asyncio.sleep(0.3)
            assert not call.done()  # waiting, not failed
            proxy.set_accepting("e0", True)
            return await call
        finally:
            await shutdown(proxy)

    assert_matches(asyncio.run(body()), reference)


def test_weights_published_mid_flight_version_every_token(model):
    new = jax.tree.map(lambda x: x * 1.3, nnx.to_pure_dict(nnx.state(model)))

    async def body():
        proxy = Proxy(engines(model))
        try:
            hold = HoldAfterTokens(proxy.engines()[0], 20)  # the first call goes to e0
            call = asyncio.create_task(proxy.generate("x", "main", "main", PROMPT, LONG))
            await hold.reached()
            await hold.meanwhile(proxy.update_weights(new, version=1))
            completion = await call
            return completion, proxy.finish("x"), [e.version for e in proxy.engines()]
        finally:
            await shutdown(proxy)

    completion, calls, versions = asyncio.run(body())
    assert versions == [1, 1]
    switch = int(np.argmax(completion.versions == 1))
    assert switch > 0 and (completion.versions[switch:] == 1).all()
    np.testing.assert_array_equal(calls[0].versions, completion.versions)
    assert len(calls[0].versions) == len(calls[0].output_ids) == len(calls[0].logprobs)


def test_cancelling_an_execution_spares_one_whose_id_it_prefixes():
    # The audit: finishing "team" cancelled the calls of "team/worker" (a prefix match).
    async def body():
        engine = ScriptedEngine("e", lambda prompt, request: [1, 2], delay_s=0.5)
        proxy = Proxy([engine])
        for execution_id in ("team", "team/worker"):
            proxy.dispatch(execution_id)
        sampling = SamplingParams(max_new_tokens=2)
        calls = [
            asyncio.ensure_future(proxy.generate(x, "main", "main", PROMPT, sampling))
            for x in ("team", "team/worker")
        ]
        await asyncio.sleep(0.1)
        proxy.cancel_execution("team")
        results = await asyncio.gather(*calls, return_exceptions=True)
        await shutdown(proxy)
        return [getattr(r, "finish_reason", type(r).__name__) for r in results]

    team, worker = asyncio.run(body())
    assert team == "cancelled" and worker != "cancelled", (team, worker)


def test_a_call_its_caller_gives_up_is_cancelled_on_the_engine():
    """A harness timeout cancels the awaiting call. The engine must drop the request too:
    the proxy forgets it at once, so a request left running is one a drain never waits
    for, and the engine's release_memory then finds it still there."""

    async def body():
        engine = ScriptedEngine("e", lambda prompt, request: [1, 2, 3], delay_s=60)
        proxy = Proxy([engine, ScriptedEngine("f", lambda prompt, request: [1])])
        proxy.dispatch("x")
        proxy.set_accepting("f", False)  # the call goes to e
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.2):
                await proxy.generate("x", "main", "main", PROMPT, SamplingParams(max_new_tokens=3))
        proxy.cancel_execution("x")  # what the harness does after its timeout
        held = engine.request_ids()
        proxy.set_accepting("f", True)
        await proxy.drain("e")
        await engine.release_memory()  # refuses while a request is in flight
        return held

    assert asyncio.run(body()) == []
