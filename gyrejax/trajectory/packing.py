"""Packing admitted forests into fixed-length rows (micro-steps: see `microsteps`).

Layout. An execution's admitted forest (the union of its admitted paths) is numbered in
depth-first pre-order ("DFS index"). A row holds *blocks*; a block is an
ancestor-closed subset of one execution's forest laid out in increasing DFS index. The
restriction of a pre-order to an ancestor-closed subset is a pre-order of the induced
sub-forest, so in the row every node's subtree is still contiguous and

  subtree_end[k] = row index one past the last block token whose DFS index lies in
                   [k, dfs_subtree_end(k)),
  pred_index[i]  = row index of the token's path predecessor (always in the block),

are both one `searchsorted` over the block's sorted DFS indices. Key k is visible to
query q iff k <= q < subtree_end[k]; blocks never see each other.

Splitting. A subtree that fits in a row together with its ancestor path
(depth(v) + size(v) <= L) is a *unit*. A tree that does not fit is cut at node
boundaries into maximal units; the nodes above them are the units' shared context.
A row that holds several units of one execution holds their ancestors once; every
token is trained (owned) in exactly one block, and other copies of an ancestor are
repeated context (loss weight 0). Since every call fits in a row, every token has
depth < L and the recursion always ends in units.

Bin packing. Units go in decreasing size order into the row where their marginal cost
(size + ancestors not yet in that row) fits best (best fit decreasing with shared
context). A unit that fits no open row may instead be split one level further (its top
node becomes context and its children units) when the pieces fit the open rows' tails:
this turns padding into trained tokens at the price of repeating the top path.

Nodes are never cut mid-way: the rest of a cut chain needs the whole chain before the
cut as context, so it costs exactly as much row space as the uncut chain, and the
piece moved into another row's tail is pure extra work. Only cuts at branch points
(siblings that stop sharing a row) can save space, and those are what units are.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from gyrejax.trajectory.rows import padding_rows
from gyrejax.trajectory.tree import Tree


@dataclasses.dataclass
class ForestLayout:
    """One execution's admitted forest in DFS pre-order (T tokens, K nodes).

    Attributes:
      tree: the execution's tree.
      node_ids: int64[K] tree node of each forest node, in pre-order.
      node_first: int64[K] DFS index of each node's first token.
      node_len: int64[K] tokens per node.
      node_depth: int64[K] depth of each node's first token.
      node_parent: int64[K] forest index of the parent (-1 for a root).
      node_end: int64[K] DFS index one past each node's subtree.
      flat: int64[T] tree flat index of each DFS token.
      depth: int64[T] position of each DFS token.
      subtree_end: int64[T] DFS index one past each token's subtree.
      parent: int64[T] DFS index of each token's path predecessor (-1 for a root token).
      trainable: bool[T] the token is trainable.
    """

    tree: Tree
    node_ids: np.ndarray
    node_first: np.ndarray
    node_len: np.ndarray
    node_depth: np.ndarray
    node_parent: np.ndarray
    node_end: np.ndarray
    flat: np.ndarray
    depth: np.ndarray
    subtree_end: np.ndarray
    parent: np.ndarray
    trainable: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.flat)

    @classmethod
    def build(cls, tree: Tree, admitted: np.ndarray) -> ForestLayout:
        """Lays out the admitted nodes of `tree` (bool[nodes]) in DFS pre-order."""
        order: list[int] = []
        parents: list[int] = []
        stack = [(c, -1) for c in reversed(tree.children[0]) if admitted[c]]
        children = tree.children
        while stack:
            node, parent = stack.pop()
            me = len(order)
            order.append(node)
            parents.append(parent)
            stack.extend((c, me) for c in reversed(children[node]) if admitted[c])
        node_ids = np.asarray(order, dtype=np.int64)
        node_parent = np.asarray(parents, dtype=np.int64)
        num_nodes = len(node_ids)
        start = tree.node_start[node_ids]
        node_len = tree.node_end[node_ids] - start
        node_first = np.zeros(num_nodes, dtype=np.int64)
        if num_nodes:
            np.cumsum(node_len[:-1], out=node_first[1:])
        node_depth = tree.node_depth[node_ids]
        # Subtree sizes: children come after parents in pre-order, so one reverse sweep.
        size = node_len.copy()
        for i in range(num_nodes - 1, 0, -1):
            if node_parent[i] >= 0:
                size[node_parent[i]] += size[i]
        node_end = node_first + size
        total = int(node_len.sum())
        ar = np.arange(total, dtype=np.int64)
        flat = np.repeat(start - node_first, node_len) + ar
        depth = np.repeat(node_depth - node_first, node_len) + ar
        subtree_end = np.repeat(node_end, node_len)
        parent = ar - 1
        if num_nodes:
            has_parent = node_parent >= 0
            pp = node_parent[has_parent]
            parent[node_first[has_parent]] = node_first[pp] + node_len[pp] - 1
            parent[node_first[~has_parent]] = -1
        return cls(
            tree=tree,
            node_ids=node_ids,
            node_first=node_first,
            node_len=node_len,
            node_depth=node_depth,
            node_parent=node_parent,
            node_end=node_end,
            flat=flat,
            depth=depth,
            subtree_end=subtree_end,
            parent=parent,
            trainable=tree.trainable[flat],
        )

    def ancestors(self, node: int) -> list[int]:
        """Forest indices of the strict ancestors of `node`, root first."""
        out = []
        p = int(self.node_parent[node])
        while p >= 0:
            out.append(p)
            p = int(self.node_parent[p])
        out.reverse()
        return out

    def subtree_size(self, node: int) -> int:
        return int(self.node_end[node] - self.node_first[node])


@dataclasses.dataclass
class _Unit:
    layout: int  # index into the layouts list
    node: int  # forest node at the top of the unit
    size: int  # tokens in the unit's subtree
    ancestors: list[int]


@dataclasses.dataclass
class _Row:
    free: int
    # layout index -> (units placed, ancestor nodes present)
    blocks: dict[int, tuple[list[int], set[int]]] = dataclasses.field(default_factory=dict)


def _children_of(layout: ForestLayout, node: int) -> list[int]:
    """Forest children of `node` (pre-order: they lie in (node, node_end))."""
    end = layout.node_end[node]
    out = []
    i = node + 1
    num = len(layout.node_first)
    while i < num and layout.node_first[i] < end:
        out.append(i)
        i = int(np.searchsorted(layout.node_first, layout.node_end[i]))
    return out


def _units(layouts: list[ForestLayout], row_length: int) -> list[_Unit]:
    """Cuts every forest into maximal subtrees that fit a row with their ancestors."""
    units = []
    for li, lay in enumerate(layouts):
        roots = np.flatnonzero(lay.node_parent < 0).tolist()
        stack = [(r, []) for r in reversed(roots)]
        while stack:
            node, anc = stack.pop()
            size = lay.subtree_size(node)
            if int(lay.node_depth[node]) + size <= row_length:
                units.append(_Unit(li, node, size, anc))
                continue
            kids = _children_of(lay, node)
            if not kids:  # cannot happen when every call fits a row
                raise ValueError(
                    f"a path of depth {int(lay.node_depth[node]) + size} exceeds row_length "
                    f"{row_length}"
                )
            stack.extend((k, [*anc, node]) for k in reversed(kids))
    return units


def _marginal(row: _Row, unit: _Unit, layouts: list[ForestLayout]) -> int:
    """Row slots `unit` takes in `row`: its subtree plus ancestors not already there."""
    lens = layouts[unit.layout].node_len
    block = row.blocks.get(unit.layout)
    present = block[1] if block is not None else ()
    return unit.size + int(sum(lens[a] for a in unit.ancestors if a not in present))


class _RowIndex:
    """Open rows, indexed for best-fit queries in O(log rows + rows sharing a forest).

    A unit's cost is the same in every row that holds nothing of its forest, so for
    those rows best fit is one bisect in the (free, row id) list; only rows that
    already hold part of the unit's forest need a marginal-cost computation.
    """

    def __init__(self, row_length: int, layouts: list[ForestLayout]) -> None:
        self.row_length = row_length
        self.layouts = layouts
        self.rows: list[_Row] = []
        self.by_free: list[tuple[int, int]] = []  # sorted (free, row id)
        self.rows_of: dict[int, set[int]] = {}  # layout -> ids of rows holding it

    def new_row(self) -> int:
        self.rows.append(_Row(free=self.row_length))
        rid = len(self.rows) - 1
        bisect.insort(self.by_free, (self.row_length, rid))
        return rid

    def best(self, unit: _Unit) -> tuple[int | None, int]:
        """Row id where `unit` leaves the least room (ties: lowest id), and its cost."""
        best, best_cost, best_key = None, 0, None
        sharing = self.rows_of.get(unit.layout, set())
        for rid in sharing:
            row = self.rows[rid]
            cost = _marginal(row, unit, self.layouts)
            if cost <= row.free and (best_key is None or (row.free - cost, rid) < best_key):
                best, best_cost, best_key = rid, cost, (row.free - cost, rid)
        full = _marginal(_Row(0), unit, self.layouts)
        j = bisect.bisect_left(self.by_free, (full, -1))
        while j < len(self.by_free) and self.by_free[j][1] in sharing:
            j += 1
        if j < len(self.by_free):
            free, rid = self.by_free[j]
            if best_key is None or (free - full, rid) < best_key:
                best, best_cost = rid, full
        return best, best_cost

    def place(self, rid: int, unit_index: int, unit: _Unit, cost: int) -> None:
        row = self.rows[rid]
        del self.by_free[bisect.bisect_left(self.by_free, (row.free, rid))]
        block = row.blocks.setdefault(unit.layout, ([], set()))
        block[0].append(unit_index)
        block[1].update(unit.ancestors)
        row.free -= cost
        bisect.insort(self.by_free, (row.free, rid))
        self.rows_of.setdefault(unit.layout, set()).add(rid)

    def save(self, rid: int) -> tuple:
        """A copy of row `rid`'s state, for `restore` (undoing a tentative split)."""
        row = self.rows[rid]
        return (rid, row.free, {k: (list(v[0]), set(v[1])) for k, v in row.blocks.items()})

    def restore(self, saved: tuple) -> None:
        rid, free, blocks = saved
        row = self.rows[rid]
        del self.by_free[bisect.bisect_left(self.by_free, (row.free, rid))]
        row.free, row.blocks = free, blocks
        bisect.insort(self.by_free, (free, rid))
        for layout, ids in self.rows_of.items():
            if layout not in blocks:
                ids.discard(rid)


