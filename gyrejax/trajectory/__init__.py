"""Trajectory processor: execution records -> prefix-shared trees -> packed micro-steps.

Pure NumPy; this package must never import JAX (the trainer moves the packed arrays to
devices itself). Entry point: `process(executions, row_length=...) -> PackedBatch`.
"""

from gyrejax.trajectory.admission import admission_rng, admit_paths
from gyrejax.trajectory.advantages import get_advantage, known_advantages, register_advantage
from gyrejax.trajectory.process import ContextTooLong, PackedBatch, PackStats, process
from gyrejax.trajectory.records import (
    STATUSES,
    Execution,
    ModelCall,
    known_roles,
    register_role,
    role_priority,
)
from gyrejax.trajectory.store import ExecutionStore
from gyrejax.trajectory.synthetic import SyntheticConfig, generate_executions
from gyrejax.trajectory.tree import Tree, build_tree

__all__ = [
    "STATUSES",
    "ContextTooLong",
    "Execution",
    "ExecutionStore",
    "ModelCall",
    "PackStats",
    "PackedBatch",
    "SyntheticConfig",
    "Tree",
    "admission_rng",
    "admit_paths",
    "build_tree",
    "generate_executions",
    "get_advantage",
    "known_advantages",
    "known_roles",
    "process",
    "register_advantage",
    "register_role",
    "role_priority",
]
