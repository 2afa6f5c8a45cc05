"""TMA descriptors (the driver's CUtensorMap) for the Hopper kernels, encoded through the driver API.

A kernel copies [rows x D] tiles of a [B, H, S, D] array with one TMA instruction. The tile lands in shared
memory as D / P panels of [rows x P] elements with the 128-byte swizzle that wgmma reads (P = 128 bytes of
elements: 64 in half precision, 32 in float32), so the map describes the array as five dimensions, fastest
first: (P, S, D / P, H, B). Rows past S read as zeros. A box may take fewer panels than D / P: float32's
Hopper passes copy tiles of rows of the transposed copies of V, K, Q and dO ([B, H, D, S]: transpose.cu) so.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .build import DTYPES

# The descriptor as a kernel argument: 128 opaque bytes (kernels/hopper.cuh's TensorMap).
TENSOR_MAP = np.dtype([("opaque", np.uint64, (16,))])

# CUtensorMapDataType, CUtensorMapSwizzle and CUtensorMapL2promotion values (cuda.h).
# float32 is copied as TF32 (CU_TENSOR_MAP_DATA_TYPE_TFLOAT32), which the copy rounds to nearest as the
# portable kernels' cvt.rna does (float32's type lets wgmma truncate: an lse 1.5e-3 low at S = 4096).
_DATA_TYPES = {"float16": 6, "bfloat16": 9, "float32": 11}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
ROW_BYTES = 128  # a swizzled row


def panel(itemsize: int) -> int:
    """Elements of a 128-byte swizzled row."""
    return ROW_BYTES // itemsize


def geometry(shape, strides, itemsize: int, rows: int, panels: int | None = None):
    """(dims, byte strides of dims 1-4, box) of the map over a [B, H, S, D] array with these element
    strides, for tiles of `rows` rows and `panels` panels (all D / P of them where None)."""
    batch, heads, seq, dim = shape
    width = panel(itemsize)
    sb, sh, ss, _ = (s * itemsize for s in strides)
    dims = (width, seq, dim // width, heads, batch)
    # A dimension of size 1 is never stepped along: any legal stride does (broadcast arrays have stride 0).
    byte_strides = tuple(s if n > 1 else 16 for s, n in zip((ss, ROW_BYTES, sh, sb), dims[1:], strict=True))
    box = (width, rows, dim // width if panels is None else panels, 1, 1)
    return dims, byte_strides, box


@functools.lru_cache(maxsize=1024)
def reasons(shape: tuple, strides: tuple, itemsize: int, data_ptr: int) -> tuple[str, ...]:
    """Why TMA cannot describe this [B, H, S, D] array (empty when it can). Only data_ptr % 16 matters:
    callers pass that, so that the answer is cached per geometry."""
    out = []
    if any(s == 0 and n > 1 for s, n in zip(strides[:3], shape[:3], strict=True)):
        out.append(f"it is broadcast (strides {tuple(strides)} in elements)")
    if shape[3] % panel(itemsize):
        out.append(f"its head dim {shape[3]} is not a multiple of {panel(itemsize)}")
    if data_ptr % 16:
        out.append(f"its data is not 16-byte aligned (address = {data_ptr % 16} mod 16)")
    if strides[3] != 1 or any((s * itemsize) % 16 or s < 0 for s in strides[:3]):
        out.append(f"its strides {tuple(strides)} (in elements) are not whole 16-byte steps")
    if any(s * itemsize >= 1 << 40 for s in strides[:3]):
        out.append(f"its strides {tuple(strides)} exceed TMA's 2^40 bytes")
    return tuple(out)


@functools.cache
def _encode_function():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p]
    fn.argtypes += [ctypes.c_int] * 4
    fn.restype = ctypes.c_int
    return fn


def tile_map(holder, rows: int, panels: int | None = None) -> np.void:
    """The descriptor of `holder` (a cusparseattn.arrays holder of a [B, H, S, D] device array) for tiles of
    `rows` rows and `panels` panels (`geometry`), as a kernel argument."""
    return _tile_map(holder.data_ptr, tuple(holder.shape), tuple(holder.strides), holder.dtype, rows, panels)


def descriptor(
    data_ptr: int, shape: tuple, strides: tuple, dtype: str, rows: int, panels: int | None = None
) -> bytes:
    """The descriptor of a [B, H, S, D] array of this geometry at `data_ptr`, for tiles of `rows` rows and
    `panels` panels (`geometry`), as the bytes of a kernel argument."""
    return _tile_map(data_ptr, shape, strides, dtype, rows, panels).tobytes()


@functools.lru_cache(maxsize=256)
def _tile_map(data_ptr: int, shape: tuple, strides: tuple, dtype: str, rows: int, panels) -> np.void:
    # The descriptor holds the address and the geometry only: a reused address with the same geometry
    # gets the same descriptor, so caching by them is exact.
    dims, byte_strides, box = geometry(shape, strides, DTYPES[dtype], rows, panels)
    # CUtensorMap is 64-byte aligned: encode into an aligned slice of a larger buffer.
    raw = np.zeros(TENSOR_MAP.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    result = _encode_function()(
        raw.ctypes.data + start,
        _DATA_TYPES[dtype],
        len(dims),
        data_ptr,
        (ctypes.c_uint64 * 5)(*dims),
        (ctypes.c_uint64 * 4)(*byte_strides),
        (ctypes.c_uint32 * 5)(*box),
        (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1),
        0,  # no interleave
        _SWIZZLE_128B,
        _L2_PROMOTION_256B,
        0,  # out-of-bounds elements read as zero
    )
    if result != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed with CUresult {result} for an array of shape {shape}, "
            f"strides {strides}, dtype {dtype}"
        )
    return raw[start : start + TENSOR_MAP.itemsize].view(TENSOR_MAP)[0]
