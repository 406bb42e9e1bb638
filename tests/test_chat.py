"""The harness's HF chat format (gyrejax/harness/chat.py): the built-in harness speaks a
Qwen3-style chat template (the project's own BPE tokenizer, loaded like a real one)
with tool calls, through the real proxy and a scripted policy."""

import asyncio
import dataclasses
import itertools
import json
import re

import numpy as np
import pytest

from gyrejax.config import HarnessConfig
from gyrejax.harness.actions import parse_action
from gyrejax.harness.agent import MAIN_SYSTEM, SUB_SYSTEM, Harness
from gyrejax.harness.chat import (
    SUMMARY_REQUEST,
    TOOLS,
    ByteChat,
    action_tool_call,
    load_chat,
    tool_call_text,
)
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.trajectory import build_tree, process

CONFIG = HarnessConfig(
    max_turns=12,
    sub_agent_max_turns=4,
    timeout_s=30.0,
    context_budget_tokens=100_000,
    max_new_tokens=512,
    max_retries=2,
)


@pytest.fixture(scope="module")
def chat(bpe_tokenizer):
    return load_chat(str(bpe_tokenizer))


def two_file_task():
    env = MiniRepoEnv()
    task = next(t for t in env.sample_tasks(50, seed=0, difficulty=2) if len(t.goals) >= 2)
    good = env.demonstration(task, rng=np.random.default_rng(0), quality=1.0)
    return task, [a for a in good if a.startswith("write")]


def turn(chat, action_text: str, thinking: str = "") -> tuple[list[int], dict]:
    """A canonical answer taking `action_text` as a tool call (after optional thinking),
    and the assistant message the chat template renders to exactly its text."""
    name, arguments = action_tool_call(parse_action(action_text))
    content = f"<think>\n{thinking}\n</think>" if thinking else ""
    text = (content + "\n" if content else "") + tool_call_text(name, arguments)
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return answer(chat, text), {"role": "assistant", "content": content, "tool_calls": [call]}


def answer(chat, text: str) -> list[int]:
    return [*chat.template.encode(text), chat.stop_ids[0]]


def run(tmp_path, chat, task, scripts, config=CONFIG, size=1):
    """Runs `size` executions of `task` ("g/<i>"); `scripts[id][kind]` are answers' ids,
    kind "main", "sub" or "summary"."""

    def respond(prompt, request):
        execution_id = request.request_id.rsplit("/", 1)[0]
        return scripts[execution_id][chat.prompt_kind(prompt, SUB_SYSTEM)].pop(0)

    async def body():
        proxy = Proxy([ScriptedEngine("scripted", respond)])
        harness = Harness(proxy, config, tmp_path, environment=MiniRepoEnv(), chat=chat)
        return await harness.run_group(task, "g", size=size, seed=0)

    return asyncio.run(body())


def template_ids(chat, messages) -> list[int]:
    ids = chat.tokenizer.apply_chat_template(
        messages, tools=list(TOOLS), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def test_harness_prompts_equal_the_chat_template_token_for_token(tmp_path, chat):
    task, writes = two_file_task()
    answers = [turn(chat, writes[0], thinking="the spec names two files; the first:")]
    answers += [turn(chat, "ls"), *(turn(chat, w) for w in writes[1:]), turn(chat, "done")]
    malformed = answer(chat, "I will write the files now.")  # no tool call: asked again
    main = [answers[0][0], malformed, *(ids for ids, _ in answers[1:])]
    (execution,) = run(tmp_path, chat, task, {"g/0": {"main": main}})
    assert execution.status == "finished" and execution.reward == 1.0
    message_of = {tuple(ids): message for ids, message in answers}

    messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task.spec}]
    calls = list(execution.calls)
    assert calls[2].prompt_ids.tolist() == calls[1].prompt_ids.tolist()  # the retry
    del calls[1]
    for call, after in zip(calls, [*calls[1:], None], strict=True):
        prompt, output = call.prompt_ids.tolist(), call.output_ids.tolist()
        assert prompt == template_ids(chat, messages)
        messages.append(message_of[tuple(output)])
        if after is None:
            break
        # Each prompt extends the last prompt + output: the answer spliced as generated.
        spliced = prompt + output
        assert after.prompt_ids[: len(spliced)].tolist() == spliced
        rest = chat.tokenizer.decode(after.prompt_ids[len(spliced) :].tolist())
        (result,) = re.fullmatch(
            r"\n<\|im_start\|>user\n<tool_response>\n(.*)\n</tool_response><\|im_end\|>\n"
            r"<\|im_start\|>assistant\n",
            rest,
            re.DOTALL,
        ).groups()
        messages.append({"role": "tool", "content": result})
    assert messages[-1]["tool_calls"][0]["function"]["name"] == "done"
    listed = [m["content"] for m in messages if m["role"] == "tool"][1]
    assert listed == writes[0].split("\n")[0].removeprefix("write ")  # ls: the file so far
    # One tree whose only fork is the retry, at the end of the retried prompt.
    tree = build_tree(list(execution.calls))
    forks = [n for n in range(1, tree.num_nodes) if len(tree.children[n]) > 1]
    depths = [tree.node_depth[n] + tree.node_end[n] - tree.node_start[n] for n in forks]
    assert len(tree.children[0]) == 1 and depths == [len(execution.calls[1].prompt_ids)]


