"""The JAX adapter: gradients by check_grads (CPU, float64), eagerly and under jit, vmap, empty rows; which
XLA call runs each pass (buffer_callback in place, pure_callback on host copies); on a GPU the kernels inside
jit on XLA's buffers and stream."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from kernel_cases import FLOAT32_BOUNDS, np_dtype

from cusparseattn import arrays, backends, dynamic, native_backends, patterns, plans, reference
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule
from cusparseattn.testing import backward_refs, check_close, forward_refs, random_qkv

jax = pytest.importorskip("jax")
ca_jax = pytest.importorskip("cusparseattn.jax")
jnp = jax.numpy
from jax.test_util import check_grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_on_cpu")


def arrays_of(B=1, Hq=2, Hkv=2, Sq=24, Sk=24, D=4, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)]
    return [jnp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


def sparse_layout(Sq=40, Sk=48, heads=1, seed=3, block=16):
    """A random block layout with a token rule in its partial blocks and an empty query block row."""
    rng = np.random.default_rng(seed)
    blocks = rng.random((1, heads, -(-Sq // block), -(-Sk // block))) < 0.6
    blocks[..., 1, :] = False
    partial = blocks & (rng.random(blocks.shape) < 0.5)
    rule = TokenRule("mod3", lambda b, h, q, k: (q + 2 * k) % 3 != 0)
    return BlockLayout(blocks, block_size=block, seq_q=Sq, seq_k=Sk, partial=partial, rule=rule)


CASES = {
    "dense": (dict(), dict()),
    "causal": (dict(Sq=20, Sk=28), dict(causal=True)),
    "causal_sq_gt_sk": (dict(Sq=28, Sk=20), dict(causal=True)),
    "random_layout": (dict(Sq=40, Sk=48), dict(layout=sparse_layout(heads=2))),
    "gqa": (dict(Hq=4, Hkv=2, Sq=20, Sk=20), dict(layout=patterns.local(window=8, block=16))),
    "mqa_scaled": (dict(Hq=3, Hkv=1, Sq=18, Sk=30), dict(scale=0.7, causal=True)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_check_grads(name, jit, x64):
    sizes, kwargs = CASES[name]

    def f(q, k, v):
        return ca_jax.attention(q, k, v, **kwargs)

    check_grads(jax.jit(f) if jit else f, tuple(arrays_of(**sizes)), order=1, modes=["rev"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_values_and_gradients_match_reference(jit):
    q, k, v = arrays_of(Hq=4, Hkv=2, Sq=30, Sk=40, D=8, dtype=np.float32)
    lay = patterns.causal(block=16).layout(30, 40)
    dout = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape).astype(np.float32))

    def f(q, k, v):
        return ca_jax.attention(q, k, v, lay, return_lse=True)

    (out, lse), vjp = jax.vjp(jax.jit(f) if jit else f, q, k, v)
    grads = vjp((dout, jnp.zeros_like(lse)))
    host = [np.asarray(x) for x in (q, k, v)]
    want_out, want_lse = reference.forward(*host, lay)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    want = reference.backward(np.asarray(dout), *host, want_out, want_lse, lay)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_empty_rows_have_zero_gradients(x64):
    lay = sparse_layout()
    q, k, v = arrays_of(Sq=40, Sk=48, D=8)
    out = ca_jax.attention(q, k, v, lay)
    assert jnp.all(out[:, :, 16:32] == 0)
    grads = jax.grad(lambda q, k, v: (ca_jax.attention(q, k, v, lay) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert jnp.all(grads[0][:, :, 16:32] == 0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_over_an_extra_axis(jit):
    q, k, v = (jnp.stack([x, 2 * x]) for x in arrays_of(Sq=20, Sk=20, D=8, dtype=np.float32))

    def loss(q, k, v):
        return (ca_jax.attention(q, k, v, causal=True) ** 2).sum()

    batched = jax.vmap(lambda q, k, v: (ca_jax.attention(q, k, v, causal=True), jax.grad(loss)(q, k, v)))
    out, grad = (jax.jit(batched) if jit else batched)(q, k, v)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(out[i]), np.asarray(ca_jax.attention(q[i], k[i], v[i], causal=True))
        )
        np.testing.assert_array_equal(np.asarray(grad[i]), np.asarray(jax.grad(loss)(q[i], k[i], v[i])))


def test_lse_is_a_constant_and_bfloat16_runs():
    q, k, v = arrays_of(dtype=np.float32)
    grad = jax.grad(lambda q: ca_jax.attention(q, k, v, return_lse=True)[1].sum())(q)
    assert not np.any(np.asarray(grad))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: ca_jax.attention(q, k, v, causal=True))(qb, kb, vb)
    assert out.dtype == jnp.bfloat16
    want = reference.forward(*(np.asarray(x) for x in (qb, kb, vb)), patterns.causal().layout(24))[0]
    np.testing.assert_array_equal(np.asarray(out), want)


def test_errors_are_raised_at_trace_time():
    q, k, v = arrays_of(dtype=np.float32)
    with pytest.raises(ValueError, match="k has 2 heads, and q's 3 heads are not a multiple of it"):
        jax.jit(lambda q, k, v: ca_jax.attention(q, k, v))(jnp.concatenate([q, q[:, :1]], axis=1), k, v)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run the forward"):
        jax.jit(lambda q, k, v: ca_jax.attention(q, k, v, backend="cuda"))(q, k, v)


# ---- which XLA call runs each pass ---------------------------------------------------------------------


def loss_and_grad(**kwargs):
    """``q -> d/dq sum(attention(q, k, v)^2)`` with k = v = q."""

    def loss(q):
        return (ca_jax.attention(q, q, q, **kwargs).astype(jnp.float32) ** 2).sum()

    return jax.grad(loss)


def test_cpu_passes_run_in_place_in_one_xla_call_each():
    (q,) = arrays_of(dtype=np.float32)[:1]
    text = jax.jit(loss_and_grad(causal=True)).lower(q).as_text()
    # Forward and backward: one buffer callback each, on XLA's CPU buffers; no host copies (pure_callback).
    assert text.count("custom_call @xla_buffer_python_cpu_callback") == 2
    assert "xla_ffi_python_cpu_callback" not in text and "pure_callback" not in text


def test_eager_calls_compile_once():
    compiles = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    (q,) = arrays_of(D=8, dtype=np.float32)[:1]
    step = loss_and_grad(layout=patterns.local(window=8, block=16))
    first = step(q)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        second = step(q)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    # The XLA call of each pass compares equal from call to call, so JAX's cache of eager calls finds it.
    assert compiles == []
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.fixture
def on_gpu(monkeypatch):
    """Make JAX arrays report a CUDA device, as they do on a GPU host (there is none here)."""
    monkeypatch.setattr(arrays.JaxTensor, "device", property(lambda self: ("cuda", 0)))
    monkeypatch.setattr(backends, "_warned", set())


@pytest.fixture
def kernels_can_run(monkeypatch):
    """Make the CUDA backend accept any inputs, so that tracing takes the kernels' path (never run here)."""
    monkeypatch.setattr(native_backends.CudaBackend, "not_supported_reasons", lambda self, inputs, op: [])


