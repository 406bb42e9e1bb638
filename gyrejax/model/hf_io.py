"""Hugging Face checkpoint I/O for Qwen2/Qwen3 models.

`load_hf` reads `config.json` plus `model.safetensors` (or a sharded
`model.safetensors.index.json`) into a `Transformer`; `export_hf` writes a model back in
the same layout, so transformers and vLLM load trained weights, and with an HF tokenizer
directory copies its files in too (`TOKENIZER_EXPORT_FILES`), so one directory serves both
`AutoTokenizer` and `AutoModelForCausalLM`, as a Qwen checkpoint does.
`tokenizer_fingerprint` names a `model.tokenizer`'s vocabulary (what the model's ids
mean) for the training checkpoints' metadata. Every problem with a checkpoint raises
`CheckpointError` naming the file and, where it applies, the tensor.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import queue
import shutil
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from gyrejax.config import BYTE_TOKENIZER, ConfigError, ModelConfig, ShardingRules
from gyrejax.model.sharding import logical_axes_of, logical_to_spec
from gyrejax.model.transformer import Transformer

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# An HF tokenizer's files, as `save_pretrained` writes them (Qwen's set, plus the
# sentencepiece model of other families): whichever exist are copied into an export.
TOKENIZER_EXPORT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
)
# The files that define what each id means: tokenizer.json alone holds it all (merges,
# added tokens); a slow tokenizer's vocabulary is spread over the others.
_VOCABULARY_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")
# Tensors some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# At most this many bytes of converted tensors exist at a time during an export (always
# at least one tensor): enough to keep the device and the copy to the host ahead of the
# disk, small beside a model.
_EXPORT_LOOKAHEAD_BYTES = 1 << 30
_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not match its config."""


_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def model_config_from_hf(hf: dict, source: str, **overrides) -> ModelConfig:
    """Maps an HF `config.json` dict to a `ModelConfig` (plus `overrides`)."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen2", "qwen3"):
        raise CheckpointError(f"{source}: model_type={model_type!r}, expected qwen2 or qwen3")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type={rope_type!r} is not supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    try:
        heads = int(hf["num_attention_heads"])
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=model_type == "qwen3",
            # Qwen2 always has q/k/v bias (no output bias); Qwen3 with attention_bias
            # has bias on q, k, v and o.
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=model_type == "qwen3" and bool(hf.get("attention_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            dtype=_HF_DTYPES.get(str(dtype), "float32"),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: malformed field: {e}") from None
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def hf_config_from_model(config: ModelConfig) -> dict:
    """The HF `config.json` dict for `config` (qwen3 with qk-norm, else qwen2).

    Raises:
      CheckpointError: the bias layout exists in neither HF architecture.
    """
    # Qwen2 always carries q/k/v bias; a model with neither qk-norm nor bias exports as
    # Qwen2 with zero biases, which computes the same function.
    if config.qk_norm and config.qkv_bias != config.o_bias:
        raise CheckpointError(
            f"model.o_bias={config.o_bias} with model.qkv_bias={config.qkv_bias}: "
            "Qwen3 has bias on q, k, v and o together or not at all"
        )
    if not config.qk_norm and config.o_bias:
        raise CheckpointError("model.o_bias=True without qk_norm: Qwen2 has no output bias")
    model_type = "qwen3" if config.qk_norm else "qwen2"
    arch = "Qwen3ForCausalLM" if config.qk_norm else "Qwen2ForCausalLM"
    hf = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": config.dtype,
        "torch_dtype": config.dtype,
    }
    if config.qk_norm:
        hf["attention_bias"] = config.qkv_bias
    return hf


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How one HF tensor maps to one model parameter.

    `to_hf` is a module-level function of the array alone (its shape says the rest), so
    it works on NumPy and JAX arrays alike and keys the jitted export cache across calls.
    """

    hf_name: str
    path: tuple
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T if isinstance(x, jax.Array) else np.ascontiguousarray(x.T)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _heads_to_hf(w: np.ndarray) -> np.ndarray:
    """Ours [e, n, d] -> HF [n*d, e]."""
    return _transpose(w.reshape(w.shape[0], -1))


def _o_to_hf(w: np.ndarray) -> np.ndarray:
    """Ours [h, d, e] -> HF [e, h*d]."""
    return _transpose(w.reshape(-1, w.shape[-1]))


