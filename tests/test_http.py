"""The servers' shared guards (gyrejax/serve/http.py) on real servers and sockets: the key
is checked before a byte of the body is read, bodies are limited per endpoint, slow or
silent connections are closed at the header timeout, slow bodies at the body timeout,
connections past the limit are refused, and every malformed body is a 400 (never a 500)
on the engine server and the OpenAI door alike. Small numbers keep it fast: 20 slow
connections, 1 s timeouts."""

import asyncio
import contextlib
import copy
import json
import socket
import threading
import time

import httpx
from conftest import ENGINE_TOKEN, start_engine_server

from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.serve.engine_server import EngineServer, scripted_answer
from gyrejax.serve.http import MAX_JSON_DEPTH, Limits
from gyrejax.serve.openai_server import OpenAIServer

AUTH = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAST = Limits(header_timeout_s=1.0, body_timeout_s=1.0, lingering_s=0.5)
SMALL_BODIES = Limits(control_body_bytes=1024, data_body_bytes=64 * 1024)


@contextlib.asynccontextmanager
async def engine_server(limits=None, delay_s=0.0):
    """A scripted engine behind an EngineServer on a free port; yields (server, url)."""
    engine = ScriptedEngine("e", scripted_answer, delay_s=delay_s)
    server = EngineServer(engine, token=ENGINE_TOKEN, limits=limits)
    url = await server.start()
    try:
        yield server, url
    finally:
        await server.stop()
        await engine.shutdown()


def host_port(url):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


# --- the key before the body --------------------------------------------------------------


def peak_rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def post_raw(host, port, path, body: bytes, headers="") -> bytes:
    """POSTs `body` from a thread while reading the answer here (a server that answers
    before reading the body, or never reads it, must not deadlock the test)."""
    with socket.create_connection((host, port), timeout=30) as s:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n"
        )

        def send():
            with contextlib.suppress(OSError):  # refused: the server closes on it
                s.sendall(head.encode() + body)

        sender = threading.Thread(target=send)
        sender.start()
        answer = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer and (chunk := s.recv(65536)):
                answer += chunk
        sender.join(timeout=30)
        return answer


def test_a_body_without_the_key_is_refused_before_it_is_read():
    """16 MB to a control endpoint without the token: a 401 from the headers alone, and
    the server's peak memory does not move (before, it read and parsed the body: 61 MB)."""
    server, url = start_engine_server("e", "--engine=scripted")
    try:
        host, port = host_port(url)
        body = b'{"pad": "' + b"x" * (16 * 2**20) + b'"}'
        post_raw(host, port, "/v1/engine/release_memory", b"{}")  # warm up the server
        reset_peak_rss(server.pid)
        before = peak_rss_kib(server.pid)
        refused = post_raw(host, port, "/v1/engine/release_memory", body)
        # With the token, a control endpoint refuses it as too large, again unread.
        too_large = post_raw(
            host, port, "/v1/engine/cancel", body, f"Authorization: Bearer {ENGINE_TOKEN}\r\n"
        )
        grown_kib = peak_rss_kib(server.pid) - before
        alive = httpx.get(f"{url}/health", timeout=10)
    finally:
        server.kill()
        server.wait()
    print(f"peak memory growth for two refused 16 MB bodies: {grown_kib} KiB")
    assert grown_kib < 4096
    assert refused.startswith(b"HTTP/1.1 401"), refused[:200]
    assert too_large.startswith(b"HTTP/1.1 413"), too_large[:200]
    assert alive.status_code == 200


def test_bodies_are_limited_per_endpoint_and_the_key_comes_first():
    prompt = list(range(1, 100)) * 6  # ~2.3 KB of JSON: past a control limit, within data

    async def go():
        async with engine_server(SMALL_BODIES) as (_, url):
            async with httpx.AsyncClient(base_url=f"{url}/v1/engine", timeout=30) as http:

                async def chunked(data: bytes):  # no Content-Length: counted while read
                    for i in range(0, len(data), 256):
                        yield data[i : i + 256]

                padded = json.dumps({"request_id": "r", "pad": "x" * 2048}).encode()
                submit = {"request": {"request_id": "s", "prompt_ids": prompt}}
                huge = {"request": {"request_id": "h", "prompt_ids": prompt * 60}}
                return {
                    "control": await http.post("cancel", headers=AUTH, content=padded),
                    "control chunked": await http.post(
                        "cancel", headers=AUTH, content=chunked(padded)
                    ),
                    "control, no key": await http.post("cancel", content=padded),
                    "data": await http.post("submit", headers=AUTH, json=submit),
                    "data too large": await http.post("submit", headers=AUTH, json=huge),
                    "gzip": await http.post(
                        "cancel",
                        headers={**AUTH, "Content-Encoding": "gzip"},
                        content=b"\x1f\x8b",
                    ),
                }

    answers = asyncio.run(go())
    status = {name: a.status_code for name, a in answers.items()}
    assert status == {
        "control": 413,
        "control chunked": 413,
        "control, no key": 401,
        "data": 200,
        "data too large": 413,
        "gzip": 415,
    }
    assert answers["control"].json()["error"]["param"] == "body"
    assert "at most 1024 bytes" in answers["control"].json()["error"]["message"]


