"""cusparseattn.schedule: the persistent passes' deals (work_order, makespan, column_schedule) against their
plain forms, one job at a time, and what they promise (every item once, no deadlock, spread walks)."""

from __future__ import annotations

import heapq
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import BlockLayout, patterns, plan, schedule
from cusparseattn.mods import mask_rule


@settings(max_examples=30, deadline=None)
@given(
    layout_lines=st.sampled_from([(1, 1), (1, 3), (2, 1), (2, 3)]),
    tiles_q=st.integers(1, 9),
    ctas=st.integers(1, 20),
    group_items=st.integers(1, 60),
    seed=st.integers(0, 2**31),
)
def test_work_order_deals_every_row_once_heaviest_first_in_groups(
    layout_lines, tiles_q, ctas, group_items, seed
):
    """The persistent kernels' schedule: each (b, h, tile) of the call once (empty rows too), CTA c's items at
    c, c + ctas, ... up to a -1. Read in the order they were dealt (by the time each CTA, taking its
    items in turn, would start them), the items come in groups of whole (b, h) lines, as few as hold them
    all in as many lines as `group_items` items take at most (more where a group's share of each CTA would
    not cover its longest row), their sizes a line apart at most, and inside a group rows with more key
    tiles first. Each went to a CTA that would be free first. A layout of one batch element or head serves
    them all."""
    batch, heads = 2, 3
    lb, lh = layout_lines
    blocks = np.random.default_rng(seed).random((lb, lh, tiles_q, 5)) < 0.4
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * tiles_q, seq_k=64 * 5), 64, 64)
    dealt = schedule.work_order(p, lb, lh, batch, heads, ctas, group_items)
    work = dealt.table
    assert dealt.parts.shape == (0, 5) and list(dealt.split_ptr) == [0]  # none without max_parts
    items = batch * heads * tiles_q
    used = min(ctas, items)
    assert work.dtype == np.int32 and work.size % used == 0
    table = work.reshape(-1, used)
    for column in table.T:  # a CTA's items, then only -1
        n = int((column >= 0).sum())
        assert (column[:n] >= 0).all() and (column[n:] == -1).all()
    assert sorted(work[work >= 0]) == list(range(items))

    tile, line = np.arange(items) % tiles_q, np.arange(items) // tiles_q
    counts = blocks.sum(axis=3)[line // heads % lb, line % heads % lh, tile]
    cost = counts + schedule.ITEM_COST
    start, finish = {}, np.zeros(used, np.int64)
    for row in table:
        for c, item in enumerate(row):
            if item >= 0:
                start[int(item)] = (int(finish[c]), c)
                finish[c] += cost[item]
    # makespan: when the last CTA of the deal finishes, from the rows' lengths alone.
    assert schedule.makespan(blocks.sum(axis=3), batch, heads, ctas, group_items) == finish.max()
    dealt = sorted(start, key=start.get)  # ties as the deal broke them: the lower CTA first
    # Lines a group: as many as `group_items` items take, or more, so that a group's share of each CTA's
    # time covers its longest row.
    lines = batch * heads
    most = max(-(-group_items // tiles_q), -(-int(cost.max()) * ctas * lines // int(cost.sum())))
    group_of = np.arange(lines) * -(-lines // most) // lines  # the lines in turn, spread evenly
    sizes = np.bincount(group_of)
    assert len(sizes) == -(-lines // most) and sizes.max() - sizes.min() <= 1 and sizes.max() <= most
    group = group_of[line[dealt]]
    assert (np.diff(group) >= 0).all()
    heavier_first = counts[dealt][:-1] >= counts[dealt][1:]
    assert (heavier_first | (np.diff(group) > 0)).all()


@settings(max_examples=40, deadline=None)
@given(
    layout_lines=st.sampled_from([(1, 1), (1, 3), (2, 3)]),
    tiles_q=st.integers(1, 6),
    ctas=st.integers(1, 16),
    max_parts=st.integers(1, 16),
    density=st.sampled_from([0.3, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_work_order_splits_rows_into_parts_that_cover_them_once(
    layout_lines, tiles_q, ctas, max_parts, density, seed
):
    """With `max_parts`, each row of the call is dealt whole or as parts of MIN_PART entries or more that
    cover its entries once, in order, each part dealt once; at most `max_parts` parts, those of a row
    consecutive (split_ptr), each naming its row's batch element, head and first query. The deal ends no
    later than without parts."""
    batch, heads, keys = 2, 3, 40
    lb, lh = layout_lines
    blocks = np.random.default_rng(seed).random((lb, lh, tiles_q, keys)) < density
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * tiles_q, seq_k=64 * keys), 64, 64)
    s = schedule.work_order(p, lb, lh, batch, heads, ctas, 2, max_parts)
    items = batch * heads * tiles_q
    table = s.table.reshape(-1, min(ctas, items))
    for column in table.T:  # a CTA's items, then only -1
        n = int((column != -1).sum())
        assert (column[n:] == -1).all()
    whole, parts = s.table[s.table >= 0], -2 - s.table[s.table < -1]
    assert sorted(parts) == list(range(len(s.parts))) and len(s.parts) <= max_parts
    split_rows = []
    for first, end in zip(s.split_ptr[:-1], s.split_ptr[1:], strict=True):
        b, h, q0 = s.parts[first, :3]
        assert (s.parts[first:end, :3] == (b, h, q0)).all() and end - first >= 2
        tile = q0 // 64
        line = ((b % lb) * lh + h % lh) * tiles_q + tile
        bounds = [p.row_ptr[line], *s.parts[first:end, 4]]
        assert list(s.parts[first:end, 3]) == bounds[:-1] and bounds[-1] == p.row_ptr[line + 1]
        assert (np.diff(bounds) >= schedule.MIN_PART).all()
        split_rows.append((b * heads + h) * tiles_q + tile)
    assert sorted([*whole, *split_rows]) == list(range(items))
    counts = blocks.sum(axis=3)
    assert schedule.makespan(counts, batch, heads, ctas, 2, max_parts) <= schedule.makespan(
        counts, batch, heads, ctas, 2
    )


def test_work_order_splits_a_last_round_of_few_rows():
    """17 equal rows on 8 CTAs: dealt whole, one CTA runs the seventeenth alone for a third of the time;
    split, its parts run on all of them, and the deal ends about when the mean does."""
    ctas, keys = 8, 40
    blocks = np.ones((1, 1, 17, keys), bool)
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * 17, seq_k=64 * keys), 64, 64)
    counts = blocks.sum(axis=3)
    whole = schedule.makespan(counts, 1, 1, ctas, 2)
    assert whole == 3 * (keys + schedule.ITEM_COST)
    split = schedule.makespan(counts, 1, 1, ctas, 2, ctas)
    mean = 17 * (keys + schedule.ITEM_COST) / ctas
    assert split < mean + 2 * (schedule.ITEM_COST + schedule.PART_COST) + keys / ctas
    s = schedule.work_order(p, 1, 1, 1, 1, ctas, 2, ctas)
    assert len(s.split_ptr) == 2 and len(s.parts) == ctas  # the last row, an eighth a CTA


@settings(max_examples=30, deadline=None)
@given(
    layout_lines=st.sampled_from([(1, 1), (1, 4), (2, 1), (2, 4)]),
    group=st.sampled_from([1, 2, 4]),
    tiles=st.sampled_from([(64, 128), (64, 64), (128, 64)]),
    ctas=st.integers(1, 20),
    seed=st.integers(0, 2**31),
)
def test_column_schedule_orders_every_query_tiles_adds_without_deadlock(
    layout_lines, group, tiles, ctas, seed
):
    """The fused backward's schedule: every (b, kv head, key tile) dealt once; each column walks its entries
    once from `start`; the adds into each query tile are ranked 0, 1, ... once each; and the waits (a visit
    on its CTA's previous one, and on the add ranked before it) form no cycle, so no timing deadlocks."""
    batch, heads = 2, 4
    lb, lh = layout_lines
    rng = np.random.default_rng(seed)
    seq = 64 * 6
    blocks = rng.random((lb, lh, 6, 6)) < 0.5
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=seq), *tiles)
    sched = schedule.column_schedule(p, lb, lh, batch, heads, group, ctas)
    tq, tk = p.tiles_q, p.tiles_k
    items = batch * (heads // group) * tk
    assert sorted(sched.table[sched.table >= 0]) == list(range(items))
    used = min(ctas, items)
    visits: list[list[tuple[int, int]]] = [[] for _ in range(used)]  # per CTA: (query tile, rank) in order
    adds = {}
    for c, item in enumerate(sched.table.tolist()):
        if item < 0:
            continue
        b, hk, k = item // (heads // group * tk), item // tk % (heads // group), item % tk
        for h in range(hk * group, (hk + 1) * group):
            column = (b * heads + h) * tk + k
            source = ((b % lb) * lh + h % lh) * tk + k
            entries = p.col_entries[p.col_ptr[source] : p.col_ptr[source + 1], 0]
            n = entries.size
            assert 0 <= sched.start[column] < max(n, 1)
            assert sched.rank_ptr[column + 1] - sched.rank_ptr[column] == n
            for s in range(n):
                tile = (b * heads + h) * tq + int(entries[(sched.start[column] + s) % n])
                rank = int(sched.ranks[sched.rank_ptr[column] + s])
                visits[c % used].append((tile, rank))
                adds.setdefault(tile, []).append(rank)
    for tile, ranks in adds.items():  # as many adds as the row has key tiles, ranked once each
        b, h, i = tile // (heads * tq), tile // tq % heads, tile % tq
        row = ((b % lb) * lh + h % lh) * tq + i
        assert sorted(ranks) == list(range(p.row_ptr[row + 1] - p.row_ptr[row]))
    # Kahn's algorithm over the waits: every visit must come out.
    node = {(c, j): v for c in range(used) for j, v in enumerate(visits[c])}
    by_rank = {(tile, rank): key for key, (tile, rank) in node.items()}
    waits = {key: [(key[0], key[1] - 1)] * (key[1] > 0) for key in node}
    for key, (tile, rank) in node.items():
        if rank > 0:
            waits[key].append(by_rank[(tile, rank - 1)])
    done, ready = set(), [key for key in node if not waits[key]]
    blocked = {key: len(w) for key, w in waits.items()}
    after: dict = {}
    for key, w in waits.items():
        for dep in w:
            after.setdefault(dep, []).append(key)
    while ready:
        key = ready.pop()
        done.add(key)
        for nxt in after.get(key, []):
            blocked[nxt] -= 1
            if blocked[nxt] == 0:
                ready.append(nxt)
    assert len(done) == len(node)


def test_deal_groups_cover_their_longest_item():
    """Lines of many short items and one long one (OpenAI's strided pattern, by key tile): in groups as few
    as `group_items` asks for, the last group's long items would start after the group before and end
    alone; groups large enough that their share of each CTA covers the longest end within one item."""
    line, lines, ctas = 64, 32, 16
    counts = np.tile(np.where(np.arange(line) % 8 == 7, 120, 8), lines)
    start = schedule._deal(counts, line, 2 * ctas, ctas).start
    finish = start + counts + schedule.ITEM_COST
    assert finish.max() - (counts + schedule.ITEM_COST).sum() / ctas < 8 + schedule.ITEM_COST


def test_column_schedule_spreads_a_heads_adds_over_steps():
    """A column of consecutive query tiles (causal here) begins its walk at the entry, from its diagonal on,
    where the fewest of its visits meet a visit of a column of its head that started before it (one into the
    same query tile at the same step, steps as the deal predicts them). From their diagonals many would
    meet; spread, only the shortest columns, which have few entries to start from."""
    tiles, ctas, heads = 32, 6, 2
    blocks = np.tril(np.ones((tiles, tiles), bool))[None, None]
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * tiles), 64, 64)
    sched = schedule.column_schedule(p, 1, 1, 1, heads, 1, ctas)
    counts = np.tile(np.diff(p.col_ptr), heads)
    item_start = schedule._deal(counts, tiles, 1, ctas).start

    def meetings(start):
        seen, met = set(), []
        for column in range(counts.size):
            h, k = divmod(column, tiles)
            entries = p.col_entries[p.col_ptr[k] : p.col_ptr[k + 1], 0]
            for step in range(entries.size):
                visit = (h, entries[(start[column] + step) % entries.size], item_start[column] + step)
                if visit in seen:
                    met.append(counts[column])
                seen.add(visit)
        return met

    diagonal = meetings(np.zeros(counts.size, int))  # each causal column's diagonal is its first entry
    spread = meetings(sched.start)
    assert len(spread) * 20 < len(diagonal) and max(spread, default=0) <= 4
    assert (sched.start < np.maximum(counts, 1)).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), tiles=st.sampled_from([(64, 64), (64, 128), (128, 64)]))
