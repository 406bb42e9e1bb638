"""Engines that share a GPU with the trainer (issue 38), the parts that run on CPU:
an engine's CUDA_VISIBLE_DEVICES mapped through this process's own list, the CUDA IPC
weight update's chunks (by a byte budget), order (layer by layer) and keying (by the
UUID of the GPU that holds each tensor, as vLLM's "ipc" backend looks it up), the fit
check before a vLLM engine starts, and the device memory a role switch records.

The GPU paths these feed (`vllm_engine._send_ipc`, `factory._check_gpu_fit`, vLLM's
sleep and wake beside JAX) are UNTESTED here: no GPU."""

import base64
import itertools
import pickle
import random

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gyrejax.loop.outputs import device_memory
from gyrejax.rollout.factory import gpu_fit_problem
from gyrejax.rollout.vllm_engine import byte_chunks, ipc_update, layer_order, visible_devices

GiB = 2**30
UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


# --- CUDA_VISIBLE_DEVICES of an engine ---------------------------------------------------


@pytest.mark.parametrize(
    ("ordinals", "parent", "want"),
    [
        ([0], None, "0"),  # nothing narrowed: ordinal i is GPU i
        ([2, 3], None, "2,3"),
        ([0], "4,5,6,7", "4"),  # SLURM / a container narrowed it: entry i, not i
        ([1], "4,5,6,7", "5"),
        ([2, 3], "4,5,6,7", "6,7"),
        ([1], " 4, 5 ", "5"),
        ([1, 0], f"{UUID},GPU-0c3a", f"GPU-0c3a,{UUID}"),  # UUIDs (or their prefixes)
        ([1], "GPU-aaaa,MIG-bbbb-1-2", "MIG-bbbb-1-2"),
        ([1], "3,1,2", "1"),  # order is the list's, not sorted
        ([1], "0,2,-1,1", "2"),  # CUDA reads up to the first entry naming no GPU
    ],
)  # fmt: skip
def test_an_engine_gets_the_parents_entry_for_each_ordinal(ordinals, parent, want):
    assert visible_devices(ordinals, parent) == want


@pytest.mark.parametrize(
    ("ordinals", "parent", "message"),
    [
        (
            [4],
            "4,5,6,7",
            "GPU ordinals [4] of this process are outside CUDA_VISIBLE_DEVICES='4,5,6,7', "
            "which makes 4 GPU(s) visible",
        ),
        (
            [1, 2],
            "0,2,-1,1",
            "GPU ordinals [2] of this process are outside CUDA_VISIBLE_DEVICES='0,2,-1,1', "
            "which makes 2 GPU(s) visible",
        ),
        (
            [0],
            "",
            "GPU ordinals [0] of this process are outside CUDA_VISIBLE_DEVICES='', which "
            "makes 0 GPU(s) visible",
        ),
        (
            [0],
            "-1",
            "GPU ordinals [0] of this process are outside CUDA_VISIBLE_DEVICES='-1', which "
            "makes 0 GPU(s) visible",
        ),
        ([], "0,1", "no GPU ordinals given"),
        ([-1], None, "GPU ordinals [-1]: expected integers >= 0"),
        ([True], "0,1", "GPU ordinals [True]: expected integers >= 0"),
    ],
)
def test_ordinals_the_parents_list_lacks_are_one_clear_error(ordinals, parent, message):
    with pytest.raises(ValueError) as error:
        visible_devices(ordinals, parent)
    assert str(error.value) == message


# --- CUDA IPC: chunks, order, keys --------------------------------------------------------


def test_chunks_stay_within_the_budget_and_cover_every_tensor_once():
    assert byte_chunks([3, 3, 3], 6) == [range(0, 2), range(2, 3)]
    assert byte_chunks([6, 1], 6) == [range(0, 1), range(1, 2)]
    assert byte_chunks([10, 1, 1, 10], 4) == [range(0, 1), range(1, 3), range(3, 4)]  # too big
    assert byte_chunks([1, 1, 1], 100) == [range(0, 3)]
    assert byte_chunks([], 5) == []
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 7, 64, 300]) for _ in range(rng.randrange(30))]
        budget = rng.choice([1, 50, 64, 299, 1000])
        chunks = byte_chunks(sizes, budget)
        assert [i for c in chunks for i in c] == list(range(len(sizes)))  # in order, once
        for chunk in chunks:
            total = sum(sizes[i] for i in chunk)
            assert total <= budget or len(chunk) == 1  # over the budget: one tensor alone
        for first, second in itertools.pairwise(chunks):  # greedy: none merges
            assert sum(sizes[i] for i in (*first, second[0])) > budget
    with pytest.raises(ValueError, match="budget=0"):
        byte_chunks([1], 0)


def test_tensors_go_layer_by_layer():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.bias",  # Qwen2's zero biases come last
        "model.layers.2.self_attn.q_proj.bias",
        "lm_head.weight",
    ]
    ordered = [names[i] for i in layer_order(names)]
    assert ordered == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.2.self_attn.q_proj.bias",
        "model.layers.10.mlp.up_proj.weight",
    ]


def uuid_of(device: int) -> str:
    return f"GPU-{device:04d}"


