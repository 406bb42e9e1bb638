"""Sandbox: limited child processes; every runaway is killed or refused, never hangs."""

import os
import threading
import time

import pytest

from gyrejax.harness.sandbox import Limits, RunResult, run_python

FAST = Limits(cpu_s=1.0, memory_bytes=256 << 20, wall_s=5.0, max_output_bytes=4096)


@pytest.fixture
def ws(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


@pytest.fixture
def outside(tmp_path):
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "keep.txt").write_text("keep")
    return directory


def assert_refused(result: RunResult, what: str):
    assert result.returncode == 1, result
    assert not result.timed_out
    assert "PermissionError: sandbox refused" in result.stderr
    assert what in result.summary(), result.summary()


def test_runs_in_the_workspace_with_a_scrubbed_environment(ws, monkeypatch):
    monkeypatch.setenv("GYREJAX_SECRET", "leak")
    script = (
        "import os, sys\n"
        "print(sorted(os.environ.items()))\n"
        "print(os.getcwd())\n"
        "print(sys.stdin.read() if sys.stdin else 'no stdin')\n"
        "print('ünïcode')\n"
        "open('made.txt', 'w').write('ok')\n"
        "os.mkdir('sub'); os.rename('made.txt', 'sub/moved.txt')\n"
    )
    result = run_python(script, ws, FAST)
    assert result.ok, result.stderr
    env_line, cwd, stdin, text = result.stdout.splitlines()[:4]
    root = os.path.realpath(ws)
    assert env_line == str(
        sorted(
            {
                "HOME": root,
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "PATH": "/usr/bin:/bin",
                "TMPDIR": root,
            }.items()
        )
    )
    assert cwd == root
    assert stdin == ""  # stdin is /dev/null
    assert text == "ünïcode"
    # Only what the script wrote is in the workspace: no script file, no bytecode.
    assert sorted(p.name for p in ws.rglob("*")) == ["moved.txt", "sub"]
    assert result.summary() == "exit 0"


def test_exceptions_are_reported_not_raised(ws):
    result = run_python("def f():\n    raise ValueError('bad thing')\nf()\n", ws, FAST)
    assert result.returncode == 1 and not result.killed and not result.timed_out
    assert result.summary() == "exit 1: ValueError: bad thing"
    assert "raise ValueError('bad thing')" in result.stderr  # the script's source line
    syntax = run_python("def f(:\n", ws, FAST)
    assert syntax.summary() == "exit 1: SyntaxError: invalid syntax"


def test_infinite_loop_is_killed_by_the_cpu_limit(ws):
    result = run_python("while True:\n    pass\n", ws, FAST)
    assert result.killed and not result.timed_out
    assert result.summary() == "killed by SIGXCPU (CPU-time limit)"
    assert result.wall_s < FAST.wall_s


def test_sleeping_script_is_killed_at_the_wall_clock(ws):
    limits = Limits(wall_s=0.5)
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)\n", ws, limits)
    assert time.monotonic() - start < 3.0
    assert result.timed_out and result.killed
    assert result.summary().startswith("timed out after 0.5 s")


def test_closed_output_does_not_hide_a_hang(ws):
    script = "import os, time\nprint('bye', flush=True)\nos.close(1)\nos.close(2)\ntime.sleep(60)"
    result = run_python(script, ws, Limits(wall_s=0.5))
    assert result.timed_out
    assert result.stdout == "bye\n"


def test_memory_bomb_fails_within_the_address_space_limit(ws):
    result = run_python("hog = []\nwhile True:\n    hog.append(bytearray(1 << 24))\n", ws, FAST)
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.summary() or result.killed


