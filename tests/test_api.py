"""The public functions on NumPy, PyTorch and JAX inputs, against the reference."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import cusparseattn
from cusparseattn import api, call, patterns, reference
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
pytestmark = pytest.mark.usefixtures("jax_on_cpu")


def randn(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def qkv(B=2, Hq=4, Hkv=2, Sq=70, Sk=90, D=16, dtype=np.float64, seed=0):
    return (
        randn(B, Hq, Sq, D, dtype=dtype, seed=seed),
        randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 1),
        randn(B, Hkv, Sk, D, dtype=dtype, seed=seed + 2),
    )


def causal_mask(Sq, Sk):
    """Bottom-right aligned, independently of the patterns: query i sees key j iff j <= i + Sk - Sq."""
    return np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq)


def random_layout(Sq, Sk, block=16, heads=1, seed=0, empty_rows=True):
    rng = np.random.default_rng(seed)
    blocks = rng.random((1, heads, -(-Sq // block), -(-Sk // block))) < 0.5
    if empty_rows:
        blocks[:, :, 1] = False  # a whole block row attends to nothing
    return BlockLayout(blocks, block_size=block, seq_q=Sq, seq_k=Sk)


def expected(q, k, v, mask, scale=None):
    """The plain dense masked softmax in float64 (inputs are float64 where it is the oracle)."""
    return reference.dense_forward(q, k, v, mask, scale=scale, precision=np.float64)


TOL = 1e-12


# ---- NumPy: layouts, causal, scale ---------------------------------------------------------------------


def test_dense_by_default():
    q, k, v = qkv()
    out, lse = api.attention_forward(q, k, v)
    ref_out, ref_lse = expected(q, k, v, np.ones((70, 90), bool))
    assert out.dtype == np.float64 and lse.dtype == np.float64 and lse.shape == (2, 4, 70)
    np.testing.assert_allclose(out, ref_out, atol=TOL)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL)


@pytest.mark.parametrize(("Sq", "Sk"), [(70, 70), (50, 90), (90, 50)])
def test_causal_is_bottom_right(Sq, Sk):
    q, k, v = qkv(Sq=Sq, Sk=Sk)
    out, lse = api.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = expected(q, k, v, causal_mask(Sq, Sk))
    np.testing.assert_allclose(out, ref_out, atol=TOL)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))  # Sq > Sk leaves the first rows empty
    np.testing.assert_allclose(lse, ref_lse, atol=TOL)


def test_pattern_is_built_for_the_lengths():
    q, k, v = qkv(Sq=100, Sk=100)
    pattern = patterns.local(window=24, block=16)
    out = api.attention(q, k, v, pattern)
    lay = pattern.layout(100, 100)
    np.testing.assert_allclose(out, expected(q, k, v, lay.to_dense())[0], atol=TOL)
    q2, k2, v2 = qkv(Sq=40, Sk=40, seed=5)
    np.testing.assert_allclose(
        api.attention(q2, k2, v2, pattern),
        expected(q2, k2, v2, pattern.layout(40, 40).to_dense())[0],
        atol=TOL,
    )


def test_block_layout_with_causal_intersects():
    q, k, v = qkv(Hq=4, Hkv=2, Sq=64, Sk=96)
    lay = random_layout(64, 96, heads=4, empty_rows=False)
    out = api.attention(q, k, v, lay, causal=True)
    mask = lay.to_dense() & causal_mask(64, 96)
    np.testing.assert_allclose(out, expected(q, k, v, mask)[0], atol=TOL)
    # The same layout gives the same intersection object, so per-layout caches keep working.
    sizes = cusparseattn.call.Sizes(2, 4, 2, 64, 96, 16, "float32", ("cpu", 0), "numpy")
    assert call.resolve_layout(lay, True, sizes) is call.resolve_layout(lay, True, sizes)


def test_pattern_with_causal_intersects():
    q, k, v = qkv(Sq=80, Sk=80)
    pattern = patterns.local(window=20, block=16, causal=False)
    out = api.attention(q, k, v, pattern, causal=True)
    mask = pattern.layout(80, 80).to_dense() & causal_mask(80, 80)
    np.testing.assert_allclose(out, expected(q, k, v, mask)[0], atol=TOL)


def test_token_rule_layout_and_empty_rows():
    q, k, v = qkv(Sq=64, Sk=64)
    rule = TokenRule("odd", lambda b, h, q, k: (q + k) % 3 != 0)
    blocks = np.ones((4, 4), bool)
    blocks[2] = False
    lay = BlockLayout(blocks, block_size=16, seq_q=64, partial=blocks, rule=rule)
    out, lse = api.attention_forward(q, k, v, lay)
    ref_out, ref_lse = expected(q, k, v, lay.to_dense())
    np.testing.assert_allclose(out, ref_out, atol=TOL)
    assert np.all(out[:, :, 32:48] == 0) and np.all(lse[:, :, 32:48] == -np.inf)
    assert not np.isnan(out).any()


@pytest.mark.parametrize("scale", [0.3, 2, np.float32(0.5), -1.0])
def test_scale(scale):
    q, k, v = qkv()
    out = api.attention(q, k, v, scale=scale)
    np.testing.assert_allclose(
        out, expected(q, k, v, np.ones((70, 90), bool), scale=float(scale))[0], atol=TOL
    )


def test_bshd_views_match_contiguous_inputs():
    q, k, v = (x.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3) for x in qkv())
    assert not q.flags.c_contiguous
    np.testing.assert_array_equal(
        api.attention(q, k, v), api.attention(*(np.ascontiguousarray(x) for x in (q, k, v)))
    )


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_dtypes(dtype):
    q, k, v = qkv(dtype=dtype, Sq=40, Sk=40)
    out, lse = api.attention_forward(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    precision = np.float64 if dtype == np.float64 else np.float32
    ref = reference.forward(q, k, v, patterns.causal().layout(40, 40), precision=precision)[0]
    np.testing.assert_array_equal(out, ref)


def test_backward_matches_reference():
    q, k, v = qkv()
    dout = randn(*q.shape, dtype=np.float64, seed=9)
    lay = random_layout(70, 90, heads=4)
    out, lse = api.attention_forward(q, k, v, lay)
    grads = api.attention_backward(dout, q, k, v, out, lse, lay)
    ref = reference.backward(dout, q, k, v, out, lse, lay, scale=0.25, precision=np.float64)
    for got, want in zip(grads, ref, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.any(grads[0][:, :, 16:32])  # the empty block row


# ---- errors before any work ----------------------------------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the reference runs: the call under test must raise first."""

    def boom(*args, **kwargs):
        raise AssertionError("work started before validation finished")

    monkeypatch.setattr(reference, "forward", boom)
    monkeypatch.setattr(reference, "backward", boom)


