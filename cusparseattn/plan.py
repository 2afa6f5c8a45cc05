"""From a layout's blocks to the kernel's tiles: which key tiles each query tile visits, and how to mask them.

The layout's block size is the user's unit of sparsity; the kernel's tile is its own. A tile is visited when
any layout block inside it is set, runs with no mask when every block inside it is full and it ends before the
sequence does, and is *partial* otherwise. A partial tile carries:

- ``sub_bits``: two words of one bit per layout block inside the tile (row-major): where the block is set,
  and where it is partial (the rule decides only there);
- in ``bits`` mode (a rule with no C expression), the token mask of the whole tile, one bit per pair.

Everything here is vectorised NumPy over tiles, computed once per (layout, tile shape, device) by
`cusparseattn.cuda`, which caches the uploaded result for as long as the layout lives.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .layout import BlockLayout

MAX_BITS_TILES = 1 << 20  # partial tiles evaluated per chunk in bits mode (memory: chunk * TILE_M * TILE_N)


@dataclass(frozen=True)
class TilePlan:
    tile_m: int
    tile_n: int
    tiles_q: int
    tiles_k: int
    rule_mode: str  # "none", "expr" or "bits"
    row_ptr: np.ndarray  # int32 [batch * heads * tiles_q + 1]
    entries: np.ndarray  # int32 [nnz, 2]: key tile, partial index or -1
    col_ptr: np.ndarray  # int32 [batch * heads * tiles_k + 1]: the same tiles by key tile (dK/dV pass)
    col_entries: np.ndarray  # int32 [nnz, 2]: query tile, partial index or -1
    sub_bits: np.ndarray  # uint64 [n_partial, 2]: set cells, partial cells
    bit_mask: np.ndarray  # uint64 [n_partial, tile_m, words] (bits mode) or [0]
    sub_q_shift: int
    sub_k_shift: int
    sub_k_count: int

    @property
    def nnz(self) -> int:
        return int(self.entries.shape[0])


# A work item's cost beyond its key tiles, in key tiles: loading Q, the pipeline's fill and drain, writing the
# output, fitted on local windows. Rows now overlap (forward_sm90) and cost less, but a smaller figure deals
# no better (docs/tuning.md: ITEM_COST).
ITEM_COST = 3


# The forward's deal may split its last rows (`work_order`): a part of a row costs its key tiles, ITEM_COST
# and PART_COST (its fp32 output and lse go to a scratch, which a combine pass folds into the row's), holds
# MIN_PART key tiles at least, and a split must end the deal SPLIT_GAIN key tiles sooner (the combine pass
# is a launch more). Rows are split into as many parts as one of SPLIT_COUNTS says: 64 at most, two weights
# a lane in the combine pass (forward_combine.cu).
PART_COST = 1
MIN_PART = 4
SPLIT_GAIN = 2 * ITEM_COST
SPLIT_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class RowSchedule:
    """`work_order`'s result: the items dealt to each CTA, and the parts of the rows that it splits."""

    table: np.ndarray  # int32 [rounds * ctas]: CTA c's r-th item at r * ctas + c, -1 past its last
    parts: np.ndarray  # int32 [parts, 5]: b, h, first query, first and end entry of each part
    split_ptr: np.ndarray  # int32 [split rows + 1]: split row s's parts are split_ptr[s] to split_ptr[s + 1]


def work_order(
    plan: TilePlan,
    layout_batch: int,
    layout_heads: int,
    batch: int,
    heads: int,
    ctas: int,
    group_items: int = 1,
    max_parts: int = 0,
) -> RowSchedule:
    """A persistent row-walking pass's schedule: every (batch element, query head, query tile) of a call (an
    empty row too: its output is written), dealt to `ctas` CTAs. An item is a row, ``(b * heads + h) *
    tiles_q + tile`` (int32), or ``-2 - p`` for part p of a split row.

    Items are dealt in order: the (b, h) lines in groups (the rows that run at the same time then come from
    a few heads and share their K and V in L2), as few as hold them all in as many lines as `group_items`
    items take at most (more where a group's share of each CTA would not cover its heaviest row), their
    sizes a line apart at most; heaviest row first inside a group; each goes to
    the CTA that would be free first, as a CTA taking work from a queue would (costs in key tiles, plus
    ITEM_COST). Dealt longest-first, the CTAs' totals stay close, and a skewed layout (causal, documents)
    leaves no SM idle at the end. Equal rows keep their order.

    Rows of equal length leave a last round that few CTAs run while the rest wait (dense, S = 16384 at head
    dim 128: 4096 rows on 132 SMs, 31.03 rounds in 32's time). With `max_parts`, the rows that start once
    the first CTA would be idle may be split into parts of consecutive entries, at most `max_parts` of
    them, dealt in the same way (`_deal`); the pass writes a part's output to a scratch, and a combine pass
    folds the parts of each row."""
    counts = np.diff(plan.row_ptr).reshape(layout_batch, layout_heads, plan.tiles_q)
    dealt = _deal(_per_call(counts, batch, heads), plan.tiles_q, group_items, ctas, max_parts)
    item, first, end = dealt.parts.T
    line, tile = np.divmod(item, plan.tiles_q)
    b, h = np.divmod(line, heads)
    row = plan.row_ptr[((b % layout_batch) * layout_heads + h % layout_heads) * plan.tiles_q + tile]
    parts = np.stack([b, h, tile * plan.tile_m, row + first, row + end], axis=1).astype(np.int32)
    # A split row's parts come together: its last is where the next part's row differs.
    split_ptr = np.concatenate([[0], np.flatnonzero(np.diff(item, append=-1)) + 1])
    return RowSchedule(dealt.table, parts, split_ptr.astype(np.int32))


