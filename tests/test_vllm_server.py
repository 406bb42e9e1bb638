"""A vLLM server (vLLM's own OpenAI-compatible server, started as a user would) used as
an engine by URL: parity with our JAX model, export to a JAX engine, in-place weight
reload with exact per-token versions, a dead server failing its requests, and servers
started without the token-in/token-out endpoint or the processed log-probs refused at
connect.

One server is started for the module (~40 s on 2 cores) and killed by the death test;
the RL test and the misconfigured-server tests start their own.
"""

import asyncio
import os
import signal
import socket

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM engine is optional)")

from conftest import call_logprobs, load_config_file
from test_vllm_engine import MAX_SEQ_LEN, PROMPTS, reference, run, write_checkpoint

from gyrejax.cells import split_into_cells
from gyrejax.config import from_dict
from gyrejax.loop import Runtime
from gyrejax.model.hf_io import export_hf, load_hf
from gyrejax.model.transformer import init_model
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.types import EngineError, Request, RequestMigrated, SamplingParams
from gyrejax.serve.vllm_server_engine import (
    VllmServerEngine,
    kill_server_process,
    server_command,
    start_server_process,
    wait_until_healthy,
)
from gyrejax.trajectory import ExecutionStore

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)
LOGPROB_ATOL = 1e-4  # float32 on both sides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint, port: int, max_model_len: int = MAX_SEQ_LEN, without=()):
    """Starts a vLLM server (its log next to the checkpoint, not a pipe it could fill),
    with the flags in `without` left out; returns its URL once it answers, and its process."""
    command, env = server_command(checkpoint, port, max_model_len=max_model_len, max_num_seqs=8)
    command = [arg for arg in command if arg not in without]
    log = open(f"{checkpoint}.server{port}.log", "w")
    process = start_server_process(command, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process)
    except RuntimeError as e:
        kill_server_process(process)
        with open(log.name) as f:
            pytest.fail(f"{e}\n{f.read()[-3000:]}")
    return url, process


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server")
    return write_checkpoint(root / "v0", seed=0), write_checkpoint(root / "v1", seed=1)


@pytest.fixture(scope="module")
def server(checkpoints):
    url, process = start_server(checkpoints[0], free_port())
    yield process, url
    kill_server_process(process)


@pytest.fixture(scope="module")
def models(checkpoints):
    """Our JAX model on each checkpoint: the independent reference."""
    return [load_hf(c) for c in checkpoints]


