"""The trajectory pipeline: executions -> one packed, weighted batch of micro-steps.

validation -> status handling -> tree -> admission -> group-relative advantages ->
loss weights -> packing -> micro-steps. Pure NumPy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gyrejax.trajectory.admission import admission_rng, admit_paths
from gyrejax.trajectory.advantages import ADVANTAGE_STDS, get_advantage, shape_rewards
from gyrejax.trajectory.buckets import (
    BucketChoice,
    check_row_lengths,
    choose_lengths,
    rows_per_micro_step_for,
)
from gyrejax.trajectory.microsteps import assign_bucketed_micro_steps, row_costs
from gyrejax.trajectory.packing import ForestLayout, assemble_rows, plan_rows, strategies
from gyrejax.trajectory.records import (
    Execution,
    ModelCall,
    check_token_range,
    check_unique_ids,
    validate_calls,
    validate_for_training,
)
from gyrejax.trajectory.rows import ROW_FIELDS, micro_step_cut, padding_rows
from gyrejax.trajectory.tree import build_tree


@dataclasses.dataclass(frozen=True)
class PackStats:
    """Counts and ratios of one `process` call (token counts are over used executions).

    naive_tokens (N) is what call-by-call training would process: the sum over calls of
    len(prompt) + len(output). unique_tokens (U) are tree tokens; admitted_tokens the
    tokens of the admitted forests; packed_tokens = the sum of row lengths (rows *
    row_length with one length), of which padding_tokens are padding (padding rows
    included) and repeated_tokens are ancestor context repeated because a tree spans
    several rows. greedy_tokens: outputs of greedy calls, context only (never trained).
    row_shapes: distinct micro-step shapes (row lengths) used.
    """

    executions_in: int
    executions_used: int
    executions_dropped: int
    placeholders: int
    executions_trained: int
    groups: int
    calls: int
    naive_tokens: int
    unique_tokens: int
    generated_tokens: int
    trainable_tokens: int
    greedy_tokens: int
    admitted_tokens: int
    admitted_trainable_tokens: int
    paths_admitted: int
    rows: int
    padding_rows: int
    micro_steps: int
    packed_tokens: int
    padding_tokens: int
    repeated_tokens: int
    waste_fraction: float
    naive_over_unique: float
    naive_over_admitted: float
    row_shapes: int

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Packed rows of one training step; every per-token array is [rows, width].

    Key k of a row is visible to query q iff k <= q < subtree_end[k]. Row r has
    `row_lengths[r]` tokens (width, the longest, for every row when one length is used);
    positions past it are padding. Micro-step m is rows [micro_step_offsets[m],
    micro_step_offsets[m + 1]), all of one length; with one length that is rows
    [m * rows_per_micro_step, (m + 1) * rows_per_micro_step). `micro_step(m)` gives its
    arrays cut to their shape, `shapes` every shape a trainer must compile.

    Attributes:
      tokens ... execution_index: the per-token fields of `rows.ROW_FIELDS` (meanings,
        dtypes and padding values in `gyrejax.trajectory.rows`).
      execution_ids: the used executions, in input order.
      execution_advantage: float32[E] advantage of each used execution.
      execution_reward: float32[E] reward of each used execution (0 for placeholders).
      rows_per_micro_step: R, rows of the base length per micro-step.
      stats: `PackStats`.
      row_lengths: int32[rows] tokens of each row (a compiled row length).
      micro_step_offsets: int64[M + 1] first row of each micro-step, then rows.
    """

    tokens: np.ndarray
    positions: np.ndarray
    subtree_end: np.ndarray
    pred_index: np.ndarray
    loss_weight: np.ndarray
    advantage: np.ndarray
    behavior_logprob: np.ndarray
    version: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    execution_index: np.ndarray
    execution_ids: tuple[str, ...]
    execution_advantage: np.ndarray
    execution_reward: np.ndarray
    rows_per_micro_step: int
    stats: PackStats
    row_lengths: np.ndarray
    micro_step_offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def row_length(self) -> int:
        """The array width: the longest row length."""
        return self.tokens.shape[1]

    @property
    def num_micro_steps(self) -> int:
        return len(self.micro_step_offsets) - 1

    def micro_step_shape(self, m: int) -> tuple[int, int]:
        """(rows, row length) of micro-step m."""
        rows, cols = micro_step_cut(self.micro_step_offsets, self.row_lengths, m)
        return rows.stop - rows.start, cols.stop

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct micro-step shapes (rows, row length), longest rows first."""
        found = {self.micro_step_shape(m) for m in range(self.num_micro_steps)}
        return tuple(sorted(found, key=lambda s: (-s[1], s[0])))

    def micro_step(self, m: int) -> dict[str, np.ndarray]:
        """The per-token arrays of micro-step m, each of `micro_step_shape(m)`."""
        cut = micro_step_cut(self.micro_step_offsets, self.row_lengths, m)
        return {name: getattr(self, name)[cut] for name in ROW_FIELDS}


# PackedBatch declares the schema's fields as its first attributes, in the schema's order.
if [f.name for f in dataclasses.fields(PackedBatch)][: len(ROW_FIELDS)] != list(ROW_FIELDS):
    raise TypeError("PackedBatch's per-token attributes differ from rows.ROW_FIELDS")


def _check_args(
    row_length: int,
    j_max: int | None,
    rows_per_micro_step: int,
    vocab_size: int | None,
    eval_retry_budget: int,
    pad_id: int,
) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, int | np.integer) and not isinstance(x, bool)

    if not is_int(row_length) or row_length < 1:
        raise ValueError(f"row_length must be an int >= 1, got {row_length!r}")
    if j_max is not None and (not is_int(j_max) or j_max < 1):
        raise ValueError(f"j_max must be an int >= 1 or None, got {j_max!r}")
    if not is_int(rows_per_micro_step) or rows_per_micro_step < 1:
        raise ValueError(f"rows_per_micro_step must be an int >= 1, got {rows_per_micro_step!r}")
    if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
    if not is_int(eval_retry_budget) or eval_retry_budget < 0:
        raise ValueError(f"eval_retry_budget must be an int >= 0, got {eval_retry_budget!r}")
    if not is_int(pad_id) or not -(2**31) <= pad_id < 2**31:
        raise ValueError(f"pad_id must be an int32, got {pad_id!r}")


class ContextTooLong(ValueError):
    """A call's context (a root-to-leaf path of its tree) is longer than the longest row.

    A tree too long for a row is trained in a longer row, split over the cell's
    `sequence` axis (context parallelism), never cut: add a length to the menu
    (train.row_lengths). Not a tree split with its trunk's K/V carried into a later row:
    sharding the row divides per-device memory by the shards with one forward per row,
    while a K/V carry needs a cache across rows (and micro-steps), an ordering of rows,
    and gradients flowing back into the trunk's earlier forward. Nor an automatic
    longer row: every shape is compiled ahead of time and sized against device memory
    (`gyrejax.memory`), so an unplanned length would compile mid-run and may not fit.

    Attributes:
      execution_id, call_id: the call.
      length: its context length (prompt + output).
      longest: the longest row length it was checked against.
      suggested: the shortest row length that would hold it (a multiple of the base
        row length, as longer menu entries must be).
    """

    def __init__(self, call: ModelCall, longest: int, base_length: int) -> None:
        self.execution_id, self.call_id = call.execution_id, call.call_id
        self.length, self.longest = call.length, longest
        self.suggested = -(-call.length // base_length) * base_length
        super().__init__(
            f"execution {call.execution_id!r} call {call.call_id}: context length "
            f"{call.length} (prompt {len(call.prompt_ids)} + output {len(call.output_ids)}) "
            f"> row_length {longest}, the longest row; a token trains only with its whole "
            f"context in one row: add a train.row_lengths entry >= {call.length} (e.g. "
            f"{self.suggested}: a multiple of train.row_length, and of cells.sequence, "
            "over which such a row is split)"
        )


def check_execution(
    execution: Execution,
    *,
    row_length: int,
    vocab_size: int | None = None,
    eval_retry_budget: int = 3,
    check_prompts: bool = True,
    base_length: int | None = None,
) -> str:
    """Everything `process` requires of one execution on its own (arguments as in
    `process`); returns what `process` does with it: "train", "placeholder" or "drop".

    A caller that must not let one bad execution stop a batch uses it to find the ones
    `process` refuses (e.g. `gyrejax.train.loop`, after `process` raised).

    Args:
      row_length: the longest row length (of `row_lengths` when given to `process`).
      check_prompts: also range-check prompt tokens (`process` leaves this to the tree
        builder, which sees each shared prompt token once).
      base_length: `process`'s row_length, for the length `ContextTooLong` suggests
        (None: row_length).

    Raises:
      ContextTooLong for a call longer than row_length; ValueError naming the execution
      (and call) for any other invalid record.
    """
    validate_calls(execution, vocab_size)
    decision = validate_for_training(execution, eval_retry_budget)
    for call in execution.calls:
        where = f"execution {execution.execution_id!r} call {call.call_id}"
        if check_prompts or decision == "drop":  # a dropped one never reaches the tree
            check_token_range(call.prompt_ids, vocab_size, where, "prompt_ids")
        if decision != "drop" and call.length > row_length:
            raise ContextTooLong(call, row_length, base_length or row_length)
    return decision


def process(
    executions: Sequence[Execution],
    *,
    row_length: int,
    j_max: int | None = 5,
    seed: int = 0,
    advantage: str = "grpo",
    advantage_std: str = "unbiased",
    reward_shaping: str = "as_is",
    rows_per_micro_step: int = 1,
    vocab_size: int | None = None,
    eval_retry_budget: int = 3,
    pad_id: int = 0,
    row_lengths: Sequence[int] | None = None,
    max_row_shapes: int | None = None,
    demonstrations: bool = False,
) -> PackedBatch:
    """Turns finished executions into one packed batch.

    Args:
      executions: the step's executions (unique ids).
      row_length: L, tokens per row. Every call's prompt + output must fit in L (in
        the longest of `row_lengths` when given). A micro-step holds R rows of L, or
        the same tokens in rows of another length (see `gyrejax.trajectory.buckets`).
      j_max: most root-to-leaf paths admitted per execution; None = all.
      seed: admission seed (per execution: seed and crc32 of its id).
      advantage: name of a registered group-relative estimator ("grpo", "rloo", ...).
      advantage_std: the group std an estimator divides by: "unbiased" (ddof=1) or
        "population" (ddof=0).
      reward_shaping: what the estimator sees of each reward: "as_is", or "pass" (1 for
        a reward of at least 1, every hidden check passed, else 0).
      rows_per_micro_step: R; the row count is padded to a multiple of R.
      vocab_size: if given, every token id must lie in [0, vocab_size).
      eval_retry_budget: eval_failed executions with at least this many evaluation
        attempts are dropped; with fewer, `process` refuses them.
      pad_id: token id written on padding.
      row_lengths: row buckets: the lengths rows may have (each compiled once by the
        trainer); None = (row_length,), every row of length L, as without buckets.
      max_row_shapes: most distinct row lengths in this batch (None = no cap). The
        lengths are chosen to minimise packed tokens; never worse than any one length.
      demonstrations: supervised training (`rl.loss = "sft"`): greedy calls' outputs
        are trained too, under the model's own distribution (`tree.build_tree`).

    Returns:
      A `PackedBatch`.

    Raises:
      ContextTooLong for a call longer than every row length (naming it, with the
      train.row_lengths entry that would hold it); ValueError naming the execution (and
      call) for any other invalid record.
    """
    _check_args(row_length, j_max, rows_per_micro_step, vocab_size, eval_retry_budget, pad_id)
    menu = (row_length,) if row_lengths is None else check_row_lengths(row_lengths, max_row_shapes)
    estimator = get_advantage(advantage)
    if advantage_std not in ADVANTAGE_STDS:
        raise ValueError(
            f"advantage_std must be one of {', '.join(ADVANTAGE_STDS)}, got {advantage_std!r}"
        )
    executions = list(executions)
    check_unique_ids(executions)

    # Validation and status handling.
    used: list[Execution] = []
    rewards: list[float] = []
    dropped = placeholders = 0
    for ex in executions:
        # Prompt tokens of used executions are range-checked by the tree builder.
        decision = check_execution(
            ex,
            row_length=menu[-1],
            base_length=row_length,
            vocab_size=vocab_size,
            eval_retry_budget=eval_retry_budget,
            check_prompts=False,
        )
        if decision == "drop":
            dropped += 1
            continue
        placeholders += decision == "placeholder"
        used.append(ex)
        rewards.append(0.0 if decision == "placeholder" else float(ex.reward))  # type: ignore[arg-type]

    # Group-relative advantages over every used execution of a group.
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(used):
        groups.setdefault(ex.group_id, []).append(i)
    reward_arr = np.asarray(rewards, dtype=np.float64)
    shaped = shape_rewards(reward_arr, reward_shaping)
    adv_arr = np.zeros(len(used), dtype=np.float64)
    for members in groups.values():
        adv_arr[members] = estimator(shaped[members], std=advantage_std)
    if not np.all(np.isfinite(adv_arr)):
        raise ValueError(f"advantage estimator {advantage!r} returned non-finite values")

    # Trees, admission, layouts.
    layouts: list[ForestLayout] = []
    layout_exec: list[int] = []
    naive = unique = generated = trainable = greedy = paths = num_calls = 0
    for i, ex in enumerate(used):
        num_calls += len(ex.calls)
        if not ex.calls:
            continue
        tree = build_tree(list(ex.calls), ex.execution_id, vocab_size, demonstrations)
        naive += sum(c.length for c in ex.calls)
        generated += sum(len(c.output_ids) for c in ex.calls)
        unique += tree.num_tokens
        trainable += int(tree.trainable.sum())
        greedy += tree.greedy_tokens
        admitted, leaves = admit_paths(tree, j_max, admission_rng(seed, ex.execution_id))
        paths += len(leaves)
        if admitted.any():
            layouts.append(ForestLayout.build(tree, admitted))
            layout_exec.append(i)

    # Loss weights: mean over trained tokens per execution, then mean over executions.
    counts = [int(lay.trainable.sum()) for lay in layouts]
    trained_execs = sum(c > 0 for c in counts)
    token_weight = [1.0 / c / trained_execs if c else 0.0 for c in counts]

    max_shapes = len(menu) if max_row_shapes is None else max_row_shapes
    rows, units, choice = _plan_bucketed(
        layouts, menu, max_shapes, row_length, rows_per_micro_step, row_lengths is not None
    )
    width = max(choice.lengths, default=row_length)
    arrays, repeated = assemble_rows(
        layouts,
        rows,
        units,
        row_length=width,
        execution_index=layout_exec,
        token_weight=token_weight,
        advantage=[float(adv_arr[i]) for i in layout_exec],
        pad_id=pad_id,
    )
    costs = np.zeros(len(rows), dtype=np.float64)
    for length in choice.lengths:  # each bucket's cost model over its own length
        sel = choice.row_length == length
        costs[sel] = row_costs(
            arrays["subtree_end"][sel, :length], arrays["execution_index"][sel, :length]
        )
    per_length = {
        length: rows_per_micro_step_for(
            length, row_length=row_length, rows_per_micro_step=rows_per_micro_step
        )
        for length in choice.lengths
    }
    order, ordered_lengths, offsets = assign_bucketed_micro_steps(
        costs, choice.row_length, per_length
    )
    num_real_rows = len(rows)
    extra = len(order) - num_real_rows
    padding = padding_rows(extra, width, pad_id)
    fields = {}
    for name, a in arrays.items():
        if extra:
            a = np.concatenate([a, padding[name]])
        a = a[order]
        a.flags.writeable = False
        fields[name] = a
    row_length_arr = ordered_lengths.astype(np.int32)
    row_length_arr.flags.writeable = False
    offsets.flags.writeable = False

    admitted_tokens = sum(lay.num_tokens for lay in layouts)
    total_rows = len(order)
    packed = int(ordered_lengths.sum())
    real = int((fields["execution_index"] >= 0).sum())
    stats = PackStats(
        executions_in=len(executions),
        executions_used=len(used),
        executions_dropped=dropped,
        placeholders=placeholders,
        executions_trained=trained_execs,
        groups=len(groups),
        calls=num_calls,
        naive_tokens=naive,
        unique_tokens=unique,
        generated_tokens=generated,
        trainable_tokens=trainable,
        greedy_tokens=greedy,
        admitted_tokens=admitted_tokens,
        admitted_trainable_tokens=sum(counts),
        paths_admitted=paths,
        rows=total_rows,
        padding_rows=total_rows - num_real_rows,
        micro_steps=len(offsets) - 1,
        packed_tokens=packed,
        padding_tokens=packed - real,
        repeated_tokens=repeated,
        waste_fraction=(packed - admitted_tokens) / packed if packed else 0.0,
        naive_over_unique=naive / unique if unique else 0.0,
        naive_over_admitted=naive / admitted_tokens if admitted_tokens else 0.0,
        row_shapes=len(choice.lengths),
    )
    return PackedBatch(
        **fields,
        execution_ids=tuple(ex.execution_id for ex in used),
        execution_advantage=adv_arr.astype(np.float32),
        execution_reward=reward_arr.astype(np.float32),
        rows_per_micro_step=rows_per_micro_step,
        stats=stats,
        row_lengths=row_length_arr,
        micro_step_offsets=offsets,
    )


def _plan_bucketed(
    layouts: list[ForestLayout],
    menu: tuple[int, ...],
    max_shapes: int,
    row_length: int,
    rows_per_micro_step: int,
    bucketed: bool,
) -> tuple[list, list, BucketChoice]:
    """Plans rows for each allowed longest length and keeps the fewest packed tokens.

    Planning at a longer length lets trees share rows (fewer repeated trunks); the
    chosen buckets then cut each planned row down to the shortest length that holds it.
    Bucketed (`row_lengths` given), each length is planned with every packing
    `strategies` offers; otherwise with the default plan only, as before buckets.
    """
    need = max((int(lay.depth.max()) + 1 for lay in layouts if lay.num_tokens), default=0)
    best = None
    for longest in (m for m in menu if m >= need):
        tries = strategies(longest, need) if bucketed else [{}]
        for kwargs in tries:
            rows, units = plan_rows(layouts, longest, **kwargs)
            fills = np.asarray([longest - row.free for row in rows], dtype=np.int64)
            allowed = [m for m in menu if m <= longest]
            choice = choose_lengths(
                fills,
                allowed,
                max_shapes,
                base_length=row_length,
                rows_per_micro_step=rows_per_micro_step,
            )
            if best is None or choice.key < best[2].key:
                best = (rows, units, choice)
    assert best is not None  # every call fits the longest length (checked above)
    return best
