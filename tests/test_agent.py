"""The harness, driven by a scripted policy through the real proxy (no model)."""

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from gyrejax.config import HarnessConfig
from gyrejax.harness import tokenizer as tok
from gyrejax.harness.agent import SUB_SYSTEM, Harness
from gyrejax.harness.envs.mini_repo import MiniRepoEnv
from gyrejax.harness.workspace import Workspace
from gyrejax.rollout.proxy import Proxy
from gyrejax.rollout.scripted import ScriptedEngine
from gyrejax.trajectory import build_tree

CONFIG = HarnessConfig(max_turns=12, sub_agent_max_turns=4, timeout_s=30.0,
                       context_budget_tokens=4000, max_new_tokens=96, max_retries=2)  # fmt: skip


def scripted_engine(scripts, summary="wrote a.txt", delay_s=0.0):
    """Answers from `scripts[execution_id]["main" | "sub"]`, in order; summaries fixed."""

    def respond(prompt, request):
        execution_id = request.request_id.rsplit("/", 1)[0]
        if int(prompt[-2]) == tok.SUMMARIZE:
            return tok.answer(summary)
        kind = "sub" if tok.decode(prompt).startswith(SUB_SYSTEM) else "main"
        return tok.answer(scripts[execution_id][kind].pop(0))

    return ScriptedEngine("scripted", respond, delay_s=delay_s)


def run_one(tmp_path, task, scripts, config=CONFIG, env=None, execution_id="x", **engine):
    async def body():
        proxy = Proxy([scripted_engine(scripts, **engine)])
        harness = Harness(proxy, config, tmp_path, environment=env or MiniRepoEnv())
        execution = await harness.run_execution(task, execution_id, "g", seed=0)
        return execution, proxy

    return asyncio.run(body())


def two_file_task():
    env = MiniRepoEnv()
    task = next(t for t in env.sample_tasks(50, seed=0, difficulty=2) if len(t.goals) >= 2)
    good = [env.demonstration(task, rng=np.random.default_rng(0), quality=1.0)]
    return task, [a for a in good[0] if a.startswith("write")]


def test_compaction_delegation_and_retries_shape_the_calls_and_the_tree(tmp_path):
    task, writes = two_file_task()
    first_line = writes[1].splitlines()[0]  # "write <path>"
    scripts = {
        "x": {
            "main": [
                "oops",
                writes[0],
                f"delegate {first_line}: see spec",
                *writes[2:],
                "ls",
                "done",
            ],
            "sub": [writes[1], "done wrote it"],
        }
    }
    config = dataclasses.replace(CONFIG, context_budget_tokens=len(task.spec) + 120)
    execution, _ = run_one(tmp_path, task, scripts, config=config)
    assert execution.status == "finished" and execution.reward == 1.0
    roles = [c.role for c in execution.calls]
    agents = [c.agent_id for c in execution.calls]
    # oops (malformed) is retried from the same context, then the write succeeds.
    assert roles[:2] == ["main", "main"]
    np.testing.assert_array_equal(execution.calls[0].prompt_ids, execution.calls[1].prompt_ids)
    assert "main_summary" in roles and "sub_agent" in roles
    assert {a for a, r in zip(agents, roles, strict=True) if r == "sub_agent"} == {"sub-1"}
    summary = execution.calls[roles.index("main_summary")]
    assert summary.prompt_ids[-2:].tolist() == [tok.SUMMARIZE, tok.ASSISTANT]
    after = execution.calls[roles.index("main_summary") + 1]
    opening = tok.start_context(tok.decode(after.prompt_ids).split(task.spec)[0], task.spec)
    assert after.prompt_ids[: len(opening)].tolist() == opening
    assert "summary: wrote a.txt" in tok.decode(after.prompt_ids)
    for call in execution.calls:  # answers are the scripted text + <eot>
        assert call.output_ids[-1] == tok.EOT and call.finish_reason == "stop"
        assert len(call.logprobs) == len(call.versions) == len(call.output_ids)

    tree = build_tree(list(execution.calls))
    depth_of = dict(zip(range(tree.num_nodes), tree.node_depth, strict=True))
    forks = [n for n in range(1, tree.num_nodes) if len(tree.children[n]) > 1]
    branch_depths = sorted(depth_of[n] + tree.node_end[n] - tree.node_start[n] for n in forks)
    # One tree (every context opens with <bos><system>): the sub-agent branches off
    # after those 2 tokens, the compacted context after the main opening, and the retry
    # at the end of the first prompt.
    assert len(tree.children[0]) == 1
    assert 2 in branch_depths
    assert len(opening) in branch_depths
    assert len(execution.calls[0].prompt_ids) in branch_depths