def test_gpu_kernels_trace_into_buffer_callbacks(on_gpu, kernels_can_run):
    (q,) = arrays_of(Sq=24, D=8, dtype=np.float32)[:1]
    jaxpr = jax.make_jaxpr(loss_and_grad(causal=True))(q.astype(jnp.bfloat16))
    calls = [e for e in jaxpr.eqns if "callback" in e.primitive.name]
    assert [(e.primitive.name, type(e.params["callback"])) for e in calls] == [
        ("buffer_callback", ca_jax._Kernels)
    ] * 2
    # The backward asks XLA for the kernels' float32 scratch (stats: two rows of 24 padded to 128) too, and
    # drops it.
    bf16, f32, stats = ("bfloat16", (1, 2, 24, 8)), ("float32", (1, 2, 24)), ("float32", (1, 2, 2, 128))
    results = [[(a.dtype.name, a.shape) for a in e.params["result_avals"]] for e in calls]
    assert results == [[bf16, f32], [bf16, bf16, bf16, stats]]
    assert "pure_callback" not in str(jax.make_jaxpr(jax.jit(loss_and_grad(causal=True)))(q))


def test_gpu_inputs_the_kernels_cannot_take_run_the_reference_on_host_copies_without_cupy(
    on_gpu, monkeypatch
):
    monkeypatch.setattr(native_backends, "_has_cupy", lambda: False)
    q, k, v = arrays_of(dtype=np.float32)
    want = reference.forward(*(np.asarray(x) for x in (q, k, v)), patterns.causal().layout(24))[0]
    f = jax.jit(lambda q: ca_jax.attention(q, k, v, causal=True))
    with pytest.warns(RuntimeWarning, match="running the NumPy reference on the host because cuda: "):
        jaxpr = str(jax.make_jaxpr(f)(q))
    assert "pure_callback" in jaxpr and "buffer_callback" not in jaxpr
    np.testing.assert_array_equal(np.asarray(f(q)), want)
    np.testing.assert_array_equal(np.asarray(ca_jax.attention(q, k, v, causal=True)), want)  # eager too
    with pytest.raises(ValueError, match="backend 'cuda' cannot run the forward"):
        jax.jit(lambda q: ca_jax.attention(q, k, v, backend="cuda"))(q)


