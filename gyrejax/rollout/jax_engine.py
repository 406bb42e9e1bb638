"""The JAX rollout engine: continuous batching over fixed slots on one cell.

One engine thread owns all state. Each loop iteration it runs the commands that arrived
(submit, import, export, cancel, weight update, ...), prefills waiting requests into
free slots (prompt lengths padded to power-of-two buckets), and then runs `decode_steps`
decode steps for all slots in one compiled call (a `lax.scan`: stop ids, token budgets
and the context limit are checked on device, so finished slots simply stop advancing).
Attention reads only a power-of-two prefix of the cache that covers every active slot.
Shapes are static per bucket, so compiles are few and cached.

Each token is sampled with `sample_per_slot` (its own temperature/top-k/top-p and a key
derived from the request seed and the token's index), carries the exact log-prob under
the distribution sampled and the engine's weight version at that decode call. Weights
change only between decode calls; requests in flight keep going.

Live migration: `export` copies a request's KV-cache rows (device arrays on this cell)
with its tokens so far; `import_request` on another engine writes them into a free slot
(device to device) and generation continues as if nothing happened.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gyrejax.cells import Cell
from gyrejax.config import SAMPLE_SHARDING_RULES, ShardingRules
from gyrejax.model import sharding
from gyrejax.model.hf_io import load_hf
from gyrejax.model.sampling import bucket_length, sample_per_slot
from gyrejax.model.transformer import KVCache, Transformer
from gyrejax.rollout.engine import Engine
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated

MAX_STOP_IDS = 8  # stop ids per request checked on device


@dataclasses.dataclass
class _Slot:
    """Host-side state of one running request."""

    request: Request
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    output: list[int]
    logprobs: list[float]
    versions: list[int]
    engines: tuple[str, ...]
    length: int = 0  # cache entries written (mirrors the device)


def _resolve(future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class JaxEngine(Engine):
    """Serves requests with the JAX model on one cell.

    Args:
      name: unique engine name (used in records).
      model: the policy (its weights are copied onto the cell).
      cell: where it runs; None means the default device.
      max_slots: concurrent requests.
      max_seq_len: cache length per slot (prompt + output).
      decode_steps: decode steps per compiled call (new requests wait at most this long).
      rules: sharding rules for the weights and cache.
      version: policy version of `model`.
    """

    exports_kv = True

    def __init__(
        self,
        name: str,
        model: Transformer,
        cell: Cell | None = None,
        *,
        max_slots: int = 8,
        max_seq_len: int = 2048,
        decode_steps: int = 8,
        rules: ShardingRules = SAMPLE_SHARDING_RULES,
        version: int = 0,
    ):
        self.name = name
        self.config = model.config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.decode_steps = decode_steps
        if cell is None:
            mesh = jax.make_mesh(
                (1, 1), ("fsdp", "tensor"), (jax.sharding.AxisType.Auto,) * 2,
                devices=jax.devices()[:1],
            )  # fmt: skip
        else:
            mesh = cell.mesh
        self.mesh = mesh
        self.rules = rules
        self.graphdef, state = nnx.split(model)
        self._param_shardings = sharding.named_shardings(
            sharding.partition_specs(state, mesh, rules), mesh
        )
        self._params = jax.device_put(nnx.to_pure_dict(state), self._param_shardings)
        self._version = version
        cache_spec = sharding.logical_to_spec(
            ("batch", "kv_heads", "length", "head_dim"),
            rules,
            (max_slots, self.config.num_kv_heads, max_seq_len, self.config.head_dim),
            dict(mesh.shape),
        )
        self._cache_sharding = NamedSharding(mesh, cache_spec)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._cache: KVCache | None = self._new_cache()
        self._slots: list[_Slot | None] = [None] * max_slots
        self._next_token = np.zeros(max_slots, np.int32)
        self._waiting: collections.deque = collections.deque()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._load = 0
        self._load_lock = threading.Lock()
        self.heartbeat = time.monotonic()
        self.tokens_generated = 0
        self._failure: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # --- interface ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.max_slots

    @property
    def load(self) -> int:
        return self._load

    @property
    def version(self) -> int:
        return self._version

    def request_ids(self) -> list[str]:
        running = [s.request.request_id for s in self._slots if s is not None]
        return running + [item[0].request.request_id for item in list(self._waiting)]

    def submit(self, request: Request) -> asyncio.Future[Completion]:
        live = LiveRequest(request, np.zeros(0, np.int32), np.zeros(0, np.float32),
                           np.zeros(0, np.int32), None, ())  # fmt: skip
        return self.import_request(live)

    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        self._check_request(live.request)
        context = len(live.request.prompt_ids) + len(live.output_ids)
        if context >= self.max_seq_len or live.remaining_tokens <= 0:
            raise ValueError(
                f"request {live.request.request_id!r} cannot continue on engine {self.name}: "
                f"{context} tokens of context (max_seq_len={self.max_seq_len}), "
                f"{live.remaining_tokens} tokens of budget left"
            )
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._load_lock:
            self._load += 1
        self._post(lambda: self._waiting.append((live, future, loop)))
        return future

    async def export(self, request_id: str) -> LiveRequest:
        return await self._call(lambda: self._export(request_id))

    def cancel(self, request_id: str) -> None:
        self._post(lambda: self._cancel(request_id))

    async def update_weights(self, weights, version: int) -> None:
        """`weights`: an nnx pure dict of parameters, an nnx State, or an HF directory."""
        if isinstance(weights, str | bytes) or hasattr(weights, "__fspath__"):
            weights = load_hf(weights)
        if isinstance(weights, nnx.Module):
            weights = nnx.state(weights)
        if isinstance(weights, nnx.State):
            weights = nnx.to_pure_dict(weights)

        def swap():
            # Wait for the copy: the caller may donate its buffers (a training update)
            # as soon as this returns.
            self._params = jax.block_until_ready(jax.device_put(weights, self._param_shardings))
            self._version = version

        await self._call(swap)

    async def release_memory(self) -> None:
        def release():
            if any(s is not None for s in self._slots) or self._waiting:
                raise RuntimeError(f"engine {self.name}: release_memory with requests in flight")
            self._cache = None
            self._params = None

        await self._call(release)

    async def resume(self) -> None:
        def resume():
            if self._cache is None:
                self._cache = self._new_cache()

        await self._call(resume)

    async def shutdown(self) -> None:
        self._stopping = True
        self._post(lambda: None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def simulate_failure(self, kind: str) -> None:
        """Test hook: "die" stops the engine thread with an error; "hang" freezes it."""
        self._post(lambda: self._fail_now(kind))

    # --- engine thread ------------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    async def _call(self, fn: Callable):
        """Runs `fn` on the engine thread between decode calls and returns its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def command():
            try:
                result = fn()
            except BaseException as e:
                loop.call_soon_threadsafe(_resolve, future, None, e)
            else:
                loop.call_soon_threadsafe(_resolve, future, result)

        self._post(command)
        return await future

    def _run(self) -> None:
        try:
            with jax.set_mesh(self.mesh), sharding.axis_rules(self.rules):
                while not self._stopping:
                    self.heartbeat = time.monotonic()
                    ready = self._params is not None and self._cache is not None
                    self._drain_commands(block=not (ready and self._busy()))
                    if self._stopping or self._params is None or self._cache is None:
                        continue
                    self._admit()
                    if any(s is not None for s in self._slots):
                        self._decode()
        except _Hang:
            while not self._stopping:  # frozen: no heartbeat, no progress
                time.sleep(0.05)
        except BaseException as e:  # the engine is dead: no request may hang
            self._failure = f"engine {self.name} failed: {e!r}"
            logging.error("%s", self._failure)
        self._fail_all(self._failure or f"engine {self.name} shut down")

    def _busy(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_now(self, kind: str) -> None:
        if kind == "hang":
            raise _Hang()
        raise RuntimeError("simulated failure")

    def _fail_all(self, message: str) -> None:
        error = EngineError(message)
        for index, slot in enumerate(self._slots):
            if slot is not None:
                slot.loop.call_soon_threadsafe(_resolve, slot.future, None, error)
                self._slots[index] = None
        while self._waiting:
            _, future, loop = self._waiting.popleft()
            loop.call_soon_threadsafe(_resolve, future, None, error)
        while True:  # commands still queued (exports, updates) must not hang either
            try:
                self._commands.get_nowait()
            except queue.Empty:
                break
        with self._load_lock:
            self._load = 0

    def _check_request(self, request: Request) -> None:
        if self._failure is not None or self._stopping:
            raise EngineError(self._failure or f"engine {self.name} is shut down")
        n = len(request.prompt_ids)
        if n >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens does not fit "
                f"engine {self.name}'s max_seq_len={self.max_seq_len}"
            )
        bad = request.prompt_ids[
            (request.prompt_ids < 0) | (request.prompt_ids >= self.config.vocab_size)
        ]
        if bad.size:
            raise ValueError(
                f"request {request.request_id!r}: token {int(bad[0])} outside "
                f"[0, {self.config.vocab_size})"
            )
        if len(request.sampling.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"request {request.request_id!r}: more than {MAX_STOP_IDS} stop ids")

    def _new_cache(self) -> KVCache:
        cache = KVCache.create(self.config, self.max_slots, self.max_seq_len)
        return jax.device_put(
            cache,
            KVCache(
                k=(self._cache_sharding,) * self.config.num_layers,
                v=(self._cache_sharding,) * self.config.num_layers,
                lengths=self._replicated,
            ),
        )

    def _finish(self, index: int, reason: str) -> None:
        slot = self._slots[index]
        self._slots[index] = None
        with self._load_lock:
            self._load -= 1
        completion = Completion(
            request_id=slot.request.request_id,
            output_ids=np.asarray(slot.output, np.int32),
            logprobs=np.asarray(slot.logprobs, np.float32),
            versions=np.asarray(slot.versions, np.int32),
            finish_reason=reason,
            engines=slot.engines,
        )
        slot.loop.call_soon_threadsafe(_resolve, slot.future, completion)

    def _emit(self, index: int, token: int, logprob: float) -> str | None:
        """Appends one sampled token; returns the finish reason if the request is done."""
        slot = self._slots[index]
        slot.output.append(token)
        slot.logprobs.append(logprob)
        slot.versions.append(self._version)
        self._next_token[index] = token
        self.tokens_generated += 1
        sampling = slot.request.sampling
        if token in sampling.stop_ids:
            return "stop"
        if len(slot.output) >= sampling.max_new_tokens or slot.length >= self.max_seq_len:
            return "length"
        return None

    def _sampling_arrays(self, slots: list[int]):
        """Per-slot sampling parameters for the given slot indices (inactive: defaults)."""
        n = len(slots)
        temperature = np.zeros(n, np.float32)
        top_k = np.zeros(n, np.int32)
        top_p = np.ones(n, np.float32)
        seed = np.zeros(n, np.int32)
        index = np.zeros(n, np.int32)
        max_new = np.ones(n, np.int32)
        stops = np.full((n, MAX_STOP_IDS), -1, np.int32)
        for i, s in enumerate(slots):
            slot = self._slots[s] if s is not None else None
            if slot is None:
                continue
            p = slot.request.sampling
            temperature[i], top_k[i], top_p[i], seed[i] = p.temperature, p.top_k, p.top_p, p.seed
            index[i], max_new[i] = len(slot.output), p.max_new_tokens
            stops[i, : len(p.stop_ids)] = p.stop_ids
        return temperature, top_k, top_p, seed, index, max_new, stops

    def _admit(self) -> None:
        """Prefills (or imports) waiting requests into free slots."""
        while self._waiting and None in self._slots:
            live, future, loop = self._waiting.popleft()
            if future.done():  # cancelled while waiting
                with self._load_lock:
                    self._load -= 1
                continue
            index = self._slots.index(None)
            self._slots[index] = _Slot(
                request=live.request,
                future=future,
                loop=loop,
                output=list(map(int, live.output_ids)),
                logprobs=list(map(float, live.logprobs)),
                versions=list(map(int, live.versions)),
                engines=(*live.engines, self.name),
            )
            if live.kv is not None and len(live.output_ids):
                self._import_kv(index, live)
            else:
                self._prefill(index)

    def _prefill(self, index: int) -> None:
        """Runs prompt (+ tokens already generated elsewhere) and samples the next token."""
        slot = self._slots[index]
        context = np.concatenate([slot.request.prompt_ids, np.asarray(slot.output, np.int32)])
        n = len(context)
        bucket = min(bucket_length(n), self.max_seq_len)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = context
        arrays = self._sampling_arrays([index])
        token, logprob, self._cache = _prefill(
            self.graphdef, self._params, tokens, np.array([n], np.int32),
            np.array([index], np.int32), self._cache, *arrays[:5],
        )  # fmt: skip
        slot.length = n
        token, logprob = jax.device_get((token, logprob))
        reason = self._emit(index, int(token[0]), float(logprob[0]))
        if reason:
            self._finish(index, reason)

    def _import_kv(self, index: int, live: LiveRequest) -> None:
        """Writes an exported request's cache rows into slot `index` (device to device)."""
        slot = self._slots[index]
        n = len(live.request.prompt_ids) + len(live.output_ids) - 1
        bucket = min(bucket_length(n), self.max_seq_len)
        ks = tuple(_pad_length(jax.device_put(k, self._replicated), bucket) for k, _ in live.kv)
        vs = tuple(_pad_length(jax.device_put(v, self._replicated), bucket) for _, v in live.kv)
        self._cache = _write_rows(self._cache, ks, vs, np.int32(index), np.int32(n))
        slot.length = n
        self._next_token[index] = int(live.output_ids[-1])

    def _decode(self) -> None:
        active_idx = [i for i, s in enumerate(self._slots) if s is not None]
        active = np.zeros(self.max_slots, bool)
        active[active_idx] = True
        longest = max(self._slots[i].length for i in active_idx)
        attend = min(bucket_length(longest + self.decode_steps), self.max_seq_len)
        arrays = self._sampling_arrays(list(range(self.max_slots)))
        tokens, logprobs, emitted, self._cache = _decode_steps(
            self.graphdef, self._params, self._next_token.copy(), self._cache, active,
            *arrays, np.int32(self.max_seq_len), self.decode_steps, attend,
        )  # fmt: skip
        tokens, logprobs, emitted = jax.device_get((tokens, logprobs, emitted))
        for step in range(self.decode_steps):
            for i in np.flatnonzero(emitted[step]):
                slot = self._slots[i]
                if slot is None:
                    continue
                slot.length += 1
                reason = self._emit(int(i), int(tokens[step, i]), float(logprobs[step, i]))
                if reason:
                    self._finish(int(i), reason)

    def _find(self, request_id: str):
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request.request_id == request_id:
                return index
        return None

    def _export(self, request_id: str) -> LiveRequest:
        index = self._find(request_id)
        if index is None:
            for item in list(self._waiting):  # not started yet: nothing to copy
                if item[0].request.request_id == request_id:
                    self._waiting.remove(item)
                    live, future, loop = item
                    with self._load_lock:
                        self._load -= 1
                    loop.call_soon_threadsafe(_resolve, future, None, RequestMigrated(live))
                    return live
            raise KeyError(f"engine {self.name} holds no request {request_id!r}")
        slot = self._slots[index]
        n = slot.length
        kv = tuple(
            (self._cache.k[layer][index, :, :n], self._cache.v[layer][index, :, :n])
            for layer in range(self.config.num_layers)
        )
        live = LiveRequest(
            request=slot.request,
            output_ids=np.asarray(slot.output, np.int32),
            logprobs=np.asarray(slot.logprobs, np.float32),
            versions=np.asarray(slot.versions, np.int32),
            kv=kv,
            engines=slot.engines,
        )
        self._slots[index] = None
        with self._load_lock:
            self._load -= 1
        slot.loop.call_soon_threadsafe(_resolve, slot.future, None, RequestMigrated(live))
        return live

    def _cancel(self, request_id: str) -> None:
        index = self._find(request_id)
        if index is not None:
            self._finish(index, "cancelled")
            return
        for item in list(self._waiting):
            if item[0].request.request_id == request_id:
                self._waiting.remove(item)
                live, future, loop = item
                with self._load_lock:
                    self._load -= 1
                empty = Completion(request_id, live.output_ids, live.logprobs, live.versions,
                                   "cancelled", (*live.engines, self.name))  # fmt: skip
                loop.call_soon_threadsafe(_resolve, future, empty)


