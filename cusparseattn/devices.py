"""The GPU: which one is current, what it is (compute capability, shared memory, SMs), and why the kernels
cannot run on given arrays there (each reason a sentence that `cusparseattn.backends.why_not` shows).
"""

from __future__ import annotations

import functools

from . import build, env, tma, tuning

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
        out.append(f"the CUDA kernels take float16, bfloat16 and float32 inputs, got {dtype}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        out.append(
            f"the CUDA kernels take head dims that are multiples of 8 up to {MAX_HEAD_DIM}, got {head_dim}"
        )
    return out


# A CUDA grid's y and z axes hold at most 65535 blocks: the passes that are not persistent launch a batch
# element per z index and heads along y (the portable dK/dV pass tuning.dkdv_splits per key/value head,
# float32's copy pass every head of K, Q and dO: transpose.cu).
GRID_YZ = 65535


def grid_reasons(q_shape, k_shape, dtype: str, dynamic: bool = False, persistent: bool = False) -> list[str]:
    """Why the kernels' grids cannot hold arrays of these [B, H, S, D] shapes (empty when they can); with
    `dynamic`, for a dynamic layout, whose tables' builder lays every (batch element, query head) along y;
    `persistent` where only persistent passes run (the Hopper forward in half precision), whose grids hold
    any batch."""
    batch, heads_q, heads_kv, head_dim = q_shape[0], q_shape[1], k_shape[1], q_shape[3]
    out = []
    if batch > GRID_YZ and not persistent:
        out.append(f"the CUDA kernels take at most {GRID_YZ} batch elements (a grid axis), got {batch}")
    elif dynamic and batch * heads_q > GRID_YZ:
        out.append(
            f"a dynamic layout's tables take at most {GRID_YZ} (batch element, query head) pairs (a grid "
            f"axis), got {batch} x {heads_q}"
        )
    along_y = max(heads_q, heads_kv * tuning.dkdv_splits(head_dim))
    if dtype == "float32":
        along_y = max(along_y, heads_kv + 2 * heads_q)
    if along_y > GRID_YZ:
        out.append(
            f"the CUDA kernels' grids take at most {GRID_YZ} blocks along the axis of heads; {heads_q} query "
            f"heads with {heads_kv} key/value heads of {dtype} take {along_y}"
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


# Where float32 runs on a Hopper GPU (`info`), and why it takes the portable kernels at "highest".
FLOAT32_ON_HOPPER = (
    "the Hopper forward and backward on TF32's wgmma at precision 'high' (the backward's dQ and dK/dV "
    "passes, not fused), reading transposed copies where a product reduces over an array's rows; the "
    "portable kernels at 'highest'"
)
FLOAT32_HIGHEST_ON_HOPPER = (
    "the Hopper kernels multiply float32 in TF32 (precision 'high'): at 'highest' (split TF32) float32 runs "
    "the portable kernels"
)


def hopper_reasons(q, k, v, dout=None, out=None, *, precision="high") -> list[str]:
    """Why a pass cannot take the Hopper kernels for these device arrays (dout: the backward's; out: the
    forward's, which it stores by TMA, where the caller gives one; empty when it can); it then runs the
    portable ones. float32 takes them at `precision` "high"."""
    if reasons := hopper_device_reasons(q.device[1]):
        return reasons
    if q.dtype == "float32" and precision != "high":
        return [FLOAT32_HIGHEST_ON_HOPPER]
    if q.shape[3] not in tuning.HOPPER_HEAD_DIMS:
        return [f"the Hopper kernels take head dims {tuning.HOPPER_HEAD_DIMS}, got {q.shape[3]}"]
    named = (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out))
    return [reason for name, t in named if t is not None for reason in tma_reasons(name, t)]


def tma_reasons(name: str, t) -> list[str]:
    return [
        f"TMA cannot copy {name}: {reason}"
        for reason in tma.reasons(tuple(t.shape), tuple(t.strides), build.DTYPES[t.dtype], t.data_ptr % 16)
    ]