Q, K, V = qkv(Sq=64, Sk=64, dtype=np.float32)

ERRORS = [
    ({"scale": float("nan")}, ValueError, "scale must be finite, got nan"),
    ({"scale": float("inf")}, ValueError, "scale must be finite, got inf"),
    ({"scale": "0.1"}, TypeError, r"scale must be a real number or None \(1/sqrt\(D\)\), got str"),
    ({"scale": True}, TypeError, "scale must be a real number or None"),
    ({"causal": 1}, TypeError, "causal must be True or False, got 1"),
    (
        {"layout": "local"},
        TypeError,
        "layout must be None, a Pattern, a BlockLayout or a DynamicLayout, got str",
    ),
    (
        {"layout": patterns.causal(block=16).layout(32)},
        ValueError,
        r"pattern.layout\(64, 64\), or pass the Pattern",
    ),
    (
        {"backend": "triton"},
        ValueError,
        "backend must be one of 'cuda', 'reference', 'flex', 'sdpa', got 'triton'",
    ),
    (
        {"backend": "cuda"},
        ValueError,
        "backend 'cuda' cannot run the forward for q float32 \\[2, 4, 64, 16\\]",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), ERRORS)
def test_errors_come_before_work(kwargs, error, message, no_work):
    with pytest.raises(error, match=message):
        api.attention(Q, K, V, **kwargs)