@pytest.mark.parametrize(
    "script, what",
    [
        ("import os\nwhile True:\n    os.fork()\n", "os.fork"),
        ("import subprocess\nsubprocess.run(['true'])\n", "subprocess.Popen"),
        ("import os\nos.system('true')\n", "os.system"),
        ("import os\nos.execv('/bin/true', ['true'])\n", "os.exec"),
        ("import os\nos.posix_spawn('/bin/true', ['true'], {})\n", "os.posix_spawn"),
        (
            "import multiprocessing as mp\nmp.get_context('spawn').Process(target=print).start()\n",
            "_posixsubprocess.fork_exec",
        ),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "socket."),
        ("import socket\nsocket.socket()\n", "socket."),
        ("import ctypes\n", "import ctypes"),
        ("import os, signal\nos.kill(-1, signal.SIGKILL)\n", "os.kill"),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "os.kill"),
        (
            "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n",
            "resource.setrlimit",
        ),
    ],
)
def test_spawning_sockets_ctypes_and_limit_changes_are_refused(ws, script, what):
    assert_refused(run_python(script, ws, FAST), what)


def test_giant_file_stops_at_the_file_size_limit(ws):
    limits = Limits(file_size_bytes=1 << 16, wall_s=5.0)
    result = run_python("open('big', 'wb').write(b'x' * (1 << 24))\n", ws, limits)
    assert result.returncode == 1
    assert "File too large" in result.summary()
    assert (ws / "big").stat().st_size <= 1 << 16


@pytest.mark.parametrize(
    "script",
    [
        "open({out!r} + '/new.txt', 'w')",
        "open({out!r} + '/keep.txt', 'a').write('x')",
        "open({out!r} + '/keep.txt', 'r+')",
        "import os\nos.open({out!r} + '/new.txt', os.O_WRONLY | os.O_CREAT)",
        "import os\nos.remove({out!r} + '/keep.txt')",
        "import os\nos.mkdir({out!r} + '/d')",
        "import os\nopen('mine', 'w').close()\nos.rename('mine', {out!r} + '/new.txt')",
        "import os\nos.rename({out!r} + '/keep.txt', 'stolen')",
        "import os\nos.link({out!r} + '/keep.txt', 'hard')",
        "import os\nos.chmod({out!r} + '/keep.txt', 0o777)",
        "import os\nos.truncate({out!r} + '/keep.txt', 0)",
        "import os\nos.symlink({out!r}, 'door')\nopen('door/keep.txt', 'w')",
        "import os\nos.chdir({out!r})",
        "import os\nos.chdir('..')",
        "import os\nos.mkfifo({out!r} + '/fifo')",
        "import shutil\nshutil.rmtree({out!r})",
        "import os\nfd = os.open({out!r}, os.O_RDONLY)\nos.mkdir('d', dir_fd=fd)",
    ],
)
def test_writes_outside_the_workspace_are_refused(ws, outside, script):
    before = sorted((p.name, p.stat().st_mode, p.read_bytes()) for p in outside.iterdir())
    result = run_python(script.format(out=str(outside)), ws, FAST)
    assert_refused(result, "sandbox refused")
    after = sorted((p.name, p.stat().st_mode, p.read_bytes()) for p in outside.iterdir())
    assert after == before


def test_reading_outside_and_dev_null_are_allowed(ws, outside):
    script = (
        f"print(open({str(outside)!r} + '/keep.txt').read())\nopen('/dev/null', 'w').write('x')"
    )
    result = run_python(script, ws, FAST)
    assert result.ok, result.stderr
    assert result.stdout == "keep\n"


def test_output_flood_is_truncated(ws):
    limits = Limits(max_output_bytes=1000, wall_s=5.0)
    script = "import sys\nfor _ in range(2000):\n    print('x' * 99)\n    sys.stderr.write('e')\n"
    result = run_python(script, ws, limits)
    assert result.ok
    assert result.stdout == ("x" * 99 + "\n") * 10
    assert len(result.stderr) == 1000
    assert result.stdout_truncated and result.stderr_truncated
    assert result.summary() == "exit 0 (output truncated)"


def test_concurrent_runs_from_threads(ws):
    results = [None] * 4

    def work(i):
        results[i] = run_python(f"print({i} * 7)", ws, FAST)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i * 7}\n" for i in range(4)]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="expected an existing directory"):
        run_python("print(1)", tmp_path / "missing")
    with pytest.raises(ValueError, match="cpu_s"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        Limits(memory_bytes=1.5)  # type: ignore[arg-type]
