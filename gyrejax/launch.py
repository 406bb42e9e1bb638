"""Entry point: `python -m gyrejax.launch --config configs/<name>.py --workdir DIR`.

Only flags live here; `run(config, workdir)` does the work and is what tests call.
Overrides: `--config.model.num_layers=4`; variants: `--config configs/tiny_cpu.py:smoke`.
Multi-process: `--coordinator HOST:PORT --num_processes P --process_id I` (or a cluster
JAX detects, e.g. SLURM) starts JAX's distributed runtime first; see `launch/local.sh`,
`launch/slurm.sbatch` and `gyrejax.distributed`.
"""

from __future__ import annotations

import logging
import sys

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


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one clear line (no traceback) for a bad flag or override."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # a bad flag value, or a config file that raises
        sys.exit(f"gyrejax.launch: {_one_line(e)}")
    except (AttributeError, KeyError) as e:  # ml_collections: override of an unknown key
        key = str(e).strip("'\"")
        culprit = next(
            (a for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")),
            "--config override",
        )
        sys.exit(f"gyrejax.launch: {culprit}: unknown config key {key!r}")


def _quiet_orbax(record) -> bool:
    """Orbax logs every checkpoint step at INFO; keep only its warnings and errors."""
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.get_absl_handler().addFilter(_quiet_orbax)
    # Import after flag parsing: nothing may touch JAX's devices before the
    # CPU-emulated device count is set from the config.
    import jax

    from gyrejax.config import ConfigError, from_dict

    try:
        config = from_dict(_CONFIG.value)
    except ConfigError as e:
        sys.exit(f"gyrejax.launch: {e}")
    except OSError as e:  # ml_collections defers a missing config file to first access
        sys.exit(f"gyrejax.launch: cannot load --config: {_one_line(e)}")
    if config.cells.num_cpu_devices:  # per process in a multi-process run
        jax.config.update("jax_num_cpu_devices", config.cells.num_cpu_devices)
    from gyrejax import distributed

    try:  # explicit flags, or a cluster JAX detects (SLURM, Open MPI, ...); else nothing
        multi_process = distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
        )
    except ValueError as e:
        sys.exit(f"gyrejax.launch: {e}")

    from gyrejax.model.hf_io import CheckpointError

    if multi_process and jax.process_count() > 1:  # process 0 decides, the others follow
        from gyrejax.distributed.job import run_multiprocess

        try:
            run_multiprocess(config, _WORKDIR.value)
        except (ConfigError, CheckpointError) as e:
            sys.exit(f"gyrejax.launch: process {jax.process_index()}: {e}")
        return
    from gyrejax.run import run

    try:
        run(config, _WORKDIR.value)
    except (ConfigError, CheckpointError) as e:
        sys.exit(f"gyrejax.launch: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
