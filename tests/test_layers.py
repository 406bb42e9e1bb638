"""The package boundaries, read from the source (no imports): no module reaches into
another package's private names, and only the entry point imports the main job."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gyrejax"


def package_of(path: Path) -> str:
    """`gyrejax.<top-level package or module>` a file belongs to."""
    return "gyrejax." + path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def gyrejax_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, imported name, line) of every `from gyrejax... import name` in `path`,
    and (module, "", line) of every `import gyrejax...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gyrejax"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("gyrejax")]
    return found


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_a_private_name_of_another_package():
    # Another package's private names are its own business: gyrejax/distributed and
    # gyrejax/loop (and everything else) reach train/, rollout/, ... through public names.
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = package_of(path)
        for module, name, line in gyrejax_imports(path):
            theirs = ".".join(module.split(".")[:2])
            hidden = private(name) or any(private(part) for part in module.split("."))
            if theirs != mine and hidden:
                offences.append(f"{path.relative_to(REPO)}:{line}: {module}.{name}")
    assert not offences, offences


def external_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing something outside gyrejax (jax, numpy, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("gyrejax"):
            names |= {a.asname or a.name for a in node.names}
    return {n for n in names if not n.startswith("gyrejax")}


def test_the_distributed_and_loop_packages_touch_no_private_attribute_of_another():
    # E.g. `trainer._compiled_for(cell)`: a private member of gyrejax used from outside
    # its class (a third-party library's private parts are that library's risk).
    offences = []
    for folder in ("distributed", "loop"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            external = external_names(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Attribute) and private(node.attr)):
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in external:
                    continue
                offences.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
    assert not offences, offences


def test_only_launch_imports_the_main_job():
    importers = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]):
        for module, name, line in gyrejax_imports(path):
            if module == "gyrejax.run" or (module == "gyrejax" and name == "run"):
                importers.append(f"{path.relative_to(REPO)}:{line}")
    assert [where.split(":")[0] for where in importers] == ["gyrejax/launch.py"], importers