def _flatten(b: np.ndarray) -> np.ndarray:
    """Ours [n, d] -> HF [n*d]."""
    return b.reshape(-1)


def _tensor_map(config: ModelConfig) -> list[_Tensor]:
    """Every parameter of the model with its HF name and layout conversions."""
    e, h, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim

    def heads_in(n):  # HF [n*d, e] -> ours [e, n, d]
        return (lambda w: _transpose(w).reshape(e, n, d), _heads_to_hf)

    def bias(n):  # HF [n*d] -> ours [n, d]
        return (lambda b: b.reshape(n, d), _flatten)

    o_in = (lambda w: _transpose(w).reshape(h, d, e), _o_to_hf)
    same = (_identity, _identity)
    linear = (_transpose, _transpose)

    table = [("model.embed_tokens.weight", ("embed",), same)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", ("blocks", i)
        table += [
            (f"{hf}.input_layernorm.weight", (*ours, "attn_norm", "scale"), same),
            (f"{hf}.post_attention_layernorm.weight", (*ours, "mlp_norm", "scale"), same),
            (f"{hf}.self_attn.q_proj.weight", (*ours, "attn", "q"), heads_in(h)),
            (f"{hf}.self_attn.k_proj.weight", (*ours, "attn", "k"), heads_in(kv)),
            (f"{hf}.self_attn.v_proj.weight", (*ours, "attn", "v"), heads_in(kv)),
            (f"{hf}.self_attn.o_proj.weight", (*ours, "attn", "o"), o_in),
            *(
                [(f"{hf}.self_attn.o_proj.bias", (*ours, "attn", "o_bias"), same)]
                if config.o_bias
                else []
            ),
            (f"{hf}.mlp.gate_proj.weight", (*ours, "mlp", "gate"), linear),
            (f"{hf}.mlp.up_proj.weight", (*ours, "mlp", "up"), linear),
            (f"{hf}.mlp.down_proj.weight", (*ours, "mlp", "down"), linear),
        ]
        if config.qkv_bias:
            table += [
                (f"{hf}.self_attn.q_proj.bias", (*ours, "attn", "q_bias"), bias(h)),
                (f"{hf}.self_attn.k_proj.bias", (*ours, "attn", "k_bias"), bias(kv)),
                (f"{hf}.self_attn.v_proj.bias", (*ours, "attn", "v_bias"), bias(kv)),
            ]
        if config.qk_norm:
            table += [
                (f"{hf}.self_attn.q_norm.weight", (*ours, "attn", "q_norm", "scale"), same),
                (f"{hf}.self_attn.k_norm.weight", (*ours, "attn", "k_norm", "scale"), same),
            ]
    table.append(("model.norm.weight", ("final_norm", "scale"), same))
    if not config.tie_embeddings:
        table.append(("lm_head.weight", ("lm_head",), linear))
    return [_Tensor(name, path, fwd, back) for name, path, (fwd, back) in table]


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_model_config(directory: str | os.PathLike, **overrides) -> ModelConfig:
    """The `ModelConfig` of an HF checkpoint directory (plus `overrides`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    path = directory / CONFIG_FILE
    return model_config_from_hf(_read_json(path), str(path), **overrides)


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = directory / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    try:
        with safe_open(single, framework="numpy") as f:
            return dict.fromkeys(f.keys(), single)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from None


def _read_tensors(files: dict[str, Path], names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(files[name], []).append(name)
    for path, file_names in by_file.items():
        try:
            with safe_open(path, framework="numpy") as f:
                available = set(f.keys())
                for name in file_names:
                    if name not in available:
                        raise CheckpointError(f"{path}: index lists {name} but the file lacks it")
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def load_hf(
    directory: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules | None = None,
    **overrides,
) -> Transformer:
    """Loads an HF Qwen2/Qwen3 checkpoint.

    Args:
      directory: holds `config.json` and the safetensors file(s).
      mesh, rules: place each parameter directly with its sharding (default: one device).
      **overrides: `ModelConfig` fields to override (e.g. `dtype`, `attention`).

    Returns:
      The model, parameters in `config.dtype`.

    Raises:
      CheckpointError: naming the file and tensor at fault.
    """
    directory = Path(directory)
    config = read_model_config(directory, **overrides)
    files = _tensor_files(directory)
    table = _tensor_map(config)
    wanted = {t.hf_name for t in table}
    missing = sorted(wanted - set(files))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(
        name
        for name in set(files) - wanted
        if not name.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_embeddings and name == "lm_head.weight")
    )
    if unexpected:
        raise CheckpointError(
            f"{directory}: unexpected tensor {unexpected[0]} for this config.json "
            f"({len(unexpected)} unexpected)"
        )

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(abstract_state))
    by_name = {t.hf_name: t for t in table}
    loaded = {}
    for name, array in _read_tensors(files, wanted):
        spec = by_name[name]
        variable = variables[spec.path]
        value = spec.to_model(array)
        if value.shape != variable.get_value().shape:
            raise CheckpointError(
                f"{files[name]}: tensor {name} has shape {array.shape}, which does not fit "
                f"the parameter shape {variable.get_value().shape} implied by config.json"
            )
        value = value.astype(variable.get_value().dtype)
        if mesh is not None:
            axes = logical_axes_of(variable)
            spec_ = logical_to_spec(axes, rules or (), value.shape, dict(mesh.shape))
            array_on_device = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec_))
        else:
            array_on_device = jax.device_put(value)
        loaded[spec.path] = variable.replace(array_on_device)
    state = nnx.from_flat_state(sorted(loaded.items()))
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _to_hf_on_device(x: jax.Array, to_hf: Callable, dtype: np.dtype) -> jax.Array:
    """One parameter in HF layout and `dtype`: reshape, transpose and cast in one program,
    on the parameter's own device(s)."""
    return to_hf(x).astype(dtype)


def hf_tensors(
    model: Transformer, get: Callable[[jax.Array], np.ndarray | jax.Array] = lambda x: x
) -> dict[str, np.ndarray | jax.Array]:
    """`model`'s parameters by HF name in HF layout: what `export_hf` writes, or, with
    the default `get`, JAX arrays left where they are (a vLLM engine's in-memory update).

    Args:
      get: applied to each parameter first (e.g. a copy to the host, or to a device).
    """
    config = model.config
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for spec in _tensor_map(config):
        value = get(variables[spec.path].get_value())
        if isinstance(value, jax.Array) and spec.to_hf is not _identity:
            value = _to_hf_on_device(value, spec.to_hf, value.dtype)
        else:
            value = spec.to_hf(value)
        tensors[spec.hf_name] = value
    for name, shape in _zero_biases(config):  # Qwen2 layout wants q/k/v biases.
        tensors[name] = get(jax.numpy.zeros(shape, config.dtype))
    return tensors


def _zero_biases(config: ModelConfig) -> list[tuple[str, tuple[int]]]:
    """The q/k/v biases (name, HF shape) a Qwen2 export carries as zeros for a model
    without them (neither qk-norm nor bias: Qwen2 computes the same function)."""
    if config.qk_norm or config.qkv_bias:
        return []
    d, h, kv = config.head_dim, config.num_heads, config.num_kv_heads
    return [
        (f"model.layers.{i}.self_attn.{proj}_proj.bias", (heads * d,))
        for i in range(config.num_layers)
        for proj, heads in (("q", h), ("k", kv), ("v", kv))
    ]


def tokenizer_fingerprint(tokenizer: str | os.PathLike) -> str:
    """What `model.tokenizer`'s ids mean, in one string: `bytes` for the byte tokenizer,
    else `sha256:<hex>` of the directory's tokenizer.json (or, lacking one, of its
    vocabulary files, else of tokenizer_config.json). Chat-template files are left out:
    a new template renders conversations differently but keeps every id's string.

    Raises:
      ConfigError: naming `config.model.tokenizer` when the directory has none of them.
    """
    if str(tokenizer) == BYTE_TOKENIZER:
        return BYTE_TOKENIZER
    directory = Path(tokenizer)
    if (directory / "tokenizer.json").is_file():
        names: tuple[str, ...] = ("tokenizer.json",)
    else:
        names = tuple(n for n in _VOCABULARY_FILES if (directory / n).is_file())
        names = names or tuple(n for n in ("tokenizer_config.json",) if (directory / n).is_file())
    if not names:
        raise ConfigError(f"config.model.tokenizer={tokenizer}: no tokenizer files in it")
    digest = hashlib.sha256()
    for name in names:
        if len(names) > 1:
            digest.update(name.encode() + b"\0")
        digest.update((directory / name).read_bytes())
    return f"sha256:{digest.hexdigest()}"


@dataclasses.dataclass(frozen=True)
class _ExportTensor:
    """One tensor of an export: where its value comes from and where it goes."""

    hf_name: str
    shape: tuple[int, ...]
    nbytes: int
    param: jax.Array | None  # None: zeros (a Qwen2 bias the model lacks)
    to_hf: Callable[[np.ndarray], np.ndarray]


def _export_plan(model: Transformer, dtype: np.dtype) -> list[_ExportTensor]:
    """Every tensor `export_hf` writes, in `hf_tensors` order, with its HF shape and
    size known before any is computed."""
    config = model.config
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    plan = []
    for spec in _tensor_map(config):
        param = variables[spec.path].get_value()
        shape = _hf_shape(spec.to_hf, param.shape)
        plan.append(_ExportTensor(spec.hf_name, shape, _nbytes(shape, dtype), param, spec.to_hf))
    for name, shape in _zero_biases(config):
        plan.append(_ExportTensor(name, shape, _nbytes(shape, dtype), None, _identity))
    return plan


@functools.cache
def _hf_shape(to_hf: Callable, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `to_hf` gives an array of `shape` (traced once per pair, not per layer)."""
    return tuple(jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape, np.float32)).shape)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


@functools.partial(jax.jit, static_argnums=(2, 3), donate_argnums=1, keep_unused=True)
def _to_hf_into(x: jax.Array, spare: jax.Array, to_hf: Callable, dtype: np.dtype) -> jax.Array:
    """`_to_hf_on_device` into `spare`'s memory (donated: an earlier result of the same
    conversion of a parameter of the same shape and sharding, which nothing reads)."""
    return to_hf(x).astype(dtype)


def _host_tensors(
    tensors: list[_ExportTensor], dtype: np.dtype, lookahead_bytes: int
) -> Iterator[np.ndarray]:
    """Each tensor's HF-layout bytes on the host, in order, converted on the parameters'
    devices and copied to the host by a thread of its own while the caller writes the
    last (a CPU backend runs a transpose in the thread that dispatches it).

    At most `lookahead_bytes` of tensors (however many, at least one) are held at a
    time: converted, with the caller, or spare. Neither device nor host holds more than
    that besides the model. A converted tensor the caller is done with is a spare, given
    to the next conversion of the same kind to write into instead of new memory (on a
    CPU, fresh pages cost about as much as the transpose itself); spares are freed
    when room is needed. Close the generator to stop the thread early.
    """
    room = threading.Condition()
    held = 0  # bytes: converted and not yet given back, or spare
    spares: dict[tuple, list[jax.Array]] = collections.defaultdict(list)
    stop = False
    done: queue.SimpleQueue = queue.SimpleQueue()

    def reserve(t: _ExportTensor, kind: tuple | None) -> tuple[bool, jax.Array | None]:
        """Waits for room for `t`: (False, None) if stopped, else (True, a spare of
        `kind` to write into, or None where the tensor takes new memory)."""
        nonlocal held
        with room:
            while not stop:
                if kind is not None and spares[kind]:
                    return True, spares[kind].pop()
                for other in spares.values():
                    while other and held and held + t.nbytes > lookahead_bytes:
                        held -= other.pop().nbytes
                if not held or held + t.nbytes <= lookahead_bytes:
                    held += t.nbytes
                    return True, None
                room.wait()
            return False, None

    def convert() -> None:
        try:
            for t in tensors:
                converts = t.param is not None and (
                    t.to_hf is not _identity or t.param.dtype != dtype
                )
                kind = (t.to_hf, t.param.shape, t.param.sharding) if converts else None
                go, spare = reserve(t, kind)
                if not go:
                    return
                if t.param is None:
                    value = np.zeros(t.shape, dtype)
                elif not converts:
                    value = t.param
                elif spare is None:
                    value = _to_hf_on_device(t.param, t.to_hf, dtype)
                else:
                    value = _to_hf_into(t.param, spare, t.to_hf, dtype)
                del spare
                host = np.asarray(jax.device_get(value))
                done.put((t.nbytes, host, (kind, value) if converts else None, None))
                del host, value
        except BaseException as e:  # handed to the caller, who raises it
            done.put((0, None, None, e))

    thread = threading.Thread(target=convert, name="export_hf-convert", daemon=True)
    thread.start()
    try:
        for _ in tensors:
            nbytes, host, converted, error = done.get()
            if error is not None:
                raise error
            yield host
            del host  # (the caller is done with it: its device memory may be reused)
            with room:
                if converted is None:
                    held -= nbytes
                else:
                    spares[converted[0]].append(converted[1])
                converted = None
                room.notify()
    finally:
        with room:
            stop = True
            spares.clear()
            room.notify()
        thread.join()


def _safetensors_header(tensors: list[_ExportTensor], dtype: np.dtype) -> bytes:
    """The safetensors header (length, then JSON padded to 8 bytes with spaces) for
    `tensors` stored in this order, exactly as `safetensors.numpy.save_file` writes it."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_safetensors(
    path: Path, tensors: list[_ExportTensor], host: Iterator[np.ndarray], dtype: np.dtype
) -> None:
    """Streams `tensors` (already in file order) into `path`: the header, then each
    tensor's bytes as `host` yields them."""
    with open(path, "wb") as f:
        f.write(_safetensors_header(tensors, dtype))
        for t in tensors:
            value = next(host)
            if value.shape != t.shape or value.dtype != dtype:
                raise CheckpointError(
                    f"{path}: tensor {t.hf_name} came out as {value.dtype}{list(value.shape)}, "
                    f"expected {dtype}{list(t.shape)}"
                )
            if sys.byteorder == "big":  # safetensors is little-endian
                value = value.byteswap()
            f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
            del value


