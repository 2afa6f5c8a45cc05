"""The array holders (NumPy, PyTorch, JAX on the CPU; CuPy and CUDA on a GPU) and the validation of inputs."""

from __future__ import annotations

import numpy as np
import pytest

from cusparseattn import arrays
from cusparseattn.arrays import CPU, wrap
from cusparseattn.call import Sizes, check_layout, validate
from cusparseattn.layout import BlockLayout

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
pytestmark = pytest.mark.usefixtures("jax_on_cpu")

DTYPES = ["float16", "bfloat16", "float32", "float64"]


def randn(*shape, dtype="float32", seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(arrays.DTYPES[dtype])


def torch_of(x):
    if x.dtype == arrays.DTYPES["bfloat16"]:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(x)


# ---- wrap and the holders' fields ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_holder_fields(dtype):
    x = randn(2, 5, 3, 8, dtype=dtype).transpose(0, 2, 1, 3)  # [B, S, H, D] seen as [B, H, S, D]
    h = wrap(x, "q")
    assert (h.framework, h.dtype, h.device, h.stream, h.name) == ("numpy", dtype, CPU, 0, "q")
    assert h.shape == (2, 3, 5, 8) and h.strides == (120, 8, 24, 1)
    assert h.data_ptr == x.ctypes.data and h.numpy() is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_holder_fields(dtype):
    t = torch_of(randn(2, 5, 3, 8, dtype=dtype)).transpose(1, 2)
    h = wrap(t, "k")
    assert (h.framework, h.dtype, h.device, h.stream) == ("torch", dtype, CPU, 0)
    assert h.shape == (2, 3, 5, 8) and h.strides == (120, 8, 24, 1) and h.data_ptr == t.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_holder_fields(dtype, x64):
    x = jnp.asarray(randn(2, 3, 5, 8, dtype=dtype))
    h = wrap(x, "v")
    assert (h.framework, h.dtype, h.device, h.stream, h.traced) == ("jax", dtype, CPU, 0, False)
    assert h.shape == (2, 3, 5, 8) and h.strides == (120, 40, 8, 1)
    assert h.data_ptr == x.unsafe_buffer_pointer()


def test_jax_tracer_has_shape_but_no_memory():
    seen = {}

    @jax.jit
    def f(x):
        h = wrap(x, "q")
        seen.update(traced=h.traced, shape=h.shape, dtype=h.dtype, device=h.device)
        with pytest.raises(TypeError, match="q is traced inside jax.jit and has no memory"):
            h.data_ptr  # noqa: B018
        return x

    with jax.default_device("cpu"):  # the default device named by platform
        f(jnp.ones((1, 2, 3, 4), jnp.float32))
    assert seen == {"traced": True, "shape": (1, 2, 3, 4), "dtype": "float32", "device": CPU}


@pytest.mark.parametrize("value", [[1.0, 2.0], 3.5, "q", None])
def test_wrap_rejects_other_types_by_name(value):
    with pytest.raises(TypeError, match="^q must be a NumPy, CuPy, PyTorch or JAX array, got builtins"):
        wrap(value, "q")


def test_wrap_leaves_holders_alone_and_rejects_torch_non_tensors():
    h = wrap(np.ones(3), "q")
    assert wrap(h, "k") is h
    with pytest.raises(TypeError, match="^k must be an array, got torch.Size"):
        wrap(torch.Size([1, 2]), "k")


def test_jax_gpu_array_has_no_stream_outside_xla(monkeypatch):
    monkeypatch.setattr(arrays.JaxTensor, "device", property(lambda self: ("cuda", 0)))
    with pytest.raises(
        TypeError, match="q is a JAX GPU array, and JAX exposes no stream to launch on outside"
    ):
        wrap(jnp.ones((2, 3)), "q").stream  # noqa: B018


class FakeXlaBuffer:
    """What jax.experimental.buffer_callback lends a callback on a GPU (there is none here)."""

    def __init__(self, shape, typestr, address, device=3, **strides):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (address, False),
            **strides,
        }
        self.device = device

    def __dlpack_device__(self):
        return (2, self.device)  # kDLCUDA


# bfloat16's type string is a bare 2-byte void: the holder takes the dtype from JAX, never from the string.
XLA_DTYPES = [("bfloat16", "<V2"), ("float16", "<f2"), ("float32", "<f4")]


