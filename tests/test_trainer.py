"""Elastic trainer: joins mid-step change nothing, rejoins never recompile, non-finite
steps are skipped, checkpoints restore onto other layouts and resume exactly, and a
corrupt checkpoint falls back to the newest readable one."""

import dataclasses
import errno
import functools
import json
import logging
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT
from flax import nnx

from gyrejax.cells import split_into_cells
from gyrejax.config import (
    CellsConfig,
    CheckpointConfig,
    ConfigError,
    ModelConfig,
    RLConfig,
    TrainConfig,
)
from gyrejax.model.hf_io import CheckpointError, export_hf, load_hf
from gyrejax.model.transformer import init_model
from gyrejax.train import checkpoint as checkpoint_module
from gyrejax.train.checkpoint import (
    TOKENIZER_KEY,
    TrainCheckpointer,
    check_tokenizer,
    restore_weights,
    save_weights,
)
from gyrejax.train.trainer import ElasticTrainer
from gyrejax.trajectory import generate_executions, process
from gyrejax.trajectory.rows import ROW_FIELDS, padding_rows

VOCAB = 64
MODEL = ModelConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8,
)  # fmt: skip
ROW = 128
TRAIN = TrainConfig(row_length=ROW, rows_per_micro_step=1, learning_rate=1e-3)


# The loss sums per-token terms of both signs that nearly cancel (advantages are zero-mean
# in each group; with GRPO's unbiased std this batch's loss is 0.0023), so rows packed
# another way round it differently by float32's epsilon times the terms' size (about 1),
# not times the sum: 3e-8 measured, 1.4e-5 of the sum.
LOSS_ATOL = {"loss": 1e-7, "grad_norm": 0.0}


def make_batch(seed=0, rows_per_micro_step=1, **buckets):
    executions = generate_executions(
        3, 3, seed=seed, turns=(4, 10), vocab_size=VOCAB, system_prompt_tokens=10,
        task_tokens=(3, 6), tool_output_tokens=(2, 10), model_output_tokens=(2, 10),
        summary_tokens=(2, 5), compaction_budget=80, retry_prob=0.2, max_call_tokens=ROW,
    )  # fmt: skip
    # Behaviour log-probs near a uniform policy over the tiny vocab keep ratios sane.
    rng = np.random.default_rng(seed)
    executions = [
        dataclasses.replace(
            ex,
            calls=[
                dataclasses.replace(
                    c,
                    logprobs=(np.log(1 / VOCAB) + rng.normal(0, 0.1, len(c.output_ids))).astype(
                        np.float32
                    ),
                    versions=np.zeros(len(c.output_ids), np.int32),
                )
                for c in ex.calls
            ],
        )
        for ex in executions
    ]
    return process(
        executions, row_length=ROW, j_max=None, rows_per_micro_step=rows_per_micro_step, **buckets
    )


def cells(size=2, fsdp=2, tensor=1):
    return split_into_cells(CellsConfig(size=size, fsdp=fsdp, tensor=tensor))


def params_np(trainer):
    return jax.tree.map(np.asarray, trainer.params)


def assert_trees_close(a, b, rtol=1e-5):
    def check(x, y):
        scale = max(np.abs(y).max(), 1e-12)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale)

    jax.tree.map(check, a, b)


def joins_during_the_step(trainer, all_cells, join_after, micro_steps):
    """An `on_micro_step` callback: once n micro-steps are done, for each n in
    `join_after`, the next of `all_cells` joins the step. The worker that made a join
    waits until the newcomer has done a micro-step, or none is left to do: else the other
    workers could take every micro-step left while it pulls the weights (before the first
    join only the core works, so the first newcomer always does one)."""
    join_after, done, worked = sorted(join_after), [], set()
    changed = threading.Condition()

    def on_micro_step(m, cell):
        with changed:
            done.append(m)
            worked.add(cell.index)
            changed.notify_all()
            joining = []
            while join_after and len(done) >= join_after[0]:
                join_after.pop(0)
                joining.append(all_cells[len(trainer.training)])
                trainer.join(joining[-1])
            for newcomer in joining:
                arrived = changed.wait_for(
                    lambda cell=newcomer: cell.index in worked or len(done) == micro_steps,
                    timeout=120,
                )
                assert arrived, f"cell {newcomer.index} joined but never did a micro-step"

    return on_micro_step


