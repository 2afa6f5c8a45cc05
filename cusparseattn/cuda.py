"""The CUDA kernels' passes of a call: the forward (`Forward`) and the backward (`Backward`), the kernels and
tiles they take for the arrays, the layout and the GPU, made once per call signature and then launched on
the caller's stream; and the GPU's classification of a rule's blocks (`classify_blocks`).

Host work per layout (the tile plan, its upload: `cusparseattn.tables`) happens once per (layout, tile shape,
device); a call then only writes addresses and launches (`cusparseattn.launches`). Nothing here synchronises
the device.
"""

from __future__ import annotations

import functools

import numpy as np

from . import build, devices, dynamic_tables, env, plan, schedule, tma, tuning
from .arrays import contiguous_strides
from .dynamic import DynamicLayout
from .gpu_tables import device_tables, per_object, score_spec, score_tables, set_rule
from .launches import (
    ARRAYS,
    Bound,
    bind_device,
    cupy_stream,
    kernel_spec_args,
    make_pass,
    pool_scratch,
    prefetch,
    run_launches,
    scratch,
)
from .layout import BlockLayout


def _tiles(kernel: str, layout, head_dim: int, device: int, score, wide=False, dtype=None, precision="high"):
    """The tiles of `kernel` over `layout` (`tuning.tile_config`); `score`: whether a score mod is given."""
    static = not isinstance(layout, DynamicLayout)
    bits, elementwise = static and plan.rule_mode(layout) == "bits", static and plan.elementwise_rule(layout)
    choice = (score is not None, bits, wide, build.DTYPES.get(dtype, 2), precision == "highest", elementwise)
    return tuning.tile_config(kernel, head_dim, devices.max_shared(device), *choice)


def _tables(layout, tiles, device: int, sizes):
    """The tables of `layout` for tiles of `tiles`; a dynamic layout's for a call of `sizes` (`_sizes`)."""
    if isinstance(layout, DynamicLayout):
        return dynamic_tables.tables(layout, sizes, tiles[0], tiles[1], device)
    return device_tables(layout, tiles[0], tiles[1], device)


def _precision(precision: str, dtype: str) -> str:
    """The precision a pass of `dtype` takes: float32's as asked (`build.PRECISIONS`), else "high"."""
    return precision if dtype == "float32" else "high"


def _sizes(q, k) -> tuple[int, int, int, int, int]:
    """What a dynamic layout's tables depend on of a call: batch, query heads, KV heads, lengths."""
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]


class _Refresh:
    """A dynamic layout's tables filled from its index arrays, as a launch among a call's passes."""

    def __init__(self, tables, layout: DynamicLayout):
        self.tables, self.layout = tables, layout

    def launch(self, stream: int, addresses: tuple) -> None:
        self.tables.refresh(stream, self.layout)


# Items per SM to a group of a persistent pass's deal (schedule.work_order, schedule.column_schedule). The
# forward: the rows in flight at once come from a few heads. The fused backward deals four: the columns of
# more heads are dealt longest first together, and an ordered add waits less for the one ranked before it;
# eight gain little more (docs/tuning.md: _FORWARD_GROUP, _FUSED_BACKWARD_GROUP).
_FORWARD_GROUP, _FUSED_BACKWARD_GROUP = 2, 4


def _wide_pays(
    kernel: str, layout: BlockLayout, head_dim: int, batch: int, heads: int, device: int, score=None
) -> bool:
    """Whether the persistent `kernel`'s wide tiles (tuning.WIDE_TILES), where `tuning.tile_config` allows
    them (not with a score mod or bit masks), would finish this call sooner than its default ones: the
    makespans of their schedules (schedule.makespan, as `Forward` deals them), a wide tile weighted by
    tuning.WIDE_TILE_COST and a partial one by tuning.WIDE_PARTIAL_COST more. Tiles that hold too many of the
    layout's cells never pay."""
    key = (kernel, head_dim, batch, heads, score is not None)
    return per_object(_wide, layout, (*key, device), lambda: _wide_schedule_pays(layout, *key, device))


