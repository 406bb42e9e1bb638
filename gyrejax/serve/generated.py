"""The exact output ids of the assistant turns the policy generated, per execution.

A black-box harness sends its history back as messages, not tokens, and often rewrites
what it received: it re-serialises tool-call arguments (other spacing, key order),
drops or nulls the content of a tool-call turn, or keeps text that the tokenizer cannot
reproduce (invalid UTF-8 from a byte model, special tokens, a non-canonical BPE split).
Rendering such a turn from its text would put tokens into the next prompt that the
policy never generated, and the trajectory tree would fork where the conversation did
not. So each answer's raw output ids are remembered under every key a harness can send
back, and the template splices them in:

  * each tool call's id (`tool_calls[].id`, which harnesses keep so that tool results
    can refer to it);
  * the turn's canonical form: content plus tool calls with their arguments parsed and
    re-dumped with sorted keys, so a re-serialised turn with new ids still matches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gyrejax.serve.chat import Message, ToolCall


def canonical(content: str, calls: Sequence[ToolCall] | Sequence[tuple[str, str]]) -> str:
    """A key equal for turns that differ only in JSON formatting or tool-call ids."""
    pairs = [(c.name, c.arguments) if isinstance(c, ToolCall) else tuple(c) for c in calls]
    normal = []
    for name, arguments in pairs:
        try:
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        except json.JSONDecodeError:
            pass
        normal.append([name, arguments])
    return json.dumps([content.strip() if pairs else content, normal], sort_keys=True)


class GeneratedTurns:
    """Output ids of one execution's answers, by tool-call id and by canonical form."""

    def __init__(self):
        self._by_call_id: dict[str, tuple[int, ...]] = {}
        self._by_form: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._by_form)

    def remember(self, output_ids: Sequence[int], content: str, calls: Sequence[ToolCall]) -> None:
        """Records one answer: its exact ids, the content and tool calls it was shown as."""
        ids = tuple(int(t) for t in output_ids)
        for call in calls:
            self._by_call_id[call.id] = ids
        self._by_form[canonical(content, calls)] = ids  # a repeat answer: the latest wins

    def lookup(self, message: Message) -> tuple[int, ...] | None:
        """The exact ids behind an assistant message sent back, or None if the policy did
        not generate it (the harness wrote or edited it: it is rendered from text)."""
        if message.role != "assistant":
            return None
        for call in message.tool_calls:
            if call.id in self._by_call_id:
                return self._by_call_id[call.id]
        return self._by_form.get(canonical(message.content, message.tool_calls))
