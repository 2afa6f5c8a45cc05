"""Testing helpers beside the oracle: random inputs, the tolerance rule against the float64 reference, and
outputs poisoned with NaN.

The rule (flash-attention's ``check_tensor_vs_ref``): a result computed in low precision passes when its error
against the float64 reference (`cusparseattn.reference` in float64) is at most twice the error of the
reference itself run in that low precision, plus a small absolute slack for rounding noise (`ATOL`), both for
the largest and for the mean error. A flat tolerance would pass bugs in one dtype and fail noise in another.

Outputs a kernel writes are made with `poisoned` first: NaN everywhere, so an element the kernel forgets to
write fails `check_close` (NaN never passes) instead of passing on whatever the memory held.

>>> import numpy as np
>>> from cusparseattn import patterns
>>> rng = np.random.default_rng(0)
>>> q, k, v = random_qkv(rng, 1, 4, 2, 40, 50, 16, np.float16, layout="bshd")
>>> q.shape, q.strides[1] < q.strides[2]  # a [B, S, H, D] array seen as [B, H, S, D]
((1, 4, 40, 16), True)
>>> layout = patterns.causal(block=16).layout(40, 50)
>>> (out64, lse64), (out, lse) = forward_refs(q, k, v, layout)
>>> check_close("out", out, out64, out, dtype=q.dtype)  # the low-precision reference passes its own rule
>>> check_close("out", out + 0.1, out64, out, dtype=q.dtype)  # doctest: +ELLIPSIS
Traceback (most recent call last):
AssertionError: out (float16): diff_max 1.0...e-01 (allowed ...
>>> bool(np.isnan(poisoned(q, shape=q.shape[:3], dtype="float32")).all())
True
"""

from __future__ import annotations

import functools

import numpy as np

from . import arrays, reference

__all__ = [
    "ATOL",
    "NO_GPU",
    "backward_refs",
    "check_close",
    "check_step",
    "forward_refs",
    "gpu_count",
    "poisoned",
    "random_qkv",
]

#: Why GPU tests skip where `gpu_count` is 0.
NO_GPU = "no CUDA GPU visible (cupy.cuda.runtime.getDeviceCount() == 0 or CuPy missing)"

#: Absolute slack per input dtype, a few units in the last place of values of order 1 (attention outputs are
#: convex combinations of standard-normal values): it absorbs the one rounding of the output to the dtype and
#: summation-order noise when the low-precision reference happens to be nearly exact.
ATOL = {
    "float16": 1e-3,  # eps 9.8e-4: about one ulp at 1
    "bfloat16": 8e-3,  # eps 7.8e-3: about one ulp at 1
    "float32": 1e-5,  # eps 1.2e-7; float32 accumulation over thousands of keys
    "float64": 1e-12,  # eps 2.2e-16; float64 accumulation
}