@pytest.mark.parametrize("dtype, typestr", XLA_DTYPES)
@pytest.mark.parametrize("strides", [{}, {"strides": None}], ids=["no_strides", "strides_none"])
def test_xla_buffer_holder_fields(dtype, typestr, strides):
    buf = FakeXlaBuffer((2, 3, 5, 8), typestr, 0x7F0000001000, **strides)
    h = arrays.XlaBuffer(buf, "q", dtype, stream=0xABC)
    assert (h.framework, h.name, h.native, h.dtype, h.device) == ("jax", "q", buf, dtype, ("cuda", 3))
    assert (h.shape, h.strides, h.data_ptr, h.stream) == (
        (2, 3, 5, 8),
        (120, 40, 8, 1),
        0x7F0000001000,
        0xABC,
    )
    assert h.describe() == f"q {dtype} [2, 3, 5, 8] (jax, cuda:3)" and wrap(h, "k") is h


@pytest.mark.parametrize("dtype, typestr", XLA_DTYPES)
def test_xla_buffer_holder_reads_byte_strides(dtype, typestr):
    size = arrays.DTYPES[dtype].itemsize
    # A [B, S, H, D] buffer seen as [B, H, S, D], strides in bytes as the interface gives them.
    buf = FakeXlaBuffer(
        (1, 3, 5, 8), typestr, 4096, device=0, strides=tuple(size * s for s in (120, 8, 24, 1))
    )
    h = arrays.XlaBuffer(buf, "k", dtype, stream=0)
    assert h.strides == (120, 8, 24, 1) and h.device == ("cuda", 0) and h.shape == (1, 3, 5, 8)


def test_xla_buffers_pass_validation():
    q, k = (FakeXlaBuffer(s, "<V2", 256 * i) for i, s in enumerate([(1, 4, 24, 8), (1, 2, 40, 8)], 1))
    h = [arrays.XlaBuffer(b, n, "bfloat16", stream=1) for b, n in ((q, "q"), (k, "k"), (k, "v"))]
    assert validate(*h) == Sizes(1, 4, 2, 24, 40, 8, "bfloat16", ("cuda", 3), "jax")


# ---- numpy(): zero copy on the CPU ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_torch_numpy_view_shares_memory(dtype, requires_grad):
    t = torch_of(randn(2, 7, 3, 8, dtype=dtype)).transpose(1, 2)
    t.requires_grad_(requires_grad and t.is_floating_point())
    view = wrap(t, "q").numpy()
    assert view.ctypes.data == t.data_ptr() and view.dtype == arrays.DTYPES[dtype]
    assert view.strides == tuple(s * t.element_size() for s in t.stride())
    np.testing.assert_array_equal(view.astype(np.float64), t.detach().double().numpy())
    view[0, 0, 0, 0] = 5  # the same memory: a write shows in the tensor
    assert float(t.detach()[0, 0, 0, 0]) == 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_numpy_view_shares_memory(dtype, x64):
    x = jnp.asarray(randn(2, 3, 7, 8, dtype=dtype))
    view = wrap(x, "q").numpy()
    assert view.ctypes.data == x.unsafe_buffer_pointer() and view.dtype == arrays.DTYPES[dtype]
    np.testing.assert_array_equal(view, np.asarray(x))


