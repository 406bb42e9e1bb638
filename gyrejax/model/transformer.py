"""Qwen2/Qwen3-family decoder in Flax NNX.

RMSNorm, rotary embeddings, grouped-query attention (optional q/k RMSNorm as in Qwen3,
optional q/k/v bias as in Qwen2, optional output bias as in Qwen3 with attention_bias),
SwiGLU MLP, tied or untied embeddings.

Two entry points share every layer:
  * training forward over packed tree rows: `model(tokens, positions, subtree_end)`;
  * decoding with a static-shape KV cache: `model.prefill(...)` writes prompts into cache
    slots, `model.decode(...)` advances the first B slots by one token.

Parameters carry logical axis names (see `sharding.py`); logits are float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gyrejax.config import ModelConfig
from gyrejax.model import attention
from gyrejax.model.sharding import constrain, sequence_layout

_INIT_STDDEV = 0.02  # HF `initializer_range` for Qwen models.


def _param(rngs: nnx.Rngs, shape, dtype, axes, init=None) -> nnx.Param:
    init = init or jax.nn.initializers.normal(_INIT_STDDEV)
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32 (as HF Qwen)."""

    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split layout, as HF Qwen).

    Args:
      x: float[B, T, heads, D].
      positions: int32[B, T].
      theta: rotary base.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def tree_attention(
    config: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, subtree_end: jax.Array
) -> jax.Array:
    """The configured tree attention (`config.attention`); float[B, L, H, D].

    Rows whose length the active sharding rules split over a mesh axis (`length` ->
    `sequence`) run the blocked attention (or, with "pallas", the kernels) context-
    parallel over it; otherwise on each device as it is. The dense reference is left to
    GSPMD either way.

    Args:
      q: float[B, L, H, D]; k, v: float[B, L, KV, D]; subtree_end: int32[B, L].
    """
    if config.attention == "dense":
        return attention.dense_tree_attention(q, k, v, subtree_end)
    block = config.attention_block_size
    kernel = "pallas" if config.attention == "pallas" else "xla"
    layout = sequence_layout(q.shape[0], q.shape[2], k.shape[2])
    if layout is not None:
        return attention.context_parallel_tree_attention(
            q, k, v, subtree_end, layout, block, kernel
        )
    if kernel == "pallas":
        from gyrejax.model import attention_kernel  # Mosaic GPU: imported only when chosen

        return attention_kernel.pallas_tree_attention(q, k, v, subtree_end, block)
    return attention.blocked_tree_attention(q, k, v, subtree_end, block)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        dt = jnp.dtype(c.dtype)
        e, h, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.config = c
        self.q = _param(rngs, (e, h, d), dt, ("embed", "heads", "head_dim"))
        self.k = _param(rngs, (e, kv, d), dt, ("embed", "kv_heads", "head_dim"))
        self.v = _param(rngs, (e, kv, d), dt, ("embed", "kv_heads", "head_dim"))
        self.o = _param(rngs, (h, d, e), dt, ("heads", "head_dim", "embed"))
        if c.qkv_bias:
            zeros = jax.nn.initializers.zeros
            self.q_bias = _param(rngs, (h, d), dt, ("heads", "head_dim"), zeros)
            self.k_bias = _param(rngs, (kv, d), dt, ("kv_heads", "head_dim"), zeros)
            self.v_bias = _param(rngs, (kv, d), dt, ("kv_heads", "head_dim"), zeros)
        if c.o_bias:
            self.o_bias = _param(rngs, (e,), dt, ("embed",), jax.nn.initializers.zeros)
        if c.qk_norm:
            self.q_norm = RMSNorm(d, c.rms_norm_eps, dt, "head_dim")
            self.k_norm = RMSNorm(d, c.rms_norm_eps, dt, "head_dim")

    def project(self, x: jax.Array, positions: jax.Array):
        """q float[B, T, H, D], k and v float[B, T, KV, D], rotary applied to q and k."""
        c = self.config
        q = jnp.einsum("bte,ehd->bthd", x, self.q[...])
        k = jnp.einsum("bte,ehd->bthd", x, self.k[...])
        v = jnp.einsum("bte,ehd->bthd", x, self.v[...])
        if c.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rotary(q, positions, c.rope_theta), ("batch", "length", "heads", None))
        k = constrain(rotary(k, positions, c.rope_theta), ("batch", "length", "kv_heads", None))
        v = constrain(v, ("batch", "length", "kv_heads", None))
        return q, k, v

    def output(self, attended: jax.Array) -> jax.Array:
        out = jnp.einsum("bthd,hde->bte", attended, self.o[...])
        return out + self.o_bias[...] if self.config.o_bias else out

    def __call__(self, x, positions, subtree_end):
        q, k, v = self.project(x, positions)
        return self.output(tree_attention(self.config, q, k, v, subtree_end))


