"""The device tables of a layout and of a score mod: what every launch over them points to, uploaded once per
(layout, tile shape, device) and (score mod, device), and dropped with their object.

A layout's tables are its tile plan (`cusparseattn.plan`), its token rule's parameters and arrays, and the
persistent passes' schedules (`cusparseattn.schedule`) for each call's sizes; a score mod's are its
parameters and captured arrays.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import build, plan, schedule
from .layout import BlockLayout

# The bytes of the score mod's Params fields (score_ip, score_fp, score_a lie in a row).
SCORE = slice(build.PARAMS.fields["score_ip"][1], build.PARAMS.fields["score_a"][1] + 4 * 8)

# id(layout) -> {(tile_m, tile_n, device) -> DeviceTables}; an entry goes when its layout does.
_tables: dict[int, dict] = {}


class DeviceTables:
    """A layout's tile plan and token-rule arrays, resident on one device."""

    def __init__(self, layout: BlockLayout, tile_m: int, tile_n: int):
        import cupy

        self.plan = plan.build(layout, tile_m, tile_n)
        p = self.plan
        # Kept as attributes: the device memory lives as long as these tables.
        # entries with one past the last row's, so that a kernel reads a row's next entry without a check.
        entries = np.concatenate([p.entries, np.array([[0, -1]], np.int32)])
        self.arrays = {
            name: cupy.asarray(entries if name == "entries" else getattr(p, name))
            for name in ("row_ptr", "entries", "col_ptr", "col_entries", "sub_bits", "bit_mask")
        }
        rule = layout.rule if p.rule_mode == "expr" else None
        self.kernel_rule = rule.kernel if rule else None
        # The parameter fields that depend on the layout alone; a launch copies this and adds its arrays.
        base = np.zeros((), build.PARAMS)
        for name, array in self.arrays.items():
            base[name] = array.data.ptr
        base["layout_batch"], base["layout_heads"] = layout.batch, layout.heads
        base["tiles_q"], base["tiles_k"] = p.tiles_q, p.tiles_k
        for name in ("sub_q_shift", "sub_k_shift", "sub_k_count"):
            base[name] = getattr(p, name)
        self.rule_arrays = set_rule(base, rule)
        # Kernels evaluate whole tiles, up to a tile (at most 256 tokens) past a sequence's end.
        base["rule_narrow"] = rule is not None and rule.narrow(max(layout.seq_q, layout.seq_k) + 256)
        base["q_origin"], base["k_origin"] = layout.origin
        # As bytes: a launch starts from a copy of them (copying a NumPy struct costs 30 us).
        self.params = base.tobytes()
        self.layout_lines = (layout.batch, layout.heads)
        self._work: dict[tuple, dict] = {}
        self.passes: dict[
            tuple, object
        ] = {}  # `launches.make_pass`: the passes over these tables, by call sizes

    def work(self, batch: int, heads: int, ctas: int, group_items: int, max_parts: int = 0) -> dict:
        """A persistent pass's schedule for `batch` x `heads` on `ctas` CTAs (schedule.work_order), on the
        device, by the Params field of each of its arrays: ``work`` (the items), ``parts`` and ``split_ptr``
        (its split rows' parts, none without `max_parts`), as `_Pass` takes them."""
        import cupy

        key = ("rows", batch, heads, ctas, group_items, max_parts)
        if key not in self._work:
            s = schedule.work_order(self.plan, *self.layout_lines, batch, heads, ctas, group_items, max_parts)
            arrays = {"work": s.table, "parts": s.parts, "split_ptr": s.split_ptr}
            self._work[key] = {field: cupy.asarray(a) for field, a in arrays.items()}
        return self._work[key]

    def columns(self, batch: int, heads: int, group: int, ctas: int, group_items: int) -> dict:
        """The fused backward's schedule (schedule.column_schedule) on the device, by the Params field of each
        of its arrays."""
        import cupy

        key = ("columns", batch, heads, group, ctas, group_items)
        if key not in self._work:
            lines = self.layout_lines
            s = schedule.column_schedule(self.plan, *lines, batch, heads, group, ctas, group_items)
            arrays = {"work": s.table, "col_start": s.start, "rank_ptr": s.rank_ptr, "ranks": s.ranks}
            self._work[key] = {field: cupy.asarray(a) for field, a in arrays.items()}
        return self._work[key]


def set_rule(params: np.ndarray, rule) -> list:
    """Writes a token rule's parameters and its uploaded arrays (int32) into a Params-like struct's rule_p and
    rule_a; returns the device arrays, which must live as long as the struct is launched with."""
    import cupy

    if rule is None:
        return []
    arrays = [cupy.asarray(np.ascontiguousarray(a, dtype=np.int32)) for a in rule.arrays]
    params["rule_p"][: len(rule.params)] = rule.params
    params["rule_a"][: len(arrays)] = [a.data.ptr for a in arrays]
    return arrays


def per_object(cache: dict, obj, key, make):
    """``cache[id(obj)][key]``, made on first use; the entry goes when `obj` does."""
    entries = cache.get(id(obj))
    if entries is None:
        entries = cache[id(obj)] = {}
        weakref.finalize(obj, cache.pop, id(obj), None)
    if key not in entries:
        entries[key] = make()
    return entries[key]


def device_tables(layout: BlockLayout, tile_m: int, tile_n: int, device: int) -> DeviceTables:
    return per_object(_tables, layout, (tile_m, tile_n, device), lambda: DeviceTables(layout, tile_m, tile_n))


# id(score mod) -> {device -> ScoreTables}
_scores: dict[int, dict] = {}


class ScoreTables:
    """A score mod's parameters and captured arrays, resident on one device: the Params fields it sets, as
    the bytes of their span (score_ip, score_fp, score_a lie in a row)."""

    def __init__(self, score_mod):
        import cupy

        self.spec = score_spec(score_mod)
        self.arrays = [cupy.asarray(np.ascontiguousarray(a)) for a in score_mod.arrays]
        ip, fp = score_mod.int_params, score_mod.float_params
        fields = np.zeros((), build.PARAMS)
        fields["score_ip"] = ip + (0,) * (8 - len(ip))
        fields["score_fp"] = fp + (0.0,) * (8 - len(fp))
        fields["score_a"] = [a.data.ptr for a in self.arrays] + [0] * (4 - len(self.arrays))
        self.fields = fields.tobytes()[SCORE]


def score_spec(score_mod) -> tuple | None:
    """What the kernels compile of a score mod (build.KernelSpec's score): its C texts; None without one."""
    return None if score_mod is None else (score_mod.c_expr, score_mod.c_grad)


def score_tables(score_mod, device: int) -> ScoreTables | None:
    if score_mod is None:
        return None
    return per_object(_scores, score_mod, device, lambda: ScoreTables(score_mod))
