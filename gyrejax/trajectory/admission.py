"""Path admission: which root-to-leaf paths of a tree are trained.

Leaves are ranked by the priority of their role (main before main_summary before
sub_agent before sub_agent_summary, see `records.register_role`). Repeatedly, within
the highest-priority class that still has a leaf with unmasked trainable tokens on its
root-to-leaf path, one leaf is sampled with probability proportional to that count; its
whole path is admitted and every token on it masked. Admission stops when no leaf has
unmasked trainable tokens left or `j_max` paths are admitted.

Masking is per node (a path always covers whole nodes), so the loop works on node
counts: leaves are numbered in DFS order, each node's subtree covers a contiguous leaf
range, and masking a node subtracts its count from that range in one slice operation.
The random stream is derived from (seed, crc32(execution_id)), so an execution's
admission does not depend on which other executions are processed with it.
"""

from __future__ import annotations

import zlib

import numpy as np

from gyrejax.trajectory.records import role_priority
from gyrejax.trajectory.tree import Tree


def admission_rng(seed: int, execution_id: str) -> np.random.Generator:
    """The per-execution random generator used for admission."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(execution_id.encode())])


def admit_paths(
    tree: Tree, j_max: int | None, rng: np.random.Generator
) -> tuple[np.ndarray, list[int]]:
    """Samples the admitted paths of one tree.

    Args:
      tree: the execution's tree.
      j_max: the most paths to admit, None for no cap.
      rng: the execution's generator (see `admission_rng`).

    Returns:
      admitted: bool[nodes], True on every node of an admitted path.
      leaves: the admitted leaves, in admission order.
    """
    if j_max is not None and j_max < 0:
        raise ValueError(f"j_max must be >= 0 or None, got {j_max}")
    num_nodes = tree.num_nodes
    admitted = np.zeros(num_nodes, dtype=bool)
    children = tree.children
    counts = tree.node_trainable_counts()

    # DFS over nodes: leaf order, the leaf range of every node, and the path count of
    # every leaf (sum of its ancestors' counts, propagated from the parent).
    leaf_nodes: list[int] = []
    leaf_lo = np.zeros(num_nodes, dtype=np.int64)
    leaf_hi = np.zeros(num_nodes, dtype=np.int64)
    path_count = np.zeros(num_nodes, dtype=np.int64)
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        node, done = stack.pop()
        if done:
            leaf_hi[node] = len(leaf_nodes)
            continue
        leaf_lo[node] = len(leaf_nodes)
        parent = int(tree.node_parent[node])
        path_count[node] = counts[node] + (path_count[parent] if parent >= 0 else 0)
        kids = children[node]
        if not kids:
            if node != 0:
                leaf_nodes.append(node)
            leaf_hi[node] = len(leaf_nodes)
            continue
        stack.append((node, True))
        for child in reversed(kids):
            stack.append((child, False))

    if not leaf_nodes:
        return admitted, []
    leaves = np.asarray(leaf_nodes, dtype=np.int64)
    remaining = path_count[leaves].copy()
    priority = np.asarray([role_priority(tree.node_role[n]) for n in leaf_nodes], np.int64)

    chosen: list[int] = []
    while j_max is None or len(chosen) < j_max:
        live = remaining > 0
        if not live.any():
            break
        best = priority[live].min()
        candidates = np.flatnonzero(live & (priority == best))
        cumulative = np.cumsum(remaining[candidates])
        r = rng.integers(int(cumulative[-1]))
        pick = int(candidates[np.searchsorted(cumulative, r, side="right")])
        leaf = int(leaves[pick])
        chosen.append(leaf)
        node = leaf
        while node > 0 and not admitted[node]:
            admitted[node] = True
            if counts[node]:
                remaining[leaf_lo[node] : leaf_hi[node]] -= counts[node]
            node = int(tree.node_parent[node])
    return admitted, chosen