def test_satellites_joining_mid_step_give_the_same_update():
    batch = make_batch()
    assert batch.num_micro_steps >= 6
    all_cells = cells()
    alone = ElasticTrainer(init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN)
    ref = alone.train_step(batch)
    assert ref.cells == (0,) and not ref.skipped

    rng = np.random.default_rng(0)
    join_after = sorted(rng.choice(np.arange(1, batch.num_micro_steps - 2), 3, replace=False))
    elastic = ElasticTrainer(init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN)
    for cell in all_cells[1:]:
        assert elastic.precompile(cell) > 0

    report = elastic.train_step(
        batch,
        on_micro_step=joins_during_the_step(elastic, all_cells, join_after, batch.num_micro_steps),
    )
    assert len(elastic.training) == 4 and len(report.joins) == 3
    assert sum(report.micro_steps_per_cell.values()) == batch.num_micro_steps
    assert len(report.cells) >= 2, report.micro_steps_per_cell  # satellites did take part
    for join in report.joins:
        assert join.weight_pull_s > 0 and join.compile_s == 0  # precompiled
    np.testing.assert_allclose(report.metrics["loss"], ref.metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(report.metrics["grad_norm"], ref.metrics["grad_norm"], rtol=1e-5)
    assert (
        report.metrics["tokens"] == ref.metrics["tokens"] == batch.stats.admitted_trainable_tokens
    )
    assert_trees_close(params_np(elastic), params_np(alone))
    assert elastic.version == alone.version == 1


def test_update_lands_on_the_core_when_satellites_claim_every_micro_step(monkeypatch):
    """The core may claim nothing (its worker started last); its zeros still take part,
    so the summed gradients are on the core's devices, next to the weights."""
    batch = make_batch(2)
    all_cells = cells()
    alone = ElasticTrainer(init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN)
    ref = alone.train_step(batch)
    trainer = ElasticTrainer(init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN)
    trainer.join(all_cells[1])
    satellite_done = threading.Event()
    work = ElasticTrainer._work

    def core_claims_last(self, cell, run, result, joined_mid_step):
        if cell.index == 0:
            assert satellite_done.wait(120)
        work(self, cell, run, result, joined_mid_step)
        if cell.index != 0:
            satellite_done.set()

    monkeypatch.setattr(ElasticTrainer, "_work", core_claims_last)
    report = trainer.train_step(batch)
    assert report.micro_steps_per_cell == {0: 0, 1: batch.num_micro_steps}
    np.testing.assert_allclose(report.metrics["loss"], ref.metrics["loss"], rtol=1e-5)
    assert_trees_close(params_np(trainer), params_np(alone))


def test_rejoining_never_recompiles_and_release_waits_for_the_boundary():
    batch = make_batch(1)
    all_cells = cells()
    trainer = ElasticTrainer(init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN)
    for cell in all_cells[1:3]:
        trainer.join(cell)
    first = trainer.train_step(batch)
    count = trainer.compile_count

    def release_mid_step(m, cell):
        if m == 0 and any(c.index == 2 for c in trainer.training):
            trainer.release(all_cells[2])

    second = trainer.train_step(batch, on_micro_step=release_mid_step)
    assert [r.cell for r in second.released] == [2] and second.released[0].wait_s > 0
    assert [c.index for c in trainer.training] == [0, 1]
    trainer.release(all_cells[1])  # no step running: immediate
    trainer.train_step(batch)
    for cell in all_cells[1:3]:
        trainer.join(cell)
    trainer.train_step(batch)
    # Cells 1 and 2 rejoined: their micro-steps were compiled in the first step. Only a
    # cross-cell reduction over a set of cells never seen before may compile.
    assert trainer.compile_count <= count + 1
    assert trainer.version == 4 and first.version == 1
    with pytest.raises(ValueError, match="cannot be released"):
        trainer.release(all_cells[0])
    with pytest.raises(ValueError, match="already training"):
        trainer.join(all_cells[1])


def test_non_finite_micro_step_skips_the_update():
    batch = make_batch(2)
    advantage = batch.advantage.copy()
    bad = 2
    r = batch.rows_per_micro_step
    advantage[bad * r : (bad + 1) * r][batch.loss_weight[bad * r : (bad + 1) * r] > 0] = np.nan
    poisoned = dataclasses.replace(batch, advantage=advantage)
    trainer = ElasticTrainer(init_model(MODEL), cells()[0], rl=RLConfig(), train=TRAIN)
    before = params_np(trainer)
    report = trainer.train_step(poisoned)
    assert report.skipped and f"micro-step {bad}" in report.skip_reason
    assert trainer.version == 0 and trainer.step == 1
    jax.tree.map(np.testing.assert_array_equal, params_np(trainer), before)
    assert not trainer.train_step(batch).skipped and trainer.version == 1


def test_unreproducible_tokens_are_dropped_counted_and_warned_once_per_run(caplog):
    """top_k 1 on tokens that are not the trainer's argmax: they cannot have been sampled
    from the distribution the trainer reproduces, so they are dropped (the step goes
    on), counted in the metrics, and named in one warning for the whole run."""
    batch = make_batch(2)
    top_k = np.where(batch.loss_weight > 0, 1, 0).astype(np.int32)
    cut = dataclasses.replace(batch, top_k=top_k)
    trainer = ElasticTrainer(init_model(MODEL), cells()[0], rl=RLConfig(), train=TRAIN)
    with caplog.at_level(logging.WARNING):
        reports = [trainer.train_step(cut) for _ in range(2)]
    assert not any(r.skipped for r in reports) and trainer.version == 2
    dropped = [r.metrics["dropped_tokens"] for r in reports]
    assert 0 < dropped[0] < reports[0].metrics["tokens"]  # argmax tokens are kept
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1 and f"{int(dropped[0])} trained tokens dropped" in warnings[0]


def test_batch_shape_must_match_the_train_config():
    trainer = ElasticTrainer(init_model(MODEL), cells()[0], rl=RLConfig(), train=TRAIN)
    with pytest.raises(ValueError, match="rows_per_micro_step=2"):
        trainer.train_step(make_batch(rows_per_micro_step=2))
    with pytest.raises(ValueError, match=r"shapes \[\(1, 256\), \(2, 64\)\] do not fit"):
        trainer.train_step(rebucket(make_batch(0)))


def rebucket(batch):
    """`batch`'s rows (one length, R = 1) re-packed in rows of three lengths: a row with
    at most 64 tokens in [2, 64] micro-steps (with an all-padding row), the shorter of the
    others fused by first fit into rows of 256, the rest left in rows of 128."""
    fill = [int(np.flatnonzero(e >= 0).max()) + 1 for e in batch.execution_index]
    short = [i for i in np.argsort(fill) if fill[i] <= 64]
    fused: list[list[int]] = []
    for i in [i for i in np.argsort(fill)[::-1] if 64 < fill[i] < 100]:
        bin_ = next((b for b in fused if sum(fill[j] for j in b) + fill[i] <= 256), None)
        fused.append([i]) if bin_ is None else bin_.append(i)
    rest = [[i] for i in range(batch.num_rows) if fill[i] >= 100]
    rows = [(256, b) for b in fused] + [(128, b) for b in rest]
    rows += [(64, [i]) for i in short] + [(64, [])] * (len(short) % 2)
    out = {f: [] for f in ROW_FIELDS}
    for _, sources in rows:
        row = padding_rows(1, 256)
        at = 0
        for i in sources:
            for f in ROW_FIELDS:
                value = getattr(batch, f)[i, : fill[i]]
                if f == "subtree_end" or f == "pred_index":
                    value = np.where(value >= 0, value + at, value)
                row[f][0, at : at + fill[i]] = value
            at += fill[i]
        for f in ROW_FIELDS:
            out[f].append(row[f][0])
    lengths = np.asarray([length for length, _ in rows], np.int32)
    sizes = [1] * (len(fused) + len(rest)) + [2] * (-(-len(short) // 2))
    offsets = np.cumsum([0, *sizes])
    out = {f: np.stack(v) for f, v in out.items()}
    return dataclasses.replace(batch, **out, row_lengths=lengths, micro_step_offsets=offsets)


BUCKETS = dataclasses.replace(TRAIN, row_lengths=(64, 256))  # and ROW: [2, 64], [1, 128], [1, 256]


def test_row_buckets_train_like_one_row_length_with_no_compile_after_precompile():
    """A batch whose micro-steps come in three shapes runs each shape's precompiled step,
    and gives the update of the same rows in one length (loss weights make
    padding irrelevant; fused rows change nothing: the tree mask keeps trees apart)."""
    plain_batch = make_batch(0)
    bucketed = rebucket(plain_batch)
    assert set(bucketed.shapes) == {(2, 64), (1, 128), (1, 256)}, bucketed.shapes
    core = cells()[0]
    trainer = ElasticTrainer(
        init_model(MODEL), core, rl=RLConfig(), train=BUCKETS, keep_last_grads=True
    )
    assert set(trainer.shapes) == set(bucketed.shapes)
    assert trainer.precompile(core) > 0
    count = trainer.compile_count
    got = trainer.train_step(bucketed)
    assert not got.skipped and got.micro_steps_per_cell == {0: bucketed.num_micro_steps}
    assert trainer.compile_count == count + 1  # the optimizer update only

    plain = ElasticTrainer(
        init_model(MODEL), core, rl=RLConfig(), train=TRAIN, keep_last_grads=True
    )
    want = plain.train_step(plain_batch)
    assert got.metrics["tokens"] == want.metrics["tokens"]
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            got.metrics[name], want.metrics[name], rtol=1e-5, atol=LOSS_ATOL[name]
        )
    assert_trees_close(trainer.last_grads, plain.last_grads)


def test_satellites_precompiled_for_every_row_shape_join_a_bucketed_step_mid_step():
    """Satellites precompiled for every shape join while a bucketed batch trains: they
    compile nothing more, and the update is the plain single-length one (the reference
    of the core-only bucket test)."""
    plain_batch = make_batch(0)
    bucketed = rebucket(plain_batch)
    assert bucketed.num_micro_steps >= 6
    all_cells = cells()
    plain = ElasticTrainer(
        init_model(MODEL), all_cells[0], rl=RLConfig(), train=TRAIN, keep_last_grads=True
    )
    want = plain.train_step(plain_batch)

    trainer = ElasticTrainer(
        init_model(MODEL), all_cells[0], rl=RLConfig(), train=BUCKETS, keep_last_grads=True
    )
    for cell in all_cells:
        assert trainer.precompile(cell) > 0
    count = trainer.compile_count
    got = trainer.train_step(
        bucketed,
        on_micro_step=joins_during_the_step(
            trainer, all_cells, [1, 2, 3], bucketed.num_micro_steps
        ),
    )
    assert len(trainer.training) == 4 and len(got.joins) == 3 and not got.skipped
    assert sum(got.micro_steps_per_cell.values()) == bucketed.num_micro_steps
    assert len(got.cells) >= 2, got.micro_steps_per_cell  # satellites did take part
    assert all(join.compile_s == 0 for join in got.joins)  # every shape was precompiled
    assert trainer.compile_count == count + 2, trainer.compile_count - count
    assert got.metrics["tokens"] == want.metrics["tokens"]
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            got.metrics[name], want.metrics[name], rtol=1e-5, atol=LOSS_ATOL[name]
        )
    assert_trees_close(trainer.last_grads, plain.last_grads)
    assert_trees_close(params_np(trainer), params_np(plain))


def optimizer_state_np(trainer):
    return jax.tree.map(np.asarray, trainer.opt_state)


def test_checkpoint_restores_onto_other_cell_layouts(tmp_path):
    batch = make_batch(3)
    checkpoints = CheckpointConfig(every_steps=1, keep=2)
    saved = ElasticTrainer(init_model(MODEL), cells(2, 2, 1)[0], rl=RLConfig(), train=TRAIN)
    saved.train_step(batch)
    saved.save(TrainCheckpointer(tmp_path / "ck", checkpoints), {"data_position": 7})
    want_params, want_opt = params_np(saved), optimizer_state_np(saved)
    for layout in [(4, 2, 2), (1, 1, 1), (8, 4, 2)]:
        trainer = ElasticTrainer(
            init_model(MODEL, seed=9), cells(*layout)[0], rl=RLConfig(), train=TRAIN
        )
        meta = trainer.restore(TrainCheckpointer(tmp_path / "ck", checkpoints))
        assert meta["data_position"] == 7 and trainer.step == 1 and trainer.version == 1
        assert len(trainer.params["embed"].sharding.device_set) == layout[0]
        jax.tree.map(np.testing.assert_array_equal, params_np(trainer), want_params)
        jax.tree.map(np.testing.assert_array_equal, optimizer_state_np(trainer), want_opt)


def test_resume_continues_the_exact_same_run(tmp_path):
    batches = [make_batch(s) for s in (4, 5, 6)]
    core = cells()[0]
    straight = ElasticTrainer(init_model(MODEL), core, rl=RLConfig(), train=TRAIN)
    for b in batches:
        straight.train_step(b)

    checkpointer = TrainCheckpointer(tmp_path / "ck", CheckpointConfig(every_steps=1, keep=1))
    first = ElasticTrainer(init_model(MODEL), core, rl=RLConfig(), train=TRAIN)
    first.train_step(batches[0])
    first.save(checkpointer)
    resumed = ElasticTrainer(init_model(MODEL, seed=5), core, rl=RLConfig(), train=TRAIN)
    resumed.restore(TrainCheckpointer(tmp_path / "ck", CheckpointConfig(every_steps=1, keep=1)))
    for b in batches[1:]:
        resumed.train_step(b)
    assert resumed.step == straight.step == 3
    jax.tree.map(np.testing.assert_array_equal, params_np(resumed), params_np(straight))


def test_a_resume_under_another_tokenizer_is_refused(tmp_path):
    checkpointer = TrainCheckpointer(tmp_path / "ck", CheckpointConfig(every_steps=1, keep=1))
    trainer = ElasticTrainer(init_model(MODEL), cells()[0], rl=RLConfig(), train=TRAIN)
    trainer.save(checkpointer, {TOKENIZER_KEY: "sha256:" + "ab" * 32})
    meta = trainer.restore(checkpointer)
    where = checkpointer.step_path(trainer.step)
    check_tokenizer(meta, "/tok/a", "sha256:" + "ab" * 32, where)  # the same: resumes
    with pytest.raises(ConfigError) as refused:
        check_tokenizer(meta, "bytes", "bytes", where)
    assert str(refused.value) == (
        f"config.model.tokenizer=bytes: checkpoint {where} was trained with another "
        "tokenizer (sha256:abababababab, this one is bytes), so its token ids would mean "
        "other strings; resume with the tokenizer it was trained with, or start in a new "
        "workdir"
    )
    old = {k: v for k, v in meta.items() if k != TOKENIZER_KEY}  # from an older run
    check_tokenizer(old, "bytes", "bytes", where)


RESTORE_IN_ANOTHER_PROCESS = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from gyrejax.train.checkpoint import restore_weights
shapes = json.loads(sys.argv[2])
mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), (jax.sharding.AxisType.Auto,) * 2)
def target(shape):
    spec = P("fsdp", "tensor") if len(shape) == 2 else P()
    return jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=NamedSharding(mesh, spec))
