"""Entry point: `python -m gyrejax.launch --config configs/<name>.py --workdir DIR`.

Only flags live here; `run(config, workdir)` does the work and is what tests call.
Overrides: `--config.model.num_layers=4`; variants: `--config configs/tiny_cpu.py:smoke`.
Multi-process: `--coordinator HOST:PORT --num_processes P --process_id I` (or a cluster
JAX detects, e.g. SLURM) starts JAX's distributed runtime first; see `launch/local.sh`,
`launch/slurm.sbatch`, `gyrejax.distributed` and `gyrejax.run`.
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for logs, checkpoints and outputs.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "Multi-process: HOST:PORT of process 0's coordinator service."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: this process's rank.")
flags.mark_flags_as_required(["config", "workdir"])


def _one_line(error: Exception) -> str:
    """ml_collections embeds tracebacks in its errors; keep the first and last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1]}"


def _unknown_override(argv: list[str], error: Exception) -> str:
    """One line for an override of a key the config lacks. ml_collections raises a
    KeyError (or an AttributeError around one) whose text is a repr with quotes and a
    newline in it, so the culprit is found by checking each override's path instead."""
    from gyrejax.config import unknown_field

    overrides = [a.removeprefix("--config.") for a in argv if a.startswith("--config.")]
    paths = [o.split("=", 1)[0] for o in overrides]
    for path in paths:
        problem = unknown_field(path)
        if problem:
            return problem
    while error.args and isinstance(error.args[0], Exception):  # ml_collections' own words
        error = error.args[0]
    words = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    for path in paths:  # a real field that the config file leaves to its default
        if repr(path.rsplit(".", 1)[-1]) in words:
            return (
                f"config: {path!r} is a field the config file does not list, so "
                f"--config.{path} has nothing to override; add it to the file"
            )
    return f"config: {' '.join(words.split())}"


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one clear line (no traceback) for a bad flag or override."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # a bad flag value, or a config file that raises
        sys.exit(f"gyrejax.launch: {_one_line(e)}")
    except (AttributeError, KeyError) as e:  # ml_collections: override of an unknown key
        sys.exit(f"gyrejax.launch: {_unknown_override(argv, e)}")


def _quiet_orbax(record) -> bool:
    """Orbax logs every checkpoint step at INFO; keep only its warnings and errors."""
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def _ignored(error: BaseException) -> str:
    """One line for an exception the run can only ignore."""
    lines = str(error).strip().splitlines()
    return f"gyrejax.launch: ignored {type(error).__name__}: {lines[0][:200] if lines else ''}"


def _one_line_unraisable(unraisable) -> None:
    """An exception Python can only ignore (Orbax's read coroutines, left pending when a
    damaged checkpoint fails a restore, raise as they are collected): one line on
    stderr, not a traceback that buries the run's own one-line error."""
    sys.stderr.write(_ignored(unraisable.exc_value) + "\n")


def _one_line_orbax_task(record) -> bool:
    """The same read coroutines as tasks, collected while their loop runs: asyncio logs
    "Task exception was never retrieved" with the traceback; one line instead. Other
    tasks' exceptions keep their traceback."""
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    if any("orbax" in frame.filename for frame in frames):
        record.msg, record.args = _ignored(error), ()
        record.exc_info = record.exc_text = None
    return True


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.get_absl_handler().addFilter(_quiet_orbax)
    sys.unraisablehook = _one_line_unraisable
    logging.getLogger("asyncio").addFilter(_one_line_orbax_task)
    from gyrejax import preflight
    from gyrejax.config import ConfigError, from_dict

    try:  # before JAX is even imported: a bad config costs a second, not a model build
        config = from_dict(_CONFIG.value)
        preflight.check_inputs(config)
    except ConfigError as e:
        sys.exit(f"gyrejax.launch: {e}")
    except OSError as e:  # ml_collections defers a missing config file to first access
        sys.exit(f"gyrejax.launch: cannot load --config: {_one_line(e)}")
    # Import after the config: nothing may touch JAX's devices before the CPU-emulated
    # device count is set from it.
    import jax

    if config.cells.num_cpu_devices:  # per process in a multi-process run
        jax.config.update("jax_num_cpu_devices", config.cells.num_cpu_devices)
    from gyrejax import compilation_cache, distributed

    try:  # every process, before its first compile: a resume loads what was compiled
        cache = compilation_cache.enable(config.compilation_cache_dir, _WORKDIR.value)
    except ConfigError as e:
        sys.exit(f"gyrejax.launch: {e}")

    try:  # explicit flags, or a cluster JAX detects (SLURM, Open MPI, ...); else nothing
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    except ValueError as e:
        sys.exit(f"gyrejax.launch: {e}")
    try:  # every process's devices: the cells are split over all of them
        preflight.check_devices(config, jax.device_count(), jax.devices()[0].platform)
    except ConfigError as e:
        sys.exit(f"gyrejax.launch: {e}")
    from gyrejax.workdir_lock import WorkdirBusy, hold

    try:  # once the config is known good (a config error leaves no workdir behind), and
        hold(_WORKDIR.value, jax.process_index())  # before the run reads or writes it
    except WorkdirBusy as e:
        sys.exit(f"gyrejax.launch: {e}")

    from gyrejax.loop.steps import NothingToTrain
    from gyrejax.model.hf_io import CheckpointError
    from gyrejax.run import run

    try:  # one process, or this process's part of several (process 0 decides)
        run(config, _WORKDIR.value)
    except (ConfigError, CheckpointError, NothingToTrain) as e:
        where = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
        gc.collect()  # what a failed restore left pending reports now, before the error
        sys.exit(f"gyrejax.launch: {where}{e}")
    if cache is not None:
        absl_logging.info("%s", cache.describe())


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