@functools.cache
def gpu_count() -> int:
    """CUDA GPUs that CuPy sees; 0 without CuPy, a driver or a device (GPU tests skip then)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # ImportError, or CUDARuntimeError without a driver
        return 0


def random_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd"):
    """Standard-normal NumPy ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` in ``dtype``.

    ``layout="bshd"`` makes each a contiguous ``[B, S, H, D]`` array seen as ``[B, H, S, D]`` through a
    transpose (the order most models keep), so strides are exercised.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    out = []
    for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)):
        shape = (B, h, s, D) if layout == "bhsd" else (B, s, h, D)
        x = rng.standard_normal(shape).astype(dtype)
        out.append(x if layout == "bhsd" else x.transpose(0, 2, 1, 3))
    return tuple(out)


def poisoned(like, shape=None, dtype=None):
    """A new array filled with NaN, of ``like``'s framework (NumPy, CuPy or PyTorch) on ``like``'s device.

    ``shape`` and ``dtype`` (a name: ``"float32"``, ``"bfloat16"``, ...) default to ``like``'s. Hand it to a
    kernel as an output: an element the kernel does not write stays NaN and fails `check_close`.
    """
    held = arrays.wrap(like, "like")
    if held.framework not in ("numpy", "cupy", "torch"):
        raise TypeError(f"like must be a NumPy, CuPy or PyTorch array (a writable one), got {held!r}")
    out = held.empty(held.shape if shape is None else tuple(shape), held.dtype if dtype is None else dtype)
    native = out.native
    # torch fills in place with fill_; NumPy's and CuPy's fill is in place already.
    (native.fill_ if held.framework == "torch" else native.fill)(float("nan"))
    return native


def check_close(name, got, ref64, low_ref, *, dtype, atol=None):
    """Assert that ``got`` is as close to ``ref64`` as the low-precision reference ``low_ref`` is, or closer.

    Passes when ``max|got - ref64| <= 2 * max|low_ref - ref64| + atol`` and the same for the mean, over the
    finite elements of ``ref64``; ``atol`` defaults to `ATOL` by ``dtype`` (the kernel's input dtype).
    Non-finite values must match exactly (``-inf`` in an empty row's lse), and NaN never passes. The failure
    message gives ``diff_max``, the low-precision reference's own error and where the worst element is.
    """
    dtype = np.dtype(dtype).name
    got, ref64, low_ref = (np.asarray(x).astype(np.float64) for x in (got, ref64, low_ref))
    if not got.shape == ref64.shape == low_ref.shape:
        raise AssertionError(
            f"{name}: shapes differ: got {got.shape}, ref {ref64.shape}, low ref {low_ref.shape}"
        )
    if np.isnan(got).any() or np.isnan(ref64).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(got) | np.isnan(ref64))[0])
        raise AssertionError(f"{name}: NaN at {where}: got {got[where]}, ref {ref64[where]}")
    finite = np.isfinite(ref64)
    bad = (~finite & (got != ref64)) | (finite & ~np.isfinite(got))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{name}: non-finite mismatch at {where}: got {got[where]}, ref {ref64[where]} "
            f"({int(bad.sum())} elements)"
        )
    if not finite.any():
        return
    err = np.abs(np.where(finite, got, 0) - np.where(finite, ref64, 0))
    low_err = np.abs(low_ref[finite] - ref64[finite])
    atol = ATOL[dtype] if atol is None else atol
    diff_max, diff_mean = err.max(), err[finite].mean()
    tol_max, tol_mean = 2 * low_err.max() + atol, 2 * low_err.mean() + atol
    if diff_max > tol_max or diff_mean > tol_mean:
        where = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
        raise AssertionError(
            f"{name} ({dtype}): diff_max {diff_max:.3e} (allowed {tol_max:.3e}), diff_mean {diff_mean:.3e} "
            f"(allowed {tol_mean:.3e}); the {dtype} reference's own error: max {low_err.max():.3e}, mean "
            f"{low_err.mean():.3e}; worst at {where}: got {got[where]!r}, ref {ref64[where]!r}"
        )


def forward_refs(q, k, v, layout, *, scale=None, low=None):
    """``(ref64, low_ref)`` for a forward: each an ``(out, lse)`` pair for `check_close`.

    ``ref64`` is the float64 reference on the same (exactly upcast) inputs; ``low_ref`` is the reference as a
    kernel computes it: float32 softmax, output rounded to the inputs' dtype, or with ``low`` (a dtype) the
    inputs and output rounded to that one: float16 bounds a TF32 kernel's float32 (the same 10 bits of
    mantissa). Check against it with ``dtype=low``.
    """
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    ref64 = reference.forward(q64, k64, v64, layout, scale=scale, precision=np.float64)
    q, k, v = (x if low is None else np.asarray(x).astype(low) for x in (q, k, v))
    return ref64, reference.forward(q, k, v, layout, scale=scale)


def backward_refs(dout, q, k, v, layout, *, scale=None, low=None):
    """``(ref64, low_ref)`` for a backward: each a ``(dq, dk, dv)`` triple for `check_close` (``low`` as in
    `forward_refs`).

    Each reference runs its own forward in its own precision and feeds that ``out`` and ``lse`` back.
    """
    q64, k64, v64, do64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    out64, lse64 = reference.forward(q64, k64, v64, layout, scale=scale, precision=np.float64)
    ref64 = reference.backward(do64, q64, k64, v64, out64, lse64, layout, scale=scale, precision=np.float64)
    dout, q, k, v = (x if low is None else np.asarray(x).astype(low) for x in (dout, q, k, v))
    out, lse = reference.forward(q, k, v, layout, scale=scale)
    return ref64, reference.backward(dout, q, k, v, out, lse, layout, scale=scale)


def check_step(results, dout, q, k, v, layout, *, dtype):
    """Assert that a training step's ``results`` (out, dq, dk, dv: host arrays) are as close to the reference
    of the host arrays ``dout, q, k, v`` on ``layout`` as `check_close` asks."""
    ref64, low_ref = forward_refs(q, k, v, layout)
    check_close("out", results[0], ref64[0], low_ref[0], dtype=dtype)
    g64, g_low = backward_refs(dout, q, k, v, layout)
    for name, got, want, want_low in zip(("dq", "dk", "dv"), results[1:], g64, g_low, strict=True):
        check_close(name, got, want, want_low, dtype=dtype)