def test_float32_and_float64_gpu_inputs_trace_into_the_reference_on_xla_buffers(on_gpu, monkeypatch, x64):
    """With CuPy, the reference runs on XLA's GPU buffers (a buffer_callback), with no host copy and no
    warning, where the kernels cannot (float64; float32 where they are not here). Traced only: these arrays
    are on the CPU, however they describe themselves."""
    monkeypatch.setattr(native_backends, "_has_cupy", lambda: True)
    cuda = native_backends.CudaBackend
    monkeypatch.setattr(cuda, "not_supported_reasons", lambda self, inputs, op: ["not here"])
    for dtype in (np.float32, np.float64):
        (q,) = arrays_of(dtype=dtype)[:1]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            jaxpr = jax.make_jaxpr(jax.jit(loss_and_grad(causal=True)))(q)
        calls = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if "callback" in e.primitive.name]
        assert [(e.primitive.name, type(e.params["callback"])) for e in calls] == [
            ("buffer_callback", ca_jax._ReferenceOnGpu)
        ] * 2
        lse = "float64" if dtype == np.float64 else "float32"
        name = np.dtype(dtype).name
        results = [[a.dtype.name for a in e.params["result_avals"]] for e in calls]
        assert results == [[name, lse], [name] * 3]


def test_traced_indices_of_a_dynamic_layout_are_operands_of_the_gpu_references_calls(on_gpu, monkeypatch):
    """On a GPU the reference in CuPy reads a traced dynamic layout's indices from XLA's int32 buffer, after
    the pass's inputs (traced only: there is no GPU here)."""
    from cusparseattn import dynamic

    monkeypatch.setattr(native_backends, "_has_cupy", lambda: True)
    (q,) = arrays_of(Sq=32, D=8, dtype=np.float32)[:1]

    def loss(q, idx):
        lay = dynamic.block_indices(idx, block=16)
        return (ca_jax.attention(q, q, q, lay, causal=True) ** 2).sum()

    idx = jnp.zeros((1, 1, 2, 1), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.jit(jax.grad(loss)))(q, idx)
    calls = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if "callback" in e.primitive.name]
    assert [type(e.params["callback"]) for e in calls] == [ca_jax._ReferenceOnGpu] * 2
    assert [[str(x.aval.dtype) for x in e.invars] for e in calls] == [
        ["float32"] * 3 + ["int32"],
        ["float32"] * 6 + ["int32"],
    ]

    class Buffer:  # XLA's int32 buffer as buffer_callback hands it over
        __cuda_array_interface__ = {"shape": (1, 1, 2, 1), "typestr": "<i4", "data": (4096, True)}

        def __dlpack_device__(self):
            return (2, 0)

    assert arrays.XlaBuffer(Buffer(), "indices", "int32", stream=7).strides == (2, 2, 1, 1)