# ---- empty() and from_numpy() --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [np.asarray, torch.from_numpy, jnp.asarray], ids=["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_empty_is_same_framework_and_device(make, dtype):
    h = wrap(make(randn(1, 2, 3, 4)), "q")
    e = h.empty((2, 3, 4), dtype)
    assert (type(e), e.framework, e.device, e.shape, e.dtype) == (type(h), h.framework, CPU, (2, 3, 4), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_from_numpy_zero_copy(dtype):
    h = wrap(torch.ones(1, dtype=torch.float32), "q")
    result = randn(2, 3, 4, dtype=dtype)
    t = h.from_numpy(result).native
    assert isinstance(t, torch.Tensor) and t.data_ptr() == result.ctypes.data
    assert str(t.dtype) == f"torch.{dtype}" and t.device.type == "cpu"
    np.testing.assert_array_equal(t.double().numpy(), result.astype(np.float64))


def test_torch_from_numpy_copies_read_only_arrays():
    result = randn(3, 4)
    result.setflags(write=False)
    t = wrap(torch.ones(1), "q").from_numpy(result).native
    assert t.data_ptr() != result.ctypes.data
    np.testing.assert_array_equal(t.numpy(), result)


def aligned(arr: np.ndarray, alignment: int = 64) -> np.ndarray:
    buf = np.empty(arr.nbytes + alignment, np.uint8)
    start = -buf.ctypes.data % alignment
    out = buf[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_from_numpy(dtype, x64):
    h = wrap(jnp.ones(1), "q")
    result = aligned(randn(2, 3, 4, dtype=dtype))
    x = h.from_numpy(result).native
    assert isinstance(x, jax.Array) and x.dtype == result.dtype
    np.testing.assert_array_equal(np.asarray(x), result)
    if dtype != "bfloat16":  # DLPack carries no bfloat16: that one dtype is copied
        assert x.unsafe_buffer_pointer() == result.ctypes.data
    unaligned = h.from_numpy(randn(65, dtype=dtype)[1:]).native  # XLA wants 64 bytes: copied, same values
    np.testing.assert_array_equal(np.asarray(unaligned), randn(65, dtype=dtype)[1:])


def test_describe_names_framework_and_device():
    assert wrap(torch.ones(2, 3, dtype=torch.bfloat16), "k").describe() == "k bfloat16 [2, 3] (torch, cpu)"
    assert arrays.device_name(("cuda", 1)) == "cuda:1"


# ---- validate ------------------------------------------------------------------------------------------


def qkv(B=2, Hq=4, Hkv=2, Sq=20, Sk=24, D=8, dtype="float32"):
    return (
        randn(B, Hq, Sq, D, dtype=dtype),
        randn(B, Hkv, Sk, D, dtype=dtype, seed=1),
        randn(B, Hkv, Sk, D, dtype=dtype, seed=2),
    )


def check(q, k, v, **extra):
    wrapped = {name: wrap(x, name) for name, x in extra.items()}
    return validate(wrap(q, "q"), wrap(k, "k"), wrap(v, "v"), **wrapped)


def test_validate_returns_sizes():
    q, k, v = qkv()
    assert check(q, k, v) == Sizes(2, 4, 2, 20, 24, 8, "float32", CPU, "numpy")


def test_validate_accepts_bshd_views_without_copy():
    q = randn(2, 20, 4, 8).transpose(0, 2, 1, 3)
    k, v = (randn(2, 24, 2, 8, seed=s).transpose(0, 2, 1, 3) for s in (1, 2))
    assert check(q, k, v).heads_q == 4
    t = torch.randn(2, 20, 4, 8).transpose(1, 2)
    assert check(t, t, t).seq_q == 20


Q, K, V = qkv()
LSE = np.zeros((2, 4, 20), np.float32)

VALIDATION_ERRORS = [
    ((Q[0], K, V), {}, ValueError, r"q must be 4-D \[batch, heads, seq, head_dim\], got shape \(4, 20, 8\)"),
    ((Q[:, :, :0], K, V), {}, ValueError, r"q has an empty dimension: shape \(2, 4, 0, 8\)"),
    ((Q, K[:1], V[:1]), {}, ValueError, "k has batch size 1, expected q's batch size 2"),
    ((Q, K[..., :4], V[..., :4]), {}, ValueError, "k has head dim 4, expected q's head dim 8"),
    ((Q, K, V[:, :, :5]), {}, ValueError, r"v has shape \(2, 2, 5, 8\), expected k's shape \(2, 2, 24, 8\)"),
    (
        (Q, K[:, :1].repeat(3, 1), V[:, :1].repeat(3, 1)),
        {},
        ValueError,
        "k has 3 heads, and q's 4 heads are not",
    ),
    ((Q, K, V), {"dout": Q[:, :2]}, ValueError, r"dout has shape \(2, 2, 20, 8\), expected q's shape"),
    ((Q, K, V), {"lse": LSE[:, :, :3]}, ValueError, r"lse has shape \(2, 4, 3\), expected .* = \(2, 4, 20\)"),
    (
        (Q, K.astype(np.float16), V),
        {},
        ValueError,
        r"q, k, v must have one dtype, got \{'float16', 'float32'\}",
    ),
    (
        (Q.astype(np.int32), K.astype(np.int32), V.astype(np.int32)),
        {},
        ValueError,
        "q, k, v have dtype int32, expected one of float16, bfloat16, float32, float64",
    ),
    ((Q, K, V), {"lse": LSE.astype(np.float16)}, ValueError, "lse has dtype float16, expected float32"),
    (
        (Q, K, torch.from_numpy(V)),
        {},
        TypeError,
        r"q, k, v must be arrays of one framework, got \{'numpy', 'torch'",
    ),
    (
        (Q[..., ::2], K[..., ::2], V[..., ::2]),
        {},
        ValueError,
        r"q's last dimension must be contiguous \(stride 1\)",
    ),
]


@pytest.mark.parametrize(("args", "extra", "error", "message"), VALIDATION_ERRORS)
def test_validate_errors(args, extra, error, message):
    with pytest.raises(error, match=message):
        check(*args, **extra)


def test_validate_devices():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"q, k, v must be on one device, got \{'cpu', 'meta:0'\}"):
        check(q, q, q.to("meta"))
    with pytest.raises(ValueError, match="q, k, v are on meta:0; expected cpu or cuda arrays"):
        check(*(q.to("meta"),) * 3)


# ---- layouts -------------------------------------------------------------------------------------------


SIZES = Sizes(2, 4, 2, 100, 130, 8, "float32", CPU, "numpy")


def block_layout(batch=1, heads=1, seq_q=100, seq_k=130, block=32):
    nq, nk = -(-seq_q // block), -(-seq_k // block)
    return BlockLayout(np.ones((batch, heads, nq, nk), bool), block_size=block, seq_q=seq_q, seq_k=seq_k)


@pytest.mark.parametrize(("batch", "heads"), [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_check_layout_accepts_shared_and_per_head(batch, heads):
    check_layout(block_layout(batch, heads), SIZES)


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        (
            block_layout(seq_q=128, seq_k=128),
            ValueError,
            r"layout was built for seq_q=128, seq_k=128, but q has 100 tokens and k has 130; build the "
            r"layout for these lengths with pattern.layout\(100, 130\), or pass the Pattern",
        ),
        (
            block_layout(batch=3),
            ValueError,
            "layout has batch 3, expected 1 \\(shared\\) or q's batch size 2",
        ),
        (block_layout(heads=2), ValueError, "layout has 2 heads, expected 1 \\(shared\\) or q's 4 heads"),
        (np.ones((4, 5), bool), TypeError, "a BlockLayout or a DynamicLayout, got ndarray"),
    ],
)
def test_check_layout_errors(layout, error, message):
    with pytest.raises(error, match=message):
        check_layout(layout, SIZES)


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_cuda_holder(dtype):
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    t = torch_of(randn(1, 6, 2, 16, dtype=dtype)).to(dev).transpose(1, 2)
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        h = wrap(t, "q")
        assert h.stream == stream.cuda_stream != torch.cuda.default_stream(dev).cuda_stream
    assert (h.device, h.dtype, h.data_ptr, h.strides) == (
        ("cuda", dev.index),
        dtype,
        t.data_ptr(),
        t.stride(),
    )
    np.testing.assert_array_equal(h.numpy(), wrap(t.cpu(), "q").numpy())
    e = h.empty((2, 3), "bfloat16").native
    assert e.device == dev and e.dtype == torch.bfloat16
    back = h.from_numpy(randn(3, 4, dtype=dtype)).native
    assert back.device == dev and str(back.dtype) == f"torch.{dtype}"
    np.testing.assert_array_equal(wrap(back.cpu(), "x").numpy(), randn(3, 4, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cupy_holder(dtype):
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(cupy.cuda.runtime.getDeviceCount() - 1) as dev:
        x = cupy.asarray(randn(1, 6, 2, 16, dtype=dtype)).transpose(0, 2, 1, 3)
        stream = cupy.cuda.Stream()
        with stream:
            h = wrap(x, "k")
            assert h.stream == stream.ptr
    assert (h.framework, h.device, h.dtype, h.data_ptr) == ("cupy", ("cuda", dev.id), dtype, x.data.ptr)
    assert h.strides == (192, 16, 32, 1)
    np.testing.assert_array_equal(h.numpy(), randn(1, 6, 2, 16, dtype=dtype).transpose(0, 2, 1, 3))
    e = h.empty((2, 3), "float16").native
    assert isinstance(e, cupy.ndarray) and e.device == x.device and e.dtype == np.float16
    back = h.from_numpy(randn(3, 4, dtype=dtype)).native
    assert back.device == x.device
    np.testing.assert_array_equal(cupy.asnumpy(back), randn(3, 4, dtype=dtype))


@pytest.mark.gpu
def test_jax_gpu_holder():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU")
    x = jax.device_put(jnp.asarray(randn(1, 2, 6, 16)), gpus[0])
    h = wrap(x, "v")
    assert h.device == ("cuda", gpus[0].local_hardware_id)
    with pytest.raises(TypeError, match="JAX exposes no stream to launch on outside XLA"):
        h.stream  # noqa: B018
    np.testing.assert_array_equal(h.numpy(), randn(1, 2, 6, 16))
    e = h.empty((2, 3), "float16").native
    assert e.devices() == {gpus[0]} and e.dtype == jnp.float16
    back = h.from_numpy(randn(3, 4)).native
    assert back.devices() == {gpus[0]}
    np.testing.assert_array_equal(np.asarray(back), randn(3, 4))