def test_path_escapes_are_refused_and_reported(tmp_path):
    task, writes = two_file_task()
    scripts = {"x": {"main": ["write ../escape.txt\nboo", "read /etc/passwd", *writes, "done"],
                     "sub": []}}  # fmt: skip
    execution, _ = run_one(tmp_path / "w", task, scripts)
    observations = tok.decode(execution.calls[2].prompt_ids)
    assert "refused" in observations and "leaves the workspace" in observations
    assert not (tmp_path / "escape.txt").exists()
    assert execution.reward == 1.0


def test_out_of_turns_is_timed_out_and_scored_on_its_workspace(tmp_path):
    task, writes = two_file_task()
    scripts = {"x": {"main": [writes[0], "ls", "ls", "ls"], "sub": []}}
    execution, _ = run_one(tmp_path, task, scripts, config=dataclasses.replace(CONFIG, max_turns=4))
    assert execution.status == "timed_out"
    assert 0 < execution.reward < 1 and len(execution.calls) == 4


def test_wall_clock_timeout_cancels_in_flight_calls(tmp_path):
    task, writes = two_file_task()
    scripts = {"x": {"main": [writes[0]] + ["ls"] * 50, "sub": []}}
    # 2 s: the first call (0.2 s) and its write land even on a loaded machine; the 50
    # calls (10 s) cannot.
    config = dataclasses.replace(CONFIG, timeout_s=2.0, max_turns=50)
    execution, proxy = run_one(tmp_path, task, scripts, config=config, delay_s=0.2)
    assert execution.status == "timed_out" and 0 < execution.reward < 1
    assert proxy.counters().in_flight == {"scripted": 0} and proxy.counters().finished == 1


@pytest.mark.parametrize(("failures", "status"), [(1, "finished"), (5, "eval_failed")])
def test_evaluation_errors_are_retried_then_marked(tmp_path, failures, status):
    task, writes = two_file_task()
    scripts = {"x": {"main": [*writes, "done"], "sub": []}}
    execution, _ = run_one(tmp_path, task, scripts, env=MiniRepoEnv(fail_evaluations=failures))
    assert execution.status == status
    if status == "finished":
        assert execution.reward == 1.0 and execution.eval_attempts == 2
    else:
        assert execution.reward is None and execution.eval_attempts == CONFIG.eval_retry_budget


def test_a_raising_tool_becomes_an_observation(tmp_path, monkeypatch):
    from gyrejax.harness.workspace import Workspace

    task, writes = two_file_task()

    def broken(self):
        raise OSError("disk on fire")

    monkeypatch.setattr(Workspace, "list_files", broken)
    scripts = {"x": {"main": ["ls", *writes, "done"], "sub": []}}
    execution, _ = run_one(tmp_path, task, scripts)
    assert "error: tool ls failed: OSError: disk on fire" in tok.decode(
        execution.calls[1].prompt_ids
    )
    assert execution.status == "finished" and execution.reward == 1.0


def test_empty_workspace_is_no_artifact(tmp_path):
    task, _ = two_file_task()
    execution, _ = run_one(tmp_path, task, {"x": {"main": ["done"], "sub": []}})
    assert execution.status == "no_artifact" and execution.reward == 0.0