restored = restore_weights(sys.argv[1], {k: target(s) for k, s in shapes.items()})
summary = {k: [float(np.asarray(v).sum()), len(v.addressable_shards)] for k, v in restored.items()}
print(json.dumps(summary))
"""


def test_weights_snapshot_restores_in_another_process_with_its_own_sharding(tmp_path):
    trainer = ElasticTrainer(init_model(MODEL), cells()[0], rl=RLConfig(), train=TRAIN)
    weights = {"gate": trainer.params["blocks"][0]["mlp"]["gate"], "embed": trainer.params["embed"]}
    save_weights(tmp_path / "snapshot", weights)
    shapes = {k: list(v.shape) for k, v in weights.items()}
    script = [sys.executable, "-c", RESTORE_IN_ANOTHER_PROCESS]
    result = subprocess.run(
        [*script, str(tmp_path / "snapshot"), json.dumps(shapes)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    restored = json.loads(result.stdout.strip().splitlines()[-1])
    for name, value in weights.items():
        total, shards = restored[name]
        np.testing.assert_allclose(total, float(np.asarray(value, np.float64).sum()), rtol=1e-5)
        assert shards == 4
    # And in this process, onto another mesh: identical values.
    again = restore_weights(tmp_path / "snapshot", jax.tree.map(np.asarray, weights))
    jax.tree.map(np.testing.assert_array_equal, again, jax.tree.map(np.asarray, weights))


def damage_checkpoint(step_dir, damage):
    """What a disk or a kill outside Orbax's atomic rename can leave: the largest array
    data file cut in half, or the metadata JSON cut short."""
    if damage == "data":
        files = [p for p in (step_dir / "params").rglob("*") if p.is_file() and "/d/" in str(p)]
        victim = max(files, key=lambda p: p.stat().st_size)
    else:
        victim = step_dir / "metadata" / "metadata"
    os.truncate(victim, victim.stat().st_size // 2)


@pytest.mark.parametrize("damage", ["data", "metadata"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_readable_one(
    tmp_path, caplog, damage
):
    batches = [make_batch(s) for s in (4, 5, 6, 7)]
    core = cells()[0]
    config = CheckpointConfig(every_steps=1, keep=3)
    first = ElasticTrainer(init_model(MODEL), core, rl=RLConfig(), train=TRAIN)
    checkpointer = TrainCheckpointer(tmp_path / "ck", config)
    saved = {}
    for b in batches[:3]:
        first.train_step(b)
        first.save(checkpointer, {"data_position": first.step})
        saved[first.step] = params_np(first)
    checkpointer.close()
    damage_checkpoint(tmp_path / "ck" / "3", damage)

    resumed = ElasticTrainer(init_model(MODEL, seed=5), core, rl=RLConfig(), train=TRAIN)
    checkpointer = TrainCheckpointer(tmp_path / "ck", config)
    with caplog.at_level(logging.WARNING):
        meta = resumed.restore(checkpointer)
    assert resumed.step == 2 and meta["data_position"] == 2
    jax.tree.map(np.testing.assert_array_equal, params_np(resumed), saved[2])
    # Named in a warning and moved aside, never deleted; Orbax lists it no more.
    (aside,) = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith("3.corrupt-")]
    assert any(f"{tmp_path / 'ck' / '3'} is unreadable" in r.getMessage() for r in caplog.records)
    assert aside.name in caplog.text and any(aside.rglob("*"))
    assert checkpointer.all_steps() == [1, 2]
    # Training goes on: step 3 is trained again and saved, and is the newest from then on.
    resumed.train_step(batches[2])
    resumed.save(checkpointer, {"data_position": 3})
    checkpointer.close()
    again = ElasticTrainer(init_model(MODEL, seed=6), core, rl=RLConfig(), train=TRAIN)
    checkpointer = TrainCheckpointer(tmp_path / "ck", config)
    assert again.restore(checkpointer)["data_position"] == 3 and again.step == 3
    assert checkpointer.all_steps() == [1, 2, 3] and aside.exists()


def two_checkpoints(tmp_path):
    """A trainer after two steps, each checkpointed under tmp_path/ck (keep 3); returns
    (the core cell, the checkpoint config, the trainer)."""
    core = cells()[0]
    config = CheckpointConfig(every_steps=1, keep=3)
    trainer = ElasticTrainer(init_model(MODEL), core, rl=RLConfig(), train=TRAIN)
    checkpointer = TrainCheckpointer(tmp_path / "ck", config)
    for b in [make_batch(4), make_batch(5)]:
        trainer.train_step(b)
        trainer.save(checkpointer)
    checkpointer.close()
    return core, config, trainer


def test_a_storage_error_is_retried_and_never_moves_a_good_checkpoint(tmp_path, monkeypatch):
    # The audit's loss: one I/O error on the newest checkpoint moved it aside for good.
    core, config, trainer = two_checkpoints(tmp_path)
    saved = params_np(trainer)
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    read = TrainCheckpointer._restore_step
    failures = {"left": 0}

    def flaky(self, step, *targets):  # the newest step's read fails by EIO, `left` times
        if step == 2 and failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return read(self, step, *targets)

    monkeypatch.setattr(TrainCheckpointer, "_restore_step", flaky)
    monkeypatch.setattr(checkpoint_module, "RESTORE_RETRY_S", 0.0)
    failures["left"] = 2  # transient: the third attempt reads it
    resumed = ElasticTrainer(init_model(MODEL, seed=5), core, rl=RLConfig(), train=TRAIN)
    resumed.restore(TrainCheckpointer(tmp_path / "ck", config))
    assert resumed.step == 2 and failures["left"] == 0
    jax.tree.map(np.testing.assert_array_equal, params_np(resumed), saved)
    failures["left"] = 10**6  # the storage stays broken: an error, not a fallback to step 1
    fresh = ElasticTrainer(init_model(MODEL, seed=6), core, rl=RLConfig(), train=TRAIN)
    with pytest.raises(CheckpointError, match=r"ck/2: could not be read in 3 attempts \(OSError"):
        fresh.restore(TrainCheckpointer(tmp_path / "ck", config))
    assert fresh.step == 0
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before  # nothing moved


def test_no_readable_checkpoint_is_one_clear_error_and_nothing_is_moved(tmp_path):
    core, config, _ = two_checkpoints(tmp_path)
    damage_checkpoint(tmp_path / "ck" / "2", "data")
    damage_checkpoint(tmp_path / "ck" / "1", "metadata")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())

    fresh = ElasticTrainer(init_model(MODEL, seed=5), core, rl=RLConfig(), train=TRAIN)
    with pytest.raises(CheckpointError) as error:
        fresh.restore(TrainCheckpointer(tmp_path / "ck", config))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"no readable checkpoint under {tmp_path}")
    assert "step 2: Exception: " in message and "step 1: JSONDecodeError" in message
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    with pytest.raises(CheckpointError, match=r"checkpoint .*/ck/2: unreadable"):
        fresh.restore(TrainCheckpointer(tmp_path / "ck", config), step=2)


def test_a_missing_or_damaged_weights_snapshot_is_one_clear_error(tmp_path):
    weights = {"w": jax.numpy.arange(4096, dtype=np.float32).reshape(64, 64)}
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}
    with pytest.raises(CheckpointError, match=f"weights snapshot {tmp_path / 'none'}: unreadable"):
        restore_weights(tmp_path / "none", target)
    path = save_weights(tmp_path / "snapshot", weights)
    data = [p for p in path.rglob("*") if p.is_file() and "/d/" in str(p)]
    victim = max(data, key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(CheckpointError) as error:
        restore_weights(path, target)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"weights snapshot {path}")


def test_a_cell_with_a_sequence_axis_gives_the_same_step():
    """Rows split over a `sequence` axis of the cell (context-parallel tree attention,
    chosen by the train rules; the trainer is unchanged) give one plain cell's loss and
    gradient norm. Parameters are not compared: Adam's first step divides by |g|, so an
    embedding row with a near-zero gradient moves by float-order noise x lr / |g|, which
    any change of layout shows (a tensor-parallel cell too); per-parameter gradients on
    a sequence mesh are checked in test_sharding.py."""
    model = dataclasses.replace(MODEL, attention="blocked", attention_block_size=32)
    batch = make_batch(4)
    plain = ElasticTrainer(init_model(model), cells()[0], rl=RLConfig(), train=TRAIN)
    want = plain.train_step(batch)
    cell = split_into_cells(CellsConfig(size=4, fsdp=2, tensor=1, sequence=2))[0]
    split = ElasticTrainer(init_model(model), cell, rl=RLConfig(), train=TRAIN)
    got = split.train_step(batch)
    assert not got.skipped and got.metrics["tokens"] == want.metrics["tokens"]
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            got.metrics[name], want.metrics[name], rtol=1e-5, atol=LOSS_ATOL[name]
        )


@pytest.mark.parametrize("cell_shape", [(2, 2, 1), (2, 1, 2)])  # (size, fsdp, tensor)
def test_remat_and_a_chunked_head_give_the_same_step_on_sharded_cells(cell_shape):
    """train.remat and train.loss_chunk_tokens trade compute for memory and nothing else:
    a step with layers rematerialised and the head in chunks (a partial last one) gives
    the loss, metrics and gradients of the plain step, with rows split over fsdp or heads
    and vocabulary over tensor. (Gradients, not weights: Adam's first step divides by
    |g|, which makes float-order noise in a near-zero gradient visible in the weights.)"""
    model = dataclasses.replace(MODEL, attention="blocked", attention_block_size=32)
    batch = make_batch(5, rows_per_micro_step=2)
    size, fsdp, tensor = cell_shape
    steps = {}
    for remat, chunk in (("none", 0), ("layer", 48)):
        train = dataclasses.replace(
            TRAIN, rows_per_micro_step=2, remat=remat, loss_chunk_tokens=chunk
        )
        cell = split_into_cells(CellsConfig(size=size, fsdp=fsdp, tensor=tensor))[0]
        trainer = ElasticTrainer(
            init_model(model), cell, rl=RLConfig(), train=train, keep_last_grads=True
        )
        report = trainer.train_step(batch)
        steps[remat] = (report, jax.tree.map(np.asarray, trainer.last_grads))
    (want, want_grads), (got, got_grads) = steps["none"], steps["layer"]
    assert not got.skipped
    for name in ("loss", "grad_norm", "entropy", "tokens"):
        np.testing.assert_allclose(got.metrics[name], want.metrics[name], rtol=1e-5)
    scale = max(np.abs(g).max() for g in jax.tree.leaves(want_grads))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
        got_grads,
        want_grads,
    )


# --- float32 master weights beside a bfloat16 model ----------------------------------

BF16 = dataclasses.replace(MODEL, dtype="bfloat16")
# Adam's updates are about the learning rate: 1e-6, as in a real RL run, is far below
# half a bfloat16 step of a weight near 0.02 (6e-5), so without masters it rounds away.
TINY_LR = 1e-6


def bfloat16_start(dtype: str):
    """A model of `dtype` holding the bfloat16 model's initial weights (exactly: every
    bfloat16 value is a float32 value)."""
    if dtype == BF16.dtype:
        return init_model(BF16)
    model = init_model(dataclasses.replace(MODEL, dtype=dtype))
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(init_model(BF16))))
    return model


def float32_np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@functools.cache
def tiny_lr_runs():
    """Three steps at TINY_LR from the same bfloat16 weights: a float32 model (the
    reference), a bfloat16 model with masters (the default) and one without
    (train.master_dtype="same"). {name: (start, end, trainer)}, start and end the weights
    the optimizer updates, as float32 arrays."""
    batches = [make_batch(s) for s in (1, 2, 3)]
    runs = {}
    for name, dtype, master_dtype in (
        ("float32", "float32", "float32"),
        ("masters", "bfloat16", "float32"),
        ("same", "bfloat16", "same"),
    ):
        train = dataclasses.replace(TRAIN, learning_rate=TINY_LR, master_dtype=master_dtype)
        trainer = ElasticTrainer(bfloat16_start(dtype), cells()[0], rl=RLConfig(), train=train)
        start = float32_np(trainer.updated_weights)
        for batch in batches:
            assert not trainer.train_step(batch).skipped
        runs[name] = (start, float32_np(trainer.updated_weights), trainer)
    return runs


def test_bfloat16_with_masters_learns_like_float32_below_bfloat16_resolution():
    """With masters a bfloat16 model's updates land like a float32 model's; without them
    nearly all round away. Tolerance: the masters run differs from the reference only in
    computing each micro-step in bfloat16 (8 significant bits), which changes Adam's
    normalised update mostly where a gradient is near zero (measured: 4.7% of the
    reference's movement in norm, every weight within 2.4 x lr); 0.1 is twice that, and
    far below the 0.99 of the run without masters."""
    runs = tiny_lr_runs()
    trainer = runs["masters"][2]
    assert {x.dtype for x in jax.tree.leaves(trainer.master)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0]
    assert {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    same = runs["same"][2]
    assert same.master is None and runs["float32"][2].master is None
    assert {x.dtype for x in jax.tree.leaves(same.opt_state) if x.ndim > 0} == {
        jnp.dtype(jnp.bfloat16)
    }
    starts = [flat(start) for start, _, _ in runs.values()]
    np.testing.assert_array_equal(starts[0], starts[1])
    np.testing.assert_array_equal(starts[0], starts[2])

    moved = {name: flat(end) - flat(start) for name, (start, end, _) in runs.items()}
    reference = moved["float32"]
    error = lambda d: np.linalg.norm(d - reference) / np.linalg.norm(reference)
    assert np.mean(reference != 0) > 0.99
    assert np.mean(moved["masters"] != 0) > 0.99 and error(moved["masters"]) < 0.1
    # Without masters only weights below about 256 x lr in magnitude move at all.
    assert np.mean(moved["same"] != 0) < 0.05 and error(moved["same"]) > 0.9


def test_published_weights_are_the_masters_cast_down(tmp_path):
    """What satellites pull, engines get (`params`, `model()`) and exports write are the
    float32 masters cast to bfloat16."""
    trainer = tiny_lr_runs()["masters"][2]
    down = jax.tree.map(lambda m: np.asarray(m.astype(jnp.bfloat16)), trainer.master)
    params = jax.tree.map(np.asarray, trainer.params)
    assert flat(float32_np(trainer.master)).tolist() != flat(float32_np(params)).tolist()
    jax.tree.map(lambda p, d: p.dtype == d.dtype or pytest.fail(p.dtype), params, down)
    jax.tree.map(np.testing.assert_array_equal, params, down)
    model = nnx.to_pure_dict(nnx.state(trainer.model()))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, model), down)
    export_hf(trainer.model(), tmp_path / "hf")
    loaded = nnx.to_pure_dict(nnx.state(load_hf(tmp_path / "hf", dtype="bfloat16")))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), down)


def test_a_checkpoint_keeps_the_masters_and_resume_continues_exactly(tmp_path):
    batches = [make_batch(s) for s in (4, 5, 6)]
    core, train = cells()[0], dataclasses.replace(TRAIN, learning_rate=TINY_LR)
    straight = ElasticTrainer(init_model(BF16), core, rl=RLConfig(), train=train)
    for b in batches:
        straight.train_step(b)

    checkpoints = CheckpointConfig(every_steps=1, keep=1)
    first = ElasticTrainer(init_model(BF16), core, rl=RLConfig(), train=train)
    first.train_step(batches[0])
    first.save(TrainCheckpointer(tmp_path / "ck", checkpoints))
    resumed = ElasticTrainer(init_model(BF16, seed=5), core, rl=RLConfig(), train=train)
    resumed.restore(TrainCheckpointer(tmp_path / "ck", checkpoints))
    assert {x.dtype for x in jax.tree.leaves(resumed.master)} == {jnp.dtype(jnp.float32)}
    jax.tree.map(
        np.testing.assert_array_equal, float32_np(resumed.master), float32_np(first.master)
    )
    jax.tree.map(
        np.testing.assert_array_equal, optimizer_state_np(resumed), optimizer_state_np(first)
    )
    jax.tree.map(np.testing.assert_array_equal, params_np(resumed), params_np(first))
    for b in batches[1:]:
        resumed.train_step(b)
    assert resumed.step == straight.step == 3
    jax.tree.map(
        np.testing.assert_array_equal, float32_np(resumed.master), float32_np(straight.master)
    )
    jax.tree.map(np.testing.assert_array_equal, params_np(resumed), params_np(straight))


def test_a_checkpoint_without_masters_resumes_with_masters_from_its_weights(tmp_path):
    """A checkpoint from before masters (bfloat16 weights and moments, as
    train.master_dtype="same" still writes) resumes: the masters and float32 moments
    equal its values exactly, and training goes on."""
    core, batch = cells()[0], make_batch(4)
    same = dataclasses.replace(TRAIN, learning_rate=TINY_LR, master_dtype="same")
    old = ElasticTrainer(init_model(BF16), core, rl=RLConfig(), train=same)
    old.train_step(batch)
    checkpoints = CheckpointConfig(every_steps=1, keep=1)
    old.save(TrainCheckpointer(tmp_path / "ck", checkpoints), {"data_position": 3})
    masters = dataclasses.replace(same, master_dtype="float32")
    new = ElasticTrainer(init_model(BF16, seed=5), core, rl=RLConfig(), train=masters)
    meta = new.restore(TrainCheckpointer(tmp_path / "ck", checkpoints))
    assert meta["data_position"] == 3 and new.step == new.version == 1
    jax.tree.map(np.testing.assert_array_equal, float32_np(new.master), float32_np(old.params))
    jax.tree.map(np.testing.assert_array_equal, params_np(new), params_np(old))
    old_moments, new_moments = optimizer_state_np(old), optimizer_state_np(new)
    jax.tree.map(
        lambda o, n: n.dtype == (np.float32 if n.ndim else o.dtype) or pytest.fail(n.dtype),
        old_moments,
        new_moments,
    )
    jax.tree.map(np.testing.assert_array_equal, float32_np(new_moments), float32_np(old_moments))
    before = flat(float32_np(new.master))
    assert not new.train_step(make_batch(5)).skipped and new.step == 2
    assert np.mean(flat(float32_np(new.master)) != before) > 0.99