def export_hf(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Writes `model` as an HF checkpoint (config.json + safetensors, sharded if large).

    Each tensor is converted to HF layout on the parameter's own device(s), copied to
    the host once and streamed into its file behind a header written first (its
    offsets follow from shapes and dtypes), so neither device nor host ever holds a
    second copy of the model (at most `_EXPORT_LOOKAHEAD_BYTES` of converted tensors).
    The files are byte for byte what `safetensors.numpy.save_file` writes for the same
    tensors.

    Files are written under temporary names and renamed, and `config.json` is written
    last, so a crash never leaves a directory that loads as a valid but partial checkpoint.

    Args:
      tokenizer: an HF tokenizer directory (a `model.tokenizer`): whichever of
        `TOKENIZER_EXPORT_FILES` it holds are copied in (and others of them the directory held
        removed), so `AutoTokenizer.from_pretrained(directory)` loads it. None or
        `bytes` (the byte tokenizer, which has no files): no tokenizer file is touched.
      max_shard_bytes: a file holds tensors up to this many bytes (a larger tensor alone).

    Returns:
      The checkpoint directory.
    """
    config = model.config
    hf_config = hf_config_from_model(config)  # refuses a layout HF lacks before any write
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32)
    plan = _export_plan(model, dtype)

    shards: list[list[_ExportTensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes

    # config.json goes first and comes back last: it marks a complete checkpoint.
    old = [CONFIG_FILE, SINGLE_FILE, INDEX_FILE]
    old += [p.name for p in directory.glob("model-*.safetensors")]
    tokenizer_files: list[Path] = []
    if tokenizer is not None and str(tokenizer) != BYTE_TOKENIZER:
        source = Path(tokenizer)
        if not source.is_dir():
            raise CheckpointError(f"tokenizer {source}: not a directory")
        if source.resolve() != directory.resolve():  # (exporting into it: keep its own)
            tokenizer_files = [source / n for n in TOKENIZER_EXPORT_FILES if (source / n).is_file()]
            old += [n for n in TOKENIZER_EXPORT_FILES if not (source / n).is_file()]
    for stale in old:
        (directory / stale).unlink(missing_ok=True)
    for path in tokenizer_files:
        tmp = directory / f".{path.name}.tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, directory / path.name)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # safetensors stores a file's tensors sorted by name (one dtype here): so do we, and
    # the device converts them in that order, one file after another.
    ordered = [sorted(shard, key=lambda t: t.hf_name) for shard in shards]
    host = _host_tensors([t for shard in ordered for t in shard], dtype, _EXPORT_LOOKAHEAD_BYTES)
    with contextlib.closing(host):  # (a failed write stops the conversions at once)
        for name, shard in zip(names, ordered, strict=True):
            tmp = directory / f".{name}.tmp"
            try:
                _write_safetensors(tmp, shard, host, dtype)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, directory / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in plan)},
            "weight_map": {t.hf_name: n for n, s in zip(names, shards, strict=True) for t in s},
        }
        _write_json(directory / INDEX_FILE, index)
    _write_json(directory / CONFIG_FILE, hf_config)
    return directory


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
