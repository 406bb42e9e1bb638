"""Chat templates: OpenAI messages -> the exact prompt token ids, output ids -> a message.

A template must reproduce, token for token, the prompt the in-process harness would
build, and must splice the policy's own output tokens back in for assistant turns it
generated (`render(..., generated=...)`): text is not a faithful carrier of tokens (a
byte model can emit invalid UTF-8 or special tokens; a BPE model's output need not be
the canonical tokenisation of its text; harnesses re-serialise tool-call JSON). With the
exact tokens spliced in, the next call's prompt extends the previous call's prompt +
output, so the trajectory tree shares the prefix and every generated token stays on it.

Two implementations of the `ChatTemplate` protocol:
  * `ByteChatTemplate`: the byte tokenizer's chat layout (gyrejax.harness.tokenizer),
    the one the in-process harness uses;
  * `HfChatTemplate`: any HF tokenizer with a chat template (`apply_chat_template`).
Tool calls use the Hermes/Qwen format in both: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks in the assistant text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gyrejax.harness import tokenizer as tok
from gyrejax.serve.wire import FieldError, as_list, as_str, get

ROLES = ("system", "user", "assistant", "tool")
_OPEN = "<tool_call>"
_CLOSE = re.compile(r"\s*</tool_call>")
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call in an assistant turn; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat message as validated from a request."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class ChatTemplate(Protocol):
    """What the OpenAI server needs from a tokenizer (see module docstring)."""

    vocab_size: int
    stop_ids: tuple[int, ...]  # ids that end an assistant turn (always stop sampling)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping] | None,
        generated: Sequence[Sequence[int] | None],
    ) -> list[int]:
        """Prompt ids for `messages` followed by the assistant generation prompt.

        `generated[i]` holds the exact output ids of assistant message i when the policy
        generated it (None otherwise: the message is rendered from its text).
        """
        ...


# --- messages --------------------------------------------------------------------------


def parse_messages(value: Any, field: str = "messages") -> list[Message]:
    """Validates OpenAI chat messages; errors name the message and field."""
    items = as_list(value, field)
    if not items:
        raise FieldError(field, "empty; expected at least one message")
    messages = []
    for i, item in enumerate(items):
        at = f"{field}[{i}]."
        role = as_str(get(item, "role", at), at + "role")
        if role == "developer":  # the newer name of "system"
            role = "system"
        if role not in ROLES:
            raise FieldError(at + "role", f"{role!r} is not one of {ROLES}")
        content = _content(item.get("content"), at + "content")
        calls = ()
        if role == "assistant" and item.get("tool_calls"):
            calls = tuple(
                _tool_call(c, f"{at}tool_calls[{j}].")
                for j, c in enumerate(as_list(item["tool_calls"], at + "tool_calls"))
            )
        elif content is None:
            raise FieldError(at + "content", "required")
        call_id = item.get("tool_call_id")
        if call_id is not None:
            as_str(call_id, at + "tool_call_id")
        messages.append(Message(role, content or "", calls, call_id))
    return messages


def _content(value: Any, field: str) -> str | None:
    """A string, or a list of text parts (the only kind a text model can take)."""
    if value is None or isinstance(value, str):
        return value
    parts = []
    for j, part in enumerate(as_list(value, field)):
        kind = get(part, "type", f"{field}[{j}].")
        if kind != "text":
            raise FieldError(f"{field}[{j}].type", f"{kind!r} is not supported; expected 'text'")
        parts.append(as_str(get(part, "text", f"{field}[{j}]."), f"{field}[{j}].text"))
    return "".join(parts)


def _tool_call(value: Any, at: str) -> ToolCall:
    function = get(value, "function", at)
    arguments = get(function, "arguments", at + "function.", "{}")
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments)
    return ToolCall(
        id=as_str(get(value, "id", at, ""), at + "id"),
        name=as_str(get(function, "name", at + "function."), at + "function.name"),
        arguments=arguments,
    )


def parse_tools(value: Any, field: str = "tools") -> list[dict] | None:
    """Validates OpenAI tool definitions (function tools only)."""
    if value is None:
        return None
    tools = as_list(value, field)
    for i, t in enumerate(tools):
        if get(t, "type", f"{field}[{i}].") != "function":
            raise FieldError(f"{field}[{i}].type", f"{t['type']!r}; only 'function' is supported")
        as_str(
            get(get(t, "function", f"{field}[{i}]."), "name", f"{field}[{i}].function."),
            f"{field}[{i}].function.name",
        )
    return tools


def split_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Splits generated text into its content and (name, arguments JSON) tool calls.

    A `<tool_call>` block that is not a JSON object with a string "name" stays in the
    content: the harness sees what the policy wrote instead of a silently dropped call.
    The JSON is read by a decoder, not cut at the first `</tool_call>`, so arguments
    may contain that text (a file about tool calls).
    """
    calls, kept, last = [], [], 0
    start = text.find(_OPEN)
    while start != -1:
        match = _tool_call_at(text, start)
        if match is None:
            start = text.find(_OPEN, start + 1)
            continue
        payload, end = match
        arguments = payload.get("arguments", {})
        calls.append((payload["name"], json.dumps(arguments, ensure_ascii=False)))
        kept.append(text[last:start])
        last = end
        start = text.find(_OPEN, end)
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _tool_call_at(text: str, start: int) -> tuple[dict, int] | None:
    """The call in the `<tool_call>` block opening at `start` and the block's end, or
    None if it is not `<tool_call>` JSON-object-with-a-name `</tool_call>`."""
    body = _SPACE.match(text, start + len(_OPEN)).end()
    try:
        payload, end = _DECODER.raw_decode(text, body)
    except json.JSONDecodeError:
        return None
    close = _CLOSE.match(text, end)
    if close is None or not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    return payload, close.end()