def test_validation_errors_name_the_argument(no_work):
    with pytest.raises(ValueError, match="k has 2 heads, and q's 3 heads are not a multiple of it"):
        api.attention(Q[:, :3], K, V)
    with pytest.raises(ValueError, match=r"lse has shape \(2, 4, 3\)"):
        api.attention_backward(Q, Q, K, V, Q, Q[..., :3, 0], causal=True)
    with pytest.raises(TypeError, match="dout must be a NumPy, CuPy, PyTorch or JAX array"):
        api.attention_backward([1], Q, K, V, Q, Q[..., 0])
    with pytest.raises(TypeError, match=r"q, k, v must be arrays of one framework, got \{'numpy', 'torch'\}"):
        api.attention(Q, torch.from_numpy(K), V)


# ---- PyTorch and JAX on the CPU: same framework out, zero copy in ---------------------------------------


@pytest.fixture
def seen_by_reference(monkeypatch):
    """Record the arrays that the reference receives and returns."""
    seen = {}
    forward = reference.forward

    def spy(q, k, v, layout, **kwargs):
        seen["q"] = q
        seen["out"], seen["lse"] = forward(q, k, v, layout, **kwargs)
        return seen["out"], seen["lse"]

    monkeypatch.setattr(reference, "forward", spy)
    return seen


@pytest.mark.parametrize("layout", [None, "pattern"])
def test_torch_cpu_in_torch_out_zero_copy(layout, seen_by_reference):
    q, k, v = (torch.from_numpy(x) for x in qkv(dtype=np.float32))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a [B, S, H, D] tensor seen as [B, H, S, D]
    lay = patterns.local(window=32, block=16) if layout else None
    out, lse = api.attention_forward(q, k, v, lay, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and lse.dtype == torch.float32
    assert seen_by_reference["q"].ctypes.data == q.data_ptr()  # the reference read the tensor's own memory
    assert seen_by_reference["q"].strides == tuple(4 * s for s in q.stride())
    assert out.data_ptr() == seen_by_reference["out"].ctypes.data  # and its result came back without a copy
    want = reference.forward(q.numpy(), k.numpy(), v.numpy(), call.resolve_layout(lay, True, sizes_of(q, k)))
    np.testing.assert_array_equal(out.numpy(), want[0])
    np.testing.assert_array_equal(lse.numpy(), want[1])


def sizes_of(q, k):
    B, Hq, Sq, D = q.shape
    return cusparseattn.call.Sizes(B, Hq, k.shape[1], Sq, k.shape[2], D, "float32", ("cpu", 0), "torch")


def test_torch_bfloat16_round_trip(seen_by_reference):
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in qkv(dtype=np.float32))
    out = api.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and seen_by_reference["q"].ctypes.data == q.data_ptr()
    want = reference.forward(*(wrap_np(x) for x in (q, k, v)), patterns.causal().layout(70, 90))[0]
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))


def wrap_np(t):
    return t.float().numpy().astype(ml_dtypes.bfloat16)


