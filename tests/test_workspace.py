"""Workspace: confined, capped file tools that answer with observations and never raise."""

import errno
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyrejax.harness.sandbox import Limits, run_python
from gyrejax.harness.workspace import Workspace, open_beneath


@pytest.fixture
def dirs(tmp_path):
    """(workspace, outside directory holding a secret file)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    return Workspace(tmp_path / "ws"), outside


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_round_trip_subdirectories_and_listing(tmp_path):
    ws = Workspace(tmp_path / "new" / "ws")  # created with parents
    assert ws.is_empty()
    assert ws.list_files() == "the workspace is empty"
    assert ws.write("b.txt", "hi there") == "wrote 'b.txt' (8 bytes)"
    assert ws.write("./src//pkg/a.py", "x = 1\n") == "wrote 'src/pkg/a.py' (6 bytes)"
    assert ws.write("u.txt", "héllo ✓") == "wrote 'u.txt' (10 bytes)"
    assert ws.read("b.txt") == "hi there"
    assert ws.read("src/pkg/a.py") == "x = 1\n"
    assert ws.read("u.txt") == "héllo ✓"
    assert ws.list_files() == "b.txt\nsrc/pkg/a.py\nu.txt"
    assert ws.files() == {
        "b.txt": b"hi there",
        "src/pkg/a.py": b"x = 1\n",
        "u.txt": "héllo ✓".encode(),
    }
    assert not ws.is_empty()
    assert ws.write("b.txt", "") == "wrote 'b.txt' (0 bytes)"
    assert ws.read("b.txt") == "'b.txt' is empty"
    assert ws.read_bytes("src/pkg/a.py") == b"x = 1\n"
    assert ws.read_bytes("missing") is None


def test_read_errors_are_observations(dirs):
    ws, _ = dirs
    ws.write("a.txt", "x")
    assert ws.read("nope.txt") == "error: cannot read 'nope.txt': no such file"
    ws.write("d/e.txt", "x")
    assert "is a directory" in ws.read("d")
    assert "is a directory" in ws.write("d", "x")
    assert "not a directory" in ws.write("a.txt/b.txt", "x")
    (ws.root / "bin.dat").write_bytes(b"\xff\xfe\x00\x81")
    assert ws.read("bin.dat") == "'bin.dat' is binary or not UTF-8; not shown"


@pytest.mark.parametrize(
    "path, reason",
    [
        ("/etc/passwd", "is an absolute path"),
        ("../x", "leaves the workspace"),
        ("a/../../x", "leaves the workspace"),
        ("a/..", "leaves the workspace"),
        ("..", "leaves the workspace"),
        ("a\x00b", "contains a NUL byte"),
        ("a\nb", "contains a control character"),
        ("", "the path is empty"),
        (".", "names the workspace itself"),
        ("./", "names the workspace itself"),
        (" a.txt", "starts or ends with whitespace"),
        ("x" * 101, "has a name longer than 100 bytes"),
        ("/".join(["abcdefghij"] * 20), "is longer than 200 bytes"),
        ("\udcff", "is not valid UTF-8"),
    ],
)
def test_confinement_refusals_say_why(dirs, path, reason):
    ws, outside = dirs
    before = snapshot(outside.parent)
    for observation in (ws.write(path, "pwned"), ws.read(path)):
        assert observation.startswith("refused: "), observation
        assert reason in observation
    assert ws.read_bytes(path) is None
    assert snapshot(outside.parent) == before


def test_non_text_arguments_are_refused(dirs):
    ws, _ = dirs
    assert ws.write(None, "x").startswith("refused: the path must be text")  # type: ignore[arg-type]
    assert ws.read(b"a.txt").startswith("refused: the path must be text")  # type: ignore[arg-type]
    assert ws.write("a.txt", b"x").startswith("refused: the content")  # type: ignore[arg-type]
    assert ws.write("a.txt", "\ud800").startswith("refused: the content")


def test_symlinks_out_of_the_workspace_are_refused(dirs):
    """Links pointing out (absolute, relative, dangling, as a file or as a directory) are
    refused for reading and writing, and the outside is never touched."""
    ws, outside = dirs
    os.symlink(outside / "secret.txt", ws.root / "file_link")
    os.symlink(outside, ws.root / "dir_link")
    os.symlink("../outside/secret.txt", ws.root / "relative_link")
    os.symlink(outside / "not_yet.txt", ws.root / "dangling_link")
    before = snapshot(outside)
    for path in ("file_link", "dir_link/secret.txt", "dir_link/new.txt", "relative_link",
                 "dangling_link"):  # fmt: skip
        for observation in (ws.read(path), ws.write(path, "pwned")):
            assert observation.startswith("refused: "), (path, observation)
            assert "leads outside the workspace through a symlink" in observation
        assert ws.read_bytes(path) is None
    assert snapshot(outside) == before
    assert not (outside / "not_yet.txt").exists()
    # Links are not files of the workspace.
    assert ws.files() == {}
    assert ws.list_files() == "the workspace is empty"
    assert ws.is_empty()


def test_symlinks_inside_are_not_followed_and_a_linked_root_works(tmp_path):
    real = tmp_path / "real"
    Workspace(real).write("a.txt", "inside")
    os.symlink(real, tmp_path / "alias")
    ws = Workspace(tmp_path / "alias")  # the root itself reached through a link is fine
    assert ws.root == real.resolve()
    assert ws.read("a.txt") == "inside"
    os.symlink("a.txt", real / "inner_link")
    assert "symlinks are not followed" in ws.read("inner_link")
    assert "symlinks are not followed" in ws.write("inner_link", "x")
    assert ws.read("a.txt") == "inside"
    assert ws.files() == {"a.txt": b"inside"}


def test_symlink_made_by_agent_code_is_refused(dirs):
    ws, outside = dirs
    result = run_python(
        f"import os\nos.symlink({str(outside)!r}, 'escape')\nos.symlink('/etc/passwd', 'pw')",
        ws.root,
        Limits(wall_s=5.0),
    )
    assert result.ok, result.summary()
    assert ws.read("escape/secret.txt").startswith("refused: ")
    assert ws.read("pw").startswith("refused: ")
    assert ws.write("escape/evil.txt", "x").startswith("refused: ")
    assert not (outside / "evil.txt").exists()


def test_a_planted_hard_link_is_not_written_through(dirs):
    """Issue 15: `write` followed a hard link to a file outside and overwrote it."""
    ws, outside = dirs
    os.link(outside / "secret.txt", ws.root / "hard.txt")
    observation = ws.write("hard.txt", "pwned")
    assert observation == (
        "refused: 'hard.txt' has 2 hard links (it may be a file outside the workspace); "
        "write to a new path instead"
    )
    assert (outside / "secret.txt").read_text() == "secret"
    assert ws.write("other.txt", "fine").startswith("wrote")  # a file of its own is fine


def test_open_beneath_refuses_a_symlink_at_any_step(dirs):
    """What makes a swapped-in link harmless: the open itself refuses links, whatever a
    check before it saw."""
    ws, outside = dirs
    ws.write("d/inner.txt", "x")
    os.symlink(outside, ws.root / "out")
    os.symlink("d", ws.root / "inside_link")  # even one that stays inside
    os.symlink(outside / "secret.txt", ws.root / "d" / "leaf")
    create = os.O_WRONLY | os.O_CREAT
    for relative, make_parents in [
        ("out/new.txt", False),
        ("out/new.txt", True),
        ("out/deeper/new.txt", True),
        ("inside_link/inner.txt", False),
        ("d/leaf", False),
    ]:
        with pytest.raises(OSError) as raised:
            open_beneath(ws.root, relative, create, make_parents=make_parents)
        assert raised.value.errno == errno.ELOOP, relative
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    os.close(open_beneath(ws.root, "d/e/f.txt", create, make_parents=True))
    assert (ws.root / "d" / "e" / "f.txt").is_file()


def test_a_symlink_swapped_in_right_after_each_check_is_refused(dirs, monkeypatch):
    """The check-then-open race, made deterministic: every time the tool has checked the
    path, the directory on it becomes a link out, as a racing process could make it."""
    ws, outside = dirs
    ws.write("d/f.txt", "first")
    d = ws.root / "d"
    check = Workspace._check

    def check_then_swap(self, path):
        if d.is_symlink():  # a directory again for the check ...
            d.unlink()
            d.mkdir()
        result = check(self, path)
        for child in d.iterdir():  # ... and a link out right after it
            child.unlink()
        d.rmdir()
        d.symlink_to(outside)
        return result

    monkeypatch.setattr(Workspace, "_check", check_then_swap)
    observation = ws.write("d/f.txt", "pwned")
    assert observation == "refused: 'd/f.txt' goes through a symlink (symlinks are not followed)"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert ws.read("d/f.txt").startswith("refused: ")


# Swaps two paths atomically (renameat2 RENAME_EXCHANGE) as fast as it can, in its own
# process so that it truly runs alongside the tool (a thread would wait for the GIL).
_SWAPPER = """
import ctypes, sys
libc = ctypes.CDLL(None)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
print("swapping", flush=True)
while True:
    libc.renameat2(-100, a, -100, b, 2)
