"""The persistent XLA compilation cache: compiled programs kept on disk between processes.

Every process of a run compiles the same programs each time it starts: the engines'
prefill and decode per context bucket, the trainer's micro-step per row shape, the warm
start's step. JAX's persistent cache stores each compiled executable under a key made of
the program, jaxlib's version, the XLA flags, the compile options and the devices, so a
process that meets a program already there loads it (milliseconds) instead of compiling
it (seconds on CPU). A stale entry cannot be loaded by mistake: any change to the
program or the toolchain is another key.

`enable` points JAX at the directory before anything compiles; `gyrejax.launch` calls it
in every process (followers of a multi-process run included), `python -m
gyrejax.generate` and the engine server take a flag. Where the directory is:

  1. a non-empty $JAX_COMPILATION_CACHE_DIR, if set: the environment wins over the
     config, so an operator (a cluster script, the test suite's per-session cache) can
     redirect every process of every run without editing configs;
  2. else `config.compilation_cache_dir`: "auto" is `<workdir>/jax_cache`, "off" or ""
     disables the cache, any other value is the directory (shared by the runs naming it).

JAX writes entries from process 0 only (a multi-process run's others read what it wrote
where their keys match: on GPU, not on CPU, where the key holds the device ids). JAX
writes an entry in place, so a process killed mid-write can leave a damaged one: JAX
then warns "Error reading persistent compilation cache entry" and compiles that program
each time; delete the directory to start afresh. The cache is trusted code: a directory
others can write lets them run code in the run.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
from absl import logging

from gyrejax.config import COMPILATION_CACHE_AUTO, COMPILATION_CACHE_OFF, ConfigError

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# "auto": the cache in the run's own directory, where a resume finds it.
AUTO_SUBDIR = "jax_cache"
# JAX's default (1 s) skips programs that compile faster: a warm tiny_cpu smoke run then
# loads 38 of its 107 programs and compiles the rest, and which ones were cached depends
# on how loaded the machine was when the first run compiled them (load shows up as
# compile time). With 0 it loads all of them, whatever the load
# (benchmarks/compile_cache_bench.py); a write costs ~2 ms (median of 81 small CPU
# programs), 2 MB for the whole run.
MIN_COMPILE_TIME_S = 0.0

_HITS = "/jax/compilation_cache/cache_hits"
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"


def resolve(setting: str, workdir: str | None) -> tuple[str | None, str]:
    """Where this process's cache is, and why.

    Args:
      setting: `config.compilation_cache_dir` (or a CLI's flag): "auto", "off", "" or a
        directory ("~" expanded).
      workdir: the run's directory ("auto" is `<workdir>/jax_cache`); None outside a run,
        where "auto" means off.

    Returns:
      (absolute directory, or None when the cache is off; its source: the environment
      variable's name, "auto", "config" or "off").
    """
    env = os.environ.get(ENV_DIR, "")
    if env:
        return os.path.abspath(os.path.expanduser(env)), ENV_DIR
    if setting in COMPILATION_CACHE_OFF or (setting == COMPILATION_CACHE_AUTO and not workdir):
        return None, "off"
    if setting == COMPILATION_CACHE_AUTO:
        return os.path.abspath(os.path.join(workdir, AUTO_SUBDIR)), "auto"
    return os.path.abspath(os.path.expanduser(setting)), "config"


@dataclasses.dataclass
class CacheUse:
    """What this process asked of the cache since `enable`: programs compiled or loaded
    through it (`requests`) and those loaded from disk (`hits`)."""

    directory: str
    source: str
    requests: int = 0
    hits: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()  # engines and trainer workers compile in threads

    def _count(self, event: str, **kwargs) -> None:
        if event in (_HITS, _REQUESTS):
            with self._lock:
                if event == _HITS:
                    self.hits += 1
                else:
                    self.requests += 1

    def describe(self) -> str:
        """One line: 'compilation cache: 40 of 42 programs loaded from DIR'."""
        return (
            f"compilation cache: {self.hits} of {self.requests} programs loaded from "
            f"{self.directory}"
        )


def _unwritable(directory: str) -> str | None:
    """Why `directory` cannot hold the cache, or None. Nothing is created here: JAX makes
    the directory at the first compile, so a run that fails before it writes nothing."""
    path = directory
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot write in {path}"
    return None


def enable(setting: str, workdir: str | None, *, field: str = "config.compilation_cache_dir"):
    """Points JAX's persistent compilation cache at `resolve(setting, workdir)`; call it
    before this process compiles anything (JAX opens the cache at the first compile and
    never moves it). Logs one line saying where it is.

    Args:
      setting, workdir: see `resolve`.
      field: the setting's name in an error (a config field or a flag).

    Returns:
      A `CacheUse` counting from now on, or None when the cache is off.

    Raises:
      ConfigError: the directory cannot be made (a file in its path, no permission).
    """
    directory, source = resolve(setting, workdir)
    if directory is None:
        logging.info("compilation cache: off (%s=%r)", field, setting)
        return None
    problem = _unwritable(directory)
    if problem:
        where = f"${ENV_DIR}" if source == ENV_DIR else f"{field}={setting!r}"
        raise ConfigError(f"{where}: {problem}")
    jax.config.update("jax_compilation_cache_dir", directory)
    if ENV_MIN_COMPILE_TIME not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    use = CacheUse(directory, source)
    jax.monitoring.register_event_listener(use._count)
    logging.info("compilation cache: %s (%s)", directory, source)
    return use