# id(layout) -> {(kernel, head dim, batch, heads, score mod?, device) -> bool}: `_wide_pays`' answers.
_wide: dict[int, dict] = {}


def _wide_schedule_pays(
    layout: BlockLayout, kernel: str, head_dim: int, batch: int, heads: int, score: bool, device: int
) -> bool:
    choice = (kernel, head_dim, devices.max_shared(device), score, plan.rule_mode(layout) == "bits")
    elementwise = plan.elementwise_rule(layout)
    narrow = tuning.tile_config(*choice, elementwise=elementwise)
    wide = tuning.tile_config(*choice, wide=True, elementwise=elementwise)
    if wide == narrow or plan.tile_cells(*wide[:2], layout.block_size) > plan.MAX_CELLS:
        return False
    sms, padded = devices.sm_count(device), tuning.pad_head_dim(head_dim)

    def span(tiles, partial_cost=0) -> float:
        counts = plan.visits(layout, *tiles[:2], partial_cost)
        ctas = min(batch * heads * counts.shape[2], sms)
        return schedule.makespan(counts, batch, heads, ctas, _FORWARD_GROUP * sms, ctas)

    return tuning.WIDE_TILE_COST[padded] * span(wide, tuning.WIDE_PARTIAL_COST[padded]) < span(narrow)


# The arrays a Hopper backward pass copies by TMA, in the order of its descriptor arguments.
_BACKWARD_MAPS = ("q", "k", "v", "dout")


def _tma_rows(tiles, names) -> dict:
    """A Hopper pass's TMA descriptors, in argument order: each array's rows a copy, a query tile of q and
    dout, a key tile of k and v."""
    return {name: tiles[0] if name in ("q", "dout") else tiles[1] for name in names}


class _Like:
    """What binding a pass reads of an array (shape, strides, dtype), without the array: a stand-in for one
    not made yet (an output, the backward's dout; C-contiguous unless `strides` are given), or the
    description of one that a kept launch must not keep alive."""

    def __init__(self, shape: tuple, dtype: str, strides: tuple | None = None):
        self.shape, self.dtype = tuple(shape), dtype
        self.strides = contiguous_strides(shape) if strides is None else tuple(strides)


def _bound_arrays(names: tuple, given: dict, made: dict) -> dict:
    """What a pass binds of each array, by name in `ARRAYS` order: the description of those `given` (not
    None), else the stand-ins `made`. Descriptions only: a kept Forward or Backward must not keep the arrays
    it was made from (a forward's tensors) alive."""
    bound = {}
    for name in names:
        array = given.get(name)
        bound[name] = made[name] if array is None else _Like(array.shape, array.dtype, array.strides)
    return bound


def forward(
    q,
    k,
    v,
    out,
    lse,
    layout: BlockLayout,
    scale: float,
    *,
    score_mod=None,
    tiles: tuple[int, int, int] | None = None,
    precision: str = "high",
):
    """Launches the forward kernel: writes `out` [B, Hq, Sq, D] and `lse` [B, Hq, Sq] (float32).

    `score_mod` is a traced `cusparseattn.trace.ScoreMod` or None; `tiles` (TILE_M, TILE_N, NWARPS)
    overrides the portable kernel's tile table, for tuning; `precision` is float32's (`build.PRECISIONS`).
    On an H100/H200 the Hopper kernel runs where `hopper_reasons` allows it.
    """
    launch = Forward(
        q, k, v, layout, scale, score_mod=score_mod, tiles=tiles, out=out, lse=lse, precision=precision
    )
    launch.run(q, k, v, out, lse, layout)