@pytest.mark.parametrize(
    "arguments",
    [
        {"path": "a.txt", "content": "line 1\nline 2\n"},
        {"path": "pkg/é 日本.py", "content": 'print("}</tool_call>")\t\\n {"name": 1}'},
        {"path": "x", "content": ""},
    ],
)
def test_tool_calls_parse_back_to_the_same_json(chat, arguments):
    text = tool_call_text("write_file", arguments)
    assert json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "write_file",
        "arguments": arguments,
    }
    action = chat.parse(answer(chat, f"<think>\nplan\n</think>\n{text}"))
    assert (action.kind, action.path, action.content) == ("write", *arguments.values())
    assert action_tool_call(action) == ("write_file", arguments)
    # What the harness keeps of the answer (its message) holds the same JSON.
    context = chat.start("s", "t")
    context.add_answer(answer(chat, text))
    (call,) = context.messages[-1].tool_calls
    assert (call.name, json.loads(call.arguments)) == ("write_file", arguments)


def test_every_action_is_a_tool_call_and_back(chat):
    for text in [
        "write a/b.txt\nhi\n",
        "read a/b.txt",
        "ls",
        "check",
        "delegate do x\nand y",
        "done",
        "done 42",
    ]:
        action = parse_action(text)
        assert chat.parse(chat.answer(text)) == action
        assert chat.text(chat.answer(text)) == tool_call_text(*action_tool_call(action))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("just text", "no tool call"),
        ("<think>\n" + tool_call_text("ls", {}) + "\n</think>", "no tool call"),  # only thought
        (tool_call_text("ls", {}) * 2, "2 tool calls"),
        ("<tool_call>\n{not json}\n</tool_call>", "no tool call"),
        (tool_call_text("rm", {}), "unknown tool 'rm'"),
        (tool_call_text("read_file", {}), "read_file: arguments missing path"),
        (tool_call_text("read_file", {"path": 1, "x": ""}), "unknown x; not text: path"),
        (tool_call_text("delegate", {"subtask": "  "}), "delegate: subtask is empty"),
        ('<tool_call>{"name": "list_files", "arguments": [1]}</tool_call>', "JSON object"),
    ],
)
def test_turns_the_harness_cannot_run_are_malformed_saying_why(chat, text, error):
    action = chat.parse(answer(chat, text))
    assert action.malformed and error in action.error and action.raw == text


def test_non_canonical_answers_are_spliced_as_generated(tmp_path, chat):
    """An answer the template would render otherwise (other JSON spacing and key order,
    extra blank lines, no final <|im_end|>) still goes back as its exact ids."""
    task, writes = two_file_task()
    path, content = writes[0].split("\n", 1)[0].split(" ", 1)[1], writes[0].split("\n", 1)[1]
    payload = json.dumps({"arguments": {"content": content, "path": path}, "name": "write_file"})
    odd = chat.template.encode(f"<think>\n\nhmm\n\n</think>\n\n<tool_call>{payload}</tool_call>")
    config = dataclasses.replace(CONFIG, max_new_tokens=len(odd))  # cut before <|im_end|>
    (execution,) = run(
        tmp_path, chat, task, {"g/0": {"main": [odd, turn(chat, "done")[0]]}}, config=config
    )
    first, second = execution.calls
    assert first.output_ids.tolist() == odd and first.finish_reason == "length"
    spliced = [*first.prompt_ids.tolist(), *odd]
    assert second.prompt_ids[: len(spliced)].tolist() == spliced
    im_end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert second.prompt_ids[len(spliced)] == im_end  # the harness closed the cut turn
    assert execution.reward > 0  # the file was written
    canonical = turn(chat, writes[0], thinking="\nhmm\n")[1]
    rendered = template_ids(
        chat,
        [
            {"role": "system", "content": MAIN_SYSTEM},
            {"role": "user", "content": task.spec},
            canonical,
        ],
    )
    assert rendered[: len(spliced)] != spliced  # re-rendering would have forked the tree