def test_a_group_runs_concurrently_and_counts(tmp_path):
    task, writes = two_file_task()
    scripts = {f"g/{i}": {"main": [*writes[: i % 2 + 1], "done"], "sub": []} for i in range(4)}

    async def body():
        proxy = Proxy([scripted_engine(scripts, delay_s=0.01)])
        harness = Harness(proxy, CONFIG, tmp_path, environment=MiniRepoEnv())
        executions = await harness.run_group(task, "g", size=4, seed=0)
        return executions, proxy.counters()

    executions, counters = asyncio.run(body())
    assert [e.execution_id for e in executions] == [f"g/{i}" for i in range(4)]
    assert {e.group_id for e in executions} == {"g"}
    rewards = [e.reward for e in executions]  # even ids wrote one file, odd ids two
    assert rewards[0] == rewards[2] < rewards[1] == rewards[3]
    assert (counters.dispatched, counters.started, counters.finished) == (4, 4, 4)


def test_tool_latency_waits_without_cpu_and_repeats_per_execution(tmp_path):
    # Two writes then done: two tool calls, each waiting a seeded lognormal time.
    task, writes = two_file_task()
    config = dataclasses.replace(CONFIG, tool_latency_median_s=0.3, tool_latency_sigma=0.5)
    wall, cpu = time.perf_counter(), time.process_time()
    execution, _ = run_one(tmp_path, task, {"x": {"main": [*writes[:2], "done"]}}, config=config)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    harness = Harness(Proxy([scripted_engine({})]), config, tmp_path / "h")
    waits = [harness._tool_latency_s(_run_state("x", calls)) for calls in (1, 2)]
    assert execution.status == "finished" and len(execution.calls) == 3
    assert wall >= sum(waits) and wall - cpu >= 0.8 * sum(waits)  # waited, not computed
    # Seeded: the same execution and call wait the same, another execution otherwise.
    assert waits == [harness._tool_latency_s(_run_state("x", c)) for c in (1, 2)]
    assert waits[0] != harness._tool_latency_s(_run_state("y", 1))
    off = Harness(Proxy([scripted_engine({})]), CONFIG, tmp_path / "o")
    assert off._tool_latency_s(_run_state("x", 1)) == 0.0


def _run_state(execution_id: str, calls: int):
    from gyrejax.harness.agent import _Run

    return _Run(execution_id, task=None, workspace=None, seed=0, calls=calls)


def test_workspace_tools_run_off_the_event_loop(tmp_path, monkeypatch):
    # The audit: 52,108 files made every `ls` take 0.45 s on the loop every execution
    # shares. A slow filesystem (each workspace call here takes 0.3 s) must not stall it.
    task, writes = two_file_task()
    slow_s = 0.3

    def slowly(method):
        def call(*args, **kwargs):
            time.sleep(slow_s)
            return method(*args, **kwargs)

        return call

    for name in ("write", "read", "list_files", "is_empty"):
        monkeypatch.setattr(Workspace, name, slowly(getattr(Workspace, name)))
    scripts = {"x": {"main": [writes[0], "ls", "done"]}}

    async def body():
        proxy = Proxy([scripted_engine(scripts)])
        harness = Harness(proxy, CONFIG, tmp_path, environment=MiniRepoEnv())
        ticks, gaps = [], []

        async def ticker():
            while True:
                before = time.monotonic()
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - before)
                ticks.append(1)

        beat = asyncio.create_task(ticker())
        execution = await harness.run_execution(task, "x", "g", seed=0)
        beat.cancel()
        return execution, gaps

    execution, gaps = asyncio.run(body())
    assert execution.status == "finished" and len(execution.calls) == 3
    assert len(gaps) > 3 * slow_s / 0.02  # it kept beating through three slow calls
    assert max(gaps) < slow_s / 2, max(gaps)
