"""Demonstrations replayed through the real harness: scored, recorded, trainable."""

import asyncio

import numpy as np

from gyrejax.config import HarnessConfig
from gyrejax.harness import tokenizer as tok
from gyrejax.harness.demonstrations import demonstration_executions
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.trajectory import process


def test_perfect_demonstrations_score_one_and_pack(tmp_path):
    env = MiniRepoEnv()
    tasks = env.sample_tasks(6, seed=3, difficulty=[1, 2, 3])
    executions = asyncio.run(
        demonstration_executions(
            env, tasks, HarnessConfig(), tmp_path, seed=0, quality=1.0, delegation_prob=0.5
        )
    )
    assert [e.reward for e in executions] == [1.0] * 6
    assert all(e.status == "finished" for e in executions)
    roles = {c.role for e in executions for c in e.calls}
    assert roles >= {"main", "sub_agent"}  # some demonstrations delegate
    for e in executions:
        first = e.calls[0]
        assert tok.decode(first.prompt_ids).endswith(e.calls[0].prompt_ids.size * "" + "")
        assert first.prompt_ids[-1] == tok.ASSISTANT and first.output_ids[-1] == tok.EOT
    options = dict(row_length=2048, j_max=None, vocab_size=tok.VOCAB_SIZE)
    batch = process(executions, demonstrations=True, **options)
    # Every generated token is trained once: the answers are what SFT learns, at
    # temperature 1 though they were recorded greedily.
    generated = sum(len(c.output_ids) for e in executions for c in e.calls)
    assert batch.stats.admitted_trainable_tokens == generated
    assert np.isclose(batch.loss_weight.sum(), 1.0)
    assert (batch.temperature == 1).all() and batch.stats.greedy_tokens == 0
    # As RL data, greedy outputs are context only: nothing would be trained.
    as_samples = process(executions, **options)
    assert as_samples.stats.admitted_trainable_tokens == 0
    assert as_samples.stats.greedy_tokens == generated


def test_imperfect_demonstrations_have_room_to_improve(tmp_path):
    env = MiniRepoEnv()
    tasks = env.sample_tasks(12, seed=4, difficulty=1)
    executions = asyncio.run(
        demonstration_executions(env, tasks, HarnessConfig(), tmp_path, seed=1, quality=0.5)
    )
    rewards = np.array([e.reward for e in executions])
    assert 0.2 < rewards.mean() < 0.95


def test_demonstrations_in_an_hf_chat_format_score_one_and_pack(tmp_path, bpe_tokenizer):
    from gyrejax.harness.chat import load_chat

    chat = load_chat(str(bpe_tokenizer))
    env = MiniRepoEnv()
    tasks = env.sample_tasks(4, seed=3, difficulty=[1, 2, 3])
    executions = asyncio.run(
        demonstration_executions(
            env, tasks, HarnessConfig(), tmp_path, seed=0, quality=1.0, delegation_prob=0.5,
            chat=chat,
        )
    )  # fmt: skip
    assert [e.reward for e in executions] == [1.0] * 4
    for e in executions:  # every action is one tool call; every answer ends its turn
        for call in e.calls:
            assert call.output_ids[-1] == chat.stop_ids[0]
            if call.role in ("main", "sub_agent"):
                assert not chat.parse(call.output_ids).malformed
    batch = process(
        executions, row_length=4096, j_max=None, vocab_size=chat.vocab_size, demonstrations=True
    )
    generated = sum(len(c.output_ids) for e in executions for c in e.calls)
    assert batch.stats.admitted_trainable_tokens == generated