def test_without_buffer_callback_the_cpu_copies_and_a_gpu_says_which_jax(monkeypatch):
    q, k, v = arrays_of(D=8, dtype=np.float32)
    want_grad = np.asarray(jax.jit(loss_and_grad(causal=True))(q))
    want_out = np.asarray(ca_jax.attention(q, k, v))
    monkeypatch.setattr(ca_jax, "buffer_callback", None)  # as in JAX older than 0.7
    step = jax.jit(loss_and_grad(causal=True))
    assert "pure_callback" in str(jax.make_jaxpr(step)(q)) and "buffer_callback" not in str(
        jax.make_jaxpr(step)(q)
    )
    np.testing.assert_array_equal(np.asarray(step(q)), want_grad)

    monkeypatch.setattr(arrays.JaxTensor, "device", property(lambda self: ("cuda", 0)))
    monkeypatch.setattr(native_backends.CudaBackend, "not_supported_reasons", lambda self, inputs, op: [])
    with pytest.raises(NotImplementedError, match=r"which JAX \S+ lacks: install JAX 0.7 or newer, or pass"):
        jax.jit(lambda q: ca_jax.attention(q, k, v))(q)
    with pytest.raises(NotImplementedError, match="install JAX 0.7 or newer"):
        ca_jax.attention(q, k, v)
    out = jax.jit(lambda q: ca_jax.attention(q, k, v, backend="reference"))(q)
    np.testing.assert_array_equal(np.asarray(out), want_out)


class FakeBuffer:
    """What ``buffer_callback`` lends on a GPU: a CUDA array interface (no strides: dense) and a device."""

    def __init__(self, shape, address, typestr="<V2"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False)}

    def __dlpack_device__(self):
        return (2, 1)  # kDLCUDA, device 1


class FakeContext:
    stream = 0x5EED


def spy_on_cuda(monkeypatch, reasons=()):
    """Record the kernel launches instead of running them; ``reasons`` is what the buffer check answers."""
    from cusparseattn import cuda, devices

    calls = {}

    def check(*named):
        calls["checked"] = [name for name, _ in named]
        return list(reasons)

    def passes(op):
        class Passes:
            """`cuda.Forward` / `cuda.Backward`: counts the plans, records the holders each is made for and
            the addresses and stream of each launch."""

            def __init__(self, q, k, v, layout, scale, *, score_mod, precision, **arrays):
                calls["planned"] = calls.get("planned", 0) + 1
                calls[op] = [q, k, v, *arrays.values(), layout, scale]
                calls["precision"] = precision

            def run_at(self, stream, addresses, *dout_and_layout):
                calls["launched"] = (stream, addresses)
                calls["launched_layout"] = dout_and_layout[-1]

        return Passes

    monkeypatch.setattr(devices, "tensor_reasons", check)
    monkeypatch.setattr(cuda, "Forward", passes("forward"))
    monkeypatch.setattr(cuda, "Backward", passes("backward"))
    plans.clear()
    return calls


def held(holders):
    return [(h.name, h.shape, h.strides, h.dtype, h.device, h.data_ptr, h.stream) for h in holders]


