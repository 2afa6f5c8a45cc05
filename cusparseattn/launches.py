"""Launching a kernel: its parameters packed once per call's sizes (`Pass`), bound to arrays of given strides
(`Bound`), then per call only the arrays' addresses written and the driver's launch on the caller's stream.
Nothing here synchronises the device.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

from . import build, tma, tuning
from .arrays import CupyTensor
from .gpu_tables import SCORE, DeviceTables


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, for CuPy's `Stream.from_external`."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def cupy_stream(handle: int):
    """The framework's current stream as a CuPy stream (0 is the legacy default stream). A program makes
    streams without end (one per ``torch.cuda.Stream()``); the last 64 are kept."""
    import cupy

    if not handle:
        return cupy.cuda.Stream.null
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


_bound = threading.local()


def bind_device(device: int) -> None:
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
ARRAYS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "stats", "vt", "kt", "qt", "dot")
# The Params field of each array's first stride, and how many strides it has.
_STRIDES = {
    "q": ("q_sb", 3), "k": ("k_sb", 3), "v": ("v_sb", 3), "out": ("o_sb", 3), "lse": ("lse_sb", 2),
    "dout": ("do_sb", 3), "dq": ("dq_sb", 3), "dk": ("dk_sb", 3), "dv": ("dv_sb", 3),
    "stats": ("stats_sb", 3), "vt": ("vt_sb", 3), "kt": ("kt_sb", 3), "qt": ("qt_sb", 3),
    "dot": ("dot_sb", 3),
}  # fmt: skip
_SIZES = _offset("seq_q")  # seq_q, seq_k, heads_q, group: four int32 in a row
_SCALE = _offset("scale")
_WORK_COUNT = _offset("work_count")
_DQ_UNORDERED = _offset("dq_unordered")
MAP_BYTES = tma.TENSOR_MAP.itemsize  # a TMA descriptor, as a kernel argument


@functools.lru_cache(maxsize=256)
def loaded_kernel(device: int, *spec_args):
    """(compiled kernel, block, shared bytes) of build.KernelSpec(*spec_args) on a device: one dictionary
    lookup per launch once it is loaded."""
    spec = build.KernelSpec(*spec_args)
    return build.load(spec, device), (spec.threads, 1, 1), spec.shared_bytes


def kernel_spec_args(
    kernel: str, q, tiles, rule: tuple, score_spec, split_rows=False, precision="high"
) -> tuple:
    """build.KernelSpec's arguments for a pass of `kernel` over arrays described as `q`: `rule` is the
    layout's (mode, kernel rule: `plan.kernel_rule`); a `tuning.PLAIN` kernel is built without it and the
    score mod's C texts (`score_spec`)."""
    if kernel in tuning.PLAIN:
        rule, score_spec = ("none", None), None
    return (kernel, q.dtype, q.shape[3], tiles, *rule, score_spec, split_rows, precision)


def prefetch(device: int, *spec_args) -> None:
    """Starts compiling build.KernelSpec(*spec_args) for a device in the background (`build.prefetch`)."""
    build.prefetch(build.KernelSpec(*spec_args), device)