def test_ranks_in_one_sort_or_a_lexsort(seed, tiles):
    """column_schedule's ranks: the adds into each query tile ordered by key, whether the tile, key and place
    in the walk fit one int64 (one sort along rows) or not (keys and step scaled to near 2**62, in the same
    order: a lexsort)."""
    print(f"seed {seed}, tiles {tiles}")
    rng = np.random.default_rng(seed)
    batch, heads, lb, lh = 2, 3, 1 + int(rng.integers(2)), 3
    blocks = rng.random((lb, lh, 6, 6)) < 0.5
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * 6), *tiles)
    lines = ((np.arange(batch)[:, None] % lb) * lh + np.arange(heads) % lh).reshape(-1)
    counts = np.diff(p.col_ptr).reshape(lb * lh, p.tiles_k)[lines].reshape(-1).astype(np.int64)
    start = (rng.integers(0, 1 << 20, counts.size) % np.maximum(counts, 1)).astype(np.int64)
    step = counts.size  # keys distinct modulo the step, as column_schedule's (deal ranks): unique in a tile
    key = rng.integers(0, 1000, counts.size) * step + rng.permutation(counts.size)
    rank_ptr = np.concatenate([[0], np.cumsum(counts)])
    ranks = schedule._rank_visits(p, lines, counts, start, key, step, rank_ptr)
    scale = 2**62 // int((key + counts * step).max())
    wide = schedule._rank_visits(p, lines, counts, start, key * scale, step * scale, rank_ptr)
    np.testing.assert_array_equal(wide, ranks)
    np.testing.assert_array_equal(ranks, oracle_ranks(p, lines, counts, start, key, step))