# --- slow and silent clients --------------------------------------------------------------


async def closed_after(reader) -> float:
    """Seconds until the server closes the connection (EOF or reset)."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionError):
        while await reader.read(4096):
            pass
    return time.monotonic() - started


def test_slow_and_silent_connections_are_closed_at_the_header_timeout():
    """20 clients trickle a request head (a header every 0.2 s, forever) and 5 send
    nothing: all are closed about 1 s (the configured timeout) after they connect, while a
    long-poll longer than that timeout runs to its end."""

    async def slow_client(host, port):
        reader, writer = await asyncio.open_connection(host, port)

        async def trickle():
            writer.write(f"POST /v1/engine/cancel HTTP/1.1\r\nHost: {host}\r\n".encode())
            with contextlib.suppress(ConnectionError):
                for i in range(100):
                    await asyncio.sleep(0.2)
                    writer.write(f"X-Slow-{i}: 1\r\n".encode())
                    await writer.drain()

        trickling = asyncio.create_task(trickle())
        try:
            return await asyncio.wait_for(closed_after(reader), timeout=10)
        finally:
            trickling.cancel()
            writer.close()

    async def silent_client(host, port):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(closed_after(reader), timeout=10)
        finally:
            writer.close()

    async def go():
        async with engine_server(FAST, delay_s=2.0) as (server, url):
            host, port = host_port(url)
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
                long_poll = asyncio.create_task(
                    http.post("/v1/engine/submit", json={"request": {"request_id": "r",
                              "prompt_ids": [1, 2, 3]}})
                )  # fmt: skip
                closed = await asyncio.gather(
                    *[slow_client(host, port) for _ in range(20)],
                    *[silent_client(host, port) for _ in range(5)],
                )
                answer = await long_poll
                after = await http.get("/v1/engine/status")
            return closed, answer, after, server.connections.header_timeouts

    closed, answer, after, timeouts = asyncio.run(go())
    print(f"slow/silent connections closed after {min(closed):.2f}-{max(closed):.2f} s")
    assert all(0.5 < t < 2.5 for t in closed), closed
    assert timeouts == 25
    assert answer.status_code == 200, answer.text  # 2 s in its handler: not a slow head
    assert answer.json()["completion"]["output_ids"] == [3, 2, 1]
    assert after.status_code == 200


def test_a_body_that_trickles_is_cut_at_the_body_timeout():
    async def go():
        async with engine_server(FAST) as (_, url):
            host, port = host_port(url)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"POST /v1/engine/cancel HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {ENGINE_TOKEN}\r\nContent-Length: 100\r\n\r\n"
                '{"request_id": '.encode()
            )
            started = time.monotonic()
            answer = await asyncio.wait_for(reader.read(4096), timeout=10)
            writer.close()
            return answer, time.monotonic() - started

    answer, seconds = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"not received within 1 s" in answer and seconds < 2.5


def test_connections_past_the_limit_are_refused_until_one_closes():
    async def go():
        async with engine_server(Limits(max_connections=4)) as (server, url):
            host, port = host_port(url)
            held = [await asyncio.open_connection(host, port) for _ in range(4)]
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection(host, port)
            refused = await asyncio.wait_for(reader.read(4096), timeout=10)
            writer.close()
            held.pop()[1].close()  # one of the four leaves: a slot is free again
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http:
                served = await http.get("/v1/engine/status")
            for _, w in held:
                w.close()
            return refused, served, server.connections.refused

    refused, served, count = asyncio.run(go())
    assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused
    assert served.status_code == 200 and count == 1


# --- malformed bodies: a 400, never a 500 -------------------------------------------------

RAW_BODIES = {
    "invalid JSON": b"{not json",
    "invalid UTF-8": b'{"a": "\xff\xfe"}',
    "not an object": b"[1, 2]",
    "100k-deep": b"[" * 100_000 + b"]" * 100_000,
    "100k-deep in an object": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    f"{MAX_JSON_DEPTH + 1}-deep": b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
    "5000-digit integer": b'{"a": ' + b"9" * 5000 + b"}",
    "NaN": b'{"a": NaN}',
    "-Infinity": b'{"a": -Infinity}',
}
WRONG_VALUES = [
    None, True, -1, 0, 2**31, 10**30, 10**400, 1.5, -1e308, "x", "", [], [1, "a"], [[]],
    {}, {"a": [1]}, [None],
]  # fmt: skip


def with_value(body: dict, dotted: str, value) -> dict:
    body = copy.deepcopy(body)
    *parents, last = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    node = body
    for key in parents:
        node = node[key]
    node[last] = value
    return body


async def fuzz(http, path, headers, base, fields):
    """Every raw body, then each field of `base` set to each wrong value: (what, answer)."""
    tries = [(name, raw) for name, raw in RAW_BODIES.items()]
    tries += [
        (f"{field}={value!r:.40}", json.dumps(with_value(base, field, value)).encode())
        for field in fields
        for value in WRONG_VALUES
    ]
    answers = []
    for what, raw in tries:
        answer = await http.post(
            path, headers={**headers, "Content-Type": "application/json"}, content=raw
        )
        answers.append((f"{path} {what}", answer))
    return answers


def assert_no_500(answers):
    for what, answer in answers:
        assert answer.status_code < 500, f"{what}: {answer.status_code} {answer.text[:300]}"
        if answer.status_code >= 400:
            error = answer.json()["error"]
            assert error["param"] or error["message"], what
    raw = [(w, a) for w, a in answers if any(w.endswith(f" {name}") for name in RAW_BODIES)]
    assert raw
    for what, answer in raw:
        # 413 where the body passes a control endpoint's limit before it is even parsed
        assert answer.status_code in (400, 413), f"{what}: {answer.status_code} {answer.text}"
        assert answer.json()["error"]["param"] == "body", what


def test_every_malformed_engine_request_is_a_400_never_a_500(tmp_path):
    request = {"request_id": "r", "prompt_ids": [1, 2], "sampling": {"max_new_tokens": 2}}
    knobs = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_ids", "seed")
    sampling = [f"request.sampling.{knob}" for knob in knobs]
    live = {"request": request, "output_ids": [3], "logprobs": [-0.5], "versions": [0]}
    endpoints = [
        ("submit", {"request": request}, ["request", "request.request_id",
         "request.prompt_ids", "request.sampling", *sampling]),
        ("import", {"live": live}, ["live", "live.output_ids", "live.logprobs",
         "live.versions", "live.engines", "live.request"]),
        ("export", {"request_id": "r"}, ["request_id"]),
        ("cancel", {"request_id": "r"}, ["request_id"]),
        ("update_weights", {"path": str(tmp_path), "version": 1}, ["path", "version"]),
    ]  # fmt: skip

    async def go():
        async with engine_server() as (server, url):
            server.weights_dir = str(tmp_path)
            answers = []
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                for endpoint, base, fields in endpoints:
                    path = f"/v1/engine/{endpoint}"
                    answers += await fuzz(http, path, AUTH, base, fields)
                alive = await http.get("/v1/engine/status", headers=AUTH)
            return answers, alive

    answers, alive = asyncio.run(go())
    assert_no_500(answers)
    assert alive.status_code == 200


def test_every_malformed_door_request_is_a_400_never_a_500():
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    chat_fields = [
        "messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens",
        "max_completion_tokens", "seed", "stop", "stop_token_ids", "n", "presence_penalty",
        "frequency_penalty", "logit_bias", "top_logprobs", "logprobs", "stream",
        "return_token_ids",
    ]  # fmt: skip

    async def go():
        engine = ScriptedEngine("e", lambda prompt, request: [70, 71])
        server = OpenAIServer(Proxy([engine]), api_key=ADMIN_KEY, default_max_tokens=4)
        url = await server.start()
        answers = []
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:

                async def start():
                    answer = (await http.post("/v1/executions", headers=ADMIN, json={})).json()
                    return answer["execution_id"], {"Authorization": f"Bearer {answer['api_key']}"}

                answers += await fuzz(
                    http, "/v1/executions", ADMIN, {"execution_id": "e"},
                    ["execution_id", "task_id", "group_id"],
                )  # fmt: skip
                _, key = await start()
                answers += await fuzz(
                    http, "/v1/chat/completions", key, {"messages": opening}, chat_fields
                )
                answers += await fuzz(
                    http,
                    "/v1/chat/completions",
                    key,
                    {"messages": [{"role": "user", "content": "u", "tool_calls": []}]},
                    ["messages.0", "messages.0.role", "messages.0.content",
                     "messages.0.tool_calls", "messages.0.name"],
                )  # fmt: skip
                answers += await fuzz(
                    http, "/v1/completions", key, {"prompt": "hi"},
                    ["prompt", "logprobs", "max_tokens", "echo", "suffix", "stop"],
                )  # fmt: skip
                execution_id, key = await start()  # raw bodies refused: it stays open
                answers += await fuzz(http, f"/v1/executions/{execution_id}/finish", key, {}, [])
                for field in ("status", "reward", "eval_attempts"):
                    for value in WRONG_VALUES:  # a try may finish it: each a fresh execution
                        execution_id, key = await start()
                        path = f"/v1/executions/{execution_id}/finish"
                        answer = await http.post(path, headers=key, json={field: value})
                        answers.append((f"{path} {field}={value!r:.40}", answer))
                alive = await http.get("/health")
        finally:
            await server.stop()
            await engine.shutdown()
        return answers, alive

    answers, alive = asyncio.run(go())
    assert_no_500(answers)
    assert alive.status_code == 200


def test_keyless_connections_idle_out_and_are_capped_per_client():
    # The audit: 64 idle keep-alive connections with no key took every slot (503 for
    # everyone, still after 12 s). A connection no request authenticated on is closed
    # soon after its request, and one address may hold only so many of them.
    limits = Limits(
        header_timeout_s=5.0, unauthenticated_idle_s=0.5, max_unauthenticated_per_client=3
    )

    async def get(reader, writer, path, headers=""):
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        return head.split(b" ")[1]

    async def go():
        async with engine_server(limits) as (server, url):
            host, port = host_port(url)
            keyless = await asyncio.open_connection(host, port)
            keyed = await asyncio.open_connection(host, port)
            auth = f"Authorization: Bearer {ENGINE_TOKEN}\r\n"
            statuses = [
                await get(*keyless, "/v1/engine/status"),  # 401: no key
                await get(*keyed, "/v1/engine/status", auth),
            ]
            silent = [await asyncio.open_connection(host, port) for _ in range(2)]
            await asyncio.sleep(0.1)  # keyless + 2 silent: the address's 3
            over = await asyncio.open_connection(host, port)
            refused = await asyncio.wait_for(over[0].read(4096), timeout=5)
            await asyncio.sleep(1.0)  # past unauthenticated_idle_s
            keyless_closed = await asyncio.wait_for(keyless[0].read(1), timeout=5) == b""
            still = await get(*keyed, "/v1/engine/status", auth)  # kept alive: it has a key
            for _, writer in [keyless, keyed, over, *silent]:
                writer.close()
            return statuses, refused, keyless_closed, still, server.connections

    statuses, refused, keyless_closed, still, stats = asyncio.run(go())
    assert statuses == [b"401", b"200"] and still == b"200"
    assert refused.startswith(b"HTTP/1.1 503") and stats.refused == 1
    assert keyless_closed and stats.idle_closed == 1


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch):
    """A long prompt's JSON (issue 40, item 6) is parsed in a worker thread, so it does
    not hold up other connections; a small one stays on the loop."""
    from gyrejax.serve import http

    parsed_on = []
    original = http.parse_json

    def recording(raw):
        parsed_on.append((len(raw), threading.current_thread() is threading.main_thread()))
        return original(raw)

    monkeypatch.setattr(http, "parse_json", recording)
    engine = ScriptedEngine("e", lambda prompt, request: [0])

    async def body():
        door = OpenAIServer(Proxy([engine]), api_key=ADMIN_KEY, default_max_tokens=1)
        url = await door.start("127.0.0.1", 0)
        key = door.open_execution("x")
        statuses = []
        async with httpx.AsyncClient(timeout=30) as client:
            for length in (8, 40_000):  # ~30 bytes vs ~160 KiB of JSON
                answer = await client.post(
                    f"{url}/v1/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": "m", "prompt": [65] * length, "max_tokens": 1},
                )
                statuses.append(answer.status_code)
        await door.stop()
        return statuses

    assert asyncio.run(body()) == [200, 200]
    (small, on_loop_small), (large, on_loop_large) = parsed_on
    assert small <= http.INLINE_JSON_BYTES < large
    assert on_loop_small and not on_loop_large