def test_kernel_pass_lends_xla_buffers_and_stream_to_the_kernels(monkeypatch):
    calls = spy_on_cuda(monkeypatch)
    lay = patterns.causal(block=16).layout(24, 40)
    q4, kv4, row, stats = (1, 4, 24, 8), (1, 2, 40, 8), (1, 4, 24), (1, 4, 2, 128)
    bufs = {n: FakeBuffer(s, 256 * (i + 1)) for i, (n, s) in enumerate(
        [("q", q4), ("k", kv4), ("v", kv4), ("out", q4), ("lse", row), ("dout", q4), ("dq", q4), ("dk", kv4),
         ("dv", kv4), ("stats", stats)]
    )}  # fmt: skip

    ca_jax._Kernels("forward", lay, 0.25, None, "bfloat16")(
        FakeContext(), (bufs["out"], bufs["lse"]), *(bufs[n] for n in "qkv")
    )
    *holders, layout, scale = calls["forward"]
    assert (layout, scale) == (lay, 0.25) and calls["checked"] == ["q", "k", "v"]
    assert held(holders) == [
        ("q", q4, (768, 192, 8, 1), "bfloat16", ("cuda", 1), 256, 0x5EED),
        ("k", kv4, (640, 320, 8, 1), "bfloat16", ("cuda", 1), 512, 0x5EED),
        ("v", kv4, (640, 320, 8, 1), "bfloat16", ("cuda", 1), 768, 0x5EED),
        ("out", q4, (768, 192, 8, 1), "bfloat16", ("cuda", 1), 1024, 0x5EED),
        ("lse", row, (96, 24, 1), "float32", ("cuda", 1), 1280, 0x5EED),
    ]
    assert calls["launched"] == (0x5EED, (256, 512, 768, 1024, 1280)) and calls["launched_layout"] is None
    moved = {
        n: FakeBuffer(b.__cuda_array_interface__["shape"], 4096 * (i + 1))
        for i, (n, b) in enumerate(bufs.items())
    }
    ca_jax._Kernels("forward", lay, 0.25, None, "bfloat16")(
        FakeContext(), (moved["out"], moved["lse"]), *(moved[n] for n in "qkv")
    )
    # The same pass on buffers laid out alike, elsewhere: planned once, launched on the new addresses.
    assert calls["planned"] == 1 and calls["launched"] == (0x5EED, (4096, 8192, 12288, 16384, 20480))

    order = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")
    outputs = tuple(bufs[n] for n in ("dq", "dk", "dv", "stats"))
    ca_jax._Kernels("backward", lay, 0.25, None, "float16")(
        FakeContext(), outputs, *(bufs[n] for n in order[:6])
    )
    *holders, layout, scale = calls["backward"]
    bound = ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv", "stats")
    assert [h.name for h in holders] == list(bound) and (layout, scale) == (lay, 0.25)
    assert calls["checked"] == list(order[:6])  # the inputs; XLA allocates the outputs
    assert [h.dtype for h in holders] == ["float16"] * 4 + ["float16", "float32"] + ["float16"] * 3 + [
        "float32"
    ]
    assert {h.stream for h in holders} == {0x5EED}
    # XLA's order to the passes' (q, k, v, out, lse, dout, dq, dk, dv, stats)
    passes_order = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "stats")
    assert calls["launched"] == (
        0x5EED,
        tuple(bufs[n].__cuda_array_interface__["data"][0] for n in passes_order),
    )


