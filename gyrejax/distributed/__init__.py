"""Multi-process gyrejax: JAX's distributed runtime, process 0's decisions, and elastic
training whose satellites live in other processes (see runtime.py and training.py)."""

from gyrejax.distributed.runtime import (
    Decision,
    Decisions,
    initialize,
    local_cells,
    owner,
)

__all__ = ["Decision", "Decisions", "initialize", "local_cells", "owner"]
