"""`make_engine`: the engine a cell serves rollouts with, by `config.rollout.engine`.

The one place a cell's engine is built from the rollout configuration: the RL loop, a
rollout batch and a follower process of a multi-process job all call it. Engines
outside the cells (vLLM servers, engine servers) are reached by URL instead
(`gyrejax.serve`).
"""

from __future__ import annotations

from collections.abc import Callable

from gyrejax.cells import Cell
from gyrejax.config import ENGINES, RolloutConfig
from gyrejax.model.transformer import Transformer
from gyrejax.rollout.engine import Engine


def _jax_engine(
    name: str, cell: Cell, model: Transformer, config: RolloutConfig, version: int, precompile: bool
) -> Engine:
    from gyrejax.rollout.jax_engine import JaxEngine

    return JaxEngine(
        name,
        model,
        cell,
        max_slots=config.max_slots,
        max_seq_len=config.max_seq_len,
        rules=config.sharding_rules,
        version=version,
        precompile=precompile,
    )


# Engine kinds by name: the names are config.ENGINES.
_KINDS: dict[str, Callable[..., Engine]] = {"jax": _jax_engine}
if tuple(_KINDS) != ENGINES:
    raise TypeError(f"engine kinds {tuple(_KINDS)} differ from config.ENGINES {ENGINES}")


def make_engine(
    cell: Cell,
    model: Transformer,
    config: RolloutConfig,
    *,
    version: int = 0,
    precompile: bool = False,
    name: str | None = None,
) -> Engine:
    """The engine of kind `config.engine` serving `cell`, with `model`'s weights.

    Args:
      cell: where it runs.
      model: the policy (its weights are copied onto the cell by the rollout rules).
      config: the rollout section (engine kind, slots, sequence length, rules).
      version: the policy version of `model`.
      precompile: never compile while serving (what it needs first before it serves,
        the rest in the background): the RL loop's engines, so that no role switch
        waits for a compile.
      name: the engine's name in records and routing (default `cell<index>`).
    """
    build = _KINDS[config.engine]
    return build(name or f"cell{cell.index}", cell, model, config, version, precompile)