def makespan(
    counts: np.ndarray, batch: int, heads: int, ctas: int, group_items: int = 1, max_parts: int = 0
) -> float:
    """When the last CTA of `work_order`'s deal would finish, in key tiles (an item's count plus ITEM_COST),
    for `counts` [layout batch, layout heads, tiles_q], the key tiles each row visits (`visits`)."""
    return _jobs(_per_call(counts, batch, heads), counts.shape[2], group_items, ctas, max_parts).end


def _per_call(counts: np.ndarray, batch: int, heads: int) -> np.ndarray:
    """A layout's [batch, heads, tiles_q] counts for every (b, h, query tile) of a call, flat."""
    return np.broadcast_to(counts, (batch, heads, counts.shape[2])).reshape(-1)


class _Jobs(NamedTuple):
    """A deal's jobs in the order dealt (`_jobs`)."""

    job: np.ndarray  # int64: the item, or -2 - p for part p
    when: np.ndarray  # when each starts, in key tiles
    cta: np.ndarray  # int64: the CTA it goes to
    end: float  # when the last CTA finishes
    parts: np.ndarray  # int64 [parts, 3]: item, first and end entry of its own; an item's in a row


class _Dealt(NamedTuple):
    """`_deal`'s result."""

    table: np.ndarray  # int32 [rounds * ctas]: items, or -2 - p for part p; -1 past a CTA's last
    start: np.ndarray  # when each item starts (a split one: its first part), in key tiles
    end: float  # when the last CTA finishes
    parts: np.ndarray  # int64 [parts, 3]: item, first and end entry of its own; an item's in a row


def _deal(counts: np.ndarray, line: int, group_items: int, ctas: int, max_parts: int = 0) -> _Dealt:
    """The deal of items of `counts` tiles each (`_jobs`) as each CTA's list, and when each item starts."""
    jobs = _jobs(counts, line, group_items, ctas, max_parts)
    whole = jobs.job >= 0
    start = np.zeros(counts.size, counts.dtype)
    start[jobs.job[whole]] = jobs.when[whole]
    part = -2 - jobs.job[~whole]
    first = jobs.parts[part, 1] == 0
    start[jobs.parts[part[first], 0]] = jobs.when[~whole][first]
    # CTA c's r-th job at [r, c]: the jobs by CTA, each CTA's in order (a stable sort, radix in 16 bits).
    width, n = min(ctas, counts.size), jobs.job.size
    per_cta = np.bincount(jobs.cta, minlength=width)
    turn = np.empty(n, np.int64)
    by_cta = np.argsort(jobs.cta.astype(np.uint16 if width <= 1 << 16 else np.int64), kind="stable")
    turn[by_cta] = np.arange(n) - np.repeat(np.cumsum(per_cta) - per_cta, per_cta)
    table = np.full((per_cta.max(initial=0), width), -1, np.int32)
    table[turn, jobs.cta] = jobs.job
    return _Dealt(table.reshape(-1), start, jobs.end, jobs.parts)