class MLP(nnx.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        e, m = config.hidden_size, config.intermediate_size
        self.gate = _param(rngs, (e, m), dt, ("embed", "mlp"))
        self.up = _param(rngs, (e, m), dt, ("embed", "mlp"))
        self.down = _param(rngs, (m, e), dt, ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jax.nn.silu(x @ self.gate[...]) * (x @ self.up[...])
        return constrain(hidden, ("batch", "length", "mlp")) @ self.down[...]


class Block(nnx.Module):
    """Pre-norm decoder layer."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config, rngs=rngs)

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        """Residual add of the attention output, then the MLP sub-layer."""
        x = constrain(x + attn_out, ("batch", "length", "embed"))
        return constrain(x + self.mlp(self.mlp_norm(x)), ("batch", "length", "embed"))

    def __call__(self, x, positions, subtree_end):
        return self.finish(x, self.attn(self.attn_norm(x), positions, subtree_end))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-shape key/value cache: one row ("slot") per concurrent sequence.

    Attributes:
      k: per layer, float[slots, KV, max_len, D] (heads before length, so a decode
        step reads each (slot, head)'s keys as one contiguous matrix).
      v: per layer, float[slots, KV, max_len, D].
      lengths: int32[slots], valid entries per slot.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, slots: int, max_len: int) -> KVCache:
        shape = (slots, config.num_kv_heads, max_len, config.head_dim)
        # Distinct buffers per layer and for k and v: the cache is donated to jit.
        layers = range(config.num_layers)
        return cls(
            k=tuple(jnp.zeros(shape, config.dtype) for _ in layers),
            v=tuple(jnp.zeros(shape, config.dtype) for _ in layers),
            lengths=jnp.zeros((slots,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


# Under `jax.checkpoint` a layer's inputs are always kept; the policy says what else is.
# "matmuls": dot_generals without batch dimensions, i.e. the weight matmuls (q, k, v, o,
# gate, up, down); attention's own products carry batch dimensions and run again.
_REMAT = {
    "layer": jax.checkpoint_policies.nothing_saveable,
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat_block(
    block: Block, x: jax.Array, positions: jax.Array, subtree_end: jax.Array, remat: str
) -> jax.Array:
    """`block(x, ...)` keeping for its backward only what `_REMAT[remat]` saves.

    `jax.checkpoint` alone says what is saved, not that the rest runs again: the
    recomputation is the forward's own ops on the same inputs, and a compiler that drops
    the optimization barriers before common-subexpression elimination (XLA's CPU
    pipeline) merges the two and keeps every activation after all. So the backward makes
    the saved activations depend on the layer's output cotangent (`_tie`): the layer
    runs again from values that differ from the forward's, and only once its backward has
    begun.
    """
    graphdef, state = nnx.split(block)

    def layer(state, x):
        return nnx.merge(graphdef, state)(x, positions, subtree_end)

    checkpointed = jax.checkpoint(layer, policy=_REMAT[remat])

    @jax.custom_vjp
    def run(state, x):
        return layer(state, x)

    def forward(state, x):
        return jax.vjp(checkpointed, state, x)  # the vjp closure holds only what is saved

    def backward(saved, cotangent):
        return _tie(saved, cotangent)(cotangent)

    run.defvjp(forward, backward)
    return run(state, x)


def _tie(saved, cotangent: jax.Array):
    """`saved` with each activation (a float array whose leading [rows, length] are the
    cotangent's) plus 0 x one element of `cotangent`: equal values (a non-finite
    cotangent poisons the gradients either way), but a data dependency no compiler may
    fold away (x * 0 is not 0 for floats), so nothing computed from them is common with
    the forward or can run before the cotangent exists."""
    zero = 0 * cotangent.reshape(-1)[0]

    def tie(a):
        activation = a.ndim >= 2 and a.shape[:2] == cotangent.shape[:2]
        if activation and jnp.issubdtype(a.dtype, jnp.floating):
            return a + zero.astype(a.dtype)
        return a

    return jax.tree.map(tie, saved)


class Transformer(nnx.Module):
    """A Qwen2/Qwen3-family causal language model."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = jnp.dtype(config.dtype)
        e, vocab = config.hidden_size, config.vocab_size
        self.embed = _param(rngs, (vocab, e), dt, ("vocab", "embed"))
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(e, config.rms_norm_eps, dt)
        if not config.tie_embeddings:
            self.lm_head = _param(rngs, (e, vocab), dt, ("embed", "vocab"))

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0)
        return constrain(x, ("batch", "length", "embed"))

    def output_matrix(self) -> jax.Array:
        """float32[embed, vocab]: the matrix that turns final hidden states into logits
        (the embedding, transposed, when tied)."""
        if self.config.tie_embeddings:
            return self.embed[...].astype(jnp.float32).T
        return self.lm_head[...].astype(jnp.float32)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32[..., vocab] logits from final hidden states float[..., embed]."""
        return hidden.astype(jnp.float32) @ self.output_matrix()

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        subtree_end: jax.Array,
        remat: str = "none",
    ) -> jax.Array:
        """Final-norm hidden states float[B, L, embed] of packed tree rows.

        Args:
          tokens: int32[B, L].
          positions: int32[B, L], each token's original position (rotary).
          subtree_end: int32[B, L]; key k is visible to query q iff k <= q < subtree_end[k].
          remat: what each layer keeps for its backward (`config.REMATS`): "none", "layer"
            (its input only) or "matmuls" (its weight matmuls' outputs too).
        """
        x = self._embed(tokens)
        for block in self.blocks:
            if remat == "none":
                x = block(x, positions, subtree_end)
            else:
                x = _remat_block(block, x, positions, subtree_end, remat)
        return self.final_norm(x)

    def __call__(self, tokens, positions, subtree_end) -> jax.Array:
        """float32[B, L, vocab] logits of packed tree rows (see `hidden_states`)."""
        return self.logits(self.hidden_states(tokens, positions, subtree_end))

    def prefill(
        self, tokens: jax.Array, lengths: jax.Array, slots: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Runs prompts from position 0 and writes their keys/values into cache slots.

        Args:
          tokens: int32[B, T] prompts, right-padded to a static bucket length T.
          lengths: int32[B] true prompt lengths (1 <= lengths <= T <= cache.max_len).
          slots: int32[B] cache slot of each prompt.
          cache: the cache to write into.

        Returns:
          float32[B, vocab] logits after each prompt's last real token, and the cache.
        """
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        causal_end = jnp.full((b, t), t, jnp.int32)  # a plain causal sequence
        x = self._embed(tokens)
        new_k, new_v = list(cache.k), list(cache.v)
        for layer, block in enumerate(self.blocks):
            normed = block.attn_norm(x)
            q, k, v = block.attn.project(normed, positions)
            out = tree_attention(self.config, q, k, v, causal_end)
            x = block.finish(x, block.attn.output(out))
            k_heads = jnp.swapaxes(k, 1, 2).astype(new_k[layer].dtype)  # [B, KV, T, D]
            v_heads = jnp.swapaxes(v, 1, 2).astype(new_v[layer].dtype)
            new_k[layer] = new_k[layer].at[slots, :, :t].set(k_heads)
            new_v[layer] = new_v[layer].at[slots, :, :t].set(v_heads)
        hidden = self.final_norm(x)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        new_lengths = cache.lengths.at[slots].set(lengths.astype(jnp.int32))
        return self.logits(last), KVCache(tuple(new_k), tuple(new_v), new_lengths)

    def decode(
        self,
        tokens: jax.Array,
        cache: KVCache,
        active: jax.Array,
        attend_len: int | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Advances every active slot among the first B by one token.

        Args:
          tokens: int32[B], the next input token of each of the cache's first B slots
            (B <= cache slots: an engine keeps its busy slots first, so that a batch
            with few requests computes only as wide as it is).
          cache: holds each slot's context; the token goes to position `lengths[s]`.
          active: bool[B]; inactive slots compute garbage and keep their length.
          attend_len: static; attention reads only the first `attend_len` cache
            positions (must exceed every active slot's length). Default: all of them.

        Returns:
          float32[B, vocab] next-token logits, and the cache.
        """
        width = tokens.shape[0]
        slots = jnp.arange(width)
        lengths = cache.lengths[:width]
        positions = lengths[:, None]  # [B, 1]
        x = self._embed(tokens[:, None])
        new_k, new_v = list(cache.k), list(cache.v)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.attn.project(block.attn_norm(x), positions)
            new_k[layer] = new_k[layer].at[slots, :, lengths].set(k[:, 0])
            new_v[layer] = new_v[layer].at[slots, :, lengths].set(v[:, 0])
            # A static prefix of the slots (and positions): read in place, not copied.
            keys, values = new_k[layer][:width], new_v[layer][:width]
            if attend_len is not None:
                keys, values = keys[:, :, :attend_len], values[:, :, :attend_len]
            out = attention.decode_attention(q[:, 0], keys, values, lengths + 1)
            x = block.finish(x, block.attn.output(out[:, None]))
        logits = self.logits(self.final_norm(x)[:, 0])
        new_lengths = cache.lengths.at[:width].set(jnp.where(active, lengths + 1, lengths))
        return logits, KVCache(tuple(new_k), tuple(new_v), new_lengths)


def init_model(config: ModelConfig, seed: int | None = None) -> Transformer:
    """A randomly initialised model (HF-like normal(0.02) weights, unit norms)."""
    return Transformer(config, rngs=nnx.Rngs(config.init_seed if seed is None else seed))


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
