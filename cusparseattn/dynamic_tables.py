"""A dynamic layout's tile tables on the GPU: buffers sized by capacity once per signature, filled at every
call from the layout's index arrays by kernels/dynamic_tables.cu on the call's stream, so that the passes
read them as they read a static layout's (`cusparseattn.gpu_tables.DeviceTables`) and nothing is read back.

A signature is what the buffers and passes depend on, never the indices' values: the indices' shape, whether
counts come, the block size, the static parts (``within``, ``plus``) by identity, the call's batch, heads and
lengths, the tile shape and the device. `reasons` says which dynamic layouts the kernels take.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from . import build, devices, plan, schedule
from .dynamic import DynamicLayout
from .gpu_tables import set_rule
from .launches import launch_kernel, struct_arguments
from .recent import Recent

_THREADS, _SCAN_THREADS = 256, build.TablesSpec.threads  # a step's CTA: most steps', the scan's
_WARPS = _THREADS // 32  # rows of a CTA in the steps that give each warp one
_DEAL_CTAS = 192  # the most CTAs the deal on the GPU takes (kernels/dynamic_tables.cu: DEAL_CTAS)
_RESIDENT = 8  # CTAs of _THREADS an SM holds at once


def reasons(layout: DynamicLayout) -> list[str]:
    """Why the kernels cannot run this (fitted) dynamic layout; empty when they can."""
    out = []
    if layout.per != "block":
        out.append(
            "the kernels take dynamic layouts per query block (block_indices): a per-token one reaches them "
            "as a per-block layout over grouped rows, which attention() makes where the query heads of each "
            "KV group share the selection (cusparseattn.token_groups)"
        )
    partial = [p for p in (layout.within, layout.plus) if p is not None and p.partial.any()]
    if len(partial) == 2:
        out.append(
            "both static parts of the dynamic layout (within and plus) have partial blocks: the kernels take "
            "one token rule, so one of them must be block-granular"
        )
    elif partial and partial[0].rule.c_expr is None:
        out.append(f"the static part's rule {partial[0].rule.name!r} has no C expression for the kernels")
    return out


@dataclass(frozen=True)
class _Geometry:
    """What the passes read of a layout's tile plan (`plan.TilePlan`), for a dynamic one: its tile counts,
    its rule's mode, and the key tiles each row is expected to visit (``row_ptr``, for the persistent
    forward's deal: `schedule.work_order` reads no more)."""

    tile_m: int
    tile_n: int
    tiles_q: int
    tiles_k: int
    rule_mode: str
    row_ptr: np.ndarray


def _ptr(counts: np.ndarray) -> np.ndarray:
    """A row_ptr of these counts: where each starts, then the end."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def _state(layout) -> np.ndarray:
    """A static part's blocks as kernels/dynamic_tables.cu reads them: 0 none, 1 full, 2 partial."""
    # partial blocks are set blocks: 1 for each set block, 1 more for each partial one
    return layout.blocks.view(np.uint8) + layout.partial.view(np.uint8)