def _jobs(counts: np.ndarray, line: int, group_items: int, ctas: int, max_parts: int = 0) -> _Jobs:
    """The deal of items of `counts` tiles each, in lines of `line` items, longest first within groups of
    whole lines (as few as hold them all at `group_items` items a group, or more where a group's share of
    each CTA would not cover its longest item), each to the CTA that would be free first (`_place`); with
    `max_parts`, its last items split (`_split_tail`). The groups' sizes differ by a line at most: a short
    last group starts its heavy items late, after the light ones of the group before (docs/tuning.md:
    _jobs)."""
    lines = counts.size // line
    # A group's share of each CTA's time covers its longest item, which would otherwise start after the
    # group before it and end alone, as in OpenAI's strided pattern (strided8) by key tile, one long column in
    # eight (docs/tuning.md: _jobs).
    cost = counts.sum() + ITEM_COST * counts.size
    longest = int(counts.max(initial=0)) + ITEM_COST
    most = max(1, -(-group_items // line), -(-longest * ctas * lines // max(cost, 1)))
    groups = -(-lines // most)
    group = np.repeat((np.arange(lines) * groups // max(lines, 1)).astype(np.int64), line)
    order = _longest_first(counts, group)
    costs = counts[order] + ITEM_COST
    when, cta, free = _place(costs, np.zeros(min(ctas, order.size), costs.dtype))
    job, parts = order.astype(np.int64), np.zeros((0, 3), np.int64)
    if max_parts and free.size:
        # Start times only grow along the deal: the items that start once a CTA would be idle are its last.
        tail = int(np.searchsorted(when, free.min()))
        # Each CTA as the tail finds it: free once its last job before the tail ends.
        before = np.zeros_like(free)
        np.maximum.at(before, cta[:tail], when[:tail] + costs[:tail])
        split = _split_tail(counts, job[tail:], costs[tail:], before, max_parts)
        if split is not None and free.max() - split.free.max() > SPLIT_GAIN:
            job, parts, free = np.concatenate([job[:tail], split.job]), split.parts, split.free
            when = np.concatenate([when[:tail], split.when])
            cta = np.concatenate([cta[:tail], split.cta])
    return _Jobs(job, when, cta, float(free.max(initial=0)), parts)


def _longest_first(counts: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The items in order of `group`, then of `counts`, longest first, equal ones in their order: a stable
    sort of one 16-bit key (NumPy's radix sort, several times quicker than a lexsort at thousands of items)
    where the counts are whole and the key fits, else a lexsort."""
    if counts.size and (counts.dtype.kind in "iu" or bool(np.all(counts == np.trunc(counts)))):
        low, high = int(counts.min()), int(counts.max())
        if (int(group[-1]) + 1) * (high - low + 1) <= 1 << 16:
            key = group * (high - low + 1) + (high - counts.astype(np.int64))
            return np.argsort(key.astype(np.uint16), kind="stable")
    return np.lexsort((-counts, group))


def _place(costs: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """When each of the jobs of `costs` starts and on which CTA, each in turn to the CTA that would be free
    first (the lowest of those free at once), from when each CTA is free (`free`); and when each is free
    after them. Starts only grow along the jobs.

    As one job at a time, but in batches: the next m jobs go to the m CTAs free first, in that order, where
    each of the first m - 1 would end after the m-th of those CTAs is free (none of them is then free again
    before it); a run of equal jobs on CTAs free within one job of each other goes round after round in the
    same order. Integer costs go as one int64 key a CTA, time * CTAs + CTA, in which a tie sorts by CTA."""
    ctas, dtype = free.size, np.result_type(costs, free, np.int64)
    if not costs.size or not ctas:
        return np.zeros(costs.size, dtype), np.zeros(costs.size, np.int64), free.astype(dtype)
    total = float(costs.sum()) + float(free.max())
    integral = dtype.kind in "iu" or bool(np.all(costs == np.trunc(costs)) and np.all(free == np.trunc(free)))
    if integral and total * ctas < 2**53:  # exact as keys, and as the floats they stand for
        start, cta, after = _place_keys(costs.astype(np.int64), free.astype(np.int64))
    else:
        start, cta, after = _place_times(costs.astype(np.float64), free.astype(np.float64))
    return start.astype(dtype, copy=False), cta, after.astype(dtype, copy=False)


def _place_keys(costs: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_place` of integer costs."""
    n, ctas = costs.size, free.size
    keys = np.sort(free * ctas + np.arange(ctas))  # the CTAs in the order they would take jobs
    step = costs * ctas
    runs = [*(np.flatnonzero(np.diff(step)) + 1).tolist(), n]  # where each run of equal jobs ends
    taken = []  # the keys of the CTAs that take the jobs, batch by batch
    pos = 0
    while pos < n:
        rounds = (runs[bisect.bisect_right(runs, pos)] - pos) // ctas
        if rounds > 1 and keys[0] + step[pos] > keys[-1]:
            taken.append((keys + step[pos] * np.arange(rounds)[:, None]).reshape(-1))
            keys = keys + step[pos] * rounds
            pos += rounds * ctas
            continue
        m = min(ctas, n - pos)
        new = keys[:m] + step[pos : pos + m]
        if m == ctas:
            new.sort()
            if new[0] > keys[-1]:  # a whole round
                taken.append(keys)
                keys = new
                pos += m
                continue
            new = keys + step[pos : pos + m]
        if m > 1:
            m = 1 + int(np.count_nonzero(np.minimum.accumulate(new[:-1]) > keys[1:m]))
        taken.append(keys[:m])
        keys = np.concatenate([new[:m], keys[m:]])
        keys.sort()
        pos += m
    after = np.empty(ctas, np.int64)
    after[keys % ctas] = keys // ctas
    start, cta = np.divmod(np.concatenate(taken), ctas)
    return start, cta, after


def _place_times(costs: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_place` of float costs: the CTAs' times beside their numbers, sorted by both."""
    n, ctas = costs.size, free.size
    cta = np.lexsort((np.arange(ctas), free))
    times = free[cta]
    start, taken = np.empty(n), np.empty(n, np.int64)
    pos = 0
    while pos < n:
        m = min(ctas, n - pos)
        new = times[:m] + costs[pos : pos + m]
        if m > 1:
            m = 1 + int(np.count_nonzero(np.minimum.accumulate(new[:-1]) > times[1:m]))
        start[pos : pos + m], taken[pos : pos + m] = times[:m], cta[:m]
        times = np.concatenate([new[:m], times[m:]])
        order = np.lexsort((cta, times))
        times, cta = times[order], cta[order]
        pos += m
    after = np.empty(ctas)
    after[cta] = times
    return start, taken, after


class _Split(NamedTuple):
    """`_split_tail`'s result: the tail's jobs (`_Jobs`' fields), and when each CTA is free after them."""

    job: np.ndarray
    when: np.ndarray
    cta: np.ndarray
    free: np.ndarray
    parts: np.ndarray


def _split_tail(
    counts: np.ndarray, items: np.ndarray, costs: np.ndarray, free: np.ndarray, max_parts: int
) -> _Split | None:
    """The tail's `items` of `costs` (those that start once the first CTA would be idle) split so that they
    end soonest, dealt from `free` in order of cost: each item of 2 * MIN_PART key tiles or more into the
    same number of parts (one of SPLIT_COUNTS, fewer where its parts would hold fewer than MIN_PART),
    `max_parts` in all at most. None where no item can be split within `max_parts`.

    Only the split chosen is dealt job by job. A split's end depends on its jobs' costs alone (equal ones
    are interchangeable): where, longest first, each would go to the next CTA in order of free time (none of
    the CTAs that took one is free again before the last of them takes its job), it is the largest of those
    sums and of the other CTAs' times, for all splits at once; the others go through `_place`."""
    n = np.rint(counts[items]).astype(np.int64)
    tried = []  # the parts of each item, for each count that changes them
    for k in SPLIT_COUNTS:
        pieces = np.clip(n // MIN_PART, 1, k)
        made = int(pieces[pieces > 1].sum())
        if not made or made > max_parts:
            break
        if not tried or not np.array_equal(pieces, tried[-1]):
            tried.append(pieces)
    if not tried:
        return None
    # Each split's jobs as values and how many of each: an item whole, or its parts of n // p + 1 entries
    # (n % p of them) and of n // p.
    pieces = np.array(tried)
    short, longer = np.divmod(n, pieces)
    split = pieces > 1
    with np.errstate(divide="ignore", invalid="ignore"):
        shares = [(costs - ITEM_COST) * length / n + ITEM_COST + PART_COST for length in (short + 1, short)]
    values = np.stack([np.where(split, shares[0], costs), np.where(split, shares[1], 0)], axis=2)
    repeats = np.stack([np.where(split, longer, 1), np.where(split, pieces - longer, 0)], axis=2)
    jobs = repeats.sum(axis=(1, 2))
    trial = np.repeat(np.arange(len(tried)), jobs)
    cost = np.repeat(values.reshape(-1), repeats.reshape(-1))
    cost = cost[np.lexsort((-cost, trial))]  # each split's jobs longest first
    ctas = free.size
    longest = np.zeros((len(tried), max(ctas, int(jobs.max()))))  # [split, job]: 0 past its last
    longest[trial, np.arange(cost.size) - np.repeat(np.cumsum(jobs) - jobs, jobs)] = cost
    times = np.sort(free.astype(np.float64))
    ends = times + longest[:, :ctas]
    before_last = np.arange(ctas) < jobs[:, None] - 1
    at_once = (jobs <= ctas) & (
        np.where(before_last, ends, np.inf).min(axis=1) >= times[np.clip(jobs - 1, 0, ctas - 1)]
    )
    ends = ends.max(axis=1)
    for t in np.flatnonzero(~at_once):
        ends[t] = _place(longest[t, : jobs[t]], free)[2].max()
    pieces = tried[int(np.argmin(ends))]  # the first that ends soonest
    # Its jobs in the order made, each whole or as its parts: part i of p of n entries from n * i // p on.
    split = pieces > 1
    of = np.repeat(np.arange(items.size), pieces)
    part = split[of]
    i = (np.arange(of.size) - np.repeat(np.cumsum(pieces) - pieces, pieces))[part]
    whole, p = n[of[part]], pieces[of[part]]
    first, end = whole * i // p, whole * (i + 1) // p
    job_cost = costs[of].astype(np.float64)
    job_cost[part] = (costs[of[part]] - ITEM_COST) * (end - first) / whole + ITEM_COST + PART_COST
    job = items[of]
    job[part] = -2 - np.arange(part.sum())
    order = np.argsort(-job_cost, kind="stable")  # equal parts in the order made
    when, cta, after = _place(job_cost[order], free)
    return _Split(job[order], when, cta, after, np.stack([items[of[part]], first, end], axis=1))


@dataclass(frozen=True)
class ColumnSchedule:
    """`column_schedule`'s result. A column is a (b, query head, key tile) of the call, numbered
    ``(b * heads + h) * tiles_k + tile_k``; its visits are its layout column's entries from ``start[column]``
    on, wrapping around."""

    table: np.ndarray  # int32 [rounds * ctas]: items (b * heads_kv + hk) * tiles_k + tile_k, as work_order's
    start: np.ndarray  # int32 [columns]: the entry (of the column's own) that its walk begins at
    rank_ptr: np.ndarray  # int64 [columns + 1]: where each column's ranks begin in `ranks`
    ranks: np.ndarray  # int32 [visits]: each visit's place among the adds into its query tile, in walk order


def column_schedule(
    plan: TilePlan,
    layout_batch: int,
    layout_heads: int,
    batch: int,
    heads: int,
    group: int,
    ctas: int,
    group_items: int = 1,
) -> ColumnSchedule:
    """The schedule of a persistent pass that walks the key tiles' columns and adds each visit's share of dQ
    into its query tile in an order fixed for that tile, so that the sums come out the same bits every run.

    An item is a (b, key/value head, key tile): the columns of the group's `group` query heads in turn. Items
    are dealt as `work_order` deals rows (`_deal`: groups of even size), into lists fixed before the launch.
    A column's walk begins at its diagonal (its first query tile at or past ``tile_k * tiles_q / tiles_k``),
    so that the columns of one head, which start together, reach each query tile at different steps; a
    column of consecutive query tiles may begin further on, where fewer of its visits would reach a query
    tile at the step that another column of its head does (`_spread_walks`). A visit's rank orders the adds
    into its query tile by the time that the deal predicts for the visit, then by the order of the deal.

    A visit waits for the adds ranked before it, and its CTA's earlier visits, all of which come earlier in
    that order: the first unfinished visit in it never waits, so the pass cannot deadlock however long each
    visit takes. Where the deal's prediction holds, a visit waits only where two were expected at one query
    tile at once.
    """
    tiles_q, tiles_k = plan.tiles_q, plan.tiles_k
    layout_columns = layout_batch * layout_heads * tiles_k
    counts = np.diff(plan.col_ptr).astype(np.int64)
    # Each layout column's walk starts at its diagonal: an offset into its own entries.
    owner = np.repeat(np.arange(layout_columns), counts)
    before = plan.col_entries[:, 0] < owner % tiles_k * tiles_q // tiles_k
    start = np.bincount(owner, weights=before, minlength=layout_columns).astype(np.int64)
    start = np.where(counts > 0, start % np.maximum(counts, 1), 0)

    # The call's columns, and their layout columns (a layout of one batch element or head serves them all).
    b, h, k = (a.reshape(-1) for a in np.indices((batch, heads, tiles_k)))
    source = ((b % layout_batch) * layout_heads + h % layout_heads) * tiles_k + k
    col_counts = counts[source]
    heads_kv = heads // group
    per_head = col_counts.reshape(batch, heads_kv, group, tiles_k)
    items = per_head.sum(axis=2).reshape(-1)
    dealt = _deal(items, tiles_k, group_items, ctas)
    table, item_start = dealt.table, dealt.start
    # When the deal expects each visit: its item's start, past the group's earlier heads' visits.
    item = (b * heads_kv + h // group) * tiles_k + k
    earlier = np.cumsum(per_head, axis=2) - per_head
    column_start = item_start[item] + earlier.reshape(-1)
    deal_rank = np.empty(items.size, np.int64)
    deal_rank[np.argsort(item_start, kind="stable")] = np.arange(items.size)
    start = _spread_walks(plan, source, col_counts, start[source], column_start, tiles_k)

    rank_ptr = np.zeros(col_counts.size + 1, np.int64)
    np.cumsum(col_counts, out=rank_ptr[1:])
    # Each query tile's adds in the order of (when, the deal's order): when * items + deal rank, unique in a
    # query tile (an item's columns are of different heads).
    key = column_start * items.size + deal_rank[item]
    lines = source[::tiles_k] // tiles_k
    ranks = _rank_visits(plan, lines, col_counts, start, key, items.size, rank_ptr)
    return ColumnSchedule(table=table, start=start.astype(np.int32), rank_ptr=rank_ptr, ranks=ranks)


def _rank_visits(
    plan: TilePlan,
    lines: np.ndarray,
    counts: np.ndarray,
    start: np.ndarray,
    key: np.ndarray,
    step: int,
    rank_ptr: np.ndarray,
) -> np.ndarray:
    """Each visit's place among the adds into its query tile (`column_schedule`'s ranks, int32, in walk
    order): call column c (of `counts[c]` entries, layout line `lines[c // tiles_k]`) visits its entries
    from `start[c]` on, wrapping around, the s-th at `key[c]` + s * `step`; a tile's adds go by that key.

    A call line's visits are its layout line's entries, a row each of [call lines, entries] arrays (rows
    padded to the longest layout line), sorted by (query tile, key) inside each row: one sort along rows
    of an int64 that holds both and the visit's place in the walk, where they fit (else a lexsort). The
    i-th visit of a row so sorted is then the (i - the row's visits into earlier tiles)-th into its tile:
    the entry's place in its row of the layout."""
    tiles_q, tiles_k = plan.tiles_q, plan.tiles_k
    ptr = plan.col_ptr.astype(np.int64)
    line_ptr = ptr[::tiles_k]
    sizes = np.diff(line_ptr)
    width = int(sizes.max(initial=0))
    # The layout's entries by line, column by column, each row padded by entries of column tiles_k (start
    # and key 0) in tile tiles_q, after every other.
    real = np.arange(width) < sizes[:, None]
    entry = np.where(real, line_ptr[:-1, None] + np.arange(width), 0)
    owner = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))[entry]
    pos = np.where(real, entry - ptr[owner], 0).astype(np.int32)  # the entry's place in its column
    n = np.where(real, ptr[owner + 1] - ptr[owner], 0)
    walk = np.where(real, ptr[owner] - line_ptr[owner // tiles_k], 0)  # where its column's walk begins
    tile = np.where(real, plan.col_entries[entry, 0], tiles_q).astype(np.int64)
    row_ptr = plan.row_ptr.astype(np.int64)
    in_row = (np.arange(row_ptr[-1]) - np.repeat(row_ptr[:-1], np.diff(row_ptr)))[entry]
    padded = not real.all()
    if sizes.size > 1:
        pos, n, walk, tile, in_row, real = (a[lines] for a in (pos, n, walk, tile, in_row, real))
    # Each call column's value at each of its visits: repeated, the row's padding after its last column's.
    repeats = np.empty((lines.size, tiles_k + 1), np.int64)
    repeats[:, :-1] = counts.reshape(lines.size, tiles_k)
    repeats[:, -1] = width - sizes[lines]

    def by_column(values, dtype=np.int64):
        table = np.zeros((lines.size, tiles_k + 1), dtype)
        table[:, :-1] = values.reshape(lines.size, tiles_k)
        return np.repeat(table.reshape(-1), repeats.reshape(-1)).reshape(lines.size, width)

    wraps = pos < by_column(start, np.int32)  # the visits past their column's last entry
    span = int((key + (counts - 1) * step)[counts > 0].max(initial=0)) + 1
    bits = max(width - 1, 0).bit_length()
    if (tiles_q + 1) * span << bits < 2**62:  # every sum below within int64
        # (tile * span + key + s * step) << bits | walk + s, s = pos - start (+ n past the last entry).
        scale = (step << bits) + 1
        placed = by_column((key << bits) - start * scale)
        placed += ((tile * span) << bits) + walk + pos.astype(np.int64) * scale
        np.add(placed, n * scale, out=placed, where=wraps)
        placed.sort(axis=1)
        placed &= (1 << bits) - 1
    else:
        s = pos - by_column(start) + wraps * n
        later = by_column(key) + s * step
        order = np.lexsort((later, np.broadcast_to(tile, later.shape)), axis=1)
        placed = np.take_along_axis(walk + s, order, axis=1)
    placed += rank_ptr[:-1:tiles_k, None]
    ranks = np.empty(rank_ptr[-1], np.int32)
    if padded:
        ranks[placed[real]] = np.broadcast_to(in_row, placed.shape)[real]
    else:
        ranks[placed] = in_row
    return ranks


# Entries a column may start its walk past its diagonal (_spread_walks): a bound on the planning time.
MAX_SPREAD = 64


def _spread_walks(
    plan: TilePlan, source: np.ndarray, counts: np.ndarray, start: np.ndarray, when: np.ndarray, tiles_k: int
):
    """Each call column's first entry (of its `counts`, from layout column `source`): its diagonal (`start`),
    or a later one where, from the diagonal, the deal would have it add into a query tile at the step that
    another column of its head does (the later add then waits for the earlier one to land, and its CTA falls
    behind the deal).

    A column of consecutive query tiles f .. f + n - 1 that starts its walk at entry r at step `when` visits
    tile i at step phase + i, phase = when - f - r, and the tiles before f + r (which it wraps around to) at
    phase + n + i: two such columns of one head meet on the tiles they share at one phase. Columns are
    taken in the order they start, each at the first entry from its diagonal on (MAX_SPREAD at most) where
    none of its visits meets one of the columns before it, else where the fewest do. Causal columns from
    their diagonals would meet a third to a half of the adds of another CTA into the same tile
    (docs/tuning.md: _spread_walks). Columns of other shapes keep the diagonal."""
    ptr = plan.col_ptr.astype(np.int64)
    tiles = plan.col_entries[:, 0].astype(np.int64)
    runs = counts > 0
    first = np.zeros(counts.size, np.int64)  # a column's first query tile
    first[runs] = tiles[ptr[source[runs]]]
    runs[runs] = tiles[ptr[source[runs] + 1] - 1] - first[runs] + 1 == counts[runs]
    order = np.argsort(when, kind="stable")
    order = order[runs[order]]
    # By head, then phase: the tiles that its columns take at that phase. The loop is plain Python, its
    # overlaps written out: every column depends on the columns of its head before it.
    held: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(-(-counts.size // tiles_k))]
    spread = []
    columns = (first[order], when[order] - first[order], start[order], counts[order], order // tiles_k)
    for f, p0, r, n, h in zip(*(a.tolist() for a in columns), strict=True):
        get, end = held[h].get, f + n
        least, best = n + 1, r
        for _ in range(min(n, MAX_SPREAD)):
            # The tiles f + r .. end at phase p0 - r, and those before f + r at p0 - r + n.
            meets, lo = 0, f + r
            taken = get(p0 - r)
            if taken is not None:
                for a, b in taken:
                    overlap = (b if b < end else end) - (a if a > lo else lo)
                    if overlap > 0:
                        meets += overlap
            taken = get(p0 - r + n) if r else None
            if taken is not None:
                for a, b in taken:
                    overlap = (b if b < lo else lo) - (a if a > f else f)
                    if overlap > 0:
                        meets += overlap
            if meets < least:
                least, best = meets, r
                if not meets:
                    break
            r = r + 1 if r + 1 < n else 0
        held[h].setdefault(p0 - best, []).append((f + best, end))
        if best:
            held[h].setdefault(p0 - best + n, []).append((f, f + best))
        spread.append(best)
    start = start.astype(np.int64)
    start[order] = spread
    return start


def rule_mode(layout: BlockLayout) -> str:
    if layout.rule is None or not layout.partial.any():
        return "none"
    return "expr" if layout.rule.c_expr is not None else "bits"


def _fine(mask: np.ndarray, rep_q: int, rep_k: int, rows: int, cols: int) -> np.ndarray:
    """Blocks repeated onto a grid of cells no larger than a tile, cut to `rows` x `cols` cells."""
    return mask.repeat(rep_q, axis=2).repeat(rep_k, axis=3)[:, :, :rows, :cols]


# A partial tile's cells are bits of one word (sub_bits).
MAX_CELLS = 64


def tile_cells(tile_m: int, tile_n: int, block_size: tuple[int, int]) -> int:
    """How many cells a tile has: the largest units inside which nothing changes, in tiles and blocks."""
    return tile_m // math.gcd(block_size[0], tile_m) * (tile_n // math.gcd(block_size[1], tile_n))


@dataclass(frozen=True)
class _Grid:
    """A layout's cells (the largest units inside which nothing changes, in tiles and blocks) and tiles."""

    layout: BlockLayout
    tile_m: int
    tile_n: int

    def __post_init__(self):
        bq, bk = self.layout.block_size
        if tile_cells(self.tile_m, self.tile_n, self.layout.block_size) > MAX_CELLS:
            raise ValueError(
                f"tiles of {self.tile_m} x {self.tile_n} hold more than {MAX_CELLS} cells of {bq} x {bk} "
                "blocks: take smaller tiles"
            )

    @property
    def cell(self) -> tuple[int, int]:
        bq, bk = self.layout.block_size
        return math.gcd(bq, self.tile_m), math.gcd(bk, self.tile_n)

    @property
    def rows(self) -> int:
        return -(-self.layout.seq_q // self.cell[0])

    @property
    def tiles(self) -> tuple[int, int]:
        return -(-self.layout.seq_q // self.tile_m), -(-self.layout.seq_k // self.tile_n)

    @property
    def per_tile(self) -> tuple[int, int]:
        return self.tile_m // self.cell[0], self.tile_n // self.cell[1]

    def cells(self, mask: np.ndarray) -> np.ndarray:
        """A [B, H, blocks_q, blocks_k] mask of the layout's blocks on the cells."""
        (bq, bk), (cq, ck) = self.layout.block_size, self.cell
        return _fine(mask, bq // cq, bk // ck, self.rows, -(-self.layout.seq_k // ck))

    def full_tiles(self) -> np.ndarray:
        """[B, H, tiles_q, tiles_k]: the tiles that need no mask (every cell full, inside the keys)."""
        (tiles_q, tiles_k), (per_q, _) = self.tiles, self.per_tile
        # Rows past the sequence's end don't matter (nothing is written for them), so they pad as full.
        row_pad = np.arange(tiles_q * per_q).reshape(tiles_q, per_q) >= self.rows
        full = _every_cell(self.tiled(self.cells(self.layout.full)) | row_pad[None, None, :, :, None, None])
        return full & ((np.arange(tiles_k) + 1) * self.tile_n <= self.layout.seq_k)  # ends before the keys do

    def tiled(self, cells: np.ndarray) -> np.ndarray:
        """Cells as [B, H, tiles_q, per_q, tiles_k, per_k] (padded with False)."""
        nb, nh, rows, cols = cells.shape
        (tiles_q, tiles_k), (per_q, per_k) = self.tiles, self.per_tile
        out = np.zeros((nb, nh, tiles_q * per_q, tiles_k * per_k), cells.dtype)
        out[:, :, :rows, :cols] = cells
        return out.reshape(nb, nh, tiles_q, per_q, tiles_k, per_k)


def _any_cell(tiled: np.ndarray) -> np.ndarray:
    """[B, H, tiles_q, tiles_k] of `_Grid.tiled` cells: whether any cell of each tile is set. A tile's cells
    (MAX_CELLS at most) one slice at a time: NumPy reduces such small axes of this shape several times
    slower."""
    return _fold(np.logical_or, tiled)


def _every_cell(tiled: np.ndarray) -> np.ndarray:
    """Whether every cell of each tile is set (`_any_cell`)."""
    return _fold(np.logical_and, tiled)


def _fold(op, tiled: np.ndarray) -> np.ndarray:
    out = tiled[:, :, :, 0, :, 0].copy()
    for i, j in np.ndindex(tiled.shape[3], tiled.shape[5]):
        if i or j:
            op(out, tiled[:, :, :, i, :, j], out=out)
    return out


def visits(layout: BlockLayout, tile_m: int, tile_n: int, partial_cost: float = 0) -> np.ndarray:
    """How many key tiles each query tile visits: [layout batch, layout heads, tiles_q] (a row of `build`'s
    plan), for weighing tilings against each other without building their plans; a partial tile (masked)
    counts 1 + `partial_cost`."""
    grid = _Grid(layout, tile_m, tile_n)
    visited = _any_cell(grid.tiled(grid.cells(layout.blocks)))
    counts = np.count_nonzero(visited, axis=3)
    if not partial_cost:
        return counts
    return counts + partial_cost * np.count_nonzero(visited & ~grid.full_tiles(), axis=3)


def build(layout: BlockLayout, tile_m: int, tile_n: int) -> TilePlan:
    grid = _Grid(layout, tile_m, tile_n)
    (cq, ck), (tiles_q, tiles_k), (per_q, per_k) = grid.cell, grid.tiles, grid.per_tile

    set_cells = grid.cells(layout.blocks)
    partial_cells = set_cells & ~grid.cells(layout.full)
    visited = _any_cell(grid.tiled(set_cells))
    full_tile = grid.full_tiles()

    counts = np.count_nonzero(visited, axis=3).reshape(-1)
    row_ptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    b_i, h_i, tq_i, tk_i = np.nonzero(visited)
    partial = ~full_tile[b_i, h_i, tq_i, tk_i]
    pidx = np.full(b_i.size, -1, dtype=np.int64)
    pidx[partial] = np.arange(np.count_nonzero(partial))

    # Which cells of each partial tile are set, and which are partial, as bits (row-major inside the tile).
    weights = np.left_shift(np.uint64(1), np.arange(per_q * per_k, dtype=np.uint64))
    sub_bits = np.zeros((np.count_nonzero(partial), 2), dtype=np.uint64)
    for word, cell_mask in enumerate((set_cells, partial_cells)):
        cells = grid.tiled(cell_mask)
        sel = cells[b_i[partial], h_i[partial], tq_i[partial], :, tk_i[partial], :].reshape(-1, per_q * per_k)
        sub_bits[:, word] = (sel.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)

    # The transpose, for passes that walk the key tiles' columns: same tiles, same partial indices.
    order = np.lexsort((tq_i, tk_i, h_i, b_i))
    col_counts = np.count_nonzero(visited, axis=2).reshape(-1)
    col_ptr = np.zeros(col_counts.size + 1, dtype=np.int64)
    np.cumsum(col_counts, out=col_ptr[1:])

    mode = rule_mode(layout)
    bit_mask = np.zeros(1, dtype=np.uint64)
    if mode == "bits":
        bit_mask = _bit_masks(
            layout, b_i[partial], h_i[partial], tq_i[partial], tk_i[partial], tile_m, tile_n
        )

    return TilePlan(
        tile_m=tile_m,
        tile_n=tile_n,
        tiles_q=tiles_q,
        tiles_k=tiles_k,
        rule_mode=mode,
        row_ptr=row_ptr.astype(np.int32),
        entries=np.stack([tk_i, pidx], axis=1).astype(np.int32),
        col_ptr=col_ptr.astype(np.int32),
        col_entries=np.stack([tq_i[order], pidx[order]], axis=1).astype(np.int32),
        sub_bits=sub_bits if sub_bits.size else np.zeros((1, 2), dtype=np.uint64),
        bit_mask=bit_mask,
        sub_q_shift=int(cq).bit_length() - 1,
        sub_k_shift=int(ck).bit_length() - 1,
        sub_k_count=per_k,
    )


def _bit_masks(layout, b, h, tq, tk, tile_m, tile_n) -> np.ndarray:
    """The layout's token mask over each partial tile, packed little-endian into 64-bit words per row."""
    words = -(-tile_n // 64)
    out = np.zeros((b.size, tile_m, words), dtype=np.uint64)
    r = np.arange(tile_m)[None, :, None]
    c = np.arange(words * 64)[None, None, :]
    step = max(1, MAX_BITS_TILES // (tile_m * tile_n))
    for s in range(0, b.size, step):
        sl = slice(s, s + step)
        q = tq[sl, None, None] * tile_m + r
        k = tk[sl, None, None] * tile_n + c
        # The layout's head index: batch/head index 0 of a shared layout stands for all of them.
        mask = layout.token_mask(b[sl, None, None], h[sl, None, None], q, k) & (c < tile_n)
        packed = np.packbits(mask, axis=2, bitorder="little")  # [n, tile_m, words * 8] bytes
        out[sl] = packed.view(np.uint64).reshape(-1, tile_m, words)
    return out
