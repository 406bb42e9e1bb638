"""Where a run's tasks come from: fresh tasks, or draws from a fixed pool.

With `harness.task_pool = K > 0` every task is drawn from one pool of K tasks (fixed by
the run seed), so demonstrations and RL see the same tasks again: a tiny model can learn
them within a CPU budget. With 0, every draw samples new tasks.
"""

from __future__ import annotations

import numpy as np

from gyrejax.config import HarnessConfig


def draw_tasks(env, config: HarnessConfig, n: int, *, seed: int, run_seed: int = 0) -> list:
    """`n` tasks for one batch (deterministic in `seed` and `run_seed`)."""
    if config.task_pool:
        pool = env.sample_tasks(config.task_pool, seed=run_seed, difficulty=config.difficulty)
        picks = np.random.default_rng([run_seed, seed]).integers(0, len(pool), n)
        return [pool[i] for i in picks]
    return env.sample_tasks(n, seed=seed, difficulty=config.difficulty)