def test_kernel_pass_refills_a_dynamic_layout_from_each_calls_index_buffers(monkeypatch):
    """A dynamic layout's indices come as operands after the inputs: each launch gets the layout over that
    call's index buffers, and calls with other index buffers of the same shape share the plan."""
    calls = spy_on_cuda(monkeypatch)
    lay = dynamic.block_indices(np.zeros((1, 1, 2, 3), np.int32), block=16)
    shapes = {
        "q": (1, 4, 24, 8),
        "k": (1, 2, 40, 8),
        "v": (1, 2, 40, 8),
        "out": (1, 4, 24, 8),
        "lse": (1, 4, 24),
    }
    bufs = {n: FakeBuffer(s, 256 * (i + 1)) for i, (n, s) in enumerate(shapes.items())}
    for address in (0x9000, 0xA000):
        indices = FakeBuffer((1, 1, 2, 3), address, "<i4")
        ca_jax._Kernels("forward", lay, 0.25, None, "bfloat16")(
            FakeContext(), (bufs["out"], bufs["lse"]), *(bufs[n] for n in "qkv"), indices
        )
        (held_indices,) = calls["launched_layout"].holders()
        assert (held_indices.data_ptr, held_indices.shape, held_indices.dtype) == (
            address,
            (1, 1, 2, 3),
            "int32",
        )
        assert held_indices.stream == 0x5EED and calls["launched"][1] == (256, 512, 768, 1024, 1280)
    assert calls["planned"] == 1


def test_kernel_pass_refuses_buffers_the_kernels_cannot_read(monkeypatch):
    calls = spy_on_cuda(monkeypatch, reasons=["q's data is not 16-byte aligned (address 0x102)"])
    lay = patterns.dense().layout(24)
    q, lse = FakeBuffer((1, 2, 24, 8), 0x102), FakeBuffer((1, 2, 24), 0x400)
    with pytest.raises(
        ValueError, match="the CUDA kernels cannot read XLA's buffers: q's data is not 16-byte"
    ):
        ca_jax._Kernels("forward", lay, 0.5, None, "float16")(FakeContext(), (q, lse), q, q, q)
    assert "forward" not in calls


def test_passes_are_equal_for_the_same_layout_object_only():
    lay = patterns.causal().layout(24)
    same = ca_jax._Kernels("forward", lay, 0.5, None, "float16")
    assert same == ca_jax._Kernels("forward", lay, 0.5, None, "float16") and hash(same) == hash(
        ca_jax._Kernels("forward", lay, 0.5, None, "float16")
    )
    twin = lay & lay  # equal contents, another object: its device tables are another cache entry
    others = [
        ca_jax._Kernels("forward", twin, 0.5, None, "float16"),
        ca_jax._Kernels("backward", lay, 0.5, None, "float16"),
        ca_jax._Kernels("forward", lay, 0.25, None, "float16"),
        ca_jax._Kernels("forward", lay, 0.5, None, "bfloat16"),
        ca_jax._ReferenceInPlace("forward", lay, 0.5, None, "float16"),
    ]
    assert twin == lay and all(same != other for other in others)


# ---- GPU: the kernels inside XLA -------------------------------------------------------------------------


def jax_gpu():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU (a CPU-only jaxlib)")
    return gpus[0]


