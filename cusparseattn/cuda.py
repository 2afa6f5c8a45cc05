"""Launching the CUDA kernels on the caller's device and stream.

Host work per layout (the tile plan, its upload) happens once per (layout, tile shape, device) and is cached;
a call then only packs the parameter struct and launches. Nothing here synchronises the device.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from . import build, plan
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


def reasons(dtype: str, head_dim: int) -> list[str]:
    """Why the kernels cannot take inputs of this dtype and head dim (empty when they can)."""
    out = []
    if dtype not in build.DTYPES:
        out.append(f"the CUDA kernels take float16 and bfloat16 inputs, got {dtype}")
    if head_dim % 8 or not 8 <= head_dim <= max(build.TILES):
        out.append(
            f"the CUDA kernels take head dims that are multiples of 8 up to {max(build.TILES)}, "
            f"got {head_dim}"
        )
    return out


@functools.cache
def compute_capability(device: int) -> int:
    """The device's compute capability as an integer (90 for 9.0), looked up once per process."""
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def tensor_reasons(*tensors) -> list[str]:
    """Why these device arrays cannot be read by 16-byte asynchronous copies (empty when they can)."""
    out = []
    for name, t in tensors:
        if t.data_ptr % 16:
            out.append(f"{name}'s data is not 16-byte aligned (address {t.data_ptr:#x})")
        if any(s % 8 for s in t.strides[:3]):
            out.append(f"{name}'s strides {t.strides} (in elements) are not multiples of 8")
        cc = compute_capability(t.device[1])
        if cc < MIN_COMPUTE_CAPABILITY:
            out.append(
                f"{name} is on a GPU of compute capability {cc // 10}.{cc % 10}; the kernels need 8.0 "
                "or newer"
            )
    return out


# ---- per-layout device tables -------------------------------------------------------------------------
# id(layout) -> {(tile_m, tile_n, device) -> DeviceTables}; an entry goes when its layout does.
_tables: dict[int, dict] = {}


class DeviceTables:
    """A layout's tile plan and token-rule arrays, resident on one device."""

    def __init__(self, layout: BlockLayout, tile_m: int, tile_n: int):
        import cupy

        self.plan = plan.build(layout, tile_m, tile_n)
        p = self.plan
        self.row_ptr = cupy.asarray(p.row_ptr)
        self.entries = cupy.asarray(p.entries)
        self.sub_bits = cupy.asarray(p.sub_bits)
        self.bit_mask = cupy.asarray(p.bit_mask)
        rule = layout.rule if p.rule_mode == "expr" else None
        params, arrays = (rule.params, rule.arrays) if rule else ((), ())
        self.rule_arrays = [cupy.asarray(np.ascontiguousarray(a, dtype=np.int32)) for a in arrays]
        self.rule_params = tuple(params) + (0,) * (8 - len(params))
        self.rule_expr = rule.c_expr if rule else None


def device_tables(layout: BlockLayout, tile_m: int, tile_n: int, device: int) -> DeviceTables:
    per_layout = _tables.get(id(layout))
    if per_layout is None:
        per_layout = _tables[id(layout)] = {}
        weakref.finalize(layout, _tables.pop, id(layout), None)
    key = (tile_m, tile_n, device)
    if key not in per_layout:
        per_layout[key] = DeviceTables(layout, tile_m, tile_n)
    return per_layout[key]


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, for CuPy's `Stream.from_external`."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_streams: dict[int, object] = {}


def _stream(handle: int):
    """The framework's current stream as a CuPy stream (0 is the legacy default stream)."""
    import cupy

    if handle not in _streams:
        if not handle:
            _streams[handle] = cupy.cuda.Stream.null
        elif hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14
            _streams[handle] = cupy.cuda.Stream.from_external(_StreamHandle(handle))
        else:
            _streams[handle] = cupy.cuda.ExternalStream(handle)
    return _streams[handle]


def forward(
    q, k, v, out, lse, layout: BlockLayout, scale: float, *, tiles: tuple[int, int, int] | None = None
):
    """Launches the forward kernel: writes `out` [B, Hq, Sq, D] and `lse` [B, Hq, Sq] (float32).

    `tiles` (TILE_M, TILE_N, NWARPS) overrides the tile table, for tuning.
    """
    import cupy

    batch, heads_q, seq_q, head_dim = q.shape
    heads_k, seq_k = k.shape[1], k.shape[2]
    device = q.device[1]
    tile_m, tile_n, nwarps = tiles or build.tile_config(head_dim)
    with cupy.cuda.Device(device), _stream(q.stream):
        tables = device_tables(layout, tile_m, tile_n, device)
        spec = build.KernelSpec(
            "forward", q.dtype, head_dim, (tile_m, tile_n, nwarps), tables.plan.rule_mode, tables.rule_expr
        )
        function = build.load(spec, device)
        p = tables.plan
        arrays = [a.data.ptr for a in tables.rule_arrays] + [0] * (4 - len(tables.rule_arrays))
        params = np.array(
            (
                q.data_ptr, k.data_ptr, v.data_ptr, out.data_ptr, lse.data_ptr,
                *q.strides[:3], *k.strides[:3], *v.strides[:3], *out.strides[:3], *lse.strides[:2],
                seq_q, seq_k, heads_q, heads_q // heads_k,
                layout.batch, layout.heads, p.tiles_q,
                p.sub_q_shift, p.sub_k_shift, p.sub_k_count,
                scale,
                tables.row_ptr.data.ptr, tables.entries.data.ptr,
                tables.sub_bits.data.ptr, tables.bit_mask.data.ptr,
                tables.rule_params, arrays,
            ),
            dtype=build.PARAMS,
        )  # fmt: skip
        function(
            (p.tiles_q, heads_q, batch), (spec.threads, 1, 1), (params[()],), shared_mem=spec.shared_bytes
        )