class Forward:
    """The forward's launch for arrays described as `q`, `k`, `v`, `out` and `lse` are (shapes, strides,
    dtype, device, address mod 16; `out` and `lse` C-contiguous unless given), over a layout, scale and
    score mod: the kernel, its tables, grid and packed parameters, made once. `run` launches it on any
    arrays described the same way; PyTorch's eager calls keep one per call signature, so that a repeated
    call only writes addresses and launches. `precision`: float32's (`build.PRECISIONS`), ignored for the
    others."""

    def __init__(
        self,
        q,
        k,
        v,
        layout: BlockLayout,
        scale: float,
        *,
        score_mod=None,
        tiles=None,
        out=None,
        lse=None,
        precision="high",
    ):
        import cupy

        precision = _precision(precision, q.dtype)

        batch, heads_q = q.shape[:2]
        self.device = device = q.device[1]
        portable = tiles or devices.hopper_reasons(q, k, v, out=out, precision=precision)
        kernel = "forward" if portable else "forward_sm90"
        # float32's Hopper forward reads V's transposed copy (transpose.cu), made first into a scratch.
        transposed = kernel == "forward_sm90" and q.dtype == "float32"
        itemsize = build.DTYPES[q.dtype]
        # The tables' uploads, on the stream of the first launch that reads them.
        with cupy.cuda.Device(device), cupy_stream(q.stream):
            bind_device(device)
            score = score_tables(score_mod, device)
            dynamic = isinstance(layout, DynamicLayout)
            wide = not (dynamic or transposed) and _wide_pays(
                kernel, layout, q.shape[3], batch, heads_q, device, score
            )
            tiles = tiles or _tiles(kernel, layout, q.shape[3], device, score, wide, q.dtype, precision)
            tables = _tables(layout, tiles, device, _sizes(q, k))
            # A dynamic layout's tables are filled at each run from its arrays (`run`'s layout).
            self.dynamic = tables if dynamic else None
            rows, work, splits = {}, None, 0
            if kernel == "forward_sm90":  # persistent: one CTA per SM walks its part of the schedule
                ctas = min(batch * heads_q * tables.plan.tiles_q, devices.sm_count(device))
                work = tables.work(batch, heads_q, ctas, _FORWARD_GROUP * devices.sm_count(device), ctas)
                grid = (ctas, 1, 1)
                # out is stored in a consumer's 64 rows (forward_sm90.cu); V's transposed copy is read
                # all its rows (head dims) and a key tile's panels at a time
                rows = {"q": tuning.forward_q_rows(q.shape[3], tiles, itemsize), "k": tiles[1]}
                if transposed:
                    rows["vt"] = _copy_box(q.shape[3], tiles[1])
                else:
                    rows["v"] = tiles[1]
                rows["out"] = 64
                splits = work["split_ptr"].size - 1
            else:
                grid = (tables.plan.tiles_q, heads_q, batch)
            made = {"out": _Like(q.shape, q.dtype), "lse": _Like(q.shape[:3], "float32")}
            names = ARRAYS[:5]
            # Split rows' parts go to a scratch (`stats`), a slot of TILE_M lse and then [TILE_M, D] outputs
            # (fp32) each; a combine pass then writes those rows.
            if splits:
                names += ("stats",)
                made["stats"] = _Like((work["parts"].shape[0], tiles[0], q.shape[3] + 1), "float32")
            if transposed:
                names += ("vt",)
                made["vt"] = _Like(transposed_shape(k.shape), "float32")
            # The float32 scratches a run makes, in the order bound: split rows' parts, V's transposed copy.
            self.scratches = tuple(made[n].shape for n in names[5:])
            arrays = _bound_arrays(names, dict(q=q, k=k, v=v, out=out, lse=lse), made)
            main = make_pass(kernel, grid, tables, score, scale, tiles, work, q=q, k=k, precision=precision)
            self.launches = [main.bind(arrays, rows)]
            if transposed:
                copy = _transpose_pass(tables, scale, q, k, [made["vt"].shape])
                self.launches.insert(0, copy.bind(arrays, {}))
            if splits:  # a warp for each query row of each split row (forward_combine.cu)
                edges = tuning.edge_tiles(tiles)
                grid = (splits, edges[0] // edges[2], 1)
                combine = make_pass("forward_combine", grid, tables, None, scale, edges, work, q=q, k=k)
                self.launches.append(combine.bind(arrays, {}))
        # What a caller that makes the arrays itself makes for `launch`, C-contiguous: out, lse, the scratches
        # (shape, dtype name each). None when out or lse were given: the launches are bound to theirs.
        # A dynamic layout's launches need its arrays: no raw-address launch for them.
        contiguous = out is None and lse is None and self.dynamic is None
        self.made = tuple((made[n].shape, made[n].dtype) for n in names[3:]) if contiguous else None

    def run(self, q, k, v, out, lse, layout=None) -> None:
        """Writes `out` and `lse` on q's stream; `layout`: the call's, where the launch was made for a
        dynamic one's signature."""
        addresses = (q.data_ptr, k.data_ptr, v.data_ptr, out.data_ptr, lse.data_ptr)
        # Each scratch lives until the launches are queued: one freed before the next is made would be
        # handed out again as that one.
        scratches = [scratch(q, shape, self.device) for shape in self.scratches]
        addresses += tuple(s.data_ptr for s in scratches)
        run_launches(self.device, self._launches(layout), q.stream, addresses)

    def _launches(self, layout) -> list:
        if self.dynamic is None:
            return self.launches
        return [_Refresh(self.dynamic, layout), *self.launches]

    def launch(self, stream: int, addresses: tuple) -> None:
        """Launches on `stream` (a raw handle) over arrays at these addresses: q, k, v, then those of
        `made`."""
        run_launches(self.device, self.launches, stream, addresses)

    def run_at(self, stream: int, addresses: tuple, layout=None) -> None:
        """Writes out and lse on `stream` (a raw handle) over arrays at these addresses: q, k, v, out, lse,
        for a caller that lends its buffers and no allocator (XLA): its scratches come from CuPy's pool.
        `layout` as `run`'s."""
        scratches = [pool_scratch(stream, shape, self.device) for shape in self.scratches]  # as run's
        addresses += tuple(s.data.ptr for s in scratches)
        run_launches(self.device, self._launches(layout), stream, addresses)


def transposed_shape(shape) -> tuple[int, int, int, int]:
    """The transposed copy that float32's Hopper passes read (transpose.cu) of an array of this shape
    [B, H, S, D]: [B, H, D, S padded to 32], whole panels of TF32's swizzled rows."""
    batch, heads, seq, head_dim = shape
    width = tma.panel(build.DTYPES["float32"])
    return batch, heads, head_dim, -(-seq // width) * width


def _copy_box(head_dim: int, rows: int) -> tuple[int, int]:
    """The TMA box (rows, panels) of a tile of `rows` rows of a transposed copy: all its rows (the head dims),
    the tile's panels."""
    return head_dim, rows // tma.panel(build.DTYPES["float32"])


def _transpose_pass(tables, scale: float, q, k, shapes: list):
    """The pass that makes the transposed copies of these shapes (transpose.cu: V's, or K's, Q's and dO's),
    a CTA for each 32 rows of 32 head dims of each head: heads on y and the batch on z, as in every pass."""
    blocks = tuning.tile_config("transpose", q.shape[3], itemsize=4)  # rows, head dims, warps
    rows, heads = max(shape[3] for shape in shapes), sum(shape[1] for shape in shapes)
    grid = (rows // blocks[0] * (q.shape[3] // blocks[1]), heads, q.shape[0])
    return make_pass("transpose", grid, tables, None, scale, blocks, q=q, k=k)


# The backward's statistics scratch pads the query rows to whole tiles of every pass (the Hopper dK/dV pass
# copies a tile's statistics whole).
_STATS_ROWS = 128


def stats_shape(q_shape, device: int, dtype: str = "bfloat16") -> tuple[int, int, int, int]:
    """The backward's float32 scratch for queries of this shape and dtype on this GPU: [B, Hq, 2, Sq padded
    to 128] (per query row lse * log2(e), then rowsum(dout * out); written by the dQ pass for the dK/dV pass).
    Where the fused backward may run (`fused_backward`), D + 1 rows more: its fp32 dQ sums, then a counter
    per query tile."""
    batch, heads, seq, head_dim = q_shape
    rows = 2 + (head_dim + 1 if fused_backward(head_dim, device, dtype) else 0)
    return batch, heads, rows, -(-seq // _STATS_ROWS) * _STATS_ROWS


def fused_backward(head_dim: int, device: int, dtype: str = "bfloat16") -> bool:
    """Whether a Hopper backward of this head dim and dtype on this GPU runs fused (unless
    CUSPARSEATTN_FUSED_BACKWARD=0): dK, dV and dQ in one pass, between a statistics pass and a pass that
    rounds dQ. Half precision only: float32 takes the dQ and dK/dV passes."""
    return (
        env.fused_backward()
        and dtype != "float32"
        and head_dim in tuning.HOPPER_HEAD_DIMS
        and not devices.hopper_device_reasons(device)
    )


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    stats,
    layout: BlockLayout,
    scale: float,
    *,
    score_mod=None,
    precision: str = "high",
):
    """Launches the backward kernels: writes `dq` [B, Hq, Sq, D], `dk` and `dv` [B, Hkv, Sk, D], and `stats`
    (float32 scratch of `stats_shape(q.shape, device, q.dtype)`, from the first kernel to the later ones).
    `precision`: float32's (`build.PRECISIONS`).

    Each gradient element is written once (no atomics), and the fused backward adds dQ's parts
    in an order fixed per query tile: the results are bitwise reproducible (unless
    CUSPARSEATTN_DETERMINISTIC=0, when the fused backward adds them as they come).
    """
    arrays = dict(dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv, stats=stats)
    Backward(q, k, v, layout, scale, score_mod=score_mod, precision=precision, **arrays).run(
        dout, q, k, v, out, lse, dq, dk, dv, stats, layout
    )


def _backward_path(q, k, v, precision: str, dout=None, dk=None, dv=None) -> tuple[bool, bool]:
    """(Hopper passes, fused) of a backward for arrays described as these (those not given: C-contiguous),
    float32's at `precision`."""
    hopper = not devices.hopper_reasons(q, k, v, dout, precision=precision)
    # The fused pass writes dK and dV through TMA too: given ones it cannot write take the two passes.
    written = (("dk", dk), ("dv", dv))
    writable = not any(devices.tma_reasons(name, t) for name, t in written if t is not None)
    return hopper, hopper and writable and fused_backward(q.shape[3], q.device[1], q.dtype)


def _backward_kernels(layout, q, device: int, score, hopper: bool, fused: bool, precision: str) -> list:
    """(kernel, tiles) of each pass of a backward over `layout` for arrays described as `q`, in launch order:
    the fused backward's statistics, fused and dQ-rounding passes (`fused_backward`), or the dQ then the
    dK/dV pass (Hopper's where `hopper`). `score`: whether a score mod is given."""
    head_dim = q.shape[3]
    if fused:
        tiles = _tiles("backward_sm90", layout, head_dim, device, score)
        edges = tuning.edge_tiles(tiles)
        return [("backward_stats", edges), ("backward_sm90", tiles), ("backward_dq_convert", edges)]
    suffix = "_sm90" if hopper else ""
    kernels = ("backward_dq" + suffix, "backward_dkdv" + suffix)
    return [(n, _tiles(n, layout, head_dim, device, score, False, q.dtype, precision)) for n in kernels]


def prefetch_backward(q, k, v, layout: BlockLayout, score_mod=None, precision: str = "high") -> None:
    """Starts compiling, on background threads (`build.prefetch`), the kernels that `Backward` takes for
    arrays described as these and a dout laid out as q, over a static layout: a training step's first
    forward calls it before it compiles its own kernel, so that its backward finds them built."""
    if isinstance(layout, DynamicLayout):
        return
    device, precision = q.device[1], _precision(precision, q.dtype)
    hopper, fused = _backward_path(q, k, v, precision)
    score = score_spec(score_mod)
    rule = plan.kernel_rule(layout)
    for kernel, tiles in _backward_kernels(layout, q, device, score, hopper, fused, precision):
        prefetch(device, *kernel_spec_args(kernel, q, tiles, rule, score, precision=precision))


class Backward:
    """The backward's passes (dQ, then dK/dV, in float32 on Hopper after the copies of K, Q and dO that
    they read transposed; or the fused backward's three, `fused_backward`) for arrays described as `q`, `k`
    and `v` and the optional others are (those not given: C-contiguous, shaped as q or k), over a layout,
    scale and score mod (tables, tiles, grids, packed parameters), made once: `run` launches them on any
    arrays described the same way. PyTorch's eager calls keep one per call signature, made in the first
    forward.

    dout may come laid out as the forward's caller left its output's gradient (a transposed view is
    common): the passes are bound to each dout layout as it comes. The Hopper passes read dout through TMA:
    without `dout` (not known yet) they are chosen for q, k and v, and `accepts` tells whether a dout fits
    them.
    """

    def __init__(
        self, q, k, v, layout: BlockLayout, scale: float, *, score_mod=None, precision="high", **arrays
    ):
        import cupy

        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device[1]
        self.precision = _precision(precision, q.dtype)
        self.stats_shape = stats_shape(q.shape, self.device, q.dtype)
        stats = arrays.get("stats")
        if stats is not None and tuple(stats.shape) != self.stats_shape:
            # The fused backward writes past the statistics: a scratch shaped under
            # CUSPARSEATTN_FUSED_BACKWARD=0, or for a GPU without the Hopper kernels, is short.
            raise ValueError(
                f"stats must have the shape stats_shape(q.shape, device) = {self.stats_shape}, got "
                f"{tuple(stats.shape)} (CUSPARSEATTN_FUSED_BACKWARD changes the rows: set it before making "
                "the scratch)"
            )
        given = (arrays.get(name) for name in ("dout", "dk", "dv"))
        self.hopper, fused = _backward_path(q, k, v, self.precision, *given)
        self.dynamic = isinstance(layout, DynamicLayout)
        made = {name: _Like(q.shape, q.dtype) for name in ("out", "dout", "dq")}
        made |= {name: _Like(k.shape, k.dtype) for name in ("dk", "dv")}
        made |= {"lse": _Like(q.shape[:3], "float32"), "stats": _Like(self.stats_shape, "float32")}
        names = ARRAYS[: ARRAYS.index("stats") + 1]
        # float32's Hopper passes read K's, Q's and dO's transposed copies (transpose.cu), made first into
        # scratches.
        tf32 = self.hopper and q.dtype == "float32"
        copies = {"kt": k.shape, "qt": q.shape, "dot": q.shape} if tf32 else {}
        made |= {name: _Like(transposed_shape(shape), "float32") for name, shape in copies.items()}
        self.transposed = tuple(made[name].shape for name in copies)
        self._arrays = _bound_arrays(names + tuple(copies), dict(arrays, q=q, k=k, v=v), made)
        # What a caller that makes the arrays itself makes for `launcher`, C-contiguous: dq, dk, dv, stats,
        # then the transposed copies' scratches (shape, dtype name each). None when any output was given: the
        # passes are bound to theirs.
        outputs = ("dq", "dk", "dv", "stats")
        given = any(arrays.get(n) is not None for n in outputs) or self.dynamic
        self.made = None if given else tuple((made[n].shape, made[n].dtype) for n in (*outputs, *copies))
        # The tables' uploads, on the stream of the first launch that reads them (as the forward's).
        with cupy.cuda.Device(self.device), cupy_stream(q.stream):
            bind_device(self.device)
            score = score_tables(score_mod, self.device)
            passes = self._fused if fused else self._two_passes
            kernels = _backward_kernels(layout, q, self.device, score, self.hopper, fused, self.precision)
            self._tables = []  # a dynamic layout's, filled at each run
            self._passes = passes(q, k, layout, score, scale, kernels)
        # The passes bound to each dout layout, by dout's strides: `Pass.bind` keeps them too, but its key
        # (every array's strides) costs more to build than a launch on the prepared path may spend.
        self._bound: dict[tuple, tuple[Bound, ...]] = {}

    def _two_passes(self, q, k, layout: BlockLayout, score, scale: float, kernels: list) -> list:
        """The dQ pass (which writes the statistics), then the dK/dV pass, after the pass that makes their
        transposed copies where they read some: (pass, TMA rows) each."""
        batch, heads_q, _, head_dim = q.shape
        passes = []
        for kernel, tiles in kernels:
            tables = _tables(layout, tiles, self.device, _sizes(q, k))
            if self.dynamic and tables not in self._tables:
                self._tables.append(tables)
            dq_pass = kernel.startswith("backward_dq")
            if dq_pass:
                grid = (tables.plan.tiles_q, heads_q, batch)
            else:
                grid = (tables.plan.tiles_k, k.shape[1] * tuning.dkdv_splits(head_dim), batch)
            rows = _tma_rows(tiles, _BACKWARD_MAPS) if self.hopper else {}
            if self.transposed:  # K's copy a key tile at a time, Q's and dO's a query tile
                names, tile = (("kt",), tiles[1]) if dq_pass else (("qt", "dot"), tiles[0])
                rows |= dict.fromkeys(names, _copy_box(head_dim, tile))
            made = make_pass(kernel, grid, tables, score, scale, tiles, q=q, k=k, precision=self.precision)
            passes.append((made, rows))
        if self.transposed:
            passes.insert(0, (_transpose_pass(tables, scale, q, k, list(self.transposed)), {}))
        return passes

    def _fused(self, q, k, layout: BlockLayout, score, scale: float, kernels: list) -> list:
        """The fused backward's passes: the statistics (and zeroed counters), the persistent pass over the
        key tiles' columns, the rounding of dQ. Under CUSPARSEATTN_DETERMINISTIC=0 the statistics pass zeroes
        the dQ sums too, and the fused pass adds its parts in as they come."""
        batch, heads_q = q.shape[:2]
        unordered = not env.deterministic()
        (stats, edges), (kernel, tiles), (convert, _) = kernels
        tables = _tables(layout, tiles, self.device, _sizes(q, k))
        if self.dynamic:
            self._tables.append(tables)
        items = batch * k.shape[1] * tables.plan.tiles_k
        ctas = min(items, devices.sm_count(self.device))
        group_items = _FUSED_BACKWARD_GROUP * devices.sm_count(self.device)
        columns = tables.columns(batch, heads_q, heads_q // k.shape[1], ctas, group_items)
        # dK and dV go out as each consumer warpgroup's 64 keys.
        rows = _tma_rows(tiles, _BACKWARD_MAPS) | dict.fromkeys(("dk", "dv"), 64)

        def plain(kernel: str, grid) -> tuple:
            return make_pass(kernel, grid, tables, None, scale, edges, q=q, k=k, unordered=unordered), {}

        grid = (ctas, 1, 1)
        fused = make_pass(kernel, grid, tables, score, scale, tiles, columns, q=q, k=k, unordered=unordered)
        return [
            plain(stats, (self.stats_shape[3] // tiles[0], heads_q, batch)),
            (fused, rows),
            plain(convert, (tables.plan.tiles_q, heads_q, batch)),
        ]

    def accepts(self, dout) -> bool:
        """Whether the passes can take this dout holder: shaped and typed like q, on its device, and readable
        by the kernels' copies."""
        if (dout.shape, dout.dtype, dout.device) != (self.shape, self.dtype, ("cuda", self.device)):
            return False
        return not devices.tensor_reasons(("dout", dout)) and not (
            self.hopper and devices.tma_reasons("dout", dout)
        )

    def passes(self, dout) -> tuple[Bound, ...]:
        """The passes bound to arrays described as the prepared ones and this `dout` (which it accepts)."""
        passes = self._bound.get(dout.strides)
        if passes is None:
            arrays = dict(self._arrays, dout=dout)
            passes = self._bound[dout.strides] = tuple(p.bind(arrays, rows) for p, rows in self._passes)
        return passes

    def launcher(self, dout):
        """``launch(stream, addresses)``: the passes for douts described as this one (which it accepts) on a
        raw stream handle, over arrays at these addresses: q, k, v, out, lse, dout, then those of `made`."""
        return functools.partial(run_launches, self.device, self.passes(dout))

    def run(self, dout, q, k, v, out, lse, dq, dk, dv, stats, layout=None) -> None:
        """Writes `dq`, `dk`, `dv` and the scratch `stats` on dout's stream; `layout`: the call's, where the
        passes were made for a dynamic one's signature."""
        addresses = tuple(a.data_ptr for a in (q, k, v, out, lse, dout, dq, dk, dv, stats))
        scratches = [scratch(q, shape, self.device) for shape in self.transposed]  # as Forward.run's
        addresses += tuple(s.data_ptr for s in scratches)
        self._run(dout.stream, addresses, dout, layout)

    def run_at(self, stream: int, addresses: tuple, dout, layout=None) -> None:
        """`run` on `stream` (a raw handle) over arrays at these addresses, in `launcher`'s order up to
        stats, for douts described as `dout` (which it accepts), for a caller that lends its buffers and no
        allocator (XLA): the transposed copies' scratches come from CuPy's pool."""
        scratches = [pool_scratch(stream, shape, self.device) for shape in self.transposed]  # as run's
        addresses += tuple(s.data.ptr for s in scratches)
        self._run(stream, addresses, dout, layout)

    def _run(self, stream: int, addresses: tuple, dout, layout) -> None:
        launches = [*(_Refresh(t, layout) for t in self._tables), *self.passes(dout)]
        run_launches(self.device, launches, stream, addresses)


def classify_blocks(
    rule, batch: int, heads: int, seq_q: int, seq_k: int, block_size: tuple[int, int], device: int
):
    """For a token rule with a C expression: ``(any, all)``, bool ``[batch, heads, blocks_q, blocks_k]``,
    whether the rule lets any / every token pair of each layout block through, evaluated on the GPU (one CTA
    per block). Returns host arrays; synchronises with the device."""
    import cupy

    bq, bk = block_size
    shape = (batch, heads, -(-seq_q // bq), -(-seq_k // bk))
    with cupy.cuda.Device(device):
        function = build.load(build.RuleSpec(rule.whole), device)
        any_, all_ = cupy.empty(shape, cupy.uint8), cupy.empty(shape, cupy.uint8)
        params = np.zeros((), build.MASK_PARAMS)
        params["any"], params["all"] = any_.data.ptr, all_.data.ptr
        params["seq_q"], params["seq_k"], params["block_q"], params["block_k"] = seq_q, seq_k, bq, bk
        params["blocks_q"], params["blocks_k"], params["heads"] = shape[2], shape[3], heads
        tables = set_rule(params, rule)
        function((shape[3], shape[2], batch * heads), (256, 1, 1), (params[()],))
        result = cupy.asnumpy(any_).astype(bool), cupy.asnumpy(all_).astype(bool)
        del tables  # only once the copies above have waited for the kernel that reads them
        return result
