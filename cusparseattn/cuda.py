"""Launching the CUDA kernels on the caller's device and stream.

Host work per layout (the tile plan, its upload) happens once per (layout, tile shape, device) and is cached;
a call then only packs the parameter struct and launches. Nothing here synchronises the device.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import weakref

import numpy as np

from . import build, env, plan, schedule, tma
from .arrays import CupyTensor, contiguous_strides
from .layout import BlockLayout

MIN_COMPUTE_CAPABILITY = 80  # mma.sync with bf16, cp.async, ldmatrix


def available() -> list[str]:
    """Why the CUDA kernels cannot run in this process (empty when they can)."""
    try:
        import cupy
    except ImportError as err:
        return [f"CuPy is not installed ({err}); install cusparseattn[cuda12] or cusparseattn[cuda13]"]
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError without a driver; any import-time failure of the runtime
        return [f"no CUDA device is usable ({type(err).__name__}: {err})"]
    if count == 0:
        return ["no CUDA GPU is visible"]
    return []


MAX_HEAD_DIM = 256


def reasons(dtype: str, head_dim: int, scale: float = 1.0) -> list[str]:
    """Why the kernels cannot take inputs of this dtype, head dim and scale (empty when they can)."""
    out = []
    if not scale > 0:
        # Masked scores are -inf before scaling: a scale <= 0 would turn them into +inf or NaN.
        out.append(f"the CUDA kernels take a positive scale, got {scale}")
    if dtype not in build.DTYPES:
        out.append(f"the CUDA kernels take float16 and bfloat16 inputs, got {dtype}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        out.append(
            f"the CUDA kernels take head dims that are multiples of 8 up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    return out


def current_device() -> int:
    """The calling thread's current CUDA device (``torch.cuda.set_device`` and ``cupy.cuda.Device`` both set
    it): where work that no array places (a layout's classification) runs."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


@functools.cache
def compute_capability(device: int) -> int:
    """The device's compute capability as an integer (90 for 9.0), looked up once per process."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


@functools.cache
def max_shared(device: int) -> int:
    """The most dynamic shared memory one block may opt into on this device, in bytes."""
    import cupy

    return int(cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.cache
def sm_count(device: int) -> int:
    """The device's streaming multiprocessors: a persistent kernel's grid."""
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


def tensor_reasons(*tensors) -> list[str]:
    """Why these device arrays cannot be read by the kernels' asynchronous copies (empty when they can): rows
    of [B, H, S, D] arrays move in 16-byte pieces, the float32 [B, H, S] vectors (lse) element by element."""
    out = []
    for name, t in tensors:
        rows = t.ndim == 4
        align = 16 if rows else 4
        if t.data_ptr % align:
            out.append(f"{name}'s data is not {align}-byte aligned (address {t.data_ptr:#x})")
        if rows and any(s % 8 for s in t.strides[:3]):
            out.append(f"{name}'s strides {t.strides} (in elements) are not multiples of 8")
        if t.strides[-1] != 1:
            out.append(f"{name}'s last dimension is not contiguous (strides {t.strides})")
    return out


def device_reasons(device: int) -> list[str]:
    """Why the kernels cannot run on this GPU (empty when they can)."""
    cc = compute_capability(device)
    if cc < MIN_COMPUTE_CAPABILITY:
        return [f"cuda:{device} has compute capability {cc // 10}.{cc % 10}; the kernels need 8.0 or newer"]
    return []


def hopper_device_reasons(device: int) -> list[str]:
    """Why the Hopper kernels (TMA, wgmma) cannot run on this GPU (empty when they can)."""
    if not env.hopper():
        return ["CUSPARSEATTN_HOPPER=0 turns the Hopper kernels off"]
    cc = compute_capability(device)
    if cc != 90:
        return [f"the Hopper kernels need compute capability 9.0, cuda:{device} has {cc // 10}.{cc % 10}"]
    return []


def hopper_reasons(q, k, v, dout=None, out=None) -> list[str]:
    """Why a pass cannot take the Hopper kernels for these device arrays (dout: the backward's; out: the
    forward's, which it stores by TMA, where the caller gives one; empty when it can); it then runs the
    portable ones."""
    if reasons := hopper_device_reasons(q.device[1]):
        return reasons
    if q.shape[3] not in build.HOPPER_HEAD_DIMS:
        return [f"the Hopper kernels take head dims {build.HOPPER_HEAD_DIMS}, got {q.shape[3]}"]
    named = (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out))
    return [reason for name, t in named if t is not None for reason in _tma_reasons(name, t)]


def _tma_reasons(name: str, t) -> list[str]:
    return [
        f"TMA cannot copy {name}: {reason}"
        for reason in tma.reasons(tuple(t.shape), tuple(t.strides), tma.ITEMSIZE, t.data_ptr % 16)
    ]


# ---- per-layout device tables -------------------------------------------------------------------------
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
        self.rule_expr = rule.kernel_expr if rule else None
        # The parameter fields that depend on the layout alone; a launch copies this and adds its arrays.
        base = np.zeros((), build.PARAMS)
        for name, array in self.arrays.items():
            base[name] = array.data.ptr
        base["layout_batch"], base["layout_heads"] = layout.batch, layout.heads
        base["tiles_q"], base["tiles_k"] = p.tiles_q, p.tiles_k
        for name in ("sub_q_shift", "sub_k_shift", "sub_k_count"):
            base[name] = getattr(p, name)
        self.rule_arrays = _set_rule(base, rule)
        # Kernels evaluate whole tiles, up to a tile (at most 256 tokens) past a sequence's end.
        base["rule_narrow"] = rule is not None and rule.narrow(max(layout.seq_q, layout.seq_k) + 256)
        base["q_origin"], base["k_origin"] = layout.origin
        # As bytes: a launch starts from a copy of them (copying a NumPy struct costs 30 us).
        self.params = base.tobytes()
        self.layout_lines = (layout.batch, layout.heads)
        self._work: dict[tuple, dict] = {}
        self.passes: dict[tuple, _Pass] = {}  # `_pass`: the passes over these tables, by call sizes

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


def _set_rule(params: np.ndarray, rule) -> list:
    """Writes a token rule's parameters and its uploaded arrays (int32) into a Params-like struct's rule_p and
    rule_a; returns the device arrays, which must live as long as the struct is launched with."""
    import cupy

    if rule is None:
        return []
    arrays = [cupy.asarray(np.ascontiguousarray(a, dtype=np.int32)) for a in rule.arrays]
    params["rule_p"][: len(rule.params)] = rule.params
    params["rule_a"][: len(arrays)] = [a.data.ptr for a in arrays]
    return arrays


def _per_object(cache: dict, obj, key, make):
    """``cache[id(obj)][key]``, made on first use; the entry goes when `obj` does."""
    entries = cache.get(id(obj))
    if entries is None:
        entries = cache[id(obj)] = {}
        weakref.finalize(obj, cache.pop, id(obj), None)
    if key not in entries:
        entries[key] = make()
    return entries[key]


def device_tables(layout: BlockLayout, tile_m: int, tile_n: int, device: int) -> DeviceTables:
    return _per_object(
        _tables, layout, (tile_m, tile_n, device), lambda: DeviceTables(layout, tile_m, tile_n)
    )


# id(score mod) -> {device -> ScoreTables}
_scores: dict[int, dict] = {}


class ScoreTables:
    """A score mod's parameters and captured arrays, resident on one device: the Params fields it sets, as
    the bytes of their span (score_ip, score_fp, score_a lie in a row)."""

    def __init__(self, score_mod):
        import cupy

        self.spec = (score_mod.c_expr, score_mod.c_grad)
        self.arrays = [cupy.asarray(np.ascontiguousarray(a)) for a in score_mod.arrays]
        ip, fp = score_mod.int_params, score_mod.float_params
        fields = np.zeros((), build.PARAMS)
        fields["score_ip"] = ip + (0,) * (8 - len(ip))
        fields["score_fp"] = fp + (0.0,) * (8 - len(fp))
        fields["score_a"] = [a.data.ptr for a in self.arrays] + [0] * (4 - len(self.arrays))
        self.fields = fields.tobytes()[_SCORE]


def score_tables(score_mod, device: int) -> ScoreTables | None:
    if score_mod is None:
        return None
    return _per_object(_scores, score_mod, device, lambda: ScoreTables(score_mod))


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, for CuPy's `Stream.from_external`."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _stream(handle: int):
    """The framework's current stream as a CuPy stream (0 is the legacy default stream). A program makes
    streams without end (one per ``torch.cuda.Stream()``); the last 64 are kept."""
    import cupy

    if not handle:
        return cupy.cuda.Stream.null
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


_bound = threading.local()


def _bind(device: int) -> None:
    """Makes the device's primary context current on this thread (once per thread and device). The runtime
    binds it lazily, at its first call that needs one; the driver calls made here (TMA encoding, launches)
    need it from the start, and a thread that PyTorch runs the backward on may not have made such a call."""
    devices = _bound.__dict__.setdefault("devices", set())
    if device not in devices:
        import cupy

        cupy.cuda.runtime.setDevice(device)  # inside `with Device(device)`: the device stays the current one
        devices.add(device)


def _offset(field: str) -> int:
    return build.PARAMS.fields[field][1]


# The arrays a pass reads and writes, in the order of their pointers, which open Params.
ARRAYS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "stats")
# The Params field of each array's first stride, and how many strides it has.
_STRIDES = {
    "q": ("q_sb", 3), "k": ("k_sb", 3), "v": ("v_sb", 3), "out": ("o_sb", 3), "lse": ("lse_sb", 2),
    "dout": ("do_sb", 3), "dq": ("dq_sb", 3), "dk": ("dk_sb", 3), "dv": ("dv_sb", 3),
    "stats": ("stats_sb", 3),
}  # fmt: skip
_SIZES = _offset("seq_q")  # seq_q, seq_k, heads_q, group: four int32 in a row
_SCALE = _offset("scale")
_SCORE = slice(_offset("score_ip"), _offset("score_a") + 4 * 8)
_WORK_COUNT = _offset("work_count")
_DQ_UNORDERED = _offset("dq_unordered")
MAP_BYTES = tma.TENSOR_MAP.itemsize  # a TMA descriptor, as a kernel argument


@functools.lru_cache(maxsize=256)
def _kernel(device: int, *spec_args):
    """(compiled kernel, block, shared bytes) of build.KernelSpec(*spec_args) on a device: one dictionary
    lookup per launch once it is loaded."""
    spec = build.KernelSpec(*spec_args)
    return build.load(spec, device), (spec.threads, 1, 1), spec.shared_bytes


class _Pass:
    """One kernel's launches for one call's sizes: the kernel, its geometry and the parameters that do not
    change from call to call (tables, sizes, scale, schedule) packed ahead. `work`: a persistent pass's
    schedule on the device, by Params field (`DeviceTables.work`, `DeviceTables.columns`). `bind` makes its
    launches over arrays of given strides. A `build.PLAIN` kernel is built without the layout's rule."""

    def __init__(
        self, kernel: str, grid, tables: DeviceTables, score, scale: float, tiles, work, unordered, q, k
    ):
        self.kernel, self.grid, self.tiles = kernel, grid, tiles
        rule = ("none", None) if kernel in build.PLAIN else (tables.plan.rule_mode, tables.rule_expr)
        spec_args = (kernel, q.dtype, q.shape[3], tiles, *rule, score and score.spec)
        # The Hopper forward's build for split rows where its deal has some (the others keep their code).
        split_rows = kernel == "forward_sm90" and work["split_ptr"].size > 1
        self.function, self.block, self.shared = _kernel(q.device[1], *spec_args, split_rows)
        # The device arrays that the parameters point to live as long as this pass.
        self.arrays = (tables, score, work)
        buffer = bytearray(tables.params)
        if score is not None:
            buffer[_SCORE] = score.fields
        heads_q, heads_k = q.shape[1], k.shape[1]
        struct.pack_into("<4i", buffer, _SIZES, q.shape[2], k.shape[2], heads_q, heads_q // heads_k)
        struct.pack_into("<f", buffer, _SCALE, scale)
        if work is not None:
            for field, array in work.items():
                struct.pack_into("<Q", buffer, _offset(field), array.data.ptr)
            struct.pack_into("<i", buffer, _WORK_COUNT, work["work"].size)
        struct.pack_into("<i", buffer, _DQ_UNORDERED, unordered)
        self.params = bytes(buffer)
        self._bound: dict[tuple, _Bound] = {}  # by the arrays' strides (their shapes follow from q's, k's)

    def bind(self, arrays: dict, rows: dict) -> _Bound:
        """Its launches over arrays described as `arrays` are (`_Bound`), made once per layout of them:
        calls that make their launch anew each time (JAX's, the functional API's) take it from here."""
        key = (tuple(tuple(a.strides) for a in arrays.values()), tuple(rows.items()))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = _Bound(self, arrays, rows)
        return bound


class _Bound:
    """A pass's launches over arrays described as `arrays` are (name -> holder, in `ARRAYS` order, any of
    them): the parameters with every stride packed, and the geometry of the TMA descriptors of the `rows`
    arrays (a Hopper kernel's: tiles of ``rows[name]`` rows). A launch's arguments (the parameters with the
    arrays' addresses, then the descriptors) are built once per tuple of addresses and kept, up to `KEPT`,
    all forgotten at once when one more comes: PyTorch's allocator hands the same few addresses back step
    after step, so that a prepared call's launch is one lookup and the driver's call. A prepared call's host
    time is the budget: writing the addresses and descriptors into the arguments at each launch made a
    forward+backward step at S = 4096 wait on the host."""

    KEPT = 64

    def __init__(self, launch: _Pass, arrays: dict, rows: dict):
        # The device arrays its parameters point to (not the pass, which keeps it: no cycle to collect).
        self.kernel, self._arrays = launch.kernel, launch.arrays
        if tuple(arrays) != tuple(name for name in ARRAYS if name in arrays):
            raise ValueError(f"a pass binds arrays of {ARRAYS} in that order, got {tuple(arrays)}")
        params = bytearray(launch.params)
        for name, holder in arrays.items():
            field, ndim = _STRIDES[name]
            struct.pack_into(f"<{ndim}q", params, _offset(field), *holder.strides[:ndim])
        self._params = bytes(params)
        # Params starts with the arrays' pointers in ARRAYS order: those not bound stay 0 (padding bytes).
        last = max(ARRAYS.index(name) for name in arrays)
        self._pointers = "<" + "".join("Q" if name in arrays else "8x" for name in ARRAYS[: last + 1])
        slots = {name: i for i, name in enumerate(arrays)}
        self._maps = tuple(
            (slots[name], (tuple(arrays[name].shape), tuple(arrays[name].strides), arrays[name].dtype, count))
            for name, count in rows.items()
        )
        self._target = (launch.function.kernel.ptr, launch.grid, launch.block, launch.shared)
        self._arguments: dict[tuple, tuple] = {}

    def launch(self, stream: int, addresses: tuple) -> None:
        """Launches on `stream` (a raw handle) over arrays at these addresses (in the order bound)."""
        arguments = self._arguments.get(addresses)
        if arguments is None:
            arguments = self._arguments_at(addresses)
        _launch(*self._target, stream, arguments[0])

    def _arguments_at(self, addresses: tuple) -> tuple:
        """(table of the arguments' addresses, the buffer it points into) for arrays at `addresses`, kept.
        Each is made whole before it is kept and never written again: threads may launch at once."""
        params = bytearray(self._params)
        struct.pack_into(self._pointers, params, 0, *addresses)
        maps = [tma.descriptor(addresses[slot], *geometry) for slot, geometry in self._maps]
        values = ctypes.create_string_buffer(
            bytes(params) + b"".join(maps), len(params) + MAP_BYTES * len(maps)
        )
        base = ctypes.addressof(values)
        table = (ctypes.c_void_p * (1 + len(maps)))(
            base, *(base + len(params) + MAP_BYTES * i for i in range(len(maps)))
        )
        if len(self._arguments) >= self.KEPT:
            self._arguments.clear()
        self._arguments[addresses] = arguments = (table, values)
        return arguments


def _launch(kernel: int, grid, block, shared: int, stream: int, table) -> None:
    """cuLaunchKernel of a loaded kernel (its CUfunction handle) on a raw stream handle; `table` holds the
    address of each argument's bytes, in order (the driver copies them before it returns). CuPy's kernel
    call, which converts each argument, costs more host time a launch than the driver's (docs/tuning.md:
    _launch)."""
    import cupy

    cupy.cuda.driver.launchKernel(kernel, *grid, *block, shared, stream, ctypes.addressof(table), 0)


def _pass(
    kernel: str, grid, tables: DeviceTables, score, scale: float, tiles, work=None, *, q, k, unordered=False
) -> _Pass:
    """The pass of `kernel` over `tables` for these sizes, made once (with a score mod, once a call: its
    tables must not outlive it in the layout's). `unordered`: the fused backward's dQ adds in any order
    (`Backward`)."""
    if score is not None:
        return _Pass(kernel, grid, tables, score, scale, tiles, work, unordered, q, k)
    # The work list lives in the tables as long as they do: its id names it.
    key = (kernel, grid, scale, tiles, id(work), unordered, q.dtype, q.shape, k.shape)
    made = tables.passes.get(key)
    if made is None:
        made = tables.passes[key] = _Pass(kernel, grid, tables, None, scale, tiles, work, unordered, q, k)
    return made


def _tiled_tables(
    kernel: str, layout: BlockLayout, head_dim: int, device: int, score, tiles=None, wide=False
):
    bits = plan.rule_mode(layout) == "bits"
    tiles = tiles or build.tile_config(kernel, head_dim, max_shared(device), score is not None, bits, wide)
    return device_tables(layout, tiles[0], tiles[1], device), tiles


# Items per SM to a group of a persistent pass's deal (schedule.work_order, schedule.column_schedule). The
# forward: the rows in flight at once come from a few heads. The fused backward deals four: the columns of
# more heads are dealt longest first together, and an ordered add waits less for the one ranked before it;
# eight gain little more (docs/tuning.md: _FORWARD_GROUP, _FUSED_BACKWARD_GROUP).
_FORWARD_GROUP, _FUSED_BACKWARD_GROUP = 2, 4


def _wide_pays(
    kernel: str, layout: BlockLayout, head_dim: int, batch: int, heads: int, device: int, score=None
) -> bool:
    """Whether the persistent `kernel`'s wide tiles (build.WIDE_TILES), where `build.tile_config` allows them
    (not with a score mod or bit masks), would finish this call sooner than its default ones: the makespans
    of their schedules (schedule.makespan, as `Forward` deals them), a wide tile weighted by
    build.WIDE_TILE_COST and a partial one by build.WIDE_PARTIAL_COST more. Tiles that hold too many of the
    layout's cells never pay."""
    key = (kernel, head_dim, batch, heads, score is not None)
    return _per_object(_wide, layout, (*key, device), lambda: _wide_schedule_pays(layout, *key, device))


# id(layout) -> {(kernel, head dim, batch, heads, score mod?, device) -> bool}: `_wide_pays`' answers.
_wide: dict[int, dict] = {}


def _wide_schedule_pays(
    layout: BlockLayout, kernel: str, head_dim: int, batch: int, heads: int, score: bool, device: int
) -> bool:
    choice = (kernel, head_dim, max_shared(device), score, plan.rule_mode(layout) == "bits")
    narrow, wide = build.tile_config(*choice), build.tile_config(*choice, wide=True)
    if wide == narrow or plan.tile_cells(*wide[:2], layout.block_size) > plan.MAX_CELLS:
        return False
    sms, padded = sm_count(device), build.pad_head_dim(head_dim)

    def span(tiles, partial_cost=0) -> float:
        counts = plan.visits(layout, *tiles[:2], partial_cost)
        ctas = min(batch * heads * counts.shape[2], sms)
        return schedule.makespan(counts, batch, heads, ctas, _FORWARD_GROUP * sms, ctas)

    return build.WIDE_TILE_COST[padded] * span(wide, build.WIDE_PARTIAL_COST[padded]) < span(narrow)


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
):
    """Launches the forward kernel: writes `out` [B, Hq, Sq, D] and `lse` [B, Hq, Sq] (float32).

    `score_mod` is a traced `cusparseattn.trace.ScoreMod` or None; `tiles` (TILE_M, TILE_N, NWARPS)
    overrides the portable kernel's tile table, for tuning. On an H100/H200 the Hopper kernel runs where
    `hopper_reasons` allows it.
    """
    launch = Forward(q, k, v, layout, scale, score_mod=score_mod, tiles=tiles, out=out, lse=lse)
    launch.run(q, k, v, out, lse)


class Forward:
    """The forward's launch for arrays described as `q`, `k`, `v`, `out` and `lse` are (shapes, strides,
    dtype, device, address mod 16; `out` and `lse` C-contiguous unless given), over a layout, scale and
    score mod: the kernel, its tables, grid and packed parameters, made once. `run` launches it on any
    arrays described the same way; PyTorch's eager calls keep one per call signature, so that a repeated
    call only writes addresses and launches."""

    def __init__(
        self, q, k, v, layout: BlockLayout, scale: float, *, score_mod=None, tiles=None, out=None, lse=None
    ):
        import cupy

        batch, heads_q = q.shape[:2]
        self.device = device = q.device[1]
        kernel = "forward" if tiles or hopper_reasons(q, k, v, out=out) else "forward_sm90"
        # The tables' uploads, on the stream of the first launch that reads them.
        with cupy.cuda.Device(device), _stream(q.stream):
            _bind(device)
            score = score_tables(score_mod, device)
            wide = _wide_pays(kernel, layout, q.shape[3], batch, heads_q, device, score)
            tables, tiles = _tiled_tables(kernel, layout, q.shape[3], device, score, tiles, wide)
            rows, work, splits = {}, None, 0
            if kernel == "forward_sm90":  # persistent: one CTA per SM walks its part of the schedule
                ctas = min(batch * heads_q * tables.plan.tiles_q, sm_count(device))
                work = tables.work(batch, heads_q, ctas, _FORWARD_GROUP * sm_count(device), ctas)
                grid = (ctas, 1, 1)
                # out is stored in a consumer's 64 rows (forward_sm90.cu)
                rows = {"q": build.forward_q_rows(q.shape[3], tiles), "k": tiles[1], "v": tiles[1], "out": 64}
                splits = work["split_ptr"].size - 1
            else:
                grid = (tables.plan.tiles_q, heads_q, batch)
            made = {"out": _Like(q.shape, q.dtype), "lse": _Like(q.shape[:3], "float32")}
            names = ARRAYS[:5]
            # Split rows' parts go to a scratch (`stats`), a slot of TILE_M lse and then [TILE_M, D] outputs
            # (fp32) each; a combine pass then writes those rows.
            self.scratch = (work["parts"].shape[0], tiles[0], q.shape[3] + 1) if splits else None
            if splits:
                names += ("stats",)
                made["stats"] = _Like(self.scratch, "float32")
            arrays = _bound_arrays(names, dict(q=q, k=k, v=v, out=out, lse=lse), made)
            self.launches = [
                _pass(kernel, grid, tables, score, scale, tiles, work, q=q, k=k).bind(arrays, rows)
            ]
            if splits:  # a warp for each query row of each split row (forward_combine.cu)
                edges = build.edge_tiles(tiles)
                grid = (splits, edges[0] // edges[2], 1)
                combine = _pass("forward_combine", grid, tables, None, scale, edges, work, q=q, k=k)
                self.launches.append(combine.bind(arrays, {}))
        # What a caller that makes the arrays itself makes for `launch`, C-contiguous: out, lse, the scratch
        # (shape, dtype name each). None when out or lse were given: the launches are bound to theirs.
        contiguous = out is None and lse is None
        self.made = tuple((made[n].shape, made[n].dtype) for n in names[3:]) if contiguous else None

    def run(self, q, k, v, out, lse) -> None:
        """Writes `out` and `lse` on q's stream."""
        addresses = (q.data_ptr, k.data_ptr, v.data_ptr, out.data_ptr, lse.data_ptr)
        if self.scratch is not None:
            addresses += (_scratch(q, self.scratch, self.device).data_ptr,)
        self.launch(q.stream, addresses)

    def launch(self, stream: int, addresses: tuple) -> None:
        """Launches on `stream` (a raw handle) over arrays at these addresses: q, k, v, then those of
        `made`."""
        _run(self.device, self.launches, stream, addresses)

    def run_at(self, stream: int, addresses: tuple) -> None:
        """Writes out and lse on `stream` (a raw handle) over arrays at these addresses: q, k, v, out, lse,
        for a caller that lends its buffers and no allocator (XLA): a split deal's scratch comes from
        CuPy's pool."""
        if self.scratch is not None:
            addresses += (_pool_scratch(stream, self.scratch, self.device).data.ptr,)
        self.launch(stream, addresses)


def _run(device: int, launches, stream: int, addresses: tuple) -> None:
    """Launches each `_Bound` in turn on `stream` over arrays at `addresses`, on `device`."""
    import cupy

    with cupy.cuda.Device(device):
        _bind(device)
        for launch in launches:
            launch.launch(stream, addresses)


def _scratch(like, shape: tuple, device: int):
    """A float32 scratch on `like`'s device, to be used on its stream: its framework's (PyTorch's caching
    allocator), or from CuPy's pool where it cannot make one (XLA's buffers), in which a freed block is
    taken again only on the stream it was made on, so only after the work queued there before."""
    try:
        return like.empty(shape, "float32")
    except NotImplementedError:
        return CupyTensor(_pool_scratch(like.stream, shape, device), "scratch")


def _pool_scratch(stream: int, shape: tuple, device: int):
    """A float32 CuPy array from CuPy's pool, made on `stream` of `device` (`_scratch`)."""
    import cupy

    with cupy.cuda.Device(device), _stream(stream):
        return cupy.empty(shape, cupy.float32)


# The backward's statistics scratch pads the query rows to whole tiles of every pass (the Hopper dK/dV pass
# copies a tile's statistics whole).
_STATS_ROWS = 128


def stats_shape(q_shape, device: int) -> tuple[int, int, int, int]:
    """The backward's float32 scratch for queries of this shape on this GPU: [B, Hq, 2, Sq padded to 128]
    (per query row lse * log2(e), then rowsum(dout * out); written by the dQ pass for the dK/dV pass). Where
    the fused backward may run (`fused_backward`), D + 1 rows more: its fp32 dQ sums, then a counter per
    query tile."""
    batch, heads, seq, head_dim = q_shape
    rows = 2 + (head_dim + 1 if fused_backward(head_dim, device) else 0)
    return batch, heads, rows, -(-seq // _STATS_ROWS) * _STATS_ROWS


def fused_backward(head_dim: int, device: int) -> bool:
    """Whether a Hopper backward of this head dim on this GPU runs fused (unless
    CUSPARSEATTN_FUSED_BACKWARD=0): dK, dV and dQ in one pass, between a statistics pass and a pass that
    rounds dQ."""
    return env.fused_backward() and head_dim in build.HOPPER_HEAD_DIMS and not hopper_device_reasons(device)


def backward(
    dout, q, k, v, out, lse, dq, dk, dv, stats, layout: BlockLayout, scale: float, *, score_mod=None
):
    """Launches the backward kernels: writes `dq` [B, Hq, Sq, D], `dk` and `dv` [B, Hkv, Sk, D], and `stats`
    (float32 scratch of `stats_shape(q.shape, device)`, from the first kernel to the later ones).

    Each gradient element is written once (no atomics), and the fused backward adds dQ's parts
    in an order fixed per query tile: the results are bitwise reproducible (unless
    CUSPARSEATTN_DETERMINISTIC=0, when the fused backward adds them as they come).
    """
    arrays = dict(dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv, stats=stats)
    Backward(q, k, v, layout, scale, score_mod=score_mod, **arrays).run(
        dout, q, k, v, out, lse, dq, dk, dv, stats
    )


class Backward:
    """The backward's passes (dQ, then dK/dV; or the fused backward's three, `fused_backward`) for arrays
    described as `q`, `k` and `v` and the optional others are (those not given: C-contiguous, shaped as q
    or k), over a layout, scale and score mod (tables, tiles, grids, packed parameters), made once: `run`
    launches them on any arrays described the same way. PyTorch's eager calls keep one per call signature,
    made in the first forward.

    dout may come laid out as the forward's caller left its output's gradient (a transposed view is
    common): the passes are bound to each dout layout as it comes. The Hopper passes read dout through TMA:
    without `dout` (not known yet) they are chosen for q, k and v, and `accepts` tells whether a dout fits
    them.
    """

    def __init__(self, q, k, v, layout: BlockLayout, scale: float, *, score_mod=None, **arrays):
        import cupy

        head_dim = q.shape[3]
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device[1]
        self.stats_shape = stats_shape(q.shape, self.device)
        stats = arrays.get("stats")
        if stats is not None and tuple(stats.shape) != self.stats_shape:
            # The fused backward writes past the statistics: a scratch shaped under
            # CUSPARSEATTN_FUSED_BACKWARD=0, or for a GPU without the Hopper kernels, is short.
            raise ValueError(
                f"stats must have the shape stats_shape(q.shape, device) = {self.stats_shape}, got "
                f"{tuple(stats.shape)} (CUSPARSEATTN_FUSED_BACKWARD changes the rows: set it before making "
                "the scratch)"
            )
        self.hopper = not hopper_reasons(q, k, v, arrays.get("dout"))
        # The fused pass writes dK and dV through TMA too: given ones it cannot write take the two passes.
        written = (("dk", arrays.get("dk")), ("dv", arrays.get("dv")))
        writable = not any(_tma_reasons(name, t) for name, t in written if t is not None)
        fused = self.hopper and writable and fused_backward(head_dim, self.device)
        made = {name: _Like(q.shape, q.dtype) for name in ("out", "dout", "dq")}
        made |= {name: _Like(k.shape, k.dtype) for name in ("dk", "dv")}
        made |= {"lse": _Like(q.shape[:3], "float32"), "stats": _Like(self.stats_shape, "float32")}
        self._arrays = _bound_arrays(ARRAYS, dict(arrays, q=q, k=k, v=v), made)
        # What a caller that makes the arrays itself makes for `launcher`, C-contiguous: dq, dk, dv, stats
        # (shape, dtype name each). None when any was given: the passes are bound to theirs.
        outputs = ("dq", "dk", "dv", "stats")
        given = any(arrays.get(n) is not None for n in outputs)
        self.made = None if given else tuple((made[n].shape, made[n].dtype) for n in outputs)
        # The tables' uploads, on the stream of the first launch that reads them (as the forward's).
        with cupy.cuda.Device(self.device), _stream(q.stream):
            _bind(self.device)
            score = score_tables(score_mod, self.device)
            passes = self._fused if fused else self._two_passes
            self._passes = passes(q, k, layout, score, scale)
        # The passes bound to each dout layout, by dout's strides: `_Pass.bind` keeps them too, but its key
        # (every array's strides) costs more to build than a launch on the prepared path may spend.
        self._bound: dict[tuple, tuple[_Bound, ...]] = {}

    def _two_passes(self, q, k, layout: BlockLayout, score, scale: float) -> list:
        """The dQ pass (which writes the statistics), then the dK/dV pass: (pass, TMA rows) each."""
        batch, heads_q, _, head_dim = q.shape
        suffix = "_sm90" if self.hopper else ""
        passes = []
        for kernel in ("backward_dq" + suffix, "backward_dkdv" + suffix):
            tables, tiles = _tiled_tables(kernel, layout, head_dim, self.device, score)
            if kernel.startswith("backward_dq"):
                grid = (tables.plan.tiles_q, heads_q, batch)
            else:
                # The dK/dV kernel's SPLITS: halves of the head dim past 128.
                splits = 2 if head_dim > 128 else 1
                grid = (tables.plan.tiles_k, k.shape[1] * splits, batch)
            rows = _tma_rows(tiles, _BACKWARD_MAPS) if self.hopper else {}
            passes.append((_pass(kernel, grid, tables, score, scale, tiles, q=q, k=k), rows))
        return passes

    def _fused(self, q, k, layout: BlockLayout, score, scale: float) -> list:
        """The fused backward's passes: the statistics (and zeroed counters), the persistent pass over the
        key tiles' columns, the rounding of dQ. Under CUSPARSEATTN_DETERMINISTIC=0 the statistics pass zeroes
        the dQ sums too, and the fused pass adds its parts in as they come."""
        batch, heads_q, _, head_dim = q.shape
        unordered = not env.deterministic()
        tables, tiles = _tiled_tables("backward_sm90", layout, head_dim, self.device, score)
        items = batch * k.shape[1] * tables.plan.tiles_k
        ctas = min(items, sm_count(self.device))
        group_items = _FUSED_BACKWARD_GROUP * sm_count(self.device)
        columns = tables.columns(batch, heads_q, heads_q // k.shape[1], ctas, group_items)
        # dK and dV go out as each consumer warpgroup's 64 keys.
        rows = _tma_rows(tiles, _BACKWARD_MAPS) | dict.fromkeys(("dk", "dv"), 64)

        def plain(kernel: str, grid) -> tuple:
            edges = build.edge_tiles(tiles)
            return _pass(kernel, grid, tables, None, scale, edges, q=q, k=k, unordered=unordered), {}

        fused = _pass(
            "backward_sm90", (ctas, 1, 1), tables, score, scale, tiles, columns, q=q, k=k, unordered=unordered
        )
        return [
            plain("backward_stats", (self.stats_shape[3] // tiles[0], heads_q, batch)),
            (fused, rows),
            plain("backward_dq_convert", (tables.plan.tiles_q, heads_q, batch)),
        ]

    def accepts(self, dout) -> bool:
        """Whether the passes can take this dout holder: shaped and typed like q, on its device, and readable
        by the kernels' copies."""
        if (dout.shape, dout.dtype, dout.device) != (self.shape, self.dtype, ("cuda", self.device)):
            return False
        return not tensor_reasons(("dout", dout)) and not (self.hopper and _tma_reasons("dout", dout))

    def passes(self, dout) -> tuple[_Bound, ...]:
        """The passes bound to arrays described as the prepared ones and this `dout` (which it accepts)."""
        passes = self._bound.get(dout.strides)
        if passes is None:
            arrays = dict(self._arrays, dout=dout)
            passes = self._bound[dout.strides] = tuple(p.bind(arrays, rows) for p, rows in self._passes)
        return passes

    def launcher(self, dout):
        """``launch(stream, addresses)``: the passes for douts described as this one (which it accepts) on a
        raw stream handle, over arrays at these addresses: q, k, v, out, lse, dout, then those of `made`."""
        return functools.partial(_run, self.device, self.passes(dout))

    def run(self, dout, q, k, v, out, lse, dq, dk, dv, stats) -> None:
        """Writes `dq`, `dk`, `dv` and the scratch `stats` on dout's stream."""
        addresses = tuple(a.data_ptr for a in (q, k, v, out, lse, dout, dq, dk, dv, stats))
        _run(self.device, self.passes(dout), dout.stream, addresses)


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
        function = build.load(build.RuleSpec(rule.c_expr), device)
        any_, all_ = cupy.empty(shape, cupy.uint8), cupy.empty(shape, cupy.uint8)
        params = np.zeros((), build.MASK_PARAMS)
        params["any"], params["all"] = any_.data.ptr, all_.data.ptr
        params["seq_q"], params["seq_k"], params["block_q"], params["block_k"] = seq_q, seq_k, bq, bk
        params["blocks_q"], params["blocks_k"], params["heads"] = shape[2], shape[3], heads
        tables = _set_rule(params, rule)
        function((shape[3], shape[2], batch * heads), (256, 1, 1), (params[()],))
        result = cupy.asnumpy(any_).astype(bool), cupy.asnumpy(all_).astype(bool)
        del tables  # only once the copies above have waited for the kernel that reads them
        return result
