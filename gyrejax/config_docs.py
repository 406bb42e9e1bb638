"""The configuration reference (docs/config.md), generated from the config dataclasses.

  python -m gyrejax.config_docs            # rewrites docs/config.md
  python -m gyrejax.config_docs --check    # exits 1 if docs/config.md is out of date

Every field of every section gets its default, its meaning (the comments written beside
or above it in gyrejax/config.py) and its check (what `__post_init__` refuses, read from
the validators it calls: `_positive`, `_non_negative`, `_one_of`, and `_fail` with a
literal message). tests/test_config.py fails when a field has no entry or the file is
stale, so the page cannot fall behind the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from gyrejax import config as config_module

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
HEADER = """# Configuration reference

What you do: set any field below in a config file (`configs/<name>.py`) or on the
command line, `--config.<section>.<field>=<value>`; a bad value is refused with one line
naming the field before anything is built. Generated from `gyrejax/config.py` by
`python -m gyrejax.config_docs`: the meaning is the code's own comment, the check what
the code refuses.
"""


def sections() -> list[tuple[str, type]]:
    """(name, dataclass) of each section of `Config`, in its order; ("", Config) first
    for its own top-level fields."""
    hints = typing.get_type_hints(config_module.Config)
    nested = [
        (f.name, hints[f.name])
        for f in dataclasses.fields(config_module.Config)
        if dataclasses.is_dataclass(hints[f.name])
    ]
    return [("", config_module.Config), *nested]


def fields_of(section: str, cls: type) -> list[dataclasses.Field]:
    """The fields a section documents (the top level: its values, not its sections)."""
    hints = typing.get_type_hints(cls)
    return [
        f for f in dataclasses.fields(cls) if section or not dataclasses.is_dataclass(hints[f.name])
    ]


def _comments(cls: type) -> dict[str, str]:
    """field -> the comment lines above it and beside it in the class body."""
    source, _ = inspect.getsourcelines(cls)
    tree = ast.parse("".join(source))
    body = tree.body[0].body
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        lines = []
        row = node.lineno - 2  # the line above, 0-based in `source`
        while row >= 0 and source[row].strip().startswith("#"):
            lines.insert(0, source[row].strip().lstrip("#").strip())
            row -= 1
        for row in range(node.lineno - 1, node.end_lineno):
            _, sep, comment = source[row].partition("  # ")
            if sep:
                lines.append(comment.strip())
        found[node.target.id] = " ".join(lines)
    return found


def _checks(cls: type) -> dict[str, list[str]]:
    """field -> what `__post_init__` refuses, from the validator calls it makes."""
    post = getattr(cls, "__post_init__", None)
    if post is None:
        return {}
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(post)))
    checks: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        literal = [a.value for a in args if isinstance(a, ast.Constant)]
        if name in ("_positive", "_non_negative"):
            text = "a positive integer" if name == "_positive" else "a number >= 0"
            for field in literal[1:]:
                checks.setdefault(field, []).append(text)
        elif name == "_one_of" and len(literal) == 2 and isinstance(args[3], ast.Name):
            choices = getattr(config_module, args[3].id)
            checks.setdefault(literal[1], []).append("one of " + ", ".join(map(str, choices)))
        elif name == "_fail" and literal and isinstance(args[0], ast.Constant):
            field = str(args[0].value).rsplit(".", 1)[-1]
            message = next((a.value for a in args[2:] if isinstance(a, ast.Constant)), None)
            if message:
                checks.setdefault(field, []).append(message)
    return checks


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def reference() -> str:
    """docs/config.md's text."""
    out = [HEADER]
    for section, cls in sections():
        title = f"`{section}`" if section else "top level"
        out.append(f"\n## {title}\n\n{inspect.getdoc(cls).splitlines()[0]}\n\n")
        out.append("| field | default | meaning | check |\n|---|---|---|---|\n")
        comments, checks = _comments(cls), _checks(cls)
        for field in fields_of(section, cls):
            name = f"{section}.{field.name}" if section else field.name
            default = field.default
            if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            check = "; ".join(dict.fromkeys(checks.get(field.name, []))) or "its type"
            out.append(
                f"| `{name}` | `{default!r}` | {_cell(comments[field.name])} | {_cell(check)} |\n"
            )
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        stale = not DOCS_PAGE.is_file() or DOCS_PAGE.read_text() != text
        if stale:
            print(f"{DOCS_PAGE} is stale: run python -m gyrejax.config_docs", file=sys.stderr)
        return int(stale)
    DOCS_PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