def test_greedy_equals_our_model_with_versions(server, models):
    _, url = server

    async def go():
        engine = await VllmServerEngine.connect(url, name="vllm-http", version=3)
        assert (engine.capacity, engine.max_seq_len) == (8, MAX_SEQ_LEN)
        futures = [engine.submit(Request(f"r{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
        done = await asyncio.gather(*futures)
        await engine.shutdown()
        return done

    completions = run(go())
    for completion, prompt in zip(completions, PROMPTS, strict=True):
        ids, logprobs = reference(models[0], prompt, 40)
        np.testing.assert_array_equal(completion.output_ids, ids)
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=LOGPROB_ATOL)
        assert completion.finish_reason == "length" and completion.engines == ("vllm-http",)
        assert set(completion.versions.tolist()) == {3}


def test_export_midway_continues_on_a_jax_engine(server, models):
    """Migration across engine kinds: tokens so far leave the vLLM server (no KV) and a
    JAX engine finishes the request exactly as an uninterrupted greedy run."""
    _, url = server
    # The longest budget the server allows, exported at the first token seen: the client
    # sees tokens late under load, and a request that ended first cannot be exported
    # (the export says so with a KeyError). Such a request tests nothing, so the same
    # request is sent again, at most three times in all.
    prompt, budget = PROMPTS[1], MAX_SEQ_LEN - len(PROMPTS[1]) - 1
    want_ids, want_logprobs = reference(models[0], prompt, budget)

    async def export_midway(remote, request_id):
        sampling = SamplingParams(temperature=0.0, max_new_tokens=budget)
        future = remote.submit(Request(request_id, prompt, sampling))
        while not remote._streams[request_id].output:
            await asyncio.sleep(0.001)
        try:
            live = await remote.export(request_id)
        except KeyError:
            await future  # it finished whole: its completion, not an error
            return None
        with pytest.raises(RequestMigrated):
            await future
        with pytest.raises(KeyError):
            await remote.export(request_id)
        return live

    async def go():
        remote = await VllmServerEngine.connect(url, name="vllm-http")
        local = JaxEngine("jax", models[0], max_slots=2, max_seq_len=MAX_SEQ_LEN)
        for attempt in range(3):
            live = await export_midway(remote, f"m{attempt}")
            if live is not None:
                break
        assert live is not None, "the request ended before its export, three times"
        completion = await local.import_request(live)
        await remote.shutdown()
        await local.shutdown()
        return live, completion

    live, completion = run(go())
    assert live.kv is None and 1 <= len(live.output_ids) < budget
    assert live.engines == ("vllm-http",)
    np.testing.assert_array_equal(completion.output_ids, want_ids)
    np.testing.assert_allclose(completion.logprobs, want_logprobs, atol=LOGPROB_ATOL)
    assert completion.engines == ("vllm-http", "jax")


def test_weight_reload_mid_flight_labels_every_token(server, checkpoints, models):
    """Weights reloaded while a request runs: tokens before carry the old version, the
    rest the new one, and those are exactly what the new weights produce greedily from
    the tokens before the switch."""
    _, url = server
    # The longest budget the server allows, the reload asked for at the first token seen:
    # the request must still run when the reload lands. Under load it once did not; such
    # a request tests nothing, so another is sent, reloading the other checkpoint back,
    # at most three times in all.
    prompt, budget = PROMPTS[0], MAX_SEQ_LEN - len(PROMPTS[0]) - 1
    sampling = SamplingParams(temperature=0.0, max_new_tokens=budget)

    async def go():
        engine = await VllmServerEngine.connect(url, name="vllm-http", version=0)
        held = 0  # the checkpoint the server serves (the module's server starts on 0)
        for version in (1, 2, 3):
            future = engine.submit(Request(f"w{version}", prompt, sampling))
            while not engine._streams[f"w{version}"].output:
                await asyncio.sleep(0.001)
            await engine.update_weights(str(checkpoints[1 - held]), version)
            completion = await future
            if (completion.versions == version).any():
                break
            held = 1 - held  # it ended before the reload landed: again
        status = await engine.status()
        await engine.shutdown()
        return completion, status, version, held

    completion, status, version, held = run(go())
    assert status["weight_version"] == str(version)
    versions = completion.versions
    switch = int(np.argmax(versions == version))
    assert 1 <= switch < budget, "the request ended before the reload, three times"
    assert np.all(versions[:switch] == version - 1) and np.all(versions[switch:] == version)
    before, _ = reference(models[held], prompt, switch)
    np.testing.assert_array_equal(completion.output_ids[:switch], before)
    context = list(prompt) + [int(t) for t in before]
    after, after_logprobs = reference(models[1 - held], context, budget - switch)
    np.testing.assert_array_equal(completion.output_ids[switch:], after)
    np.testing.assert_allclose(completion.logprobs[switch:], after_logprobs, atol=LOGPROB_ATOL)


def test_refuses_bad_requests_and_fails_when_the_server_dies(server):
    process, url = server

    async def go():
        engine = await VllmServerEngine.connect(url, name="vllm-http")
        too_long = Request("x", [1] * MAX_SEQ_LEN, GREEDY)
        with pytest.raises(ValueError, match="max_seq_len"):
            engine.submit(too_long)
        with pytest.raises(TypeError, match="directory path"):
            await engine.update_weights({"w": np.zeros(2)}, 1)
        # The host goes away mid-stream: the server is frozen once a first token has
        # arrived and the client has drained what was already sent, and killed only if
        # the request is still open then (on a loaded machine the whole answer can be
        # out before the freeze; then the server is thawed and the next request tried).
        budget = MAX_SEQ_LEN - len(PROMPTS[2]) - 1
        for attempt in range(5):
            request_id = f"d{attempt}"
            future = engine.submit(
                Request(
                    request_id, PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=budget)
                )
            )
            # (a stream is forgotten only after its future is done)
            while not future.done() and not engine._streams[request_id].output:
                await asyncio.sleep(0.001)
            if future.done():
                continue
            os.killpg(process.pid, signal.SIGSTOP)
            await asyncio.sleep(0.5)
            if not future.done():
                break
            os.killpg(process.pid, signal.SIGCONT)
        else:
            pytest.fail("every request ended before the server could be frozen mid-stream")
        kill_server_process(process)
        with pytest.raises(EngineError):
            await future
        with pytest.raises(EngineError):
            await engine.status()
        await engine.shutdown()

    run(go())


def test_rl_runtime_rolls_out_on_an_external_vllm_server(tmp_path):
    """The RL loop with a vLLM server beside the rollout cell: it serves executions, gets
    every published version (an HF export it reloads), and what it records is exactly
    the policy of the version it reports."""
    c = load_config_file("tiny_cpu", "smoke")
    c.cells.size, c.cells.fsdp = 4, 4  # two cells: cell 0 trains, cell 1 rolls out
    c.scheduler.policy, c.scheduler.async_training_cells = "async", 1
    c.train.steps, c.scheduler.max_staleness = 2, 0  # step 2 trains version-1 groups only
    config = from_dict(c)
    start = export_hf(init_model(config.model), tmp_path / "start")
    url, process = start_server(start, free_port(), max_model_len=config.rollout.max_seq_len)
    try:
        c.rollout.vllm_servers = (url,)
        config = from_dict(c)
        workdir = tmp_path / "run"
        summary = Runtime(
            config, split_into_cells(config.cells), init_model(config.model), workdir
        ).run()
        label = run(_weight_label(url))
    finally:
        kill_server_process(process)
    assert summary["steps"] == 2 and label == "2"  # the last publication reached it
    calls = [call for e in ExecutionStore(workdir / "executions") for call in e.calls]
    on_vllm = [call for call in calls if call.engines == ("vllm0",)]
    versions = {int(call.versions[0]) for call in on_vllm if len(set(call.versions)) == 1}
    assert 1 in versions, versions  # version-1 groups ran there after the first publication
    references = {0: init_model(config.model), 1: load_hf(workdir / "published" / "version_1")}
    for call in on_vllm:
        version = int(call.versions[0])
        if np.all(call.versions == version) and version in references:
            np.testing.assert_allclose(
                call.logprobs, call_logprobs(references[version], call), atol=LOGPROB_ATOL
            )


def test_connect_names_every_missing_flag(checkpoints):
    """A real vLLM server started without the flags this engine needs is refused by
    `connect` with every flag to add in one message, not used until a request fails or
    records wrong log-probs."""
    # --enable-scale-out: the token-in/token-out endpoint, without which nothing could be
    # generated; --logprobs-mode: raw log-probs are not the sampled distribution's under
    # temperature or top-p, so PPO's ratios would be silently wrong.
    without = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs")
    url, process = start_server(checkpoints[0], free_port(), without=without)
    try:
        with pytest.raises(ValueError) as error:
            run(VllmServerEngine.connect(url, name="v"))
    finally:
        kill_server_process(process)
    message = str(error.value)
    assert "start it with --enable-scale-out" in message, message
    assert "start it with --logprobs-mode processed_logprobs" in message, message


async def _weight_label(url) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(url + "/weight_info") as response:
        return (await response.json())["weight_version"]
