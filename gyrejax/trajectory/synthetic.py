"""Seeded generator of agent-shaped executions, for tests and benchmarks.

Each execution is a multi-turn agent loop in which every call's prompt is the agent's
full current context, exactly as a real harness re-sends its history:

  main context = system prompt + task, then per turn: model output + observation
  (a tool output, or the result of a sub-agent). When the context passes the
  compaction budget, a `main_summary` call (prompt = context + summary instruction)
  writes a summary and the main agent restarts from system + task + summary.
  A sub-agent runs its own loop from its own system prompt + subtask (compacting with
  `sub_agent_summary` calls) and returns its last output as the observation.
  A malformed output is retried from the same prompt (a fork in the tree); sometimes
  the retry repeats the same tokens. A timed-out execution stops early.

Prompt arrays are read-only views of one growing context buffer per agent context, so
generating 100M naive tokens does not take 400 MB per copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gyrejax.trajectory.records import Execution, ModelCall

_FIRST_REGULAR_TOKEN = 8  # ids below are "special": markers, instructions


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of `generate_executions` (token counts are inclusive [low, high] ranges)."""

    turns: tuple[int, int] = (100, 300)
    tool_output_tokens: tuple[int, int] = (10, 150)
    model_output_tokens: tuple[int, int] = (10, 100)
    summary_tokens: tuple[int, int] = (100, 300)
    system_prompt_tokens: int = 300
    task_tokens: tuple[int, int] = (50, 200)
    compaction_budget: int = 7000
    sub_agent_prob: float = 0.04
    sub_agent_turns: tuple[int, int] = (3, 15)
    retry_prob: float = 0.04
    retry_repeat_prob: float = 0.3
    timeout_prob: float = 0.1
    no_artifact_prob: float = 0.0
    eval_failed_prob: float = 0.0
    vocab_size: int = 32000
    max_call_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in (
            "turns",
            "tool_output_tokens",
            "model_output_tokens",
            "summary_tokens",
            "task_tokens",
            "sub_agent_turns",
        ):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"SyntheticConfig.{name} must be 0 <= low <= high, got {lo, hi}")
        if self.model_output_tokens[0] < 1 or self.summary_tokens[0] < 1:
            raise ValueError("SyntheticConfig: model outputs and summaries need >= 1 token")
        if self.vocab_size <= _FIRST_REGULAR_TOKEN:
            raise ValueError(f"SyntheticConfig.vocab_size must be > {_FIRST_REGULAR_TOKEN}")
        if self.longest_call() > self.max_call_tokens:
            raise ValueError(
                f"SyntheticConfig: a call may reach {self.longest_call()} tokens > "
                f"max_call_tokens={self.max_call_tokens}; lower compaction_budget"
            )

    def longest_call(self) -> int:
        """Upper bound on one call's prompt + output length."""
        system = self.system_prompt_tokens + self.task_tokens[1] + 2
        observation = max(self.tool_output_tokens[1], self.model_output_tokens[1]) + 1
        before_summary = max(self.compaction_budget, system + self.summary_tokens[1] + 1)
        return (
            before_summary + self.model_output_tokens[1] + observation + 2 + self.summary_tokens[1]
        )


class _Context:
    """An agent's context: an append-only buffer whose prefixes are handed out as prompts."""

    def __init__(self, capacity: int, parts: list[np.ndarray]) -> None:
        self.buf = np.zeros(capacity, dtype=np.int32)
        self.n = 0
        for part in parts:
            self.append(part)

    def append(self, ids: np.ndarray) -> None:
        self.buf[self.n : self.n + len(ids)] = ids
        self.n += len(ids)

    def prompt(self) -> np.ndarray:
        view = self.buf[: self.n]
        view.flags.writeable = False
        return view


