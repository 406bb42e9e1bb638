"""The harness's chat formats: an agent's context as prompt ids, a model turn as an action.

The agent loop (agent.py) keeps one context per agent and asks its format for:
`start(system, task)` -> a context; `context.prompt()` (the next call's prompt ids),
`context.summary_prompt()`, `context.add_answer(output_ids)`,
`context.add_observation(text)`, `context.restart(summary_text)`, `len(context)` (its
length in tokens, for the compaction budget); `parse(output_ids)` -> an `Action`;
`text(output_ids)` -> the answer's text (summaries). Two formats, chosen by
`model.tokenizer` (`load_chat`):

  * `ByteChat` (`bytes`): the byte tokenizer's layout (harness/tokenizer.py), actions
    in the plain-text syntax (`parse_action`); the ids are exactly those the harness
    built before formats existed.
  * `HfChat` (an HF tokenizer directory): the tokenizer's own chat template renders the
    conversation (system, task, turns, tool results) with `TOOLS` as function tools;
    the model acts with one tool call per turn in Qwen3's format,
    `<tool_call>\\n{"name": "write_file", "arguments": {...}}\\n</tool_call>`, and may
    think first (`<think>...</think>`, ignored when parsing). Tool results go back as
    `tool` messages, other observations (a malformed turn's error, a summary) as `user`
    messages.

Splice: every answer goes back into its context as the exact ids the policy generated,
never re-encoded from its text (the OpenAI door's `serve.chat.HfChatTemplate`, shared
here): a BPE model's output need not be the canonical encoding of its text, and an
earlier turn's thinking may be rendered differently by a template. So each call's
prompt extends the previous call's prompt + output token for token, and the calls of
one agent share their prefix in the trajectory tree. When the answer is canonical (as
a template would render its content and tool calls), the prompt equals
`tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from gyrejax.config import BYTE_TOKENIZER
from gyrejax.harness import tokenizer as tok
from gyrejax.harness.actions import Action, parse_action
from gyrejax.serve.chat import HfChatTemplate, Message, ToolCall, split_tool_calls

# The agent's tools in the HF format (OpenAI function specs, passed to the template).
TOOLS = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params},
                "required": list(required),
            },
        },
    }
    for name, description, params, required in (
        (
            "write_file",
            "Write a file in the workspace (replacing it).",
            (("path", "relative path"), ("content", "the whole file")),
            ("path", "content"),
        ),
        ("read_file", "Read a file of the workspace.", (("path", "relative path"),), ("path",)),
        ("list_files", "List the workspace's files.", (), ()),
        ("run_checks", "Run the task's visible checks on the workspace.", (), ()),
        (
            "delegate",
            "Hand a subtask to a sub-agent; its result comes back.",
            (("subtask", "what to do"),),
            ("subtask",),
        ),
        ("done", "Finish (a sub-agent may report a result).", (("result", "optional result"),), ()),
    )
)
# tool name -> the action it is, and which argument fills which Action field.
_TOOL_ACTIONS = {
    "write_file": ("write", {"path": "path", "content": "content"}),
    "read_file": ("read", {"path": "path"}),
    "list_files": ("ls", {}),
    "run_checks": ("check", {}),
    "delegate": ("delegate", {"subtask": "subtask"}),
    "done": ("done", {"result": "result"}),
}
_ACTION_TOOLS = {kind: (name, fields) for name, (kind, fields) in _TOOL_ACTIONS.items()}
_REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
_TOOL_NAMES = ", ".join(_TOOL_ACTIONS)
# What the harness asks when a context passes its budget (HF format; the byte format
# has its <summarize> token).
SUMMARY_REQUEST = "Summarize your progress on the task so far, briefly."
_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)


def load_chat(tokenizer: str) -> ByteChat | HfChat:
    """The format for `model.tokenizer`: `bytes`, or an HF tokenizer directory (loaded
    with `AutoTokenizer.from_pretrained`, as a Qwen checkpoint's would be)."""
    if tokenizer == BYTE_TOKENIZER:
        return ByteChat()
    from transformers import AutoTokenizer

    return HfChat(AutoTokenizer.from_pretrained(tokenizer))


def tokenizer_size(tokenizer: str) -> int:
    """How many token ids `model.tokenizer` can produce (a model's vocabulary must cover
    them); reads an HF directory's tokenizer without building a format."""
    if tokenizer == BYTE_TOKENIZER:
        return tok.VOCAB_SIZE
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer))


