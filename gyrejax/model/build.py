"""`build_model`: the run's starting policy, loaded from an HF checkpoint or initialised
from the seed, placed on one cell's mesh. Every process of a job builds the same one."""

from __future__ import annotations

import jax

from gyrejax.config import ModelConfig, ShardingRules
from gyrejax.model import sharding
from gyrejax.model.hf_io import load_hf
from gyrejax.model.transformer import Transformer, init_model


def build_model(config: ModelConfig, mesh: jax.sharding.Mesh, rules: ShardingRules) -> Transformer:
    """Loads `config.hf_checkpoint` or initialises randomly, placed on `mesh` by `rules`
    (the sampling rules where the model first generates)."""
    if config.hf_checkpoint:
        return load_hf(
            config.hf_checkpoint,
            mesh=mesh,
            rules=rules,
            dtype=config.dtype,
            attention=config.attention,
            attention_block_size=config.attention_block_size,
        )
    model = init_model(config)
    sharding.shard_model(model, mesh, rules)
    return model
