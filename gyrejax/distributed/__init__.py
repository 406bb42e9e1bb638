"""Multi-process gyrejax: JAX's distributed runtime and process 0's decisions
(runtime.py), the trainer's transport across processes (transport.py), and what an RL
run adds across processes (rl.py)."""

from gyrejax.distributed.runtime import (
    Decision,
    Decisions,
    initialize,
    local_cells,
    owner,
)

__all__ = ["Decision", "Decisions", "initialize", "local_cells", "owner"]
