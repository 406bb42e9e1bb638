"""OpenAI-compatible server: external clients record exactly what the in-process path does.

Each test runs a `Proxy` + `OpenAIServer` on a free port in the test's event loop and
drives it as a black-box harness would (the `openai` package, or plain httpx); the
reference is the same conversation made in process through `Proxy.generate` with the
token contexts the harness builds (gyrejax.harness.agent).
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import zlib

import httpx
import numpy as np
import openai
import pytest

from gyrejax.config import ModelConfig
from gyrejax.harness import tokenizer as tok
from gyrejax.harness.agent import MAIN_SYSTEM, SUB_SYSTEM
from gyrejax.model.transformer import init_model
from gyrejax.rollout.jax_engine import JaxEngine
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.rollout.types import SamplingParams
from gyrejax.serve.openai_server import OpenAIServer, prompt_body_bytes
from gyrejax.serve.wire import execution_from_json
from gyrejax.trajectory import Execution, ExecutionStore, build_tree

SPEC = "make a.txt say hello"
MAX_TOKENS = 96
OPENING = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": SPEC}]


def seed_of(execution_id: str, n: int) -> int:
    """The harness's per-call seed (Harness._call with run.seed = 0)."""
    return (zlib.crc32(execution_id.encode()) + n) % 2**31


def harness_sampling(execution_id, n, max_tokens=MAX_TOKENS):
    """What Harness._call passes to the proxy."""
    return SamplingParams(
        temperature=1.0,
        max_new_tokens=max_tokens,
        stop_ids=(tok.EOT,),
        seed=seed_of(execution_id, n),
    )


def scripted(answers, delay_s=0.0):
    """Answers `answers[(execution, kind)]` in order (kind: main, sub or summary); an
    answer is text (sent as text + <eot>) or a list of token ids."""

    def respond(prompt, request):
        execution_id = request.request_id.rsplit("/", 1)[0]
        if int(prompt[-2]) == tok.SUMMARIZE:
            kind = "summary"
        elif tok.decode(prompt).startswith(SUB_SYSTEM):
            kind = "sub"
        else:
            kind = "main"
        answer = answers[(execution_id, kind)].pop(0)
        return answer if isinstance(answer, list) else tok.answer(answer)

    return ScriptedEngine("scripted", respond, delay_s=delay_s)


ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@contextlib.asynccontextmanager
async def serving(engine, store=None, **server_args):
    """A proxy over `engine` behind an OpenAIServer on a free port; yields (url, proxy)."""
    proxy = Proxy([engine])
    server = OpenAIServer(
        proxy, api_key=ADMIN_KEY, store=store, default_max_tokens=MAX_TOKENS, **server_args
    )
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield url, proxy, http
    finally:
        await server.stop()
        await engine.shutdown()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


