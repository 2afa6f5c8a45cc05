"""How a persistent pass deals its work to CTAs, fixed before the launch: the forward's rows (`work_order`,
and `makespan`, the time its deal would take) and the fused backward's key-tile columns (`column_schedule`).

A deal works on a `cusparseattn.plan.TilePlan` (which tiles each row and column visits) and the call's
sizes; `cusparseattn.cuda` uploads the result once per (layout, tiles, grid). Everything is NumPy on the
host, bit-identical to the plain forms that tests/test_schedule.py spells out.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .plan import TilePlan

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
    for `counts` [layout batch, layout heads, tiles_q], the key tiles each row visits (`plan.visits`)."""
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


def deal_order(counts: np.ndarray, line: int, group_items: int, ctas: int) -> np.ndarray:
    """The items of `counts` tiles each in the order `work_order` deals them (groups of whole lines, longest
    first in each): int64, for a deal whose real costs come later (a dynamic layout's, made on the GPU by
    rounds of `ctas` items of this order)."""
    return _jobs(counts, line, group_items, ctas).job


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