class _Writer:
    """Makes the calls of one execution."""

    def __init__(self, execution_id: str, cfg: SyntheticConfig, rng: np.random.Generator):
        self.execution_id = execution_id
        self.cfg = cfg
        self.rng = rng
        self.calls: list[ModelCall] = []
        self.clock = 1.7e9 + float(rng.uniform(0, 1e6))
        self.version = int(rng.integers(0, 4))
        self.capacity = cfg.longest_call() + 16

    def tokens(self, bounds: tuple[int, int]) -> np.ndarray:
        n = int(self.rng.integers(bounds[0], bounds[1] + 1))
        return self.rng.integers(_FIRST_REGULAR_TOKEN, self.cfg.vocab_size, n, dtype=np.int32)

    def call(self, agent: str, role: str, prompt: np.ndarray, output: np.ndarray) -> None:
        n = len(output)
        versions = np.full(n, self.version, dtype=np.int32)
        if n and self.rng.random() < 0.05:  # a weight update landed mid-request
            versions[int(self.rng.integers(0, n)) :] += 1
        logprobs = -self.rng.exponential(0.4, n).astype(np.float32)
        start = self.clock
        self.clock += 0.5 + 0.02 * n
        self.calls.append(
            ModelCall(
                execution_id=self.execution_id,
                call_id=len(self.calls),
                agent_id=agent,
                role=role,
                prompt_ids=prompt,
                output_ids=output,
                logprobs=logprobs,
                versions=versions,
                finish_reason="stop",
                engines=(f"engine-{int(self.rng.integers(0, 4))}",),
                started_at=start,
                finished_at=self.clock,
            )
        )

    def turn(self, agent: str, role: str, ctx: _Context) -> np.ndarray:
        """One model call on `ctx` (with a possible malformed try first); returns output."""
        prompt = ctx.prompt()
        output = self.tokens(self.cfg.model_output_tokens)
        if self.rng.random() < self.cfg.retry_prob:
            self.call(agent, role, prompt, output)  # malformed; retried from the same prompt
            if self.rng.random() >= self.cfg.retry_repeat_prob:
                output = self.tokens(self.cfg.model_output_tokens)
            else:
                output = output.copy()
        self.call(agent, role, prompt, output)
        ctx.append(output)
        return output

    def loop(
        self,
        agent: str,
        role: str,
        summary_role: str,
        head: list[np.ndarray],
        turns: int,
        allow_sub_agents: bool,
        sub_system: np.ndarray,
    ) -> np.ndarray:
        """Runs one agent loop of `turns` calls; returns its last output."""
        cfg = self.cfg
        ctx = _Context(self.capacity, head)
        output = np.zeros(0, np.int32)
        for t in range(turns):
            output = self.turn(agent, role, ctx)
            if t == turns - 1:
                break
            if allow_sub_agents and self.rng.random() < cfg.sub_agent_prob:
                sub = f"sub-{len(self.calls)}"
                subtask = np.concatenate([[3], self.tokens(cfg.task_tokens)]).astype(np.int32)
                sub_turns = int(
                    self.rng.integers(cfg.sub_agent_turns[0], cfg.sub_agent_turns[1] + 1)
                )
                result = self.loop(
                    sub,
                    "sub_agent",
                    "sub_agent_summary",
                    [sub_system, subtask],
                    max(sub_turns, 1),
                    False,
                    sub_system,
                )
                ctx.append(np.concatenate([[4], result]).astype(np.int32))
            else:
                ctx.append(
                    np.concatenate([[5], self.tokens(cfg.tool_output_tokens)]).astype(np.int32)
                )
            if ctx.n >= cfg.compaction_budget:
                ctx.append(np.asarray([6, 7], np.int32))  # the summary instruction
                summary = self.tokens(cfg.summary_tokens)
                self.call(agent, summary_role, ctx.prompt(), summary)
                ctx = _Context(self.capacity, [*head, np.asarray([2], np.int32), summary])
        return output


def generate_executions(
    num_groups: int,
    group_size: int,
    *,
    seed: int,
    config: SyntheticConfig | None = None,
    **overrides,
) -> list[Execution]:
    """Generates `num_groups * group_size` agent-shaped executions.

    Args:
      num_groups: groups (one task each).
      group_size: executions per group.
      seed: everything is a function of the seed (and the config).
      config: a `SyntheticConfig`; keyword `overrides` replace its fields, e.g.
        `generate_executions(2, 4, seed=0, turns=(5, 10), vocab_size=64)`.

    Returns:
      The executions, group by group. Rewards are drawn per group around a group
      success rate, so groups have reward variance.
    """
    cfg = dataclasses.replace(config or SyntheticConfig(), **overrides)
    rng = np.random.default_rng(seed)
    system = rng.integers(_FIRST_REGULAR_TOKEN, cfg.vocab_size, cfg.system_prompt_tokens)
    system = np.concatenate([[1], system]).astype(np.int32)
    sub_system = rng.integers(_FIRST_REGULAR_TOKEN, cfg.vocab_size, cfg.system_prompt_tokens // 2)
    sub_system = np.concatenate([[1], sub_system]).astype(np.int32)
    executions = []
    for g in range(num_groups):
        task_len = int(rng.integers(cfg.task_tokens[0], cfg.task_tokens[1] + 1))
        task = rng.integers(_FIRST_REGULAR_TOKEN, cfg.vocab_size, task_len).astype(np.int32)
        success_rate = float(rng.uniform(0.1, 0.9))
        for i in range(group_size):
            execution_id = f"g{g:03d}-e{i:03d}"
            ex_rng = np.random.default_rng([seed, g, i])
            writer = _Writer(execution_id, cfg, ex_rng)
            turns = int(ex_rng.integers(cfg.turns[0], cfg.turns[1] + 1))
            status = "finished"
            u = ex_rng.random()
            if u < cfg.timeout_prob:
                status = "timed_out"
                turns = max(1, int(turns * ex_rng.uniform(0.3, 0.8)))
            elif u < cfg.timeout_prob + cfg.no_artifact_prob:
                status = "no_artifact"
            elif u < cfg.timeout_prob + cfg.no_artifact_prob + cfg.eval_failed_prob:
                status = "eval_failed"
            if turns > 0:
                writer.loop("main", "main", "main_summary", [system, task], turns, True, sub_system)
            reward: float | None = float(ex_rng.binomial(10, success_rate)) / 10.0
            if status == "timed_out":
                reward *= 0.5
            elif status == "no_artifact":
                reward = None
            elif status == "eval_failed":
                reward = None
            executions.append(
                Execution(
                    execution_id=execution_id,
                    task_id=f"task-{g:03d}",
                    group_id=f"group-{g:03d}",
                    calls=writer.calls,
                    status=status,
                    reward=reward,
                    eval_attempts=3 if status == "eval_failed" else 1,
                )
            )
    return executions