def _try_open(index: _RowIndex, units: list[_Unit], unit: _Unit) -> bool:
    """Splits `unit` one level (top node -> context) if all children fit open rows.

    Used only when `unit` fits no open row: it then saves a row at the price of
    repeating the top path. Splitting a chain (one child) never saves anything, since
    the rest of a chain needs the same context as the whole, so it is not tried.
    """
    lay = index.layouts[unit.layout]
    kids = _children_of(lay, unit.node)
    if len(kids) < 2 or not index.by_free:
        return False
    ancestors = [*unit.ancestors, unit.node]
    subs = sorted(
        (_Unit(unit.layout, k, lay.subtree_size(k), ancestors) for k in kids),
        key=lambda u: -u.size,
    )
    if subs[0].size > index.by_free[-1][0]:
        return False
    saved: dict[int, tuple] = {}
    for sub in subs:
        rid, cost = index.best(sub)
        if rid is None:
            for state in saved.values():
                index.restore(state)
            return False
        if rid not in saved:
            saved[rid] = index.save(rid)
        units.append(sub)
        index.place(rid, len(units) - 1, sub, cost)
    return True


def plan_rows(
    layouts: list[ForestLayout],
    row_length: int,
    *,
    unit_cap: int | None = None,
    tree_first_above: int | None = None,
) -> tuple[list[_Row], list[_Unit]]:
    """Assigns every unit of every forest to a row (see module docstring).

    Args:
      layouts: one `ForestLayout` per execution.
      row_length: L.
      unit_cap: cut forests into units whose footprint (depth + size) is at most this
        (default L). Smaller units fill rows more evenly at the price of more
        repeated context; `strategies` tries a few.
      tree_first_above: if set, units with a footprint above it are placed forest by
        forest (largest forest first, each forest's units largest first), the rest
        after them by size. One forest's big units placed in a row then share its
        trunk instead of each repeating it in a different row.

    Returns:
      The rows (each a dict layout -> (unit indices, ancestor nodes)) and the units.
    """
    units = _units(layouts, unit_cap or row_length)

    def footprint(i: int) -> int:
        return units[i].size + int(layouts[units[i].layout].node_depth[units[i].node])

    if tree_first_above is None:
        order = sorted(range(len(units)), key=lambda i: (-footprint(i), i))
    else:
        forest_size: dict[int, int] = {}
        for u in units:
            forest_size[u.layout] = forest_size.get(u.layout, 0) + u.size

        def key(i: int) -> tuple:
            if footprint(i) > tree_first_above:
                return (0, -forest_size[units[i].layout], units[i].layout, -footprint(i), i)
            return (1, -footprint(i), i)

        order = sorted(range(len(units)), key=key)
    index = _RowIndex(row_length, layouts)
    for ui in order:
        unit = units[ui]
        rid, cost = index.best(unit)
        if rid is None:
            n_units = len(units)
            if _try_open(index, units, unit):
                continue
            del units[n_units:]  # sub-units of a failed split
            rid = index.new_row()
            cost = _marginal(index.rows[rid], unit, layouts)
        index.place(rid, ui, unit, cost)
    return index.rows, units


