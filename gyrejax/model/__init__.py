"""Qwen2/Qwen3-family model in Flax NNX: tree-row training forward, KV-cache decoding,
logical-axis sharding and HF checkpoint I/O."""

from gyrejax.model.build import build_model
from gyrejax.model.hf_io import CheckpointError, export_hf, load_hf, read_model_config
from gyrejax.model.sampling import Generation, generate, sample_tokens
from gyrejax.model.transformer import KVCache, Transformer, count_params, init_model

__all__ = [
    "CheckpointError",
    "Generation",
    "KVCache",
    "Transformer",
    "build_model",
    "count_params",
    "export_hf",
    "generate",
    "init_model",
    "load_hf",
    "read_model_config",
    "sample_tokens",
]