def test_each_handle_is_keyed_by_the_uuid_of_the_gpu_that_holds_its_tensor():
    handles = [("h0", 0, 0, 0, 0, 0, 3), ("h1", 0, 0, 0, 0, 0, 5)]
    update = ipc_update(
        ["a", "b"], ["bfloat16", "float32"], [(2, 3), [4]], [3, 5], handles, uuid_of
    )
    assert update["names"] == ["a", "b"] and update["dtype_names"] == ["bfloat16", "float32"]
    assert update["shapes"] == [[2, 3], [4]]
    keyed = pickle.loads(base64.b64decode(update["ipc_handles_pickled"]))
    assert keyed == [{"GPU-0003": handles[0]}, {"GPU-0005": handles[1]}]  # never GPU 0's
    with pytest.raises(ValueError, match="different lengths"):
        ipc_update(["a"], ["float32"], [[1]], [0, 1], handles, uuid_of)


def test_vllms_ipc_backend_reads_the_update_and_finds_its_own_gpu(monkeypatch):
    """The payload through vLLM's own `IPCWeightTransferUpdateInfo` (it unpickles and
    checks lengths), then the lookup its worker does (`receive_weights`): the worker on
    GPU 5 finds the handle keyed by GPU 5's UUID, a worker on GPU 0 none."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM engine is optional)")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    handles = [("h0", 0, 0, 0, 0, 0, 5), ("h1", 0, 0, 0, 0, 0, 5)]
    update = ipc_update(["a", "b"], ["float32"] * 2, [[2], [3]], [5, 5], handles, uuid_of)
    info = IPCWeightTransferUpdateInfo(**update)
    assert info.names == ["a", "b"] and len(info.ipc_handles) == 2
    assert all(uuid_of(5) in h and uuid_of(0) not in h for h in info.ipc_handles)
    assert [h[uuid_of(5)] for h in info.ipc_handles] == handles


# --- room for vLLM on a GPU ---------------------------------------------------------------


def test_the_fit_check_names_the_field_and_what_fits():
    assert gpu_fit_problem(1, 5, 79 * GiB, 80 * GiB, 0.9, 0) is None
    assert gpu_fit_problem(1, 5, 79 * GiB, 80 * GiB, 0.9, 6 * GiB) is None
    assert gpu_fit_problem(0, 0, 40 * GiB, 80 * GiB, 0.9, 0) == (
        "config.rollout.gpu_memory_utilization=0.9: cell 0's GPU 0 has 40.0 GiB free of "
        "80.0 GiB, below the 72.0 GiB vLLM takes at start (JAX holds the rest: on the core "
        "cell, the trainer's state); at most 0.50 fits"
    )
    assert gpu_fit_problem(2, 3, 79 * GiB, 80 * GiB, 0.9, 16 * GiB) == (
        "config.rollout.gpu_memory_utilization=0.9: cell 2's GPU 3 has 79.0 GiB free of "
        "80.0 GiB; beside vLLM's 72.0 GiB it leaves 7.0 GiB, below the 16.0 GiB an in-memory "
        "weight update copies there (the weights in HF layout and one chunk of copies); "
        "at most 0.79 fits"
    )


# --- the memory a switch records ----------------------------------------------------------


def test_device_memory_counts_each_buffer_once_per_device():
    devices = jax.devices()[4:6]
    others = jax.devices()[6:7]
    source, before = device_memory(devices)
    assert source == "live_arrays"  # CPU devices report no memory stats
    mesh = jax.make_mesh((2,), ("x",), devices=devices)
    split = jax.device_put(np.ones((8, 256), np.float32), NamedSharding(mesh, PartitionSpec("x")))
    whole = jax.device_put(np.ones((64,), np.float32), NamedSharding(mesh, PartitionSpec()))
    elsewhere = jax.device_put(np.ones((1024,), np.float32), others[0])
    want = [b + 4 * 256 * 4 + 64 * 4 for b in before]  # a row block each, `whole` on both
    assert device_memory(devices) == ("live_arrays", want)
    assert [s.data.nbytes for s in split.addressable_shards] == [4096, 4096]  # shard views
    assert device_memory(devices) == ("live_arrays", want)  # share buffers: not twice
    split.delete()
    del whole
    assert device_memory(devices) == ("live_arrays", before)
    assert device_memory(others)[1][0] >= elsewhere.nbytes


def test_device_memory_skips_an_array_deleted_while_it_counts(monkeypatch):
    """A running step donates (deletes) its accumulator between micro-steps, so an array
    listed as live may be gone when its shards are read: it holds nothing."""
    device = jax.devices()[7]
    gone = jax.device_put(np.ones((256,), np.float32), device)
    kept = jax.device_put(np.ones((16,), np.float32), device)
    gone.delete()
    monkeypatch.setattr(jax, "live_arrays", lambda: [gone, kept])
    assert device_memory([device]) == ("live_arrays", [kept.nbytes])

    class DeletedWhileRead:  # alive when asked, gone while its shards are read: jax 0.10
        def is_deleted(self):  # then fails inside `addressable_shards` with a TypeError
            return False  # (its buffer list is already None); a learning_bench run died

        @property
        def addressable_shards(self):
            raise TypeError("'NoneType' object is not iterable")

    monkeypatch.setattr(jax, "live_arrays", lambda: [DeletedWhileRead(), kept])
    assert device_memory([device]) == ("live_arrays", [kept.nbytes])


def test_device_memory_names_devices_another_process_holds(monkeypatch):
    device = jax.devices()[0]
    monkeypatch.setattr(jax, "process_index", lambda: device.process_index + 1)
    assert device_memory([device]) == ("other_process", [None])