# ---- the schedules, against the greedy deal one job at a time ----------------------------------------------
def oracle_order(counts, line, group_items, ctas):
    """The items in the order `oracle_deal` deals them: longest first within groups of lines."""
    lines = counts.size // line
    cost = counts.sum() + schedule.ITEM_COST * counts.size
    longest = int(counts.max(initial=0)) + schedule.ITEM_COST
    most = max(1, -(-group_items // line), -(-longest * ctas * lines // max(cost, 1)))
    groups = -(-lines // most)
    return np.lexsort((-counts, np.arange(counts.size) // line * groups // max(lines, 1)))


def oracle_deal(counts, line, group_items, ctas, max_parts=0):
    """schedule._deal as (table, start, end, parts), plainly: the items longest first within groups of lines,
    each to the CTA that a heap of (free at, CTA) gives first; with `max_parts`, the items that start once a
    CTA is idle split in the way (of SPLIT_COUNTS) that ends soonest, where that gains SPLIT_GAIN."""
    order = oracle_order(counts, line, group_items, ctas)
    costs = (counts[order] + schedule.ITEM_COST).tolist()
    jobs = [(item, c, -1) for item, c in zip(order.tolist(), costs, strict=True)]
    queue = [(0, c) for c in range(min(ctas, len(jobs)))]

    def place(jobs, queue):
        placed = []
        for _, c, _ in jobs:
            when, cta = heapq.heappop(queue)
            placed.append((when, cta))
            heapq.heappush(queue, (when + c, cta))
        return placed

    placed, parts = place(jobs, queue), []
    if max_parts and queue:
        tail = next((i for i, (when, _) in enumerate(placed) if when >= min(queue)[0]), len(placed))
        free = [0] * len(queue)
        for (_, c, _), (when, cta) in zip(jobs[:tail], placed[:tail], strict=True):
            free[cta] = when + c
        before = [(t, cta) for cta, t in enumerate(free)]
        heapq.heapify(before)
        best = None
        for k in schedule.SPLIT_COUNTS:
            split, made = [], []
            for item, c, _ in jobs[tail:]:
                n = int(round(counts[item]))
                pieces = max(1, min(k, n // schedule.MIN_PART))
                if pieces == 1:
                    split.append((item, c, -1))
                    continue
                bounds = [n * i // pieces for i in range(pieces + 1)]
                for first, end in zip(bounds[:-1], bounds[1:], strict=True):
                    share = (c - schedule.ITEM_COST) * (end - first) / n
                    split.append((item, share + schedule.ITEM_COST + schedule.PART_COST, len(made)))
                    made.append((item, first, end))
            if not made or len(made) > max_parts:
                break
            split.sort(key=lambda job: -job[1])
            trial = list(before)
            place(split, trial)
            end = max(t for t, _ in trial)
            if best is None or end < best[0]:
                best = (end, split, made)
        if best and max(queue)[0] - best[0] > schedule.SPLIT_GAIN:
            queue, jobs, parts = before, jobs[:tail] + best[1], best[2]
            placed = placed[:tail] + place(jobs[tail:], queue)
    dealt = [[] for _ in queue]
    start = np.zeros(counts.size, counts.dtype)
    for (item, _, part), (when, cta) in zip(jobs, placed, strict=True):
        dealt[cta].append(item if part < 0 else -2 - part)
        if part < 0 or parts[part][1] == 0:
            start[item] = when
    table = np.full((max(map(len, dealt), default=0), len(dealt)), -1, np.int32)
    for cta, items in enumerate(dealt):
        table[: len(items), cta] = items
    return table.reshape(-1), start, float(max((t for t, _ in queue), default=0)), parts


def oracle_spread(p, source, counts, start, when, tiles_k):
    """schedule._spread_walks plainly: columns of consecutive query tiles in the order they start, each at the
    first entry from its diagonal (MAX_SPREAD at most) that meets no visit of the head's columns before it
    into the same tile at the same step, else where the fewest do."""
    entries = [p.col_entries[p.col_ptr[s] : p.col_ptr[s + 1], 0].tolist() for s in source]
    held = {}  # (head, phase): the tiles [a, b) its columns take
    start = start.copy()
    for c in np.argsort(when, kind="stable"):
        e, n = entries[c], int(counts[c])
        if not n or e[-1] - e[0] + 1 != n:
            continue
        f, h, p0 = e[0], c // tiles_k, int(when[c]) - e[0]

        def met(phase, lo, hi, h=h):
            return sum(max(0, min(hi, b) - max(lo, a)) for a, b in held.get((h, phase), []))

        r, least, best = int(start[c]), n + 1, int(start[c])
        for _ in range(min(n, schedule.MAX_SPREAD)):
            meets = met(p0 - r, f + r, f + n) + (met(p0 - r + n, f, f + r) if r else 0)
            if meets < least:
                least, best = meets, r
                if not meets:
                    break
            r = (r + 1) % n
        held.setdefault((h, p0 - best), []).append((f + best, f + n))
        if best:
            held.setdefault((h, p0 - best + n), []).append((f, f + best))
        start[c] = best
    return start


def oracle_ranks(p, lines, counts, start, key, step):
    """schedule._rank_visits plainly: each column's visits from its start entry, the s-th at key + s * step;
    the adds into each query tile numbered by that key."""
    adds, ranks = {}, []
    for c in range(counts.size):
        line, k = divmod(c, p.tiles_k)
        column = int(lines[line]) * p.tiles_k + k
        entries = p.col_entries[p.col_ptr[column] : p.col_ptr[column + 1], 0]
        for s in range(counts[c]):
            tile = (line, int(entries[(start[c] + s) % counts[c]]))
            adds.setdefault(tile, []).append(int(key[c] + s * step))
            ranks.append((tile, adds[tile][-1]))
    return np.array([sorted(adds[tile]).index(k) for tile, k in ranks], np.int32)


def oracle_column_schedule(p, lb, lh, batch, heads, group, ctas, group_items):
    """schedule.column_schedule from the oracles: (table, start, rank_ptr, ranks)."""
    tiles_q, tiles_k = p.tiles_q, p.tiles_k
    counts = np.diff(p.col_ptr).astype(np.int64)
    diagonal = np.zeros(counts.size, np.int64)  # each layout column's first entry at or past its diagonal
    for s in range(counts.size):
        tiles = p.col_entries[p.col_ptr[s] : p.col_ptr[s + 1], 0]
        diagonal[s] = np.count_nonzero(tiles < s % tiles_k * tiles_q // tiles_k) % max(counts[s], 1)
    b, h, k = (a.reshape(-1) for a in np.indices((batch, heads, tiles_k)))
    source = ((b % lb) * lh + h % lh) * tiles_k + k
    per_head = counts[source].reshape(batch, heads // group, group, tiles_k)
    table, item_start, _, _ = oracle_deal(per_head.sum(axis=2).reshape(-1), tiles_k, group_items, ctas)
    item = (b * (heads // group) + h // group) * tiles_k + k
    when = item_start[item] + (np.cumsum(per_head, axis=2) - per_head).reshape(-1)
    deal_rank = np.argsort(np.argsort(item_start, kind="stable"))
    start = oracle_spread(p, source, counts[source], diagonal[source], when, tiles_k)
    key = when * item_start.size + deal_rank[item]
    ranks = oracle_ranks(p, source[::tiles_k] // tiles_k, counts[source], start, key, item_start.size)
    return table, start.astype(np.int32), np.concatenate([[0], np.cumsum(counts[source])]), ranks


@settings(max_examples=60, deadline=None)
@given(
    layout_lines=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]),
    tiles_q=st.integers(1, 12),
    ctas=st.integers(1, 12),
    group_items=st.integers(1, 40),
    max_parts=st.integers(0, 16),
    density=st.sampled_from([0.3, 0.8, 1.0, "skewed"]),
    partial_cost=st.sampled_from([0, 0.2, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_deals_match_the_greedy_one_job_at_a_time(
    layout_lines, tiles_q, ctas, group_items, max_parts, density, partial_cost, seed
):
    """makespan, work_order and _deal give exactly what dealing one job at a time from a heap of CTAs gives:
    the same tables, starts, parts and end, to the bit (float costs too: visits' partial tiles). "skewed":
    a few long rows, then many equal short ones, which CTAs far apart in time take."""
    print(f"seed {seed}")
    batch, heads, keys = 2, 2, 24
    lb, lh = layout_lines
    rng = np.random.default_rng(seed)
    if density == "skewed":
        blocks = np.zeros((lb, lh, tiles_q, keys), bool)
        blocks[..., 0] = True
        blocks[:, :, : rng.integers(1, tiles_q + 1)] = rng.random(keys) < 0.8
    else:
        blocks = rng.random((lb, lh, tiles_q, keys)) < density
    partial = blocks & (rng.random(blocks.shape) < 0.3)
    rule = mask_rule(lambda b, h, q, k: (q + 2 * k) % 3 != 0, name="mod3")
    layout = BlockLayout(
        blocks, block_size=64, seq_q=64 * tiles_q, seq_k=64 * keys, partial=partial, rule=rule
    )
    p = plan.build(layout, 64, 64)
    counts = plan.visits(layout, 64, 64, partial_cost)
    per_call = np.broadcast_to(counts, (batch, heads, tiles_q)).reshape(-1)
    table, start, end, parts = oracle_deal(per_call, tiles_q, group_items, ctas, max_parts)
    assert repr(schedule.makespan(counts, batch, heads, ctas, group_items, max_parts)) == repr(end)
    dealt = schedule._deal(per_call, tiles_q, group_items, ctas, max_parts)
    for got, want in ((dealt.table, table), (dealt.start, start)):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    # work_order deals the plan's rows (whole key tiles) the same way; its parts name their rows' entries.
    row_counts = np.diff(p.row_ptr).reshape(lb, lh, tiles_q)
    per_call = np.broadcast_to(row_counts, (batch, heads, tiles_q)).reshape(-1)
    table, _, _, parts = oracle_deal(per_call, tiles_q, group_items, ctas, max_parts)
    s = schedule.work_order(p, lb, lh, batch, heads, ctas, group_items, max_parts)
    np.testing.assert_array_equal(s.table, table)
    want = []
    for item, first, end in parts:
        line, tile = divmod(item, tiles_q)
        b, h = divmod(line, heads)
        row = p.row_ptr[((b % lb) * lh + h % lh) * tiles_q + tile]
        want.append((b, h, tile * 64, row + first, row + end))
    np.testing.assert_array_equal(s.parts, np.array(want, np.int32).reshape(-1, 5))
    ends = [i + 1 for i in range(len(parts)) if i + 1 == len(parts) or parts[i + 1][0] != parts[i][0]]
    np.testing.assert_array_equal(s.split_ptr, [0, *ends])


@settings(max_examples=40, deadline=None)
@given(
    layout_lines=st.sampled_from([(1, 1), (1, 4), (2, 1), (2, 4)]),
    group=st.sampled_from([1, 2, 4]),
    tiles=st.sampled_from([(64, 128), (64, 64), (128, 64)]),
    shape=st.sampled_from(["random", "causal", "dense"]),
    ctas=st.integers(1, 20),
    group_items=st.integers(1, 60),
    seed=st.integers(0, 2**31),
)
def test_column_schedule_matches_the_plain_one(layout_lines, group, tiles, shape, ctas, group_items, seed):
    """column_schedule gives exactly what its plain form gives: the deal one column at a time, the walks
    spread one column at a time, each query tile's adds ranked by a sort of that tile's own."""
    print(f"seed {seed}")
    batch, heads = 2, 4
    lb, lh = layout_lines
    rng = np.random.default_rng(seed)
    blocks = {
        "random": rng.random((lb, lh, 8, 8)) < 0.5,
        "causal": np.broadcast_to(np.tril(np.ones((8, 8), bool)), (lb, lh, 8, 8)),
        "dense": np.ones((lb, lh, 8, 8), bool),
    }[shape]
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=64 * 8), *tiles)
    got = schedule.column_schedule(p, lb, lh, batch, heads, group, ctas, group_items)
    want = oracle_column_schedule(p, lb, lh, batch, heads, group, ctas, group_items)
    for name, b in zip(("table", "start", "rank_ptr", "ranks"), want, strict=True):
        a = getattr(got, name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


# ---- speed -------------------------------------------------------------------------------------------------
def test_a_new_layouts_schedule_is_quick():
    """The host's schedule of a new layout as cuda.py plans it for an H100 (132 SMs) at head dim 128, B = 2,
    H = 16, causal, S = 16384: the forward's (the two makespans that weigh the wide tiles against the
    default ones, from the layout's rows alone, then its deal) and the fused backward's columns, each the
    best of five runs. The bounds leave room for a shared 2-core VM's slower days (the same code takes two
    to three times as long there from one day to the next) and still catch a change of the algorithm's
    order; the columns' ranks are an int32 a visit (528384 here), and _spread_walks takes a head's columns
    one at a time."""
    sms, batch, heads, seq = 132, 2, 16, 16384
    layout = patterns.causal(block=128).layout(seq)
    # build's tiles at head dim 128: the forward's (TILES, WIDE_TILES and WIDE_PARTIAL_COST), the fused
    # backward's; cuda's _FORWARD_GROUP and _FUSED_BACKWARD_GROUP items per SM to a group.
    forward, fused = plan.build(layout, 128, 128), plan.build(layout, 64, 128)

    def forward_schedule():
        for tiles, partial_cost in (((128, 192), 1.0), ((128, 128), 0)):
            counts = plan.visits(layout, *tiles, partial_cost)
            ctas = min(batch * heads * counts.shape[2], sms)
            schedule.makespan(counts, batch, heads, ctas, 2 * sms, ctas)
        ctas = min(batch * heads * forward.tiles_q, sms)
        schedule.work_order(forward, 1, 1, batch, heads, ctas, 2 * sms, ctas)

    def backward_schedule():
        ctas = min(batch * heads * fused.tiles_k, sms)
        schedule.column_schedule(fused, 1, 1, batch, heads, 1, ctas, 4 * sms)

    def best(run):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    seconds = best(forward_schedule), best(backward_schedule)
    print(f"forward {seconds[0] * 1e3:.2f} ms, fused backward {seconds[1] * 1e3:.2f} ms")
    assert seconds[0] < 6e-3 and seconds[1] < 80e-3


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=50),
    line=st.sampled_from([1, 2, 4]),
    ctas=st.integers(1, 12),
    group_items=st.integers(1, 64),
)
def test_deal_order_is_the_order_the_deal_takes_its_items(counts, line, ctas, group_items):
    """The order a deal made on the GPU takes (dynamic layouts' fused backward) is `_deal`'s: longest first
    inside groups of whole lines."""
    counts = np.array(counts * line, np.int64)  # whole lines
    order = schedule.deal_order(counts, line, group_items, ctas)
    np.testing.assert_array_equal(order, oracle_order(counts, line, group_items, ctas))