def tool_calls_text(calls: Sequence[ToolCall]) -> str:
    """How an assistant turn's tool calls read in the prompt when not spliced."""
    blocks = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        payload = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>{payload}</tool_call>")
    return "".join(blocks)


# --- templates ------------------------------------------------------------------------


class ByteChatTemplate:
    """The byte tokenizer's chat layout (gyrejax.harness.tokenizer), as the harness
    builds contexts:

      <bos> [<system> tools-json <eot>] then per message:
      system: <system> text <eot>   user: <user> text <eot>   tool: <tool> text <eot>
      assistant: <assistant> output-ids [<eot> if the output did not end with it]
      and finally <assistant> (the generation prompt).
    """

    vocab_size = tok.VOCAB_SIZE
    stop_ids = (tok.EOT,)

    def encode(self, text: str) -> list[int]:
        return tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return tok.decode(ids)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping] | None,
        generated: Sequence[Sequence[int] | None],
    ) -> list[int]:
        ids = [tok.BOS]
        if tools:
            spec = json.dumps(list(tools), sort_keys=True, separators=(",", ":"))
            ids += [tok.SYSTEM, *tok.encode(f"tools: {spec}"), tok.EOT]
        marker = {"system": tok.SYSTEM, "user": tok.USER, "tool": tok.TOOL}
        for message, exact in zip(messages, generated, strict=True):
            if message.role != "assistant":
                ids += [marker[message.role], *tok.encode(message.content), tok.EOT]
                continue
            if exact is None:
                exact = tok.encode(message.content + tool_calls_text(message.tool_calls))
            ids += [tok.ASSISTANT, *exact]
            if list(exact[-1:]) != [tok.EOT]:  # cut at max_tokens: close the turn
                ids.append(tok.EOT)
        return [*ids, tok.ASSISTANT]


class HfChatTemplate:
    """An HF tokenizer's own chat template, with generated turns spliced in as ids.

    Each assistant turn the policy generated is rendered as a placeholder, the template
    text is cut at the placeholders, and the policy's exact output ids go in between;
    when those ids end with a stop token that the template writes right after the
    placeholder (e.g. `<|im_end|>`), the template's copy is dropped, so the turn reads
    exactly as it was sampled.

    Args:
      tokenizer: a `transformers` tokenizer with a `chat_template`.
      stop_ids: ids that end an assistant turn; default the tokenizer's eos id.
    """

    _PLACEHOLDER = "\x00gyrejax-generated-{}\x00"

    def __init__(self, tokenizer, stop_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.stop_ids = tuple(stop_ids if stop_ids is not None else [tokenizer.eos_token_id])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping] | None,
        generated: Sequence[Sequence[int] | None],
    ) -> list[int]:
        dicts = []
        for i, (message, exact) in enumerate(zip(messages, generated, strict=True)):
            if exact is not None:
                dicts.append({"role": "assistant", "content": self._PLACEHOLDER.format(i)})
            else:
                dicts.append(_hf_message(message))
        text = self.tokenizer.apply_chat_template(
            dicts,
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        ids: list[int] = []
        for i, exact in enumerate(generated):
            if exact is None:
                continue
            before, text = text.split(self._PLACEHOLDER.format(i), 1)
            ids += self.encode(before) + list(exact)
            if exact and exact[-1] in self.stop_ids:
                stop_text = self.tokenizer.decode([exact[-1]], skip_special_tokens=False)
                if text.startswith(stop_text):
                    text = text[len(stop_text) :]
        return ids + self.encode(text)


def _hf_message(message: Message) -> dict:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _json_or_text(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