class Pass:
    """One kernel's launches for one call's sizes: the kernel, its geometry and the parameters that do not
    change from call to call (tables, sizes, scale, schedule) packed ahead. `work`: a persistent pass's
    schedule on the device, by Params field (`DeviceTables.work`, `DeviceTables.columns`). `bind` makes its
    launches over arrays of given strides. A `tuning.PLAIN` kernel is built without the layout's rule.
    `precision`: float32's (`build.PRECISIONS`)."""

    def __init__(
        self,
        kernel: str,
        grid,
        tables: DeviceTables,
        score,
        scale: float,
        tiles,
        work,
        unordered,
        q,
        k,
        precision="high",
    ):
        self.kernel, self.grid, self.tiles = kernel, grid, tiles
        # The Hopper forward's build for split rows where its deal has some (the others keep their code).
        split_rows = kernel == "forward_sm90" and work["split_ptr"].size > 1
        rule = (tables.plan.rule_mode, tables.kernel_rule)
        spec_args = kernel_spec_args(kernel, q, tiles, rule, score and score.spec, split_rows, precision)
        self.function, self.block, self.shared = loaded_kernel(q.device[1], *spec_args)
        # The device arrays that the parameters point to live as long as this pass.
        self.arrays = (tables, score, work)
        buffer = bytearray(tables.params)
        if score is not None:
            buffer[SCORE] = score.fields
        heads_q, heads_k = q.shape[1], k.shape[1]
        struct.pack_into("<4i", buffer, _SIZES, q.shape[2], k.shape[2], heads_q, heads_q // heads_k)
        struct.pack_into("<f", buffer, _SCALE, scale)
        if work is not None:
            for field, array in work.items():
                struct.pack_into("<Q", buffer, _offset(field), array.data.ptr)
            struct.pack_into("<i", buffer, _WORK_COUNT, work["work"].size)
        struct.pack_into("<i", buffer, _DQ_UNORDERED, unordered)
        self.params = bytes(buffer)
        self._bound: dict[tuple, Bound] = {}  # by the arrays' strides (their shapes follow from q's, k's)

    def bind(self, arrays: dict, rows: dict) -> Bound:
        """Its launches over arrays described as `arrays` are (`Bound`), made once per layout of them:
        calls that make their launch anew each time (JAX's, the functional API's) take it from here."""
        key = (tuple(tuple(a.strides) for a in arrays.values()), tuple(rows.items()))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = Bound(self, arrays, rows)
        return bound


class Bound:
    """A pass's launches over arrays described as `arrays` are (name -> holder, in `ARRAYS` order, any of
    them): the parameters with every stride packed, and the geometry of the TMA descriptors of the `rows`
    arrays (a Hopper kernel's: tiles of ``rows[name]`` rows, or (rows, panels): `tma.geometry`). A launch's
    arguments (the parameters with the arrays' addresses, then the descriptors) are built once per tuple of
    addresses and kept, up to `KEPT`, all forgotten at once when one more comes: PyTorch's allocator hands
    the same few addresses back step after step, so that a prepared call's launch is one lookup and the
    driver's call. A prepared call's host time is the budget: writing the addresses and descriptors into
    the arguments at each launch made a forward+backward step at S = 4096 wait on the host."""

    KEPT = 64

    def __init__(self, launch: Pass, arrays: dict, rows: dict):
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
            (slots[name], (tuple(a.shape), tuple(a.strides), a.dtype, *_box(box)))
            for name, box in rows.items()
            for a in (arrays[name],)
        )
        self._target = (launch.function.kernel.ptr, launch.grid, launch.block, launch.shared)
        self._arguments: dict[tuple, tuple] = {}

    def launch(self, stream: int, addresses: tuple) -> None:
        """Launches on `stream` (a raw handle) over arrays at these addresses (in the order bound)."""
        arguments = self._arguments.get(addresses)
        if arguments is None:
            arguments = self._arguments_at(addresses)
        launch_kernel(*self._target, stream, arguments[0])

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


def _box(box) -> tuple:
    """A TMA box as `tma.descriptor` takes it: rows, or (rows, panels)."""
    return box if isinstance(box, tuple) else (box,)


def struct_arguments(params: bytes) -> tuple:
    """(table, buffer): the argument table of a kernel that takes one struct, `params`, by value, and the
    buffer holding its bytes, which must live until the launch returns."""
    values = ctypes.create_string_buffer(bytes(params), len(params))
    return (ctypes.c_void_p * 1)(ctypes.addressof(values)), values


def launch_kernel(kernel: int, grid, block, shared: int, stream: int, table) -> None:
    """cuLaunchKernel of a loaded kernel (its CUfunction handle) on a raw stream handle; `table` holds the
    address of each argument's bytes, in order (the driver copies them before it returns). CuPy's kernel
    call, which converts each argument, costs more host time a launch than the driver's (docs/tuning.md:
    launch_kernel)."""
    import cupy

    cupy.cuda.driver.launchKernel(kernel, *grid, *block, shared, stream, ctypes.addressof(table), 0)


def make_pass(
    kernel: str,
    grid,
    tables: DeviceTables,
    score,
    scale: float,
    tiles,
    work=None,
    *,
    q,
    k,
    unordered=False,
    precision="high",
) -> Pass:
    """The pass of `kernel` over `tables` for these sizes, made once (with a score mod, once a call: its
    tables must not outlive it in the layout's). `unordered`: the fused backward's dQ adds in any order
    (`Backward`); `precision`: float32's (`build.PRECISIONS`)."""
    args = (kernel, grid, tables, score, scale, tiles, work, unordered, q, k, precision)
    if score is not None:
        return Pass(*args)
    # The work list lives in the tables as long as they do: its id names it.
    key = (kernel, grid, scale, tiles, id(work), unordered, q.dtype, q.shape, k.shape, precision)
    made = tables.passes.get(key)
    if made is None:
        made = tables.passes[key] = Pass(*args)
    return made


def run_launches(device: int, launches, stream: int, addresses: tuple) -> None:
    """Launches each `Bound` in turn on `stream` over arrays at `addresses`, on `device`."""
    import cupy

    with cupy.cuda.Device(device):
        bind_device(device)
        for launch in launches:
            launch.launch(stream, addresses)


def scratch(like, shape: tuple, device: int):
    """A float32 scratch on `like`'s device, to be used on its stream: its framework's (PyTorch's caching
    allocator), or from CuPy's pool where it cannot make one (XLA's buffers), in which a freed block is
    taken again only on the stream it was made on, so only after the work queued there before."""
    try:
        return like.empty(shape, "float32")
    except NotImplementedError:
        return CupyTensor(pool_scratch(like.stream, shape, device), "scratch")


def pool_scratch(stream: int, shape: tuple, device: int):
    """A float32 CuPy array from CuPy's pool, made on `stream` of `device` (`scratch`)."""
    import cupy

    with cupy.cuda.Device(device), cupy_stream(stream):
        return cupy.empty(shape, cupy.float32)