GPU_RANDOM_LAYOUT = sparse_layout(Sq=192, Sk=150, heads=2, seed=5, block=32)
GPU_CASES = {  # sizes, attention's arguments, the layout they resolve to (for the reference)
    # Lengths that are not multiples of any tile; Sq != Sk aligns causal bottom-right.
    "gqa_causal": (dict(Hq=4, Hkv=2, Sq=200, Sk=264), dict(causal=True), patterns.causal().layout(200, 264)),
    "random_layout": (
        dict(Hq=2, Hkv=1, Sq=192, Sk=150),
        dict(layout=GPU_RANDOM_LAYOUT, scale=0.3),
        GPU_RANDOM_LAYOUT,
    ),
    "dense_mqa": (dict(Hq=3, Hkv=1, Sq=129, Sk=129), dict(), patterns.dense().layout(129)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_jit_grad_runs_the_kernels_on_xla_buffers(name, dtype):
    gpu = jax_gpu()
    sizes, kwargs, lay = GPU_CASES[name]
    rng = np.random.default_rng(11)
    host = random_qkv(rng, 2, sizes["Hq"], sizes["Hkv"], sizes["Sq"], sizes["Sk"], 64, np_dtype(dtype))
    dout_host = rng.standard_normal(host[0].shape).astype(np_dtype(dtype))
    # float32 copies of the low-precision values: the casts back inside jit are exact, and they make XLA write
    # the kernels' inputs just before them (and read their outputs just after) on its stream.
    q32, k32, v32, dout32 = (jax.device_put(x.astype(np.float32), gpu) for x in (*host, dout_host))

    def loss(q, k, v):
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        out = ca_jax.attention(q, k, v, backend="cuda", **kwargs)
        return (out.astype(jnp.float32) * dout32).sum(), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    text = step.lower(q32, k32, v32).as_text()
    assert text.count("custom_call @xla_buffer_python_gpu_callback") == 2  # the forward and the backward
    assert "xla_ffi_python_gpu_callback" not in text and "pure_callback" not in text  # no host round trip
    assert str(jax.make_jaxpr(step)(q32, k32, v32)).count("callback=<cusparseattn.jax._Kernels") == 2

    grads, out = step(q32, k32, v32)
    grads, out = jax.block_until_ready((grads, out))  # the only synchronisation
    assert out.dtype == np_dtype(dtype) and out.devices() == {gpu}
    # float32 runs in TF32 (JAX's default matmul precision: "high"), whose error float16's reference bounds.
    low = FLOAT32_BOUNDS["high"] if dtype == "float32" else None
    (out64, _), (out_lo, _) = forward_refs(*host, lay, scale=kwargs.get("scale"), low=low)
    check_close("out", np.asarray(out), out64, out_lo, dtype=low or dtype)
    ref64, refs_lo = backward_refs(dout_host, *host, lay, scale=kwargs.get("scale"), low=low)
    for grad_name, got, want64, want_lo in zip(("dq", "dk", "dv"), grads, ref64, refs_lo, strict=True):
        check_close(grad_name, np.asarray(got), want64, want_lo, dtype=low or dtype)


@pytest.mark.gpu
def test_gpu_eager_calls_and_vmap_run_the_kernels_on_xla_buffers(monkeypatch):
    from cusparseattn import cuda

    gpu = jax_gpu()
    launched, launch = [], cuda.Forward.run_at

    def spy(self, stream, addresses, layout=None):
        launched.append(("cuda", self.device))
        return launch(self, stream, addresses, layout)

    monkeypatch.setattr(cuda.Forward, "run_at", spy)
    rng = np.random.default_rng(3)
    host = random_qkv(rng, 2, 4, 2, 160, 160, 64, np.float16)
    q, k, v = (jax.device_put(np.ascontiguousarray(x), gpu) for x in host)
    lay = patterns.local(window=48, block=32).layout(160)
    (out64, lse64), (out_lo, lse_lo) = forward_refs(*host, lay)

    out, lse = ca_jax.attention(q, k, v, lay, return_lse=True, backend="cuda")  # eager
    doubled = out * 2  # queued on XLA's stream after the kernel: no synchronisation in between
    batched = jax.jit(jax.vmap(lambda q, k, v: ca_jax.attention(q, k, v, lay, backend="cuda")))(
        jnp.stack([q, -q]), jnp.stack([k, k]), jnp.stack([v, v])
    )
    doubled, lse, batched = jax.block_until_ready((doubled, lse, batched))
    # One launch eagerly, then one per element of the vmapped axis: each on XLA's buffers (and stream).
    assert launched == [("cuda", gpu.local_hardware_id)] * 3
    check_close("out", np.asarray(doubled) / 2, out64, out_lo, dtype="float16")
    check_close("lse", np.asarray(lse), lse64, lse_lo, dtype="float32")
    check_close("vmap out", np.asarray(batched[0]), out64, out_lo, dtype="float16")
    (neg64, _), (neg_lo, _) = forward_refs(-host[0], host[1], host[2], lay)
    check_close("vmap out of -q", np.asarray(batched[1]), neg64, neg_lo, dtype="float16")
