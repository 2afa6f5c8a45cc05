"""The reference on the GPU (``python -m pytest -m gpu tests/test_reference_gpu.py``): float32 and float64
CuPy arrays, torch CUDA tensors (eager autograd and ``torch.compile``) and JAX GPU arrays run it in CuPy on
their GPU. Its answers are the NumPy reference's: float64 to rounding, float32 at most twice as far from
float64 as the host's float32 reference is (the STYLE rule). Not one byte goes from the device to the host.
float64 chooses it; float32 chooses the kernels (tests/test_kernels_*.py), so its calls here ask for it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from kernel_cases import to_device, to_host

import cusparseattn as ca
from cusparseattn import arrays, backends, mods, patterns, reference
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule
from cusparseattn.testing import check_close, random_qkv

pytestmark = pytest.mark.gpu

DTYPES = ["float32", "float64"]
# The backend these tests ask for: float64 GPU arrays choose the reference, float32 ones the kernels.
BACKEND = {"float32": "reference", "float64": None}


def random_layout(seq_q, seq_k, heads, seed=3, block=32):
    """Random blocks with a batch- and head-dependent token rule in half of them, and a query block row
    that attends to nothing (out 0, lse -inf, zero gradients)."""
    rng = np.random.default_rng(seed)
    nq, nk = -(-seq_q // block), -(-seq_k // block)
    blocks = rng.random((1, heads, nq, nk)) < 0.6
    blocks[:, :, 1] = False
    partial = blocks & (rng.random(blocks.shape) < 0.5)
    rule = TokenRule("by_head", lambda b, h, q, k: (q + 2 * k + b + h) % 4 != 0)
    return BlockLayout(blocks, block_size=block, seq_q=seq_q, seq_k=seq_k, partial=partial, rule=rule)


# name: (B, Hq, Hkv, Sq, Sk, D), memory order, layout, score mod
CASES = {
    "gqa_causal": ((2, 4, 2, 200, 200, 64), "bhsd", patterns.causal(block=64).layout(200), None),
    "bshd_local_softcap": (
        (1, 3, 3, 160, 230, 32),
        "bshd",
        patterns.local(window=64, block=32).layout(160, 230),
        mods.softcap(20.0),
    ),
    "rule_empty_rows_alibi": (
        (2, 2, 1, 150, 130, 64),
        "bshd",
        random_layout(150, 130, heads=2),
        mods.alibi(mods.alibi_slopes(2)),  # a captured table, looked up on the GPU
    ),
}


def host_case(name, dtype, seed=0):
    """``(dout, q, k, v)`` on the host in ``dtype``, the layout and the score mod of case ``name``."""
    sizes, order, layout, mod = CASES[name]
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, *sizes, np.dtype(dtype), layout=order)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return (dout, q, k, v), layout, mod


def host_refs(host, layout, mod, dtype):
    """The host's float64 and ``dtype`` references: ``(out, lse, dq, dk, dv)`` each."""
    refs = []
    for precision in (np.float64, np.dtype(dtype)):
        dout, q, k, v = (x.astype(precision) for x in host)
        out, lse = reference.forward(q, k, v, layout, precision=precision, score_mod=mod)
        grads = reference.backward(dout, q, k, v, out, lse, layout, precision=precision, score_mod=mod)
        refs.append((out, lse, *grads))
    return refs


def assert_like_host(results, refs, dtype) -> None:
    """The GPU's ``(out, lse, dq, dk, dv)`` (host arrays) against the host references."""
    for name, got, want64, want_low in zip(("out", "lse", "dq", "dk", "dv"), results, *refs, strict=True):
        assert got.dtype == want_low.dtype, name
        if dtype == "float64":
            np.testing.assert_allclose(got, want64, rtol=1e-9, atol=1e-11, err_msg=name)
        else:
            check_close(name, got, want64, want_low, dtype="float32")