# --- bytes ------------------------------------------------------------------------------


class ByteContext:
    """A context in the byte layout (harness/tokenizer.py): a flat list of ids."""

    def __init__(self, system: str, task: str):
        self.opening = tok.start_context(system, task)
        self.ids = list(self.opening)

    def __len__(self) -> int:
        return len(self.ids)

    def prompt(self) -> list[int]:
        return [*self.ids, tok.ASSISTANT]

    def summary_prompt(self) -> list[int]:
        return [*self.ids, tok.SUMMARIZE, tok.ASSISTANT]

    def add_answer(self, output_ids: Sequence[int]) -> None:
        self.ids = [*self.ids, tok.ASSISTANT, *output_ids]
        if list(output_ids[-1:]) != [tok.EOT]:  # cut at max_new_tokens: close the turn
            self.ids.append(tok.EOT)

    def add_observation(self, text: str) -> None:
        self.ids = self.ids + tok.observation(text)

    def restart(self, summary_text: str) -> None:
        self.ids = self.opening + tok.observation(summary_text)


class ByteChat:
    """The byte tokenizer's format (see the module docstring)."""

    vocab_size = tok.VOCAB_SIZE
    stop_ids = (tok.EOT,)

    def start(self, system: str, task: str) -> ByteContext:
        return ByteContext(system, task)

    def parse(self, output_ids: Sequence[int]) -> Action:
        return parse_action(tok.decode(output_ids))

    def text(self, output_ids: Sequence[int]) -> str:
        return tok.decode(output_ids)

    def answer(self, action_text: str) -> list[int]:
        """The ids a policy emits to take `action_text` (scripted policies)."""
        return tok.answer(action_text)

    def prompt_kind(self, prompt_ids: Sequence[int], sub_system: str) -> str:
        """ "summary", "sub" (a context opened with `sub_system`) or "main"."""
        if len(prompt_ids) >= 2 and int(prompt_ids[-2]) == tok.SUMMARIZE:
            return "summary"
        return "sub" if tok.decode(prompt_ids).startswith(sub_system) else "main"


# --- HF tokenizers ----------------------------------------------------------------------


class HfContext:
    """A conversation rendered by an HF chat template, answers spliced in as their ids."""

    def __init__(self, chat: HfChat, system: str, task: str):
        self._chat = chat
        self._opening = [Message("system", system), Message("user", task)]
        self.messages = list(self._opening)
        self.generated: list[list[int] | None] = [None] * len(self.messages)
        self._prompt: list[int] | None = None  # cached until the conversation changes

    def __len__(self) -> int:
        return len(self.prompt())

    def prompt(self) -> list[int]:
        if self._prompt is None:
            self._prompt = self._chat.render(self.messages, self.generated)
        return list(self._prompt)

    def summary_prompt(self) -> list[int]:
        request = Message("user", SUMMARY_REQUEST)
        return self._chat.render([*self.messages, request], [*self.generated, None])

    def add_answer(self, output_ids: Sequence[int]) -> None:
        content, calls = split_tool_calls(self._chat.decode(output_ids))
        n = len(self.messages)
        tool_calls = tuple(ToolCall(f"call_{n}_{i}", *call) for i, call in enumerate(calls))
        self._append(Message("assistant", content, tool_calls), [int(t) for t in output_ids])

    def add_observation(self, text: str) -> None:
        """A tool's result answers the turn's one tool call; anything else (an error
        about a malformed turn) is a user message."""
        calls = self.messages[-1].tool_calls if self.messages[-1].role == "assistant" else ()
        if len(calls) == 1:
            self._append(Message("tool", text, tool_call_id=calls[0].id), None)
        else:
            self._append(Message("user", text), None)

    def restart(self, summary_text: str) -> None:
        self.messages = [*self._opening, Message("user", summary_text)]
        self.generated = [None] * len(self.messages)
        self._prompt = None

    def _append(self, message: Message, generated: list[int] | None) -> None:
        self.messages.append(message)
        self.generated.append(generated)
        self._prompt = None


