"""Engines over HTTP: the proxy routes, drains, retries and publishes weights to remote
engines exactly as to local ones (in-process servers on free ports, and a server in a
subprocess that is killed or frozen mid-request)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from conftest import ENGINE_TOKEN, HoldAfterTokens, start_engine_server

from gyrejax.config import ModelConfig
from gyrejax.model.hf_io import export_hf, load_hf
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import init_model
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.rollout.types import SamplingParams
from gyrejax.serve.engine_server import EngineServer, scripted_answer
from gyrejax.serve.http import token_digest
from gyrejax.serve.http_engine import HttpEngine

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
LONG = SamplingParams(temperature=0.0, max_new_tokens=64)
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1)


async def remote_fleet(engines, weights_dir=None, **client):
    """Each engine behind its own EngineServer (token `ENGINE_TOKEN`, weights from
    `weights_dir` only); returns (servers, HttpEngine clients)."""
    servers = [EngineServer(e, token=ENGINE_TOKEN, weights_dir=weights_dir) for e in engines]
    urls = [await s.start() for s in servers]
    return servers, [await HttpEngine.connect(url, token=ENGINE_TOKEN, **client) for url in urls]


async def close(servers, clients):
    for client in clients:
        await client.shutdown()
    for server in servers:
        await server.stop()
        await server.engine.shutdown()


def test_proxy_over_http_engines_drains_by_resubmit_and_publishes_weights(model, tmp_path):
    reference = generate(model, [PROMPT], max_new_tokens=64)[0]
    checkpoint = export_hf(init_model(CONFIG, seed=2), tmp_path / "step_1")
    after_update = generate(load_hf(checkpoint), [PROMPT], max_new_tokens=64)[0]

    async def body():
        local = [
            JaxEngine(f"e{i}", model, max_slots=4, max_seq_len=128, decode_steps=2)
            for i in range(2)
        ]
        servers, remote = await remote_fleet(local, weights_dir=tmp_path)
        proxy = Proxy(remote)
        hold = HoldAfterTokens(local[0], 20)
        try:
            info = [(r.name, r.capacity, r.version, r.exports_kv) for r in remote]
            calls = [
                asyncio.create_task(proxy.generate(f"x{i}", "main", "main", PROMPT, LONG))
                for i in range(3)
            ]
            await hold.reached()
            held = proxy.counters().in_flight["e0"]
            report = await hold.meanwhile(proxy.drain("e0"))
            results = await asyncio.gather(*calls)
            records = [proxy.finish(f"x{i}") for i in range(3)]
            await remote[0].release_memory()  # drained: it may free its memory, and resume
            await remote[0].resume()
            proxy.set_accepting("e0", True)
            await proxy.update_weights(checkpoint, version=1)
            updated = await proxy.generate("y", "main", "main", PROMPT, LONG)
            with pytest.raises(ValueError, match="outside"):  # the engine refuses: a 400
                await proxy.generate("z", "main", "main", [1, 500], LONG)
            return info, held, report, results, records, updated, [r.version for r in remote]
        finally:
            await close(servers, remote)

    info, held, report, results, records, updated, versions = asyncio.run(body())
    assert info == [("e0", 4, 0, False), ("e1", 4, 0, False)]
    assert held >= 1 and report.migrated == report.resubmits == held
    assert sum(r.engines == ("e0", "e1") for r in results) == held
    for result, (call,) in zip(results, records, strict=True):  # as if never interrupted
        assert result.output_ids.tolist() == reference.token_ids
        np.testing.assert_allclose(result.logprobs, reference.logprobs, atol=1e-4)
        assert call.output_ids.tolist() == reference.token_ids and call.finish_reason == "length"
        np.testing.assert_array_equal(call.logprobs, result.logprobs)
    assert versions == [1, 1] and (updated.versions == 1).all()
    assert updated.output_ids.tolist() == after_update.token_ids


@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_a_dead_or_frozen_server_is_retried_on_the_other(failure):
    server, far_url = start_engine_server("far", "--engine=scripted", "--scripted_delay_s=60")
    try:

        async def body():
            servers, (near,) = await remote_fleet([ScriptedEngine("near", scripted_answer)])
            far = await HttpEngine.connect(
                far_url, token=ENGINE_TOKEN, poll_interval_s=0.1, status_timeout_s=1.0
            )
            proxy = Proxy([far, near], hang_timeout_s=1.0)
            try:
                call = asyncio.create_task(
                    proxy.generate("x", "main", "main", PROMPT, SamplingParams(max_new_tokens=8))
                )
                while not (await far.status())["request_ids"]:
                    await asyncio.sleep(0.02)
                server.send_signal(signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
                completion = await asyncio.wait_for(call, timeout=30)
                again = await proxy.generate("y", "main", "main", PROMPT, LONG)
                return completion, again, proxy.counters(), proxy.finish("x")
            finally:
                await close(servers, [far, near])

        completion, again, counters, calls = asyncio.run(body())
    finally:
        server.kill()
        server.wait(timeout=30)
    answer = scripted_answer(PROMPT, None)
    assert completion.output_ids.tolist() == answer and completion.engines == ("near",)
    assert again.engines == ("near",) and counters.retries == 1
    (call,) = calls  # the record is the whole call, from the survivor
    assert call.output_ids.tolist() == answer and call.engines == ("near",)
    assert call.prompt_ids.tolist() == PROMPT and len(call.logprobs) == len(answer)


def test_malformed_engine_requests_are_refused_by_field_and_the_server_keeps_serving(tmp_path):
    async def body():
        engine = ScriptedEngine("e", scripted_answer, delay_s=0.2)
        servers, (remote,) = await remote_fleet([engine], weights_dir=tmp_path)
        url = servers[0].url
        try:
            bad = {
                "submit": [
                    (b"{oops", "body"),
                    ({}, "request"),
                    ({"request": {"prompt_ids": [1]}}, "request.request_id"),
                    ({"request": {"request_id": "r", "prompt_ids": []}}, "request.prompt_ids"),
                    (
                        {"request": {"request_id": "r", "prompt_ids": [1, "a"]}},
                        "request.prompt_ids[1]",
                    ),
                    (
                        {
                            "request": {
                                "request_id": "r",
                                "prompt_ids": [1],
                                "sampling": {"top_p": 2},
                            }
                        },
                        "request.sampling.top_p",
                    ),
                    (
                        {
                            "request": {
                                "request_id": "r",
                                "prompt_ids": [1],
                                "sampling": {"max_new_tokens": 0},
                            }
                        },
                        "request.sampling.max_new_tokens",
                    ),
                ],
                "import": [
                    (
                        {
                            "live": {
                                "request": {"request_id": "r", "prompt_ids": [1]},
                                "output_ids": [2, 3],
                                "logprobs": [-1.0],
                                "versions": [0, 0],
                            }
                        },
                        "live.output_ids",
                    ),
                ],
                "update_weights": [
                    ({"path": str(tmp_path / "missing"), "version": 1}, "path"),
                    ({"path": str(tmp_path), "version": -1}, "version"),
                ],
                "export": [({"request_id": "nobody"}, "request_id")],
            }
            answers = []
            auth = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
            async with httpx.AsyncClient(base_url=f"{url}/v1/engine", headers=auth) as http:
                for endpoint, cases in bad.items():
                    for payload, field in cases:
                        kwargs = (
                            {"content": payload}
                            if isinstance(payload, bytes)
                            else {"json": payload}
                        )
                        answers.append((endpoint, field, await http.post(endpoint, **kwargs)))
            with pytest.raises(KeyError):
                await remote.export("nobody")
            with pytest.raises(ValueError, match="path"):
                await remote.update_weights(tmp_path / "missing", 1)
            with pytest.raises(TypeError, match="path"):
                await remote.update_weights({"w": np.zeros(3)}, 1)
            await remote.update_weights(tmp_path, 3)  # a scripted engine only takes the version
            proxy = Proxy([remote])
            call = asyncio.create_task(proxy.generate("x", "main", "main", PROMPT))
            while not engine.request_ids():  # on the server, not just sent
                await asyncio.sleep(0.01)
            with pytest.raises(RuntimeError, match="in flight"):
                await remote.release_memory()
            return answers, await call, remote.version
        finally:
            await close(servers, [remote])

    answers, completion, version = asyncio.run(body())
    for endpoint, field, answer in answers:
        error = answer.json()["error"]
        assert 400 <= answer.status_code < 500, (endpoint, field, answer.text)
        assert error["param"] == field or error["message"].startswith(field), (
            endpoint,
            answer.text,
        )
    assert completion.output_ids.tolist() == scripted_answer(PROMPT, None)
    assert version == 3 and (completion.versions == 3).all()


def test_vllm_client_names_what_the_server_lacks():
    """`VllmServerEngine.connect` against a server that is not a suitably started vLLM
    (here our own engine server: no vLLM development endpoints) is one ValueError
    naming the missing setting; nothing listening is an EngineError."""
    from gyrejax.rollout.types import EngineError
    from gyrejax.serve.vllm_server_engine import VllmServerEngine

    async def go():
        server = EngineServer(ScriptedEngine("e", scripted_answer), token=ENGINE_TOKEN)
        url = await server.start()
        try:
            with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE=1"):
                await VllmServerEngine.connect(url, name="v")
        finally:
            await server.stop()
        with pytest.raises(EngineError):
            await VllmServerEngine.connect(url, name="v")  # nothing listens there now

    asyncio.run(go())


def test_vllm_client_never_reuses_a_connection_the_server_may_be_closing(monkeypatch):
    """vLLM closes a connection idle 5 s; a POST sent on it at that moment fails with
    ServerDisconnectedError (aiohttp retries only idempotent methods), and CI once lost a
    vLLM engine, and every later weight update, to a generate request that did. Frozen
    in time here: the server drops, unanswered, any request that arrives on a connection
    idle longer than vLLM's keep-alive. The client must have let that connection go."""
    import aiohttp.connector

    from gyrejax.serve.vllm_server_engine import VllmServerEngine

    keepalive_s = 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default
    skipped = [0.0]  # simulated idle time, on the client's pool clock and the server's
    monkeypatch.setattr(aiohttp.connector, "monotonic", lambda: time.monotonic() + skipped[0])

    async def connection(reader, writer):
        last = None
        while await reader.readuntil(b"\r\n\r\n"):
            if last is not None and time.monotonic() + skipped[0] - last > keepalive_s:
                writer.close()  # the server had closed it; the client sent anyway
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            last = time.monotonic() + skipped[0]

    async def go():
        server = await asyncio.start_server(connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = VllmServerEngine(f"http://127.0.0.1:{port}", name="v", capacity=1, max_seq_len=2)
        try:
            assert await engine._vllm("POST", "/resume") == {}
            skipped[0] = keepalive_s + 0.5
            assert await engine._vllm("POST", "/resume") == {}  # on a fresh connection
        finally:
            await engine.shutdown()
            server.close()

    asyncio.run(go())


class ReleaseCounter(ScriptedEngine):
    """A scripted engine that counts release_memory calls."""

    released = 0

    async def release_memory(self) -> None:
        self.released += 1


def test_engine_servers_need_the_token_and_load_weights_only_from_their_directory(
    tmp_path, monkeypatch
):
    """The audit drove an engine with `update_weights {"path": "/etc"}` and
    `release_memory`, no credentials needed. Now every endpoint but /health needs the
    token, and weights load only from under --weights_dir, symlinks resolved."""
    published, outside = tmp_path / "published", tmp_path / "outside"
    (published / "version_1").mkdir(parents=True)
    outside.mkdir()
    (published / "escape").symlink_to(outside)
    engine = ReleaseCounter("e", scripted_answer)
    monkeypatch.delenv("GYREJAX_ENGINE_TOKEN", raising=False)

    async def body():
        server = EngineServer(engine, token=ENGINE_TOKEN, weights_dir=published)
        url = await server.start()
        try:
            request = {"request": {"request_id": "r", "prompt_ids": [1, 2]}}
            calls = [
                ("GET", "status", None),
                ("POST", "submit", request),
                ("POST", "import", {"live": request}),
                ("POST", "export", {"request_id": "r"}),
                ("POST", "cancel", {"request_id": "r"}),
                ("POST", "update_weights", {"path": str(published / "version_1"), "version": 1}),
                ("POST", "release_memory", {}),
                ("POST", "resume", {}),
            ]
            wrong = {"Authorization": "Bearer not-the-engine-token-0123"}
            async with httpx.AsyncClient(base_url=f"{url}/v1/engine") as http:
                refused = [
                    await http.request(method, path, json=payload, headers=headers)
                    for headers in ({}, wrong, {"Authorization": ENGINE_TOKEN})  # no "Bearer"
                    for method, path, payload in calls
                ]
                health = await http.get(f"{url}/health")
                auth = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
                paths = {
                    "/etc": "/etc",
                    "dot-dot": str(published / ".." / "outside"),
                    "symlink out": str(published / "escape"),
                    "relative": "outside",
                }
                confined = {
                    what: await http.post(
                        "update_weights", headers=auth, json={"path": path, "version": 1}
                    )
                    for what, path in paths.items()
                }
            with pytest.raises(ValueError, match="missing or wrong token"):
                await HttpEngine.connect(url)  # no token given, none in the environment
            monkeypatch.setenv("GYREJAX_ENGINE_TOKEN", ENGINE_TOKEN)
            remote = await HttpEngine.connect(url)  # the environment's token
            await remote.update_weights(published / "version_1", 2)
            await remote.release_memory()
            await remote.shutdown()
            return refused, health, confined, remote.version
        finally:
            await server.stop()

    refused, health, confined, version = asyncio.run(body())
    for answer in refused:
        assert answer.status_code == 401, (answer.request.url, answer.text)
        assert answer.json()["error"]["param"] == "Authorization"
    assert engine.released == 1 and version == 2  # only the authenticated calls got through
    assert health.status_code == 200 and health.json() == {"ok": True}
    for what, answer in confined.items():
        error = answer.json()["error"]
        assert answer.status_code == 403, (what, answer.text)
        assert error["param"] == "path" and "outside" in error["message"], what
    assert "'/etc'" in confined["/etc"].json()["error"]["message"]

    with pytest.raises(ValueError, match="no token"):
        EngineServer(engine, token=None)
    with pytest.raises(ValueError, match="at least 16"):
        EngineServer(engine, token="short")

    async def open_server():
        server = EngineServer(engine, token=None, insecure_no_auth=True)
        with pytest.raises(ValueError, match="loopback"):
            await server.start("0.0.0.0")

    asyncio.run(open_server())
    # The command line refuses to start without a token, before loading any model.
    env = {k: v for k, v in os.environ.items() if k != "GYREJAX_ENGINE_TOKEN"}
    run = subprocess.run(
        [sys.executable, "-m", "gyrejax.serve.engine_server", "--engine=scripted"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "no token: give --token or set GYREJAX_ENGINE_TOKEN" in run.stderr, run.stderr


def test_a_server_holding_only_the_token_digest_admits_the_token_alone():
    """A multi-process run's followers learn the engine token over the coordinator's
    unauthenticated key-value store, so they are given its digest: their servers admit
    the token, and refuse a wrong one and the digest itself (what a reader of the store
    could send)."""
    engine = ScriptedEngine("e", scripted_answer)
    digest = token_digest(ENGINE_TOKEN)

    async def body():
        server = EngineServer(engine, token=None, token_sha256=digest)
        url = await server.start()
        try:
            async with httpx.AsyncClient(base_url=f"{url}/v1/engine") as http:
                return {
                    key: (await http.get("status", headers={"Authorization": f"Bearer {key}"}))
                    for key in (ENGINE_TOKEN, digest, "not-the-engine-token-0123")
                }
        finally:
            await server.stop()

    answers = asyncio.run(body())
    assert answers[ENGINE_TOKEN].status_code == 200, answers[ENGINE_TOKEN].text
    for refused in (digest, "not-the-engine-token-0123"):
        assert answers[refused].status_code == 401, refused
    with pytest.raises(ValueError, match="not both"):
        EngineServer(engine, token=ENGINE_TOKEN, token_sha256=digest)
    with pytest.raises(ValueError, match="not a SHA-256"):
        EngineServer(engine, token=None, token_sha256=ENGINE_TOKEN)