def test_jax_cpu_reads_in_place(seen_by_reference):
    q, k, v = (jnp.asarray(x) for x in qkv(dtype=np.float32))
    out, lse = api.attention_forward(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and lse.shape == (2, 4, 70)
    # The reference runs inside an XLA call on XLA's own buffers: the array's memory, not a copy.
    assert seen_by_reference["q"].ctypes.data == q.unsafe_buffer_pointer()
    want = reference.forward(*(np.asarray(x) for x in (q, k, v)), patterns.causal().layout(70, 90))
    np.testing.assert_array_equal(np.asarray(out), want[0])
    np.testing.assert_array_equal(np.asarray(lse), want[1])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_functional_pair(jit):
    q, k, v = (jnp.asarray(x) for x in qkv(dtype=np.float32))
    dout = jnp.asarray(randn(2, 4, 70, 16, seed=9))
    lay = patterns.local(window=40, block=32)

    def pair(q, k, v, dout):
        out, lse = api.attention_forward(q, k, v, lay, causal=True)
        return out, lse, api.attention_backward(dout, q, k, v, out, lse, lay, causal=True)

    out, lse, grads = (jax.jit(pair) if jit else pair)(q, k, v, dout)
    host = [np.asarray(x) for x in (q, k, v)]
    resolved = call.resolve_layout(lay, True, sizes_of(q, k))
    want_out, want_lse = reference.forward(*host, resolved)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    want = reference.backward(np.asarray(dout), *host, want_out, want_lse, resolved)
    for got, ref in zip(grads, want, strict=True):
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_attention_dispatches_to_the_differentiable_adapters():
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(Sq=32, Sk=32, dtype=np.float32))
    out = api.attention(q, k, v)
    assert out.grad_fn is not None  # recorded by the torch adapter: the raw pair returns no autograd graph
    jq, jk, jv = (jnp.asarray(x.detach().numpy()) for x in (q, k, v))
    grad = jax.grad(lambda q: api.attention(q, jk, jv).sum())(jq)
    out.sum().backward()
    np.testing.assert_allclose(np.asarray(grad), q.grad.numpy(), atol=1e-5)


def test_numpy_users_never_import_torch_or_jax():
    code = (
        "import sys, numpy as np, cusparseattn\n"
        "q = np.ones((1, 2, 16, 8), np.float32)\n"
        "cusparseattn.attention(q, q, q, causal=True)\n"
        "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ---- docstring examples --------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["arrays", "api", "backends", "torch", "jax"])
def test_docstring_examples(module):
    mod = importlib.import_module(f"cusparseattn.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- GPU: results on the caller's device and stream ------------------------------------------------------


def spy_on_kernel(monkeypatch) -> dict:
    """Record the stream and device that the CUDA forward launches on."""
    from cusparseattn import cuda, launches

    launched, run = {}, launches.run_launches

    def spy(device, launches, stream, addresses):
        launched.update(stream=stream, device=("cuda", device))
        return run(device, launches, stream, addresses)

    monkeypatch.setattr(cuda, "run_launches", spy)
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["dense", "local"])
def test_torch_cuda_in_out_same_device_and_stream(dtype, layout, monkeypatch):
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    q, k, v = (torch.from_numpy(x).to(dev, getattr(torch, dtype)) for x in qkv(Sq=200, Sk=200, D=64))
    lay = patterns.local(window=64, block=32) if layout == "local" else None
    stream = torch.cuda.Stream(dev)
    launched = spy_on_kernel(monkeypatch)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        out, lse = api.attention_forward(q, k, v, lay, causal=True)
    stream.synchronize()
    assert launched == {"stream": stream.cuda_stream, "device": ("cuda", dev.index)}
    assert out.device == dev and lse.device == dev and out.dtype == q.dtype and lse.dtype == torch.float32
    host = [x.float().cpu().numpy().astype(np.float32) for x in (q, k, v)]
    want, want_lse = reference.forward(*host, call.resolve_layout(lay, True, sizes_of(q, k)))
    tol = 2e-2 if dtype == "bfloat16" else 2e-3
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=tol)
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=tol)


@pytest.mark.gpu
def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    q, k, v = (cupy.asarray(x.astype(np.float16)) for x in qkv(Sq=128, Sk=128, D=64))
    out = api.attention(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16 and out.device == q.device
    host = [cupy.asnumpy(x) for x in (q, k, v)]
    want = reference.forward(*host, patterns.causal().layout(128, 128))[0]
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float32), want.astype(np.float32), atol=2e-3)