class HfChat:
    """An HF tokenizer's chat template with `TOOLS` (see the module docstring).

    Args:
      tokenizer: a `transformers` tokenizer with a chat template in the ChatML / Qwen3
        layout (`<|im_start|>role\\n...<|im_end|>`; tool calls as `<tool_call>` blocks).
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        # The end-of-turn token first (what a turn ends with, as the template closes
        # it), then the tokenizer's eos (a base model's <|endoftext|>).
        stops = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
        stops.append(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        unknown = tokenizer.unk_token_id
        stop_ids = tuple(dict.fromkeys(s for s in stops if s is not None and s != unknown))
        self.tokenizer = tokenizer
        self.template = HfChatTemplate(tokenizer, stop_ids=stop_ids)
        self.vocab_size = self.template.vocab_size
        self.stop_ids = stop_ids
        self.tools = list(TOOLS)

    def start(self, system: str, task: str) -> HfContext:
        return HfContext(self, system, task)

    def render(self, messages: Sequence[Message], generated: Sequence) -> list[int]:
        return self.template.render(messages, self.tools, generated)

    def decode(self, output_ids: Sequence[int]) -> str:
        """The answer's text with its markup (tool calls, thinking); stop ids dropped."""
        return self.template.decode(output_ids)

    def text(self, output_ids: Sequence[int]) -> str:
        """The answer's text without its thinking (summaries)."""
        return _THINKING.sub("", self.decode(output_ids)).strip()

    def parse(self, output_ids: Sequence[int]) -> Action:
        """The action of a turn: its one tool call (thinking ignored); else malformed."""
        raw = self.decode(output_ids)
        _, calls = split_tool_calls(_THINKING.sub("", raw))
        if len(calls) != 1:
            why = "no tool call" if not calls else f"{len(calls)} tool calls"
            return _malformed(
                raw, f"{why}; make exactly one tool call per turn, one of: {_TOOL_NAMES}"
            )
        name, arguments = calls[0]
        return tool_call_action(name, json.loads(arguments), raw)

    def answer(self, action_text: str) -> list[int]:
        """The ids a policy emits to take `action_text` (text syntax) as a tool call, the
        way the template renders one (scripted policies and demonstrations)."""
        action = parse_action(action_text)
        text = action.raw if action.malformed else tool_call_text(*action_tool_call(action))
        return [*self.template.encode(text), self.stop_ids[0]]

    def prompt_kind(self, prompt_ids: Sequence[int], sub_system: str) -> str:
        """ "summary", "sub" (a context opened with `sub_system`) or "main"."""
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        if text.endswith(f"{SUMMARY_REQUEST}<|im_end|>\n<|im_start|>assistant\n"):
            return "summary"
        return "sub" if text.startswith(f"<|im_start|>system\n{sub_system}") else "main"


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as a Qwen3 chat template renders it (json.dumps spacing)."""
    payload = json.dumps(name, ensure_ascii=False)
    return (
        f'<tool_call>\n{{"name": {payload}, "arguments": '
        f"{json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>"
    )


def tool_call_action(name: str, arguments, raw: str = "") -> Action:
    """The action a tool call asks for; a call the harness cannot run is malformed,
    saying why (unknown tool, arguments not an object, missing or unknown or non-string
    arguments)."""
    raw = raw or tool_call_text(name, arguments)
    if name not in _TOOL_ACTIONS:
        return _malformed(raw, f"unknown tool {name!r}; expected one of {_TOOL_NAMES}")
    kind, fields = _TOOL_ACTIONS[name]
    if not isinstance(arguments, dict):
        return _malformed(raw, f"{name}: arguments must be a JSON object")
    unknown = sorted(set(arguments) - set(fields))
    missing = [a for a in _REQUIRED[name] if a not in arguments]
    wrong = sorted(a for a in fields if a in arguments and not isinstance(arguments[a], str))
    if unknown or missing or wrong:
        problems = [
            f"{what} {', '.join(names)}"
            for what, names in (("unknown", unknown), ("missing", missing), ("not text:", wrong))
            if names
        ]
        return _malformed(raw, f"{name}: arguments {'; '.join(problems)}")
    values = {fields[a]: v for a, v in arguments.items()}
    for field in ("path", "subtask", "result"):  # as the text syntax strips them
        if field in values:
            values[field] = values[field].strip()
    for field in ("path", "subtask"):
        if field in values and not values[field]:
            return _malformed(raw, f"{name}: {field} is empty")
    return Action(kind, **values)


def action_tool_call(action: Action) -> tuple[str, dict]:
    """The tool call that asks for `action` (the inverse of `tool_call_action`)."""
    name, fields = _ACTION_TOOLS[action.kind]
    arguments = {a: getattr(action, f) for a, f in fields.items()}
    if action.kind == "done" and not action.result:
        arguments = {}
    return name, arguments


def _malformed(raw: str, why: str) -> Action:
    return Action("malformed", error=why, raw=raw)