async def start(http, execution_id, **fields):
    """Starts an execution with the admin key; returns the execution's own key."""
    response = await http.post(
        "/v1/executions", headers=ADMIN, json={"execution_id": execution_id, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()["api_key"]


async def finish(http, execution_id, key, **fields):
    response = await http.post(
        f"/v1/executions/{execution_id}/finish", headers=bearer(key), json=fields
    )
    assert response.status_code == 200, response.text
    return execution_from_json(response.json())


def without_times(calls):
    return [dataclasses.replace(c, started_at=0.0, finished_at=0.0) for c in calls]


def assert_same_trees(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        else:
            assert x == y, field.name


# --- one conversation, in process and over HTTP --------------------------------------------


async def in_process(proxy, x, turns=3, max_tokens=MAX_TOKENS):
    """Harness contexts: a retried turn, tool turns, a sub-agent, a final summary call."""
    proxy.dispatch(x)
    n = 0

    async def call(agent, role, context, suffix=(tok.ASSISTANT,)):
        nonlocal n
        prompt = np.asarray([*context, *suffix])
        sampling = harness_sampling(x, n, max_tokens)
        completion = await proxy.generate(x, agent, role, prompt, sampling)
        n += 1
        return completion.output_ids.tolist()

    context = tok.start_context(MAIN_SYSTEM, SPEC)
    await call("main", "main", context)  # malformed: asked again from the same context
    for turn in range(turns):
        out = await call("main", "main", context)
        context = [*context, tok.ASSISTANT, *out] + ([] if out[-1:] == [tok.EOT] else [tok.EOT])
        if turn == 0:
            sub = await call("sub-1", "sub_agent", tok.start_context(SUB_SYSTEM, "check a.txt"))
            context += tok.observation(f"subtask result: {tok.decode(sub)}")
        else:
            context += tok.observation(f"ok {turn}")
    await call("main", "main_summary", context, (tok.SUMMARIZE, tok.ASSISTANT))
    return proxy.finish(x)


async def over_http(url, x, turns=3, stream=False, max_tokens=MAX_TOKENS):
    """The same conversation from a harness that speaks the OpenAI API (text only: it
    sends back the assistant text it received, never token ids)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        key = await start(http, x, task_id="t", group_id="g")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        n = 0

        async def chat(messages, agent="main", role="main", streamed=False):
            nonlocal n
            kwargs = dict(
                model="gyrejax",
                messages=messages,
                temperature=1.0,
                max_tokens=max_tokens,
                seed=seed_of(x, n),
                extra_headers={"X-Gyrejax-Agent": agent, "X-Gyrejax-Role": role},
            )
            n += 1
            if streamed:
                chunks = [
                    c async for c in await client.chat.completions.create(stream=True, **kwargs)
                ]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None
            answer = await client.chat.completions.create(
                extra_body={"return_token_ids": True}, **kwargs
            )
            return answer.choices[0].message.content, answer.choices[0].model_extra

        messages = list(OPENING)
        await chat(messages)
        for turn in range(turns):
            text, extra = await chat(messages, streamed=stream and turn == 1)
            messages.append({"role": "assistant", "content": text})
            if turn == 0:
                sub = [
                    {"role": "system", "content": SUB_SYSTEM},
                    {"role": "user", "content": "check a.txt"},
                ]
                result, _ = await chat(sub, agent="sub-1", role="sub_agent")
                messages.append({"role": "tool", "content": f"subtask result: {result}"})
            else:
                messages.append({"role": "tool", "content": f"ok {turn}"})
            if extra is not None:
                context = extra["prompt_token_ids"][:-1]  # before the generation prompt
        # The last main prompt, from the server's `return_token_ids`, is the context of a
        # summary call: a raw completion (<summarize> is not a chat message).
        context = [*context, tok.ASSISTANT, *extra["token_ids"]]
        context += [] if context[-1] == tok.EOT else [tok.EOT]
        context += tok.observation(f"ok {turns - 1}")
        summary = await client.completions.create(
            model="gyrejax",
            prompt=[*context, tok.SUMMARIZE, tok.ASSISTANT],
            temperature=1.0,
            max_tokens=max_tokens,
            seed=seed_of(x, n),
            logprobs=1,
            extra_body={"stop_token_ids": [tok.EOT]},
            extra_headers={"X-Gyrejax-Role": "main_summary"},
        )
        await client.close()
        assert len(summary.choices[0].logprobs.token_logprobs) == summary.usage.completion_tokens
        return await finish(http, x, key, status="finished", reward=0.5)


def scripted_answers(x):
    return {
        (x, "main"): ["oops", "write a.txt\nhello", "ls", "done"],
        (x, "sub"): ["done ok"],
        (x, "summary"): ["wrote a.txt"],
    }


def test_openai_client_records_what_the_in_process_harness_records(tmp_path):
    async def reference():
        return await in_process(Proxy([scripted(scripted_answers("x"))]), "x")

    async def served():
        store = ExecutionStore(tmp_path / "executions")
        async with serving(scripted(scripted_answers("x")), store=store) as (url, _, _):
            execution = await over_http(url, "x", stream=True)
        return execution, store.get("x")

    expected = asyncio.run(reference())
    execution, stored = asyncio.run(served())
    assert (execution.status, execution.reward, execution.task_id) == ("finished", 0.5, "t")
    assert stored == execution  # persisted on finish
    assert [c.role for c in expected].count("main_summary") == 1
    assert without_times(execution.calls) == without_times(expected)
    assert_same_trees(build_tree(list(execution.calls)), build_tree(expected))


CONFIG = ModelConfig(
    vocab_size=tok.VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_real_jax_engine_answers_round_trip_exactly():
    """A random byte model writes invalid UTF-8 and special tokens; the harness sends
    back the lossy text, and the server still splices in the exact tokens."""
    model = init_model(CONFIG, seed=3)

    def engine():
        return JaxEngine("jax", model, max_slots=2, max_seq_len=256, decode_steps=4)

    async def reference():
        proxy = Proxy([engine()])
        try:
            return await in_process(proxy, "x", turns=2, max_tokens=24)
        finally:
            await proxy.engines()[0].shutdown()

    async def served():
        async with serving(engine()) as (url, _, _):
            return await over_http(url, "x", turns=2, max_tokens=24)

    expected = asyncio.run(reference())
    execution = asyncio.run(served())
    lossy = [c for c in expected if tok.encode(tok.decode(c.output_ids)) != c.output_ids.tolist()]
    assert lossy, "the random model should write something text cannot carry"
    assert without_times(execution.calls) == without_times(expected)
    assert_same_trees(build_tree(list(execution.calls)), build_tree(expected))


# --- tool calls re-serialised by the harness ----------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
# As the policy wrote it: odd spacing, key order, and an invalid UTF-8 byte in the text.
RAW_CALL = (
    'thinking \xff<tool_call>{"arguments": {"path": "a.txt",   "content": "hi"}, '
    '"name": "write"}</tool_call>'
)


def raw_answer():
    data = RAW_CALL.encode("latin-1")  # \xff is the single byte 0xff
    return [tok.BYTE_OFFSET + b for b in data] + [tok.EOT]


@pytest.mark.parametrize("rewrite", ["same_ids", "new_ids", "edited"])
def test_reserialised_tool_calls_map_back_to_the_generated_tokens(rewrite):
    answers = {("x", "main"): [raw_answer(), "done", "done"]}

    async def body():
        async with serving(scripted(answers)) as (_, _, http):
            key = await start(http, "x")
            headers = bearer(key)
            first = await http.post(
                "/v1/chat/completions",
                headers=headers,
                json={"messages": OPENING, "tools": TOOLS, "max_tokens": 200},
            )
            message = first.json()["choices"][0]["message"]
            assert first.json()["choices"][0]["finish_reason"] == "tool_calls"
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "write"
            assert json.loads(call["function"]["arguments"]) == {"path": "a.txt", "content": "hi"}
            # The harness re-serialises the arguments and may renumber or edit the turn.
            arguments = json.dumps(
                json.loads(call["function"]["arguments"]), indent=2, sort_keys=True
            )
            sent = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"] if rewrite == "same_ids" else "call_renumbered",
                        "type": "function",
                        "function": {"name": "write", "arguments": arguments},
                    }
                ],
            }
            if rewrite == "edited":
                sent["content"] = "I will write the file."
            else:
                sent["content"] = message["content"]  # "thinking \ufffd": lossy text
            history = [
                *OPENING,
                sent,
                {"role": "tool", "tool_call_id": call["id"], "content": "wrote a.txt"},
            ]
            second = await http.post(
                "/v1/chat/completions",
                headers=headers,
                json={"messages": history, "tools": TOOLS, "max_tokens": 200},
            )
            assert second.status_code == 200, second.text
            return await finish(http, "x", key)

    execution = asyncio.run(body())
    first, second = execution.calls
    spliced = np.concatenate([first.prompt_ids, first.output_ids])
    tree = build_tree(list(execution.calls))
    forks = [n for n in range(1, tree.num_nodes) if len(tree.children[n]) > 1]
    if rewrite == "edited":  # the harness changed the turn: its text is what the policy saw
        assert second.prompt_ids[: len(spliced)].tolist() != spliced.tolist()
        assert forks
    else:
        assert second.prompt_ids[: len(spliced)].tolist() == spliced.tolist()
        assert not forks and int(tree.trainable.sum()) == first.length - len(first.prompt_ids) + (
            second.length - len(second.prompt_ids)
        )


# --- concurrency and lifecycle ------------------------------------------------------------


def test_concurrent_executions_stay_separate_and_finish_cancels_in_flight():
    answers = {(x, "main"): [f"answer {x} {i}" for i in range(4)] for x in ("a", "b", "c")}

    async def conversation(http, x):
        key = await start(http, x)
        messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": x}]
        for _ in range(3):
            r = await http.post(
                "/v1/chat/completions",
                json={"messages": messages},
                headers={**bearer(key), "X-Gyrejax-Execution": x},  # the optional cross-check
            )
            assert r.status_code == 200, r.text
            messages += [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "tool", "content": "ok"},
            ]
        return await finish(http, x, key)

    async def body():
        async with serving(scripted(answers, delay_s=0.05)) as (_, proxy, http):
            executions = await asyncio.gather(*(conversation(http, x) for x in ("a", "b")))
            # Finishing while a call is in flight cancels it; the call is still recorded.
            # (Its answer would come in an hour: only the cancel can end it.)
            proxy.engines()[0].delay_s = 3600
            key = await start(http, "c")
            hanging = asyncio.create_task(
                http.post(
                    "/v1/chat/completions",
                    headers=bearer(key),
                    json={"messages": OPENING},
                )
            )
            while not proxy.counters().in_flight["scripted"]:
                await asyncio.sleep(0.005)
            cancelled = await finish(http, "c", key, status="timed_out")
            late = await hanging
            after = await http.post(
                "/v1/chat/completions",
                headers=bearer(key),
                json={"messages": OPENING},
            )
            return executions, cancelled, late, after, proxy.counters()

    executions, cancelled, late, after, counters = asyncio.run(body())
    for x, execution in zip("ab", executions, strict=True):
        assert [c.call_id for c in execution.calls] == [0, 1, 2]
        for i, call in enumerate(execution.calls):
            assert call.execution_id == x
            assert tok.decode(call.output_ids) == f"answer {x} {i}"
            assert f"<user>{x}<eot>" in tok.render(call.prompt_ids)
    (call,) = cancelled.calls
    assert cancelled.status == "timed_out" and call.finish_reason == "cancelled"
    assert late.json()["choices"][0]["finish_reason"] == "cancelled"
    assert after.status_code == 401  # a finished execution's key is void
    assert (counters.dispatched, counters.finished) == (3, 3)


def test_a_request_whose_body_arrives_after_finish_is_refused_not_served():
    # The audit: authenticated on its headers before finish, its body sent after; it was
    # served, and its call orphaned in the proxy (never in any record).
    async def body():
        async with serving(scripted({("d", "main"): ["late"]})) as (_, proxy, http):
            key = await start(http, "d")
            sent_headers, go = asyncio.Event(), asyncio.Event()

            async def slow_body():
                yield b'{"messages": '
                sent_headers.set()
                await go.wait()
                yield json.dumps(OPENING).encode() + b"}"

            request = asyncio.create_task(
                http.post("/v1/chat/completions", headers=bearer(key), content=slow_body())
            )
            await sent_headers.wait()
            await asyncio.sleep(0.2)  # the server has the headers: authenticated
            finished = await finish(http, "d", key)
            go.set()
            late = await request
            return finished, late, proxy.counters()

    finished, late, counters = asyncio.run(body())
    assert late.status_code == 401 and "finished (or is finishing) while this" in late.text
    assert finished.calls == () and counters.in_flight["scripted"] == 0


def test_a_full_disk_loses_no_finished_execution(small_filesystem):
    # The audit: finish answered 500 without storing the record, and its retry got 401
    # (the key already void). Now: 507 with the record, the key still valid, and the
    # same finish retried stores it once the disk has room.
    root, fill, free = small_filesystem
    store = ExecutionStore(root / "store")

    async def body():
        answers = {("e", "main"): ["wrote it"]}
        async with serving(scripted(answers), store=store) as (_, _, http):
            key = await start(http, "e")
            r = await http.post(
                "/v1/chat/completions", headers=bearer(key), json={"messages": OPENING}
            )
            assert r.status_code == 200, r.text
            fill()
            full = await http.post("/v1/executions/e/finish", headers=bearer(key), json={})
            refused = await http.post(
                "/v1/chat/completions", headers=bearer(key), json={"messages": OPENING}
            )
            free()
            stored = await finish(http, "e", key, status="timed_out")  # a retry: the first record
            again = await http.post("/v1/executions/e/finish", headers=bearer(key), json={})
            return full, refused, stored, again

    full, refused, stored, again = asyncio.run(body())
    assert full.status_code == 507 and "could not be stored" in full.text
    assert "No space left on device" in full.json()["error"]["message"]
    kept = execution_from_json(full.json()["execution"])
    assert refused.status_code == 401  # no model calls once finishing
    assert without_times(stored.calls) == without_times(kept.calls) and len(kept.calls) == 1
    assert stored.status == "finished"  # the record as first made
    assert store.get("e") == stored and again.status_code == 401  # stored: key void now


def test_a_prompt_past_the_token_limit_is_refused_and_a_huge_body_is_never_read():
    # The audit: two 60 MiB prompts took 2.26 GB and blocked /health for 5 s. The body
    # limit now follows from max_prompt_tokens, and a prompt past it is a 400.
    async def body():
        answers = {("p", "main"): ["ok"]}
        async with serving(scripted(answers), max_prompt_tokens=64) as (_, proxy, http):
            key = await start(http, "p")
            ids = await http.post(
                "/v1/completions", headers=bearer(key),
                json={"model": "m", "prompt": list(range(1, 66)), "max_tokens": 2},
            )  # fmt: skip
            chat = await http.post(
                "/v1/chat/completions", headers=bearer(key),
                json={"messages": [{"role": "user", "content": "x" * 200}]},
            )  # fmt: skip
            huge = await http.post(
                "/v1/completions", headers=bearer(key),
                content=b'{"prompt": "' + b"x" * prompt_body_bytes(64) + b'"}',
            )  # fmt: skip
            fits = await http.post(
                "/v1/completions", headers=bearer(key),
                json={"model": "m", "prompt": list(range(1, 65)), "max_tokens": 2},
            )  # fmt: skip
            return ids, chat, huge, fits, len(proxy.calls("p"))

    ids, chat, huge, fits, recorded = asyncio.run(body())
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    assert "the prompt is 65 tokens; this server takes at most 64" in ids.text
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert huge.status_code == 413  # refused by its Content-Length, before reading it
    assert fits.status_code == 200 and recorded == 1  # only the call that fits


# --- keys, and stored records never replaced -------------------------------------------------


def test_a_stored_execution_is_never_replaced_through_the_door(tmp_path):
    """The audit's loss: starting a stored id again and finishing it replaced a record of 1
    call with reward 1.0 by one of 0 calls with reward 0.0. A stored id is now a 409 at
    start, and a record stored by another writer while an execution runs is kept: finish
    answers 409 with its own record, which is stored nowhere."""
    answers = {("x", "main"): ["first"], ("y", "main"): ["mine"]}

    async def body():
        store = ExecutionStore(tmp_path / "executions")
        async with serving(scripted(answers), store=store) as (_, _, http):
            key = await start(http, "x")
            call = await http.post(CHAT, headers=bearer(key), json={"messages": OPENING})
            assert call.status_code == 200, call.text
            await finish(http, "x", key, reward=1.0)
            again = await http.post("/v1/executions", headers=ADMIN, json={"execution_id": "x"})
            key = await start(http, "y")
            await http.post(CHAT, headers=bearer(key), json={"messages": OPENING})
            other = Execution("y", task_id="other", group_id="g", calls=[], reward=0.25)
            store.put(other)  # another writer, while y runs
            late = await http.post(
                "/v1/executions/y/finish", headers=bearer(key), json={"reward": 1.0}
            )
            return again, late, store.get("x"), store.get("y")

    again, late, x, y = asyncio.run(body())
    assert again.status_code == 409, again.text
    assert again.json()["error"]["param"] == "execution_id"
    assert "already stored" in again.json()["error"]["message"]
    assert (len(x.calls), x.reward) == (1, 1.0)  # untouched
    assert late.status_code == 409 and "NOT stored" in late.json()["error"]["message"]
    returned = execution_from_json(late.json()["execution"])  # the client still has it
    assert (len(returned.calls), returned.reward) == (1, 1.0)
    assert (y.task_id, y.reward, len(y.calls)) == ("other", 0.25, 0)  # the other writer's


def test_executions_need_the_admin_key_and_then_each_its_own_key():
    answers = {(x, "main"): ["a", "b"] for x in ("p", "q", "r")}

    async def body():
        async with serving(scripted(answers), max_open_executions=2) as (url, _, http):
            creating = {
                "no key": await http.post("/v1/executions", json={"execution_id": "p"}),
                "wrong key": await http.post(
                    "/v1/executions", headers=bearer("not-the-admin-key-0123"), json={}
                ),
            }
            key_p, key_q = await start(http, "p"), await start(http, "q")
            creating["an execution's key"] = await http.post(
                "/v1/executions", headers=bearer(key_p), json={}
            )
            creating["past the bound"] = await http.post(
                "/v1/executions", headers=ADMIN, json={"execution_id": "r"}
            )
            chat = {"messages": OPENING}
            refused = {
                "call, the id as key": await http.post(CHAT, headers=bearer("p"), json=chat),
                "call, the admin key": await http.post(CHAT, headers=ADMIN, json=chat),
                "status, no key": await http.get("/v1/executions/p"),
                "status, q's key": await http.get("/v1/executions/p", headers=bearer(key_q)),
                "finish, q's key": await http.post(
                    "/v1/executions/p/finish", headers=bearer(key_q), json={"reward": 1.0}
                ),
                "finish, admin key": await http.post(
                    "/v1/executions/p/finish", headers=ADMIN, json={"reward": 1.0}
                ),
            }
            # The OpenAI client sends the execution key as its api_key.
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key_p, max_retries=0)
            answer = await client.chat.completions.create(model="gyrejax", messages=OPENING)
            models = await client.models.list()
            impostor = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="p", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await impostor.chat.completions.create(model="gyrejax", messages=OPENING)
            status = await http.get("/v1/executions/p", headers=bearer(key_p))
            p = await finish(http, "p", key_p, reward=1.0)
            void = await http.get("/v1/executions/p", headers=bearer(key_p))
            key_r = await start(http, "r")  # p's slot is free again
            q = await finish(http, "q", key_q)
            await finish(http, "r", key_r)
            await client.close()
            await impostor.close()
            return creating, refused, answer, models, status, p, void, q, (key_p, key_q, key_r)

    creating, refused, answer, models, status, p, void, q, keys = asyncio.run(body())
    assert {k: a.status_code for k, a in creating.items()} == {
        "no key": 401,
        "wrong key": 401,
        "an execution's key": 401,
        "past the bound": 429,
    }
    for what, answer_ in refused.items():
        assert answer_.status_code == 401, (what, answer_.text)
        assert answer_.json()["error"]["param"] == "Authorization", what
        assert answer_.headers["WWW-Authenticate"] == "Bearer", what
    assert answer.choices[0].message.content == "a"
    assert [m.id for m in models.data] == ["gyrejax"]
    assert status.json() == {"execution_id": "p", "calls": 1, "in_flight": 0}
    assert (len(p.calls), p.reward) == (1, 1.0) and len(q.calls) == 0
    assert void.status_code == 401  # a finished execution's key opens nothing
    assert len(set(keys)) == 3 and all(len(k) >= 40 and k not in "pqr" for k in keys)


def test_the_door_needs_an_admin_key_unless_open_on_loopback():
    proxy = Proxy([scripted({("x-open", "main"): ["hi"]})])
    with pytest.raises(ValueError, match="no admin key"):
        OpenAIServer(proxy, api_key=None)
    with pytest.raises(ValueError, match="at least 16"):
        OpenAIServer(proxy, api_key="short")

    async def open_door():
        server = OpenAIServer(proxy, api_key=None, insecure_no_auth=True)
        with pytest.raises(ValueError, match="loopback"):
            await server.start("0.0.0.0")
        url = await server.start("127.0.0.1")
        try:
            async with httpx.AsyncClient(base_url=url) as http:
                created = await http.post("/v1/executions", json={"execution_id": "x-open"})
                keyless = await http.post(CHAT, json={"messages": OPENING})
                key = created.json()["api_key"]
                keyed = await http.post(CHAT, headers=bearer(key), json={"messages": OPENING})
                await finish(http, "x-open", key)
            return created, keyless, keyed
        finally:
            await server.stop()

    created, keyless, keyed = asyncio.run(open_door())
    assert created.status_code == 200
    assert keyless.status_code == 401 and keyed.status_code == 200  # execution keys still

    # The command line: one clear line, before any engine is contacted.
    env = {k: v for k, v in os.environ.items() if k != "GYREJAX_API_KEY"}
    command = [sys.executable, "-m", "gyrejax.serve.openai_server", "--engine_url=http://h:1"]
    cases = {
        "no key": ([], "no admin key: give --api_key or set GYREJAX_API_KEY"),
        "open, not loopback": (["--insecure_no_auth", "--host=0.0.0.0"], "is not loopback"),
    }
    for what, (flags, message) in cases.items():
        run = subprocess.run(command + flags, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and message in run.stderr, (what, run.stderr[-2000:])


# --- malformed requests ---------------------------------------------------------------------

X_KEY = "<execution x's key>"  # replaced by the key the server returns
AUTH = {"Authorization": f"Bearer {X_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def nested(depth):
    return {"a": nested(depth - 1)} if depth else {}


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_TOOL = [{"type": "function", "function": {"name": "f", "parameters": nested(70)}}]
MALFORMED = [
    # (path, headers, body (bytes = raw), status, field named)
    (CHAT, AUTH, b"{not json", 400, "body"),
    (CHAT, AUTH, b"[1, 2]", 400, "body"),
    (CHAT, AUTH, b"\xff\xfe{", 400, "body"),
    (CHAT, AUTH, DEEP, 400, "body"),  # past the parser's recursion limit
    (CHAT, AUTH, {"messages": OPENING, "tools": DEEP_TOOL}, 400, "body"),  # past MAX_JSON_DEPTH
    (CHAT, AUTH, b'{"messages": [], "seed": ' + b"7" * 5000 + b"}", 400, "body"),
    (CHAT, AUTH, b'{"messages": [], "temperature": NaN}', 400, "body"),
    (CHAT, AUTH, {"messages": OPENING, "temperature": 10**400}, 400, "temperature"),
    (CHAT, AUTH, {"messages": OPENING, "max_tokens": 10**30}, 400, "max_tokens"),
    (CHAT, AUTH, {}, 400, "messages"),
    (CHAT, AUTH, {"messages": []}, 400, "messages"),
    (CHAT, AUTH, {"messages": "hi"}, 400, "messages"),
    (CHAT, AUTH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, AUTH, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, AUTH, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        CHAT,
        AUTH,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CHAT, AUTH, {"messages": OPENING, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    (CHAT, AUTH, {"messages": OPENING, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {}, {"messages": OPENING}, 401, "Authorization"),
    (CHAT, {"Authorization": "Bearer nobody"}, {"messages": OPENING}, 401, "Authorization"),
    (CHAT, {"Authorization": "Bearer x"}, {"messages": OPENING}, 401, "Authorization"),  # the id
    (CHAT, ADMIN, {"messages": OPENING}, 401, "Authorization"),  # the admin key is no execution's
    (CHAT, {"X-Gyrejax-Execution": "x"}, {"messages": OPENING}, 401, "Authorization"),
    (
        CHAT,
        {**AUTH, "X-Gyrejax-Execution": "nobody"},
        {"messages": OPENING},
        400,
        "X-Gyrejax-Execution",
    ),
    (CHAT, {**AUTH, "X-Gyrejax-Role": "critic"}, {"messages": OPENING}, 400, "X-Gyrejax-Role"),
    (CHAT, AUTH, {"messages": OPENING, "temperature": -1}, 400, "temperature"),
    (CHAT, AUTH, {"messages": OPENING, "temperature": "hot"}, 400, "temperature"),
    (CHAT, AUTH, {"messages": OPENING, "top_p": 0}, 400, "top_p"),
    (CHAT, AUTH, {"messages": OPENING, "top_p": 1.5}, 400, "top_p"),
    (CHAT, AUTH, {"messages": OPENING, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, AUTH, {"messages": OPENING, "max_completion_tokens": 2.5}, 400, "max_completion_tokens"),
    (CHAT, AUTH, {"messages": OPENING, "seed": -1}, 400, "seed"),
    (CHAT, AUTH, {"messages": OPENING, "n": 2}, 400, "n"),
    (CHAT, AUTH, {"messages": OPENING, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (CHAT, AUTH, {"messages": OPENING, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, AUTH, {"messages": OPENING, "stop": ["ab"]}, 400, "stop[0]"),
    (CHAT, AUTH, {"messages": OPENING, "stop_token_ids": [9999]}, 400, "stop_token_ids[0]"),
    (COMPLETIONS, AUTH, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, AUTH, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, AUTH, {"prompt": [5, -3]}, 400, "prompt[1]"),
    (COMPLETIONS, AUTH, {"prompt": [5, tok.VOCAB_SIZE]}, 400, "prompt[1]"),
    (COMPLETIONS, AUTH, {"prompt": [5, 2.5]}, 400, "prompt[1]"),
    (COMPLETIONS, AUTH, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, AUTH, {"prompt": "hi", "logprobs": 5}, 400, "logprobs"),
    ("/v1/executions", {}, {"execution_id": "y"}, 401, "Authorization"),
    ("/v1/executions", AUTH, {"execution_id": "y"}, 401, "Authorization"),
    ("/v1/executions", ADMIN, {"execution_id": "x"}, 409, "execution_id"),
    ("/v1/executions", ADMIN, {"execution_id": 7}, 400, "execution_id"),
    ("/v1/executions/x/finish", AUTH, {"status": "great"}, 400, "status"),
    ("/v1/executions/x/finish", AUTH, {"reward": "high"}, 400, "reward"),
    ("/v1/executions/x/finish", AUTH, {"reward": 10**400}, 400, "reward"),
    ("/v1/executions/x/finish", {}, {}, 401, "Authorization"),
    ("/v1/executions/x/finish", ADMIN, {}, 401, "Authorization"),
    ("/v1/executions/nobody/finish", AUTH, {}, 401, "Authorization"),
]


def test_malformed_requests_get_4xx_naming_the_field_and_the_server_keeps_serving():
    async def body():
        engine = scripted({("x", "main"): ["fine"]})
        async with serving(engine) as (_, _, http):
            key = await start(http, "x")
            answers = []
            for path, headers, payload, _, _ in MALFORMED:
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                headers = {k: v.replace(X_KEY, key) for k, v in headers.items()}
                answers.append(
                    await http.post(
                        path, headers={**headers, "Content-Type": "application/json"}, content=raw
                    )
                )
            ok = await http.post(CHAT, headers=bearer(key), json={"messages": OPENING})
            return answers, ok, await finish(http, "x", key)

    answers, ok, execution = asyncio.run(body())
    for (path, _, payload, status, field), answer in zip(MALFORMED, answers, strict=True):
        error = answer.json()["error"]
        where = f"{path} {payload!r}: {answer.text}"
        assert answer.status_code == status, where
        assert error["param"] == field or error["message"].startswith(field), where
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    assert len(execution.calls) == 1  # nothing malformed reached the proxy


# --- an HF tokenizer's own chat template ------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer():
    """A byte-level BPE tokenizer (no merges) with ChatML specials, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"],
    )
    hf.chat_template = CHATML
    return hf


def test_hf_chat_template_splices_the_generated_ids_into_its_own_layout():
    from gyrejax.serve.chat import HfChatTemplate

    hf = chatml_tokenizer()
    template = HfChatTemplate(hf)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    # The policy spelled <tool_call> out byte by byte (not the special token) and
    # formatted the JSON its own way: no text rendering reproduces these ids.
    generated = template.encode('<tool_call>{"name":"ls" , "arguments":{}}</tool_call>')
    generated = [*generated, im_end]
    answers = {("x", "main"): [generated, [*template.encode("done"), im_end]]}

    async def body():
        proxy = Proxy([scripted(answers)])
        server = OpenAIServer(proxy, template, api_key=ADMIN_KEY, default_max_tokens=MAX_TOKENS)
        url = await server.start()
        try:
            async with httpx.AsyncClient(base_url=url) as http:
                key = await start(http, "x")
                headers = bearer(key)
                tools = [{"type": "function", "function": {"name": "ls"}}]
                first = await http.post(
                    CHAT, headers=headers, json={"messages": OPENING, "tools": tools}
                )
                (call,) = first.json()["choices"][0]["message"]["tool_calls"]
                history = [
                    *OPENING,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"},
                ]
                second = await http.post(
                    CHAT, headers=headers, json={"messages": history, "tools": tools}
                )
                assert second.status_code == 200, second.text
                return await finish(http, "x", key)
        finally:
            await server.stop()

    first, second = asyncio.run(body()).calls
    text = hf.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in OPENING],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert first.prompt_ids.tolist() == template.encode(text)  # the template's own layout
    assert first.output_ids.tolist() == generated
    spliced = [*first.prompt_ids.tolist(), *generated]
    assert second.prompt_ids[: len(spliced)].tolist() == spliced
    rest = hf.decode(second.prompt_ids[len(spliced) :].tolist(), skip_special_tokens=False)
    assert rest == "\n<|im_start|>tool\na.txt<|im_end|>\n<|im_start|>assistant\n"