@pytest.fixture
def no_fallback(monkeypatch):
    """Fail on any RuntimeWarning (the host-copy fallback warns) and on any copy to the host that goes
    through cusparseattn's holders."""

    def refuse(self):
        raise AssertionError(f"{self.describe()} was copied to the host")

    monkeypatch.setattr(arrays.CupyTensor, "numpy", refuse)
    monkeypatch.setattr(arrays.TorchTensor, "numpy", refuse)
    monkeypatch.setattr(backends, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


@pytest.fixture
def small_bands(monkeypatch):
    """Bands of a few block rows, so that every case walks several bands and gathers keys in several runs."""
    monkeypatch.setattr(reference, "DEVICE_CHUNK_BYTES", 1 << 18)


# ---- CuPy ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_cupy_arrays_run_the_reference_on_their_gpu(case, dtype, no_fallback, small_bands):
    cupy = pytest.importorskip("cupy")
    host, layout, mod = host_case(case, dtype)
    dout, q, k, v = (cupy.asarray(x) for x in host)
    out, lse = reference.forward(q, k, v, layout, precision=dtype, score_mod=mod)
    grads = reference.backward(dout, q, k, v, out, lse, layout, precision=dtype, score_mod=mod)
    for x in (out, lse, *grads):
        assert isinstance(x, cupy.ndarray) and x.device == q.device
    assert_like_host([x.get() for x in (out, lse, *grads)], host_refs(host, layout, mod, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_arrays_choose_the_reference_on_the_gpu_without_a_warning(dtype, no_fallback):
    cupy = pytest.importorskip("cupy")
    host, layout, mod = host_case("rule_empty_rows_alibi", dtype)
    dout, q, k, v = (cupy.asarray(x) for x in host)
    device = f"cuda:{q.device.id}"
    chosen = f"reference (CuPy, on {device})"
    if dtype == "float32":
        assert backends.runs_on(q, k, v, layout, score_mod=mod).startswith(f"cuda ({device}, float32 on TF32")
        with backends.use_backends("reference"):
            assert backends.runs_on(q, k, v, layout, score_mod=mod) == chosen
    else:
        assert backends.runs_on(q, k, v, layout, score_mod=mod) == chosen
    assert backends.why_not(q, k, v, layout, score_mod=mod)["reference"] == []
    backend = BACKEND[dtype]
    out, lse = ca.attention_forward(q, k, v, layout, score_mod=mod, backend=backend)
    grads = ca.attention_backward(dout, q, k, v, out, lse, layout, score_mod=mod, backend=backend)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_like_host([x.get() for x in (out, lse, *grads)], host_refs(host, layout, mod, dtype), dtype)


# ---- PyTorch -----------------------------------------------------------------------------------------------


def torch_step(attend, host, dtype):
    """``attend(q, k, v) -> (out, lse)`` on CUDA copies of ``host`` ([B, S, H, D] views kept), then the
    backward of ``sum(out * dout)``: ``(out, lse, dq, dk, dv)`` as torch tensors."""
    torch = pytest.importorskip("torch")
    dout, q, k, v = (to_device(x) for x in host)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = attend(q, k, v)
    (out * dout).sum().backward()
    assert out.device == q.device and out.dtype == getattr(torch, dtype)
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_cuda_tensors_train_on_the_reference_on_the_gpu(case, dtype, no_fallback, small_bands):
    host, layout, mod = host_case(case, dtype)
    backend = BACKEND[dtype]
    results = torch_step(
        lambda q, k, v: ca.attention(q, k, v, layout, score_mod=mod, return_lse=True, backend=backend),
        host,
        dtype,
    )
    assert_like_host([to_host(t) for t in results], host_refs(host, layout, mod, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_compile_takes_float32_and_float64_cuda_tensors(dtype, no_fallback):
    torch = pytest.importorskip("torch")
    host, layout, mod = host_case("bshd_local_softcap", dtype)

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return ca.attention(q, k, v, layout, score_mod=mod, return_lse=True, backend=BACKEND[dtype])

    results = torch_step(attend, host, dtype)
    assert results[1].dtype == (torch.float64 if dtype == "float64" else torch.float32)
    assert_like_host([to_host(t) for t in results], host_refs(host, layout, mod, dtype), dtype)


# ---- JAX ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_gpu_arrays_run_the_reference_on_xla_buffers(dtype, request, no_fallback):
    jax = pytest.importorskip("jax")
    ca_jax = pytest.importorskip("cusparseattn.jax")
    if dtype == "float64":
        request.getfixturevalue("x64")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU (a CPU-only jaxlib)")
    host, layout, mod = host_case("rule_empty_rows_alibi", dtype)
    dout, q, k, v = (jax.device_put(np.ascontiguousarray(x), gpus[0]) for x in host)

    def loss(q, k, v):
        out, lse = ca_jax.attention(q, k, v, layout, score_mod=mod, return_lse=True, backend=BACKEND[dtype])
        return (out * dout).sum(), (out, lse)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    jaxpr = str(jax.make_jaxpr(step)(q, k, v))
    assert jaxpr.count("callback=<cusparseattn.jax._ReferenceOnGpu") == 2 and "pure_callback" not in jaxpr
    grads, (out, lse) = jax.block_until_ready(step(q, k, v))
    assert out.devices() == {gpus[0]}
    results = [np.asarray(x) for x in (out, lse, *grads)]
    assert_like_host(results, host_refs(host, layout, mod, dtype), dtype)


# ---- no copy to the host -----------------------------------------------------------------------------------


def device_to_host_copies(run) -> list[str]:
    """The device-to-host copies that CUDA saw (CUPTI, through torch's profiler: every copy of the process,
    CuPy's too) while ``run()`` ran and the device finished its work."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "DtoH" in e.name or "Device -> P" in e.name]


def test_the_copy_counter_sees_torch_and_cupy_copies():
    """The counter of the next test is not blind: it sees a torch and a CuPy copy to the host."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    assert device_to_host_copies(lambda: torch.ones(4, device="cuda").cpu())
    assert device_to_host_copies(lambda: cupy.arange(4).get())


def test_a_float64_call_copies_nothing_to_the_host(no_fallback, small_bands, monkeypatch):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    host, layout, mod = host_case("rule_empty_rows_alibi", "float64")
    tensors = [to_device(x) for x in host]
    cupies = [cupy.asarray(x) for x in host]

    def torch_call():
        dout, q, k, v = (t.detach().requires_grad_(i > 0) for i, t in enumerate(tensors))
        out = ca.attention(q, k, v, layout, score_mod=mod)
        (out * dout).sum().backward()

    def cupy_call():
        dout, q, k, v = cupies
        out, lse = ca.attention_forward(q, k, v, layout, score_mod=mod)
        ca.attention_backward(dout, q, k, v, out, lse, layout, score_mod=mod)

    for call in (torch_call, cupy_call):
        call()  # the first call plans and lets CuPy compile its kernels: the second is the one counted

    def refuse(*args, **kwargs):
        raise AssertionError("an array was copied to the host")

    monkeypatch.setattr(cupy, "asnumpy", refuse)
    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    assert device_to_host_copies(torch_call) == []
    assert device_to_host_copies(cupy_call) == []
