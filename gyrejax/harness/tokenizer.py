"""A byte-level tokenizer with a few special tokens, and the chat layout of contexts.

Token ids 0-7 are special; every byte b is token 8 + b, so VOCAB_SIZE = 264 (the tiny
config's `model.vocab_size`). A context is

  <bos> <system> system-text <eot> <user> task-text <eot>
  ( <assistant> action <eot> <tool> observation <eot> )*

and a model call's prompt is the context followed by <assistant>; the model answers with
text ending in <eot> (the stop id). The next call's prompt extends the previous one
exactly, so the calls of one agent share their prefix in the trajectory tree. A summary
call appends <summarize> <assistant> instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PAD, BOS, EOT, SYSTEM, USER, ASSISTANT, TOOL, SUMMARIZE = range(8)
SPECIAL_NAMES = tuple(f"<{n}>" for n in "pad bos eot system user assistant tool summarize".split())
BYTE_OFFSET = len(SPECIAL_NAMES)
VOCAB_SIZE = BYTE_OFFSET + 256


def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def decode(ids: Iterable[int]) -> str:
    """Text of the byte tokens in `ids`; special tokens are dropped."""
    data = bytes(int(i) - BYTE_OFFSET for i in ids if BYTE_OFFSET <= int(i) < VOCAB_SIZE)
    return data.decode("utf-8", errors="replace")


def render(ids: Sequence[int]) -> str:
    """Human-readable text with special tokens shown by name (for logs and tests)."""
    out, pending = [], []
    for i in map(int, ids):
        if i < BYTE_OFFSET:
            if pending:
                out.append(bytes(pending).decode("utf-8", errors="replace"))
                pending = []
            out.append(SPECIAL_NAMES[i])
        else:
            pending.append(i - BYTE_OFFSET)
    if pending:
        out.append(bytes(pending).decode("utf-8", errors="replace"))
    return "".join(out)


def start_context(system: str, task: str) -> list[int]:
    """The opening of every agent context: system prompt and task."""
    return [BOS, SYSTEM, *encode(system), EOT, USER, *encode(task), EOT]


def observation(text: str) -> list[int]:
    """A tool result appended after the model's answer."""
    return [TOOL, *encode(text), EOT]


def answer(text: str) -> list[int]:
    """What the model emits for `text` (a completed answer ends with <eot>)."""
    return [*encode(text), EOT]