"""


def test_a_symlink_swapped_in_mid_path_during_writes_never_leads_outside(dirs):
    """Another process swaps a directory on the path for a link out while the tool writes
    through that path: the check-then-open race."""
    ws, outside = dirs
    ws.write("d/f.txt", "first")
    os.symlink(outside, ws.root / "swap")
    swapper = subprocess.Popen(
        [sys.executable, "-c", _SWAPPER, str(ws.root / "d"), str(ws.root / "swap")],
        stdout=subprocess.PIPE,
    )
    wrote = tries = 0
    try:
        assert swapper.stdout.readline() == b"swapping\n"
        end = time.monotonic() + 1.5  # "d": a directory one moment, a link out the next
        while time.monotonic() < end and not (outside / "f.txt").exists():
            tries += 1
            wrote += ws.write("d/f.txt", f"try {tries}").startswith("wrote")
    finally:
        swapper.kill()
        swapper.wait()
        swapper.stdout.close()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"], f"out in {tries} tries"
    assert wrote > 0 and tries > 100  # the race ran, and writes inside still work


def test_fifo_left_by_agent_code_does_not_block(dirs):
    ws, _ = dirs
    os.mkfifo(ws.root / "pipe")
    assert ws.read("pipe") == "error: 'pipe' is not a regular file"
    assert ws.write("pipe", "x") == "refused: 'pipe' exists and is not a regular file"
    assert ws.files() == {}
    assert ws.read_bytes("pipe") is None


def test_caps(tmp_path):
    ws = Workspace(tmp_path / "ws", max_files=3, max_file_bytes=10, max_total_bytes=25)
    assert ws.write("a", "x" * 10) == "wrote 'a' (10 bytes)"
    assert "over the 10-byte file size cap" in ws.write("b", "x" * 11)
    assert "over the 10-byte file size cap" in ws.write("b", "é" * 6)  # 12 bytes
    assert ws.write("b", "x" * 10).startswith("wrote")
    assert "over the 25-byte total size cap" in ws.write("c", "x" * 6)
    assert ws.write("c", "x" * 5).startswith("wrote")
    assert "the 3-file cap" in ws.write("d", "")
    # Overwriting an existing file counts its new size only.
    assert ws.write("a", "y" * 10).startswith("wrote")
    assert ws.write("a", "").startswith("wrote")
    assert ws.write("d", "x").startswith("refused")  # still 3 files
    assert ws.files() == {"a": b"", "b": b"x" * 10, "c": b"x" * 5}
    # A file over the cap made by agent code is shown truncated.
    (ws.root / "a").write_text("z" * 30)
    assert ws.read("a") == "z" * 10 + "\n[truncated: 'a' is over 10 bytes]"


def test_constructor_validates(tmp_path):
    with pytest.raises(ValueError, match="max_files=0"):
        Workspace(tmp_path, max_files=0)


_PATH_CHARS = st.sampled_from([*"ab./\\ -\x00\n~", "..", "é", "\udcff", "/tmp", "x" * 60])


@pytest.fixture(scope="module")
def scratch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("random_paths")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.one_of(st.text(max_size=30), st.lists(_PATH_CHARS, max_size=12).map("".join)),
    content=st.text(max_size=40),
)
def test_random_paths_never_raise_and_never_escape(scratch_root, path, content):
    with tempfile.TemporaryDirectory(dir=scratch_root) as scratch:
        parent = Path(scratch)
        ws = Workspace(parent / "ws")
        os.symlink(parent, ws.root / "up")
        for observation in (
            ws.write(path, content),
            ws.read(path),
            ws.list_files(),
        ):
            assert isinstance(observation, str)
        ws.files()
        ws.is_empty()
        ws.read_bytes(path)
        # Nothing was created next to the workspace.
        assert sorted(p.name for p in parent.iterdir()) == ["ws"]
        assert sorted(p.name for p in scratch_root.iterdir()) == [parent.name]
