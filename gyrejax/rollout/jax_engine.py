"""The JAX rollout engine: continuous batching over fixed slots on one cell.

One engine thread owns all state. Each loop iteration it runs the commands that arrived
(submit, import, export, cancel, weight update, ...), prefills waiting requests into
free slots (prompt lengths padded to power-of-two buckets), and then runs `decode_steps`
decode steps for its busy slots in one compiled call (a `lax.scan`: stop ids, token
budgets and the context limit are checked on device, so finished slots simply stop
advancing). Busy slots are kept first (a freed slot takes the last busy one's KV rows),
so a decode computes over a width of slots (a power of four) that covers them, not every
slot: a half-empty engine, or a batch-1 tail, costs what it holds. Attention reads only a
power-of-two prefix of the cache that covers every busy slot. Shapes are static per
bucket, so compiles are few and cached.

Each token is sampled with `sample_per_slot` (its own temperature/top-k/top-p and a key
derived from the request seed and the token's index), carries the exact log-prob under
the distribution sampled and the engine's weight version at that decode call. Weights
change only between decode calls; requests in flight keep going.

Live migration: `export` copies a request's KV-cache rows (device arrays on this cell,
padded to the same length buckets) with its tokens so far; `import_request` on another
engine writes them into a free slot (device to device) and generation continues as if
nothing happened.

Compiles: every device function is compiled ahead of time per length bucket, and the
executables are kept and counted (`compile_count`). With `precompile=True` the engine
thread never compiles, so a drain, an import, a weight update or a release/resume never
waits for a compile. Before serving it compiles the cache allocation and KV export and
import at the largest bucket; a background thread then compiles KV import and export for
every bucket (small) and the slot move, and each prefill or decode bucket (length, and
for decode width) the engine asks for, when first needed (`compile_all`: every bucket,
ahead of need). Meanwhile the engine runs the cheapest compiled bucket that fits (the
same tokens up to float summation order, since padding, idle slots and a longer
attention prefix are masked; KV rows to import are fitted to one on the host), or leaves
that work waiting while it serves everything else, commands first.
On CPU-emulated devices a compile takes the cores the cells compute on, so buckets never
used are not compiled unless asked. `ready()` returns once the engine serves,
`precompiled()` once its background compiler first ran out of work. Without `precompile`
each executable compiles on first use, on the engine thread (tests, one-off batches).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
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
from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated

MAX_STOP_IDS = 8  # stop ids per request checked on device

# Executables shared by engines that would compile the very same one (same model, shapes,
# mesh devices and rules): several engines on one device (tests, benchmarks) compile
# once. Engines on different cells have different devices, so each compiles its own.
_SHARED: dict[tuple, jax.stages.Compiled] = {}
_SHARED_LOCKS: dict[tuple, threading.Lock] = collections.defaultdict(threading.Lock)
_SHARED_GUARD = threading.Lock()


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
      precompile: never compile on the engine thread: what it needs first before it
        serves, the rest in the background (see the module docstring).
      compile_all: with `precompile`, compile every length bucket in the background
        before it is needed (where compiling costs no accelerator time).
      narrow: decode only as wide as the busy slots (a power of four); False: every
        slot in every call, one decode executable per length bucket.
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
        precompile: bool = False,
        compile_all: bool = False,
        narrow: bool = True,
    ):
        self.name = name
        self.config = model.config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.decode_steps = decode_steps
        if cell is None:
            mesh = jax.make_mesh(
                (1, 1),
                ("fsdp", "tensor"),
                (jax.sharding.AxisType.Auto,) * 2,
                devices=jax.devices()[:1],
            )
        else:
            mesh = cell.mesh
        self.mesh = mesh
        self.rules = rules
        self.graphdef, state = nnx.split(model)
        self._param_shardings = sharding.named_shardings(
            sharding.partition_specs(state, mesh, rules), mesh
        )
        params = nnx.to_pure_dict(state)
        self._params = jax.device_put(params, self._param_shardings)
        self._abstract_params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            params,
            self._param_shardings,
        )
        self._version = version
        cache_spec = sharding.logical_to_spec(
            ("batch", "kv_heads", "length", "head_dim"),
            rules,
            (max_slots, self.config.num_kv_heads, max_seq_len, self.config.head_dim),
            dict(mesh.shape),
        )
        self._cache_sharding = NamedSharding(mesh, cache_spec)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        layers = self.config.num_layers
        self._cache_shardings = KVCache(
            k=(self._cache_sharding,) * layers,
            v=(self._cache_sharding,) * layers,
            lengths=self._replicated,
        )
        # Compiled executables by key (see `_compile`); every compile is counted, so a
        # test can prove that nothing after start-up compiles.
        self.compile_count = 0
        self.compile_s = 0.0  # seconds spent compiling (precompile included)
        self.ready_s: float | None = None  # from start until the engine served
        self.precompile_s: float | None = None  # from start until `precompiled()`
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._buckets = length_buckets(max_seq_len)
        self._widths = width_buckets(max_slots) if narrow else [max_slots]
        self.decode_widths: collections.Counter[int] = collections.Counter()  # calls by width
        self._decode_wants: collections.Counter[tuple] = collections.Counter()
        self._signature = (
            self.graphdef,
            self.config,
            mesh,
            tuple(map(tuple, rules)),
            max_slots,
            max_seq_len,
            decode_steps,
            *jax.tree.leaves(self._abstract_params),
        )
        self._precompile = precompile
        self._compile_all = compile_all
        self._ready = threading.Event()  # serving
        self._precompiled = threading.Event()  # the ahead-of-need compiles are done
        self._pending: list[tuple] = []  # background compiles, the next one first
        self._pending_changed = threading.Condition()  # guards _pending and the counters
        self._started_at = time.perf_counter()
        self._compiler: threading.Thread | None = None
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
        live = LiveRequest(
            request, np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), None, ()
        )
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

    async def update_weights(self, weights: Weights | nnx.Module, version: int) -> None:
        """`weights`: parameters (a pure dict or an nnx State), an HF directory, or a
        model whose parameters to take."""
        if isinstance(weights, str | bytes) or hasattr(weights, "__fspath__"):
            weights = load_hf(weights)
        if isinstance(weights, nnx.Module):
            weights = nnx.state(weights)
        if isinstance(weights, nnx.State):
            weights = nnx.to_pure_dict(weights)
        weights = self._conform(weights)

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

    async def ready(self) -> None:
        """Returns once the engine serves (with `precompile`: once the cache and the
        largest KV export and import are compiled)."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)

    async def precompiled(self) -> None:
        """Returns once the background compiler first ran out of work: KV import and
        export for every bucket, what the engine asked for by then, and with
        `compile_all` every bucket, are compiled. At once without `precompile`."""
        if self._precompile:
            await asyncio.get_running_loop().run_in_executor(None, self._precompiled.wait)

    async def shutdown(self) -> None:
        self._stopping = True
        self._post(lambda: None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self._compiler is not None:  # stops after the compile in progress
            with self._pending_changed:
                self._pending_changed.notify_all()
            await asyncio.get_running_loop().run_in_executor(None, self._compiler.join)

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
                if self._precompile:
                    self._precompile_start()
                self._ready.set()
                progress = True
                while not self._stopping:
                    self.heartbeat = time.monotonic()
                    ready = self._params is not None and self._cache is not None
                    # Block (briefly) for commands unless there is work that can run now;
                    # work waiting for a background compile is polled.
                    self._drain_commands(block=not (ready and self._busy() and progress))
                    if self._stopping or self._params is None or self._cache is None:
                        continue
                    progress = self._admit()
                    if any(s is not None for s in self._slots):
                        progress = self._decode() or progress
        except _Hang:
            while not self._stopping:  # frozen: no heartbeat, no progress
                time.sleep(0.05)
        except BaseException as e:  # the engine is dead: no request may hang
            self._failure = f"engine {self.name} failed: {e!r}"
            logging.error("%s", self._failure)
        self._ready.set()  # nobody waits for an engine that will never serve
        self._precompiled.set()
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

    def _conform(self, weights):
        """`weights` as the compiled functions expect them: same tree and shapes as the
        engine's parameters (else ValueError), same dtypes (cast on the host if not:
        casting on the device would compile)."""
        if jax.tree.structure(weights) != jax.tree.structure(self._abstract_params):
            raise ValueError(f"engine {self.name}: weights do not match the model's parameters")

        def conform(path, x, want):
            if tuple(x.shape) != want.shape:
                raise ValueError(
                    f"engine {self.name}: weight {jax.tree_util.keystr(path)} has shape "
                    f"{tuple(x.shape)}, the model has {want.shape}"
                )
            return x if x.dtype == want.dtype else np.asarray(x).astype(want.dtype)

        return jax.tree_util.tree_map_with_path(conform, weights, self._abstract_params)

    # --- compiled executables -----------------------------------------------------------

    def _executable_keys(self) -> tuple[list[tuple], list[tuple], list[tuple]]:
        """What the engine compiles: before serving (the cache; KV export at the largest
        bucket, which fits any length, and the import of such rows), in the background
        ahead of need (KV import, then export, for every bucket: small, and in the same
        order on every engine, so that the bucket an exporter uses is compiled on its
        importer too; the slot move), and the prefill and decode buckets (in the background
        when first needed, or ahead with `compile_all`: decode at every width)."""
        largest = self._buckets[-1]
        dtype = jnp.dtype(self.config.dtype).name
        serving = [("cache",), ("export", largest), ("import", largest, dtype)]
        smaller = self._buckets[:-1]
        ahead = [("move",)]
        ahead += [("import", b, dtype) for b in smaller] + [("export", b) for b in smaller]
        buckets = []
        for b in reversed(self._buckets):
            buckets += [("decode", b, w) for w in reversed(self._widths)] + [("prefill", b)]
        return serving, ahead, buckets

    def _precompile_start(self) -> None:
        """Compiles what serving needs on the engine thread (small; commands are still
        answered between two compiles), then starts the background compiler."""
        serving, ahead, buckets = self._executable_keys()
        for key in serving:
            if self._stopping:
                return
            self.heartbeat = time.monotonic()
            self._executable(key)
            self._drain_commands(block=False)
        self.ready_s = time.perf_counter() - self._started_at
        logging.info(
            "engine %s serves after %.1f s (%d executables compiled, length buckets %s)",
            self.name,
            self.ready_s,
            self.compile_count,
            self._buckets,
        )
        with self._pending_changed:
            self._pending = ahead + (buckets if self._compile_all else [])
        self._compiler = threading.Thread(
            target=self._compile_in_background, name=f"engine-{self.name}-compile", daemon=True
        )
        self._compiler.start()

    def _compile_in_background(self) -> None:
        """Compiles pending executables one by one, the ones the engine asked for first,
        until the engine stops."""
        try:
            while True:
                with self._pending_changed:
                    while not self._pending and not self._stopping:
                        if not self._precompiled.is_set():
                            self.precompile_s = time.perf_counter() - self._started_at
                            logging.info(
                                "engine %s: precompiled after %.1f s (%d executables, %.1f "
                                "s compiling)",
                                self.name,
                                self.precompile_s,
                                self.compile_count,
                                self.compile_s,
                            )
                            self._precompiled.set()
                        self._pending_changed.wait()
                    if self._stopping:
                        return
                    key = self._pending.pop(0)
                self._executable(key)
        except Exception as e:  # the engine serves on with the buckets it has
            logging.error("engine %s: background compile failed: %r", self.name, e)
        finally:
            self._precompiled.set()

    def _bucketed(self, key: tuple, compile_key: tuple | None = None) -> tuple | None:
        """The prefill, decode or export executable for `key` (kind, length bucket[,
        width]) and the bucket it runs at: (executable, length[, width]). Without
        `precompile`: `key`'s own, compiled now if need be. With it, never a compile on
        this thread: `runnable_bucket` of the compiled ones, or None; a prefill or
        decode goes to the front of the background queue (`key`, or `compile_key`)."""
        if key in self._executables or not self._precompile:
            return self._executable(key), *key[1:]
        wanted = compile_key or key
        if key[0] != "export" and wanted not in self._executables:  # exports keep their
            with self._pending_changed:  # place after the imports (_executable_keys)
                if wanted in self._pending:
                    self._pending.remove(wanted)
                self._pending.insert(0, wanted)
                self._pending_changed.notify_all()
        chosen = runnable_bucket(key, list(self._executables))  # list(): one GIL step
        return None if chosen is None else (self._executables[chosen], *chosen[1:])

    def _executable(self, key: tuple) -> jax.stages.Compiled:
        """The compiled executable for `key`: this engine's, another engine's with the
        same signature, or compiled now (counted in `compile_count`)."""
        executable = self._executables.get(key)
        if executable is not None:
            return executable
        shared = (self._signature, key)
        with _SHARED_GUARD:
            lock = _SHARED_LOCKS[shared]
        with lock:  # an engine compiling the same executable: wait for it, not again
            executable = _SHARED.get(shared)
            if executable is None:
                start = time.perf_counter()
                executable = _SHARED[shared] = self._compile(key)
                elapsed = time.perf_counter() - start
                with self._pending_changed:  # the engine and background threads both count
                    self.compile_count += 1
                    self.compile_s += elapsed
                serving = self._ready.is_set() and threading.current_thread() is self._thread
                if serving and self._precompile:  # a shape the precompile did not foresee
                    logging.warning(
                        "engine %s compiled %s while serving (%.1f s)", self.name, key, elapsed
                    )
        self._executables[key] = executable
        return executable

    def _compile(self, key: tuple) -> jax.stages.Compiled:
        """Lowers and compiles one executable for this cell (ahead of time, with the
        shardings pinned so that outputs fed back in match what was compiled).

        Keys: ("cache",) allocates the KV cache; ("prefill", T) runs one prompt padded to
        T; ("decode", A, W) runs `decode_steps` steps of the first W slots attending to
        A cache positions; ("export", L) reads one slot's first L positions; ("import",
        L, dtype) writes L rows of that dtype into a slot; ("move",) copies one slot's
        rows and length into another.
        """
        rep, cache, params = self._replicated, self._abstract_cache(), self._abstract_params

        def host(shape, dtype):  # arrays the engine passes from NumPy
            return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

        def sampling(n):  # see `_sampling_arrays`: six values per slot, then stop ids
            per_slot = (jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.int32, jnp.int32)
            return (*(host((n,), d) for d in per_slot), host((n, MAX_STOP_IDS), jnp.int32))

        kind, *rest = key
        if kind == "cache":
            fn = functools.partial(KVCache.create, self.config, self.max_slots, self.max_seq_len)
            jitted, args = jax.jit(fn, out_shardings=self._cache_shardings), ()
        elif kind == "prefill":
            (length,) = rest
            fn = functools.partial(_prefill, self.graphdef)
            jitted = jax.jit(
                fn, donate_argnums=(4,), out_shardings=(rep, rep, self._cache_shardings)
            )
            one = host((1,), jnp.int32)
            args = (params, host((1, length), jnp.int32), one, one, cache, *sampling(1)[:5])
        elif kind == "decode":
            length, s = rest
            fn = functools.partial(_decode_steps, self.graphdef, self.decode_steps, length)
            jitted = jax.jit(
                fn, donate_argnums=(2,), out_shardings=(rep, rep, rep, self._cache_shardings)
            )
            args = (
                params,
                host((s,), jnp.int32),
                cache,
                host((s,), jnp.bool_),
                *sampling(s),
                host((), jnp.int32),
            )
        elif kind == "export":
            (length,) = rest
            jitted = jax.jit(functools.partial(_read_rows, length), out_shardings=rep)
            args = (cache, host((), jnp.int32))
        elif kind == "move":
            jitted = jax.jit(_move_slot, donate_argnums=(0,), out_shardings=self._cache_shardings)
            args = (cache, host((), jnp.int32), host((), jnp.int32))
        elif kind == "import":
            length, dtype = rest
            fn = functools.partial(_write_rows, min(length, self.max_seq_len))
            jitted = jax.jit(fn, donate_argnums=(0,), out_shardings=self._cache_shardings)
            shape = (self.config.num_kv_heads, length, self.config.head_dim)
            rows = (host(shape, dtype),) * self.config.num_layers
            args = (cache, rows, rows, host((), jnp.int32), host((), jnp.int32))
        else:
            raise ValueError(f"unknown executable {key!r}")
        with jax.set_mesh(self.mesh), sharding.axis_rules(self.rules):
            return jitted.lower(*args).compile()

    def _abstract_cache(self) -> KVCache:
        shape = (self.max_slots, self.config.num_kv_heads, self.max_seq_len, self.config.head_dim)
        layer = jax.ShapeDtypeStruct(shape, self.config.dtype, sharding=self._cache_sharding)
        layers = (layer,) * self.config.num_layers
        lengths = jax.ShapeDtypeStruct((self.max_slots,), jnp.int32, sharding=self._replicated)
        return KVCache(k=layers, v=layers, lengths=lengths)

    def _new_cache(self) -> KVCache:
        return self._executable(("cache",))()

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

    def _admit(self) -> bool:
        """Prefills (or imports) waiting requests into free slots; returns whether any
        was. A prompt whose prefill is not compiled yet keeps waiting (others go first).
        Stops after the one in progress when a command arrives, so that an export (a
        drain) never waits for a queue of prefills."""
        admitted, deferred = False, []
        while self._waiting and None in self._slots:
            live, future, loop = self._waiting.popleft()
            if future.done():  # cancelled while waiting
                with self._load_lock:
                    self._load -= 1
                continue
            prefill = None
            if live.kv is None or not len(live.output_ids):
                n = len(live.request.prompt_ids) + len(live.output_ids)
                prefill = self._bucketed(("prefill", min(bucket_length(n), self.max_seq_len)))
                if prefill is None:
                    deferred.append((live, future, loop))
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
            if prefill is None:
                self._import_kv(index, live)
            else:
                self._prefill(index, *prefill)
            admitted = True
            if not self._commands.empty():
                break
        self._waiting.extendleft(reversed(deferred))
        return admitted

    def _prefill(self, index: int, prefill: jax.stages.Compiled, bucket: int) -> None:
        """Runs prompt (+ tokens already generated elsewhere) and samples the next token
        (`prefill`: the executable for `bucket`, which holds the context)."""
        slot = self._slots[index]
        context = np.concatenate([slot.request.prompt_ids, np.asarray(slot.output, np.int32)])
        n = len(context)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = context
        arrays = self._sampling_arrays([index])
        token, logprob, self._cache = prefill(
            self._params,
            tokens,
            np.array([n], np.int32),
            np.array([index], np.int32),
            self._cache,
            *arrays[:5],
        )
        slot.length = n
        token, logprob = jax.device_get((token, logprob))
        reason = self._emit(index, int(token[0]), float(logprob[0]))
        if reason:
            self._finish(index, reason)

    def _import_kv(self, index: int, live: LiveRequest) -> None:
        """Writes an exported request's cache rows into slot `index` (device to device)."""
        slot = self._slots[index]
        n = len(live.request.prompt_ids) + len(live.output_ids) - 1
        rows = live.kv[0][0]
        if rows.shape[1] < n:
            raise ValueError(
                f"request {live.request.request_id!r}: {rows.shape[1]} KV rows for {n} positions"
            )
        key = ("import", int(rows.shape[1]), rows.dtype.name)
        if key in self._executables or not self._precompile:
            write = self._executable(key)
            ks = tuple(jax.device_put(k, self._replicated) for k, _ in live.kv)
            vs = tuple(jax.device_put(v, self._replicated) for _, v in live.kv)
        else:
            # Rows whose import is not compiled yet (or from another kind of engine): fit
            # them on the host into the smallest compiled bucket that holds n positions,
            # rather than compile on this thread.
            dtype = jnp.dtype(self.config.dtype).name
            bucket = next(
                b for b in self._buckets if b >= n and ("import", b, dtype) in self._executables
            )
            write = self._executables[("import", bucket, dtype)]

            def fit(x):
                x = np.asarray(x)[:, :bucket].astype(dtype)
                x = np.pad(x, ((0, 0), (0, bucket - x.shape[1]), (0, 0)))
                return jax.device_put(x, self._replicated)

            ks = tuple(fit(k) for k, _ in live.kv)
            vs = tuple(fit(v) for _, v in live.kv)
        self._cache = write(self._cache, ks, vs, np.int32(index), np.int32(n))
        slot.length = n
        self._next_token[index] = int(live.output_ids[-1])

    def _compact(self) -> None:
        """Moves the last busy slots into the first free ones (KV rows, length, next
        token), so that the busy slots come first and a decode is only as wide as they
        are. Skipped while the move is not compiled yet (the decode is then wider)."""
        if ("move",) not in self._executables and self._precompile:
            return
        busy = [i for i, slot in enumerate(self._slots) if slot is not None]
        holes = [i for i in range(len(busy)) if self._slots[i] is None]
        if not holes:  # 0..n-1 all busy
            return
        move = self._executable(("move",))
        # As many busy slots lie at n or beyond as there are holes below n: the last ones.
        for free, last in zip(holes, reversed(busy), strict=False):
            self._cache = move(self._cache, np.int32(last), np.int32(free))
            self._slots[free], self._slots[last] = self._slots[last], None
            self._next_token[free] = self._next_token[last]

    def _decode(self) -> bool:
        """Runs `decode_steps` steps for the busy slots; False if no decode executable
        that fits is compiled yet (the slots wait for the background compile)."""
        self._compact()
        active_idx = [i for i, s in enumerate(self._slots) if s is not None]
        longest = max(self._slots[i].length for i in active_idx)
        attend = min(bucket_length(longest + self.decode_steps), self.max_seq_len)
        wide = next(w for w in self._widths if w > active_idx[-1])
        key = ("decode", attend, wide)
        # A narrower width is compiled once it was wanted for a while, not for a passing
        # dip: on CPU even a cache hit costs a trace, on the cores the cells decode on.
        # Until then a wider one runs (first of all, the full width: it fits any batch).
        self._decode_wants[key] += 1
        patient = self._decode_wants[key] >= NARROW_AFTER_CALLS
        found = self._bucketed(key, None if patient else ("decode", attend, self.max_slots))
        if found is None:
            return False
        decode, _, width = found
        self.decode_widths[width] += 1
        active = np.zeros(width, bool)
        active[[i for i in active_idx if i < width]] = True
        arrays = self._sampling_arrays(list(range(width)))
        tokens, logprobs, emitted, self._cache = decode(
            self._params,
            self._next_token[:width].copy(),
            self._cache,
            active,
            *arrays,
            np.int32(self.max_seq_len),
        )
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
        return True

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
        # Rows up to a length bucket, not exactly n: one compiled copy per bucket (the
        # largest is compiled before the engine serves, so some always fits).
        length = min(bucket_length(slot.length), self.max_seq_len)
        export, _ = self._bucketed(("export", length))
        kv = export(self._cache, np.int32(index))
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
                empty = Completion(
                    request_id,
                    live.output_ids,
                    live.logprobs,
                    live.versions,
                    "cancelled",
                    (*live.engines, self.name),
                )
                loop.call_soon_threadsafe(_resolve, future, empty)


class _Hang(Exception):
    """Raised on the engine thread by `simulate_failure("hang")`."""


# Decode calls that must want a narrower width before the engine compiles it.
NARROW_AFTER_CALLS = 16


def length_buckets(max_len: int) -> list[int]:
    """Every length `min(bucket_length(n), max_len)` takes for 1 <= n <= max_len: the
    prompt, attention and KV-copy lengths an engine with this cache length compiles."""
    buckets, length = [], bucket_length(1)
    while length < max_len:
        buckets.append(length)
        length *= 2
    return [*buckets, max_len]


def runnable_bucket(key: tuple, compiled: list[tuple]) -> tuple | None:
    """Which compiled executable runs `key` (kind, length[, width]) until its own is
    compiled: the cheapest one at least as long and wide (work ~ length x width); for a
    decode, else the widest as long but narrower (it decodes the first slots only: the
    others wait a call, not the compile); else None."""
    kind = key[0]
    fits = [
        k
        for k in compiled
        if k[0] == kind
        and len(k) == len(key)
        and all(a >= b for a, b in zip(k[1:], key[1:], strict=True))
    ]
    if fits:
        return min(fits, key=lambda k: (math.prod(k[1:]), k[1:]))
    narrower = [k for k in compiled if k[0] == kind == "decode" and k[1] >= key[1]]
    return max(narrower, key=lambda k: (k[2], -k[1])) if narrower else None


def width_buckets(max_slots: int) -> list[int]:
    """The decode widths an engine with `max_slots` compiles: powers of four below it,
    then `max_slots` itself. A decode wastes at most 4x on idle slots (not `max_slots`
    times), and every length bucket compiles at most this many widths."""
    widths, width = [], 1
    while width < max_slots:
        widths.append(width)
        width *= 4
    return [*widths, max_slots]


def _move_slot(cache: KVCache, source, target) -> KVCache:
    """Copies cache slot `source` (all positions, and its length) into slot `target`."""

    def move(layer_cache):
        rows = jax.lax.dynamic_index_in_dim(layer_cache, source, keepdims=True)
        return jax.lax.dynamic_update_slice(layer_cache, rows, (target, 0, 0, 0))

    k, v = tuple(map(move, cache.k)), tuple(map(move, cache.v))
    return KVCache(k, v, cache.lengths.at[target].set(cache.lengths[source]))


def _read_rows(length: int, cache: KVCache, slot) -> tuple:
    """Per layer (k, v) [KV, length, D]: the first `length` positions of cache `slot`."""

    def read(layer_cache):
        return jax.lax.dynamic_index_in_dim(layer_cache, slot, keepdims=False)[:, :length]

    return tuple((read(k), read(v)) for k, v in zip(cache.k, cache.v, strict=True))


def _write_rows(length: int, cache: KVCache, ks, vs, slot, n) -> KVCache:
    """Writes the first `length` of each layer's rows [KV, >= length, D] into cache
    `slot`, which then holds `n` valid positions (rows past n are never attended)."""

    def write(layer_cache, rows):
        rows = rows[None, :, :length].astype(layer_cache.dtype)
        return jax.lax.dynamic_update_slice(layer_cache, rows, (slot, 0, 0, 0))

    k = tuple(write(c, r) for c, r in zip(cache.k, ks, strict=True))
    v = tuple(write(c, r) for c, r in zip(cache.v, vs, strict=True))
    return KVCache(k, v, cache.lengths.at[slot].set(n))


def _prefill(
    graphdef, params, tokens, lengths, slots, cache, temperature, top_k, top_p, seed, index
):
    """Prefills prompts into cache slots and samples each one's next token."""
    model = nnx.merge(graphdef, params)
    logits, cache = model.prefill(tokens, lengths, slots, cache)
    token, logprob = sample_per_slot(logits, temperature, top_k, top_p, seed, index)
    return token, logprob, cache


def _decode_steps(
    graphdef,
    num_steps,
    attend_len,
    params,
    tokens,
    cache,
    active,
    temperature,
    top_k,
    top_p,
    seed,
    index,
    max_new,
    stops,
    max_len,
):
    """`num_steps` decode steps of the cache's first W slots (W: the width of `tokens`);
    returns tokens, log-probs and emitted masks [K, W]."""
    model = nnx.merge(graphdef, params)

    def step(carry, _):
        tokens, cache, active, index = carry
        logits, cache = model.decode(tokens, cache, active, attend_len)
        new, logprob = sample_per_slot(logits, temperature, top_k, top_p, seed, index)
        index = index + active
        stopped = jnp.any(new[:, None] == stops, axis=-1)
        exhausted = (index >= max_new) | (cache.lengths[: tokens.shape[0]] >= max_len)
        emitted = active
        tokens = jnp.where(active, new, tokens)
        active = active & ~stopped & ~exhausted
        return (tokens, cache, active, index), (new, logprob, emitted)

    (_, cache, _, _), (new, logprob, emitted) = jax.lax.scan(
        step, (tokens, cache, active, index), None, length=num_steps
    )
    return new, logprob, emitted, cache