def test_compaction_delegation_and_retries_keep_one_tree_and_train(tmp_path, chat):
    task, writes = two_file_task()
    first_line = writes[1].splitlines()[0]
    opening = chat.start(MAIN_SYSTEM, task.spec).prompt()
    scripts = {
        f"g/{i}": {
            "main": [
                answer(chat, "oops"),
                turn(chat, writes[0])[0],
                turn(chat, f"delegate {first_line}: see spec")[0],
                *(turn(chat, w)[0] for w in writes[2:]),
                turn(chat, "ls")[0],
                turn(chat, "done")[0],
            ],
            "sub": [turn(chat, writes[1], thinking="mine")[0], turn(chat, "done wrote it")[0]],
            "summary": [answer(chat, "<think>\nshort\n</think>\nwrote a file")] * 12,
        }
        for i in range(2)
    }
    del scripts["g/1"]["main"][2]  # the second execution writes the second file itself
    scripts["g/1"]["main"][1:1] = [turn(chat, writes[1])[0]]
    config = dataclasses.replace(CONFIG, context_budget_tokens=len(opening) + 150)
    executions = run(tmp_path, chat, task, scripts, config=config, size=2)
    for execution in executions:
        assert execution.status == "finished" and execution.reward == 1.0
    calls = list(executions[0].calls)
    roles = [c.role for c in calls]
    assert roles[:2] == ["main", "main"] and "sub_agent" in roles and "main_summary" in roles
    np.testing.assert_array_equal(calls[0].prompt_ids, calls[1].prompt_ids)
    summary = calls[roles.index("main_summary")]
    request = chat.tokenizer.decode(summary.prompt_ids.tolist())
    assert request.endswith(f"{SUMMARY_REQUEST}<|im_end|>\n<|im_start|>assistant\n")
    after = calls[roles.index("main_summary") + 1]
    opening_ids = chat.tokenizer.apply_chat_template(
        [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task.spec}],
        tools=list(TOOLS),
        tokenize=True,
        return_dict=False,
    )
    assert after.prompt_ids[: len(opening_ids)].tolist() == list(opening_ids)
    assert "summary: wrote a file<|im_end|>" in chat.tokenizer.decode(after.prompt_ids.tolist())
    # Every call of an agent extends the previous prompt + output, unless it retries that
    # prompt or a compaction came between.
    for agent in ("main", "sub-1"):
        mine = [c for c in calls if c.agent_id == agent]
        acts = [i for i, c in enumerate(mine) if not c.role.endswith("summary")]
        for i, j in itertools.pairwise(acts):
            a, b = mine[i], mine[j]
            spliced = [*a.prompt_ids.tolist(), *a.output_ids.tolist()]
            retry = np.array_equal(a.prompt_ids, b.prompt_ids)
            assert retry or j > i + 1 or b.prompt_ids[: len(spliced)].tolist() == spliced
    tree = build_tree(calls)
    assert len(tree.children[0]) == 1  # one tree: every context opens with the system turn
    batch = process(executions, row_length=4096, vocab_size=chat.vocab_size)
    stats = batch.stats
    assert stats.executions_trained == 2 and stats.calls == sum(len(e.calls) for e in executions)
    # Every generated token is on its tree and trainable once per distinct path (calls
    # after two compactions to the same context can start their answers alike).
    paths = {
        (e.execution_id, *c.prompt_ids.tolist(), *c.output_ids[: k + 1].tolist())
        for e in executions
        for c in e.calls
        for k in range(len(c.output_ids))
    }
    assert stats.trainable_tokens == len(paths) <= stats.generated_tokens
    assert stats.unique_tokens < stats.naive_tokens / 2
    assert np.isclose(batch.loss_weight.sum(), 1.0)
    assert batch.tokens.max() < chat.vocab_size


def test_byte_chat_builds_the_byte_layout():
    from gyrejax.harness import tokenizer as tok

    chat = ByteChat()
    context = chat.start("sys", "task")
    assert context.prompt() == [*tok.start_context("sys", "task"), tok.ASSISTANT]
    context.add_answer(tok.encode("ls"))  # cut: the turn is closed
    context.add_observation("a.txt")
    assert context.summary_prompt()[-2:] == [tok.SUMMARIZE, tok.ASSISTANT]
    assert tok.render(context.prompt()).endswith(
        "<eot><assistant>ls<eot><tool>a.txt<eot><assistant>"
    )
    assert chat.prompt_kind(context.summary_prompt(), "x") == "summary"
    assert chat.prompt_kind(context.prompt(), "sys") == "sub"