def strategies(row_length: int, longest_path: int) -> list[dict[str, int | None]]:
    """`plan_rows` keyword sets worth trying for rows of `row_length` (the first is the
    default plan). Cheap (tens of ms each on 2.4M tokens), so bucketed packing plans
    with each and keeps the fewest packed tokens.
    """
    caps = [c for c in (row_length, row_length // 2) if c >= longest_path]
    return [
        {"unit_cap": cap, "tree_first_above": above}
        for cap in caps
        for above in (None, row_length // 2, row_length // 4, row_length // 16)
    ]


def assemble_rows(
    layouts: list[ForestLayout],
    rows: list[_Row],
    units: list[_Unit],
    *,
    row_length: int,
    execution_index: list[int],
    token_weight: list[float],
    advantage: list[float],
    pad_id: int,
) -> tuple[dict[str, np.ndarray], int]:
    """Writes the planned rows into padded [rows, row_length] arrays.

    Args:
      layouts: one `ForestLayout` per packed execution.
      rows, units: from `plan_rows`.
      row_length: L.
      execution_index: per layout, the index written to `execution_index`.
      token_weight: per layout, the loss weight of each of its trained tokens.
      advantage: per layout, the advantage written on all of its tokens.
      pad_id: token id of padding.

    Returns:
      Every field of `rows.ROW_FIELDS`, [rows, row_length], and the number of repeated
      (context) tokens.
    """
    length = row_length
    arrays = padding_rows(len(rows), length, pad_id)
    tokens, positions = arrays["tokens"], arrays["positions"]
    subtree_end, pred_index = arrays["subtree_end"], arrays["pred_index"]
    loss_weight, adv = arrays["loss_weight"], arrays["advantage"]
    behavior_logprob, version = arrays["behavior_logprob"], arrays["version"]
    ex_index = arrays["execution_index"]
    owned_context: list[set[int]] = [set() for _ in layouts]
    repeated = 0
    for r, row in enumerate(rows):
        offset = 0
        for li, (unit_ids, context) in row.blocks.items():
            lay = layouts[li]
            owned = owned_context[li]
            ranges = [
                (int(lay.node_first[a]), int(lay.node_len[a]), a not in owned) for a in context
            ]
            owned.update(context)
            for ui in unit_ids:
                node = units[ui].node
                ranges.append((int(lay.node_first[node]), units[ui].size, True))
            ranges.sort()
            starts = np.asarray([x[0] for x in ranges], dtype=np.int64)
            lens = np.asarray([x[1] for x in ranges], dtype=np.int64)
            mine = np.asarray([x[2] for x in ranges], dtype=bool)
            n = int(lens.sum())
            begins = np.zeros(len(lens), dtype=np.int64)
            np.cumsum(lens[:-1], out=begins[1:])
            idx = np.repeat(starts - begins, lens) + np.arange(n, dtype=np.int64)
            own = np.repeat(mine, lens)
            repeated += n - int(own.sum())
            flat = lay.flat[idx]
            sl = slice(offset, offset + n)
            tokens[r, sl] = lay.tree.tokens[flat]
            positions[r, sl] = lay.depth[idx]
            subtree_end[r, sl] = offset + np.searchsorted(idx, lay.subtree_end[idx])
            par = lay.parent[idx]
            pred_index[r, sl] = np.where(par >= 0, offset + np.searchsorted(idx, par), -1)
            trained = lay.trainable[idx] & own
            loss_weight[r, sl] = np.where(trained, np.float32(token_weight[li]), 0)
            behavior_logprob[r, sl] = np.where(trained, lay.tree.logprob[flat], 0)
            version[r, sl] = np.where(trained, lay.tree.version[flat], 0)
            for name, off in (("temperature", 1), ("top_p", 1), ("top_k", 0)):
                arrays[name][r, sl] = np.where(trained, getattr(lay.tree, name)[flat], off)
            adv[r, sl] = advantage[li]
            ex_index[r, sl] = execution_index[li]
            offset += n
        if offset > length:  # a planning bug, never a data problem
            raise AssertionError(f"row {r} overfull: {offset} > {length}")
    return arrays, repeated
