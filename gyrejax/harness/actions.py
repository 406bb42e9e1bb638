"""The agent's actions: what one model turn may say, parsed and formatted.

The harness owns this syntax (it runs the tools, sub-agents and `done`); an environment
supplies the tasks, the visible checks behind `check` and the scoring. Demonstrations
write their actions with `format_action`.

Syntax (one action per model turn, plain text):

  write <path>\\n<content>   everything after the first newline is the file's content
  read <path>
  ls
  check                      run the visible checks
  delegate <subtask text>    hand a subtask to a sub-agent (the text may span lines)
  done                       finish; a sub-agent may add a result: `done <result>`

Leading whitespace before the keyword is ignored; `read`, `ls` and `check` take a single
line; a delegate's subtask and a done's result are stripped of surrounding whitespace.
Anything else parses to `Action(kind="malformed", error=<why>, raw=<text>)`.
"""

from __future__ import annotations

import dataclasses

ACTION_KINDS = ("write", "read", "ls", "check", "delegate", "done")
ACTION_SYNTAX = (
    "one action per turn: 'write <path>' then the content on the next lines; "
    "'read <path>'; 'ls'; 'check'; 'delegate <subtask>'; 'done' or 'done <result>'"
)


@dataclasses.dataclass(frozen=True)
class Action:
    """One parsed agent action.

    Attributes:
      kind: one of ACTION_KINDS, or "malformed".
      path: write / read: the path as written (surrounding whitespace stripped).
      content: write: the file content, verbatim.
      subtask: delegate: the subtask text.
      result: done: the result text (may be empty).
      error: malformed: why the text is not an action.
      raw: malformed: the text as given.
    """

    kind: str
    path: str = ""
    content: str = ""
    subtask: str = ""
    result: str = ""
    error: str = ""
    raw: str = ""

    @property
    def malformed(self) -> bool:
        return self.kind == "malformed"


def _malformed(text: object, why: str) -> Action:
    raw = text if isinstance(text, str) else repr(text)
    return Action("malformed", error=f"{why}; {ACTION_SYNTAX}", raw=raw)


def parse_action(text: str) -> Action:
    """Parses one model turn into an Action; never raises (bad input -> kind "malformed")."""
    if not isinstance(text, str):
        return _malformed(text, f"expected text, got {type(text).__name__}")
    body = text.lstrip()
    if not body:
        return _malformed(text, "empty action")
    first_line, newline, rest = body.partition("\n")
    keyword, _, argument = first_line.partition(" ")
    argument = argument.strip()
    if keyword not in ACTION_KINDS:
        shown = keyword if len(keyword) <= 20 else keyword[:17] + "..."
        return _malformed(text, f"unknown action {shown!r}")
    if keyword == "write":
        if not argument:
            return _malformed(text, "write needs a path")
        if not newline:
            return _malformed(text, "write needs its content after a newline")
        return Action("write", path=argument, content=rest)
    if rest.strip():
        if keyword in ("delegate", "done"):
            # All text after the keyword, verbatim but for the ends: whitespace closing the
            # first line ("\r", spaces) is part of the text, so format_action restores it.
            argument = body[len(keyword) :].strip()
        else:
            return _malformed(text, f"{keyword} takes a single line")
    if keyword == "read":
        if not argument:
            return _malformed(text, "read needs a path")
        return Action("read", path=argument)
    if keyword in ("ls", "check"):
        if argument:
            return _malformed(text, f"{keyword} takes no argument")
        return Action(keyword)
    if keyword == "delegate":
        if not argument:
            return _malformed(text, "delegate needs a subtask")
        return Action("delegate", subtask=argument)
    return Action("done", result=argument)


def format_action(action: Action) -> str:
    """The text of `action` (the inverse of parse_action for well-formed actions)."""
    if action.kind == "write":
        return f"write {action.path}\n{action.content}"
    if action.kind == "read":
        return f"read {action.path}"
    if action.kind in ("ls", "check"):
        return action.kind
    if action.kind == "delegate":
        return f"delegate {action.subtask}"
    if action.kind == "done":
        return f"done {action.result}" if action.result else "done"
    if action.kind == "malformed":
        return action.raw
    raise ValueError(f"action kind {action.kind!r}: expected one of {ACTION_KINDS}")
