"""Checks of a configuration against what surrounds the run, before anything is built.

`Config` validates itself (field types, ranges, cross-field rules). What it cannot see
is checked here, each failure one `ConfigError` line naming the field and value:


  * `check_inputs` (no JAX; launch runs it right after parsing the config, so a typo
    costs a second, not a model build): the directories the config names exist
    (`train.executions_dir` holding records, `model.hf_checkpoint` holding a
    config.json, a `model.tokenizer` path holding an HF tokenizer's files), and a model
    that runs the harness covers its tokenizer's vocabulary (the byte tokenizer's, or
    `len()` of the HF tokenizer, loaded with transformers): its ids would index past the
    embedding; `rollout.engine=vllm` finds the vllm package installed;
  * `check_devices`, once the device count is known and before any cell is built:
    `cells.size` divides it, and the async policy leaves a cell to roll out.

`check` runs both (for callers of `run` that skip launch). It imports neither JAX nor
the model (the byte tokenizer and the store's file suffix are plain Python; transformers
only for an HF tokenizer).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

from gyrejax.config import BYTE_TOKENIZER, Config, ConfigError
from gyrejax.harness import tokenizer
from gyrejax.trajectory.store import SUFFIX

# What marks a directory as an HF tokenizer (AutoTokenizer.from_pretrained reads either).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _runs_harness(config: Config) -> bool:
    """Whether the run records executions with the harness (warm start, RL, a rollout
    batch): everything but training on a stored set."""
    return not config.train.executions_dir


def _runs_rl(config: Config) -> bool:
    return not config.train.executions_dir and config.train.steps > 0


def _model_vocab_size(config: Config) -> int:
    """The vocabulary the model will have: an HF checkpoint's own, else the config's."""
    path = config.model.hf_checkpoint
    if not path:
        return config.model.vocab_size
    field = f"config.model.hf_checkpoint={path}"
    try:
        with open(os.path.join(path, "config.json")) as f:
            vocab_size = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{field}: unreadable config.json ({e})") from None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ConfigError(f"{field}: config.json has vocab_size={vocab_size!r}")
    return vocab_size


def check_inputs(config: Config) -> None:
    """The checks that need no device (see the module docstring).

    Raises:
      ConfigError naming the field and value.
    """
    store = config.train.executions_dir
    if store:
        if not os.path.isdir(store):
            raise ConfigError(f"config.train.executions_dir={store}: not a directory")
        with os.scandir(store) as entries:
            if not any(e.name.endswith(SUFFIX) and not e.name.startswith(".") for e in entries):
                raise ConfigError(
                    f"config.train.executions_dir={store}: no execution records (*{SUFFIX}) in it"
                )
    checkpoint = config.model.hf_checkpoint
    if checkpoint:
        if not os.path.isdir(checkpoint):
            raise ConfigError(f"config.model.hf_checkpoint={checkpoint}: not a directory")
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise ConfigError(
                f"config.model.hf_checkpoint={checkpoint}: no config.json (not an HF checkpoint)"
            )
    tokenizer_dir = config.model.tokenizer
    if tokenizer_dir != BYTE_TOKENIZER:
        field = f"config.model.tokenizer={tokenizer_dir}"
        if not os.path.isdir(tokenizer_dir):
            raise ConfigError(
                f"{field}: not a directory (expected {BYTE_TOKENIZER!r} or an HF tokenizer "
                "directory)"
            )
        if not any(os.path.isfile(os.path.join(tokenizer_dir, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"{field}: no {' or '.join(TOKENIZER_FILES)} (not an HF tokenizer directory)"
            )
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "config.rollout.engine=vllm: the vllm package is not installed "
            "(pip install -e '.[vllm]'; on GPU hosts: pip install vllm)"
        )
    if _runs_harness(config):
        vocab_size = _model_vocab_size(config)
        tokenizer_size = _tokenizer_size(config.model.tokenizer)
        if vocab_size < tokenizer_size:
            field = "model.vocab_size" if not checkpoint else "model.hf_checkpoint's vocab_size"
            path = config.model.tokenizer
            named = "" if path == BYTE_TOKENIZER else f" (model.tokenizer={path})"
            raise ConfigError(
                f"config.{field}={vocab_size}: below the harness tokenizer's vocabulary of "
                f"{tokenizer_size} tokens{named} (its token ids would index past the embedding)"
            )


def _tokenizer_size(path: str) -> int:
    """How many ids the harness's tokenizer produces: the byte tokenizer's, or an HF
    tokenizer directory's `len(tokenizer)` (its added tokens included; a checkpoint's
    vocab_size may be padded beyond it, as Qwen's are)."""
    if path == BYTE_TOKENIZER:
        return tokenizer.VOCAB_SIZE
    from gyrejax.harness.chat import tokenizer_size  # transformers, only for an HF path

    try:
        return tokenizer_size(path)
    except Exception as e:  # whatever transformers raises for a directory it cannot load
        raise ConfigError(
            f"config.model.tokenizer={path}: not a loadable HF tokenizer "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def check_devices(config: Config, num_devices: int) -> None:
    """The checks that need the device count (all processes' devices).

    Raises:
      ConfigError naming the field and value.
    """
    size = config.cells.size
    if num_devices % size:
        raise ConfigError(f"config.cells.size={size}: must divide the device count {num_devices}")
    num_cells = num_devices // size
    s = config.scheduler
    if _runs_rl(config) and s.policy == "async" and math.ceil(s.async_training_cells) >= num_cells:
        raise ConfigError(
            f"config.scheduler.async_training_cells={s.async_training_cells:g}: trains up to "
            f"{math.ceil(s.async_training_cells)} cells, expected fewer than the number of "
            f"cells, {num_cells} ({num_devices} devices / cells.size={size}): the async "
            "policy keeps at least one cell rolling out"
        )


def check(config: Config, num_devices: int) -> None:
    """`check_inputs` and `check_devices`."""
    check_inputs(config)
    check_devices(config, num_devices)