class _Hang(Exception):
    """Raised on the engine thread by `simulate_failure("hang")`."""


def _pad_length(x: jax.Array, length: int) -> jax.Array:
    """[KV, n, D] -> [KV, length, D] (zeros after n)."""
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_rows(cache: KVCache, ks, vs, slot, length) -> KVCache:
    def write(layer_cache, rows):
        return jax.lax.dynamic_update_slice(layer_cache, rows[None].astype(layer_cache.dtype),
                                            (slot, 0, 0, 0))  # fmt: skip

    k = tuple(write(c, r) for c, r in zip(cache.k, ks, strict=True))
    v = tuple(write(c, r) for c, r in zip(cache.v, vs, strict=True))
    return KVCache(k, v, cache.lengths.at[slot].set(length))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(5,))
def _prefill(graphdef, params, tokens, lengths, slots, cache, temperature, top_k, top_p, seed,
             index):  # fmt: skip
    model = nnx.merge(graphdef, params)
    logits, cache = model.prefill(tokens, lengths, slots, cache)
    token, logprob = sample_per_slot(logits, temperature, top_k, top_p, seed, index)
    return token, logprob, cache


@functools.partial(jax.jit, static_argnums=(0, 13, 14), donate_argnums=(3,))
def _decode_steps(graphdef, params, tokens, cache, active, temperature, top_k, top_p, seed,
                  index, max_new, stops, max_len, num_steps, attend_len):  # fmt: skip
    """`num_steps` decode steps; returns tokens, log-probs and emitted masks [K, S]."""
    model = nnx.merge(graphdef, params)

    def step(carry, _):
        tokens, cache, active, index = carry
        logits, cache = model.decode(tokens, cache, active, attend_len)
        new, logprob = sample_per_slot(logits, temperature, top_k, top_p, seed, index)
        index = index + active
        stopped = jnp.any(new[:, None] == stops, axis=-1)
        exhausted = (index >= max_new) | (cache.lengths >= max_len)
        emitted = active
        tokens = jnp.where(active, new, tokens)
        active = active & ~stopped & ~exhausted
        return (tokens, cache, active, index), (new, logprob, emitted)

    (_, cache, _, _), (new, logprob, emitted) = jax.lax.scan(
        step, (tokens, cache, active, index), None, length=num_steps
    )
    return new, logprob, emitted, cache