class DynamicTables:
    """The tile tables of dynamic layouts of one signature (module docstring) on one device, for the passes
    (`launches.make_pass`); `refresh` fills them from a layout's arrays on a stream."""

    def __init__(self, layout: DynamicLayout, sizes: tuple, tile_m: int, tile_n: int, device: int):
        import cupy

        batch, heads_q, heads_kv, seq_q, seq_k = sizes
        (bq, bk), within, plus = layout.block_size, layout.within, layout.plus
        tiles_q, tiles_k = -(-seq_q // tile_m), -(-seq_k // tile_n)
        n_qb, n_kb = -(-seq_q // bq), -(-seq_k // bk)
        cell_q, cell_k = np.gcd(bq, tile_m), np.gcd(bk, tile_n)
        if plan.tile_cells(tile_m, tile_n, layout.block_size) > plan.MAX_CELLS:
            raise ValueError(
                f"tiles of {tile_m} x {tile_n} hold more than {plan.MAX_CELLS} cells of {bq} x {bk}"
            )
        parts = [p for p in (within, plus) if p is not None]
        lines_batch = batch if layout.batch > 1 or any(p.batch > 1 for p in parts) else 1
        lines_heads = heads_q if layout.heads > 1 or any(p.heads > 1 for p in parts) else 1
        lines = lines_batch * lines_heads

        # Key tiles a row may visit: those of its chosen blocks (a tile holds at most max(1, tile_m / bq)
        # query blocks, a key block spans at most max(1, bk / tile_n) tiles), and the plus part's.
        chosen_tiles = max(1, tile_m // bq) * layout.width * max(1, bk // tile_n)
        plus_visits = (
            plan.visits(plus, tile_m, tile_n) if plus is not None else np.zeros((1, 1, tiles_q), int)
        )
        within_visits = plan.visits(within, tile_m, tile_n) if within is not None else tiles_k
        expected = np.minimum(np.minimum(within_visits, chosen_tiles) + plus_visits, tiles_k)
        expected = np.broadcast_to(expected, (lines_batch, lines_heads, tiles_q)).reshape(-1)
        self.capacity = lines * tiles_q * min(tiles_k, chosen_tiles + int(plus_visits.max()))

        rule = next((p.rule for p in parts if p.partial.any()), None)
        self.plan = _Geometry(tile_m, tile_n, tiles_q, tiles_k, "expr" if rule else "none", _ptr(expected))
        self.kernel_rule = rule.whole if rule else None
        self.layout_lines = (lines_batch, lines_heads)
        self.parts = (within, plus)  # held, so that the ids in its key stay theirs

        tile_words, q_words, words = -(-tiles_k // 32), -(-tiles_q // 32), -(-n_kb // 32)
        zeros = {
            "chosen": (layout.batch * layout.heads * n_qb * words, cupy.uint32),
            "visited": (lines * tiles_q * tile_words, cupy.uint32),
            "partial": (lines * tiles_q * tile_words, cupy.uint32),
            "visited_t": (lines * tiles_k * q_words, cupy.uint32),
            "row_count": (lines * tiles_q, cupy.int32),
            "col_count": (lines * tiles_k, cupy.int32),
            "row_ptr": (lines * tiles_q + 1, cupy.int32),
            "col_ptr": (lines * tiles_k + 1, cupy.int32),
            "entries": ((self.capacity + 1) * 2, cupy.int32),  # one past the last: as DeviceTables' entries
            "col_entries": (self.capacity * 2, cupy.int32),
            "sub_bits": (self.capacity * 2, cupy.uint64),
        }
        self.arrays = {name: cupy.zeros(n, dtype) for name, (n, dtype) in zeros.items()}
        self.arrays["entries"][-1] = -1  # the extra entry's partial index
        for name, part in (("within", within), ("plus", plus)):
            if part is not None:
                self.arrays[name] = cupy.asarray(_state(part))

        t = np.zeros((), build.TABLES_PARAMS)
        for name, array in self.arrays.items():
            t[name] = array.data.ptr
        group = heads_q // heads_kv if layout.heads == heads_kv != heads_q else 1
        values = dict(
            sel_batch=layout.batch, sel_heads=layout.heads, sel_group=group,
            w_batch=within.batch if within else 1, w_heads=within.heads if within else 1,
            p_batch=plus.batch if plus else 1, p_heads=plus.heads if plus else 1,
            lines_batch=lines_batch, lines_heads=lines_heads, n_qb=n_qb, n_kb=n_kb, width=layout.width,
            words=words, block_q=bq, block_k=bk, cell_q=cell_q, cell_k=cell_k, per_q=tile_m // cell_q,
            per_k=tile_n // cell_k, cell_rows=-(-seq_q // cell_q), cell_cols=-(-seq_k // cell_k),
            tiles_q=tiles_q, tiles_k=tiles_k, tile_words=tile_words, q_words=q_words, tile_n=tile_n,
            seq_k=seq_k, capacity=self.capacity,
        )  # fmt: skip
        for name, value in values.items():
            t[name] = value
        # Steps 1 and 3 give a warp each row (step 3 each column too) in turn, from a grid the SMs hold.
        self._resident = _RESIDENT * devices.sm_count(device)
        rows = lines * tiles_q
        self._launches = [  # (grid, threads) of each step
            ((-(-n_qb // _WARPS), layout.batch * layout.heads, 1), _THREADS),
            (self._grid(rows), _THREADS),
            ((2, 1, 1), _SCAN_THREADS),
            (self._grid(rows + lines * tiles_k), _THREADS),
        ]
        self._step_items = rows + lines * tiles_k
        self._t = t
        self._expected_rows = expected[:tiles_q]  # line 0's, for the fused backward's deal
        self._pack()
        self._function = build.load(build.TablesSpec(), device)

        # The passes' parameters that the tables set, as gpu_tables.DeviceTables makes them.
        base = np.zeros((), build.PARAMS)
        for name in ("row_ptr", "entries", "col_ptr", "col_entries", "sub_bits"):
            base[name] = self.arrays[name].data.ptr
        base["layout_batch"], base["layout_heads"] = lines_batch, lines_heads
        base["tiles_q"], base["tiles_k"] = tiles_q, tiles_k
        base["sub_q_shift"], base["sub_k_shift"] = int(cell_q).bit_length() - 1, int(cell_k).bit_length() - 1
        base["sub_k_count"] = tile_n // cell_k
        self.rule_arrays = set_rule(base, rule)
        base["rule_narrow"] = rule is not None and rule.narrow(max(seq_q, seq_k) + 256, whole=True)
        base["q_origin"], base["k_origin"] = parts[0].origin if parts else (0, 0)
        self.params = base.tobytes()
        self.passes: dict[tuple, object] = {}
        self._work: dict[tuple, dict] = {}
        self._columns: tuple | None = None  # (its key, its arrays): one fused backward's schedule

    def work(self, batch: int, heads: int, ctas: int, group_items: int, max_parts: int = 0) -> dict:
        """The persistent forward's deal (as `DeviceTables.work`), made from the rows' expected visits at
        plan time: the rows' lengths come at run time, so no row is split."""
        import cupy

        key = (batch, heads, ctas, group_items)
        if key not in self._work:
            s = schedule.work_order(self.plan, *self.layout_lines, batch, heads, ctas, group_items)
            arrays = {"work": s.table, "parts": s.parts, "split_ptr": s.split_ptr}
            self._work[key] = {field: cupy.asarray(a) for field, a in arrays.items()}
        return self._work[key]

    def columns(self, batch: int, heads: int, group: int, ctas: int, group_items: int) -> dict:
        """The fused backward's schedule (as `DeviceTables.columns`): its deal of items, each walk from its
        column's first entry, and the ranks of the visits, all of which `refresh` makes on the GPU from each
        call's tables; the order the deal takes its items in comes from their expected visits, at plan
        time."""
        import cupy

        key = (batch, heads, group, ctas, group_items)
        if self._columns is not None:
            if self._columns[0] != key:
                raise ValueError("a dynamic layout's tables take one fused backward's schedule")
            return self._columns[1]
        p = self.plan
        heads_kv = heads // group
        costs = np.broadcast_to(group * self._expected_columns(), (batch, heads_kv, p.tiles_k)).reshape(-1)
        order = schedule.deal_order(np.ceil(costs).astype(np.int64), p.tiles_k, group_items, ctas)
        rounds = -(-order.size // ctas)
        calls = batch * heads // (self.layout_lines[0] * self.layout_lines[1])
        made = {
            "work": cupy.full(rounds * ctas, -1, cupy.int32),
            "col_start": cupy.zeros(batch * heads * p.tiles_k, cupy.int32),
            "rank_ptr": cupy.zeros(batch * heads * p.tiles_k + 1, cupy.int64),
            "ranks": cupy.zeros(calls * self.capacity, cupy.int32),
        }
        scratch = {
            "order": cupy.asarray(order.astype(np.int32)),
            "col_pos": cupy.zeros(self.capacity, cupy.int32),
            "item_start": cupy.zeros(batch * heads_kv * p.tiles_k, cupy.int32),
            "item_rank": cupy.zeros(batch * heads_kv * p.tiles_k, cupy.int32),
        }
        self.arrays |= scratch
        t = self._t
        for name, array in {**made, **scratch}.items():
            if name != "col_start":
                t[name] = array.data.ptr
        t["batch"], t["heads_q"], t["group"], t["ctas"] = batch, heads, group, ctas
        t["rounds"], t["item_cost"], t["items"] = rounds, schedule.ITEM_COST, order.size
        if ctas > _DEAL_CTAS:
            raise ValueError(f"the deal on the GPU takes at most {_DEAL_CTAS} CTAs, got {ctas}")
        self._launches[2] = ((4, 1, 1), _SCAN_THREADS)  # three scans, then the deal
        self._launches[3] = (self._grid(self._step_items + ctas), _THREADS)  # a warp a deal CTA's walk too
        self._launches.append(((-(-p.tiles_q // _WARPS), batch * heads, 1), _THREADS))
        self._pack()
        self._columns = (key, made)
        return made

    def _grid(self, items: int) -> tuple[int, int, int]:
        """A grid of warps for `items` taken in turn: as many CTAs as the SMs hold at once, or fewer."""
        return (max(1, min(-(-items // _WARPS), self._resident)), 1, 1)

    def _expected_columns(self) -> np.ndarray:
        """The visits each key tile's column is expected to take: each row's expected visits spread evenly
        over the key tiles its static parts let it visit (line 0's)."""
        p, (within, plus) = self.plan, self.parts
        rows = self._expected_rows.astype(float)
        if plus is not None:
            built = plan.build(plus, p.tile_m, p.tile_n)
            plus_columns = np.diff(built.col_ptr)[: p.tiles_k]
            rows = rows - np.diff(built.row_ptr)[: p.tiles_q]
        else:
            plus_columns = 0
        if within is None:
            return rows.sum() / p.tiles_k + plus_columns
        built = plan.build(within, p.tile_m, p.tile_n)
        counts = np.diff(built.row_ptr)[: p.tiles_q]
        row_of = np.repeat(np.arange(p.tiles_q), counts)
        share = np.where(counts > 0, rows / np.maximum(counts, 1), 0)[row_of]
        tiles = built.entries[: row_of.size, 0]
        return np.bincount(tiles, weights=share, minlength=p.tiles_k) + plus_columns

    def _pack(self) -> None:
        """The parameters of each step, from the struct as it is now."""
        t, self._steps = self._t, []
        for step in range(len(self._launches)):
            t["step"] = step
            self._steps.append(t.tobytes())
        self._arguments: dict[tuple, list] = {}

    def refresh(self, stream: int, layout: DynamicLayout) -> None:
        """Fills the tables from `layout`'s index arrays (of this signature) on `stream`, a raw handle."""
        holders = layout.holders()
        key = tuple((h.data_ptr, h.strides) for h in holders)
        arguments = self._arguments.get(key)
        if arguments is None:
            arguments = self._arguments_for(holders)
            if len(self._arguments) >= 16:
                self._arguments.clear()
            self._arguments[key] = arguments
        for (grid, threads), (table, _) in zip(self._launches, arguments, strict=True):
            launch_kernel(self._function.kernel.ptr, grid, (threads, 1, 1), 0, stream, table)

    def _arguments_for(self, holders) -> list:
        indices, counts = holders[0], holders[1] if len(holders) > 1 else None
        out = []
        for step in self._steps:
            params = bytearray(step)
            fields = build.TABLES_PARAMS.fields
            struct.pack_into("<Q", params, fields["indices"][1], indices.data_ptr)
            struct.pack_into("<4q", params, fields["i_sb"][1], *indices.strides)
            if counts is not None:
                struct.pack_into("<Q", params, fields["counts"][1], counts.data_ptr)
                struct.pack_into("<3q", params, fields["c_sb"][1], *counts.strides)
            out.append(struct_arguments(params))
        return out


_kept = Recent(16)


def tables(layout: DynamicLayout, sizes: tuple, tile_m: int, tile_n: int, device: int) -> DynamicTables:
    """The tables of `layout`'s signature (module docstring) for a call of `sizes` (batch, heads_q,
    heads_kv, seq_q, seq_k) on tiles of tile_m x tile_n, made once (the last 16 kept)."""
    i, c = layout.holders()[0], layout.counts is not None
    parts = (layout.within, layout.plus)
    key = (i.shape, c, layout.block_size, *map(id, parts), sizes, tile_m, tile_n, device)
    made = _kept.get(key)
    if made is None:
        made = _kept.put(key, DynamicTables(layout, sizes, tile_m, tile_n, device), first=True)
    return made
