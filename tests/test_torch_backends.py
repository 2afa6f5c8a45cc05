"""The PyTorch backends, "sdpa" and "flex": against the reference on random data, their reasons, and the
torch adapter running them."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from kernel_cases import np_dtype, to_device, to_host

import cusparseattn
from cusparseattn import backends, call, mods, patterns, reference
from cusparseattn.backends import current_backend, select, use_backends, why_not
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule
from cusparseattn.testing import backward_refs, check_close, forward_refs, random_qkv
from cusparseattn.torch_backends import FlexBackend, SdpaBackend

torch = pytest.importorskip("torch")
ca_torch = pytest.importorskip("cusparseattn.torch")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def random_blocks(rng, B, H, sq, sk, block=16, density=0.3):
    """A rule-free layout with about ``density`` of its blocks set: some query rows attend to nothing."""
    blocks = rng.random((B, H, -(-sq // block), -(-sk // block))) < density
    return BlockLayout(blocks, block_size=block, seq_q=sq, seq_k=sk)


# name: ((B, Hq, Hkv, Sq, Sk, D), memory order, layout(rng, B, Hq, Sq, Sk))
CASES = {
    "causal": (
        (1, 2, 2, 100, 100, 16),
        "bhsd",
        lambda rng, B, H, sq, sk: patterns.causal(block=16).layout(sq),
    ),
    "local_gqa_bshd": (
        (2, 4, 2, 120, 120, 24),
        "bshd",
        lambda rng, B, H, sq, sk: patterns.local(window=40, block=32).layout(sq, sk),
    ),
    "random_per_head_empty_rows": ((2, 4, 1, 80, 113, 16), "bhsd", random_blocks),
    "document_rule": (
        (1, 2, 1, 96, 96, 16),
        "bhsd",
        lambda rng, B, H, sq, sk: patterns.from_mask(
            mods.document_mask(np.repeat([0, 1, 2], [30, 50, 16])), block=16
        ).layout(sq, sk),
    ),
}


def torch_qkv(case, dtype, seed=0):
    sizes, order, make_layout = CASES[case]
    rng = np.random.default_rng(seed)
    host = random_qkv(rng, *sizes, dtype, layout=order)
    layout = make_layout(rng, sizes[0], sizes[1], sizes[3], sizes[4])
    dout = rng.standard_normal(host[0].shape).astype(dtype)
    return host, dout, layout, [torch.from_numpy(x) for x in (*host, dout)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_forward_matches_the_reference(backend, case, dtype):
    host, _, layout, (q, k, v, _) = torch_qkv(case, dtype)
    if CASES[case][1] == "bshd":
        assert q.stride(1) < q.stride(2)  # a [B, S, H, D] view: no copy made before the backend
    out, lse = cusparseattn.attention_forward(q, k, v, layout, backend=backend)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == np.float64 else torch.float32)
    (out64, lse64), (out_low, lse_low) = forward_refs(*host, layout)
    check_close("out", out.numpy(), out64, out_low, dtype=dtype)
    check_close("lse", lse.numpy(), lse64, lse_low, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_backward_matches_the_reference(case, dtype):
    host, dout, layout, (q, k, v, do) = torch_qkv(case, dtype, seed=1)
    out, lse = cusparseattn.attention_forward(q, k, v, layout, backend="sdpa")
    grads = cusparseattn.attention_backward(do, q, k, v, out, lse, layout, backend="sdpa")
    for name, got, ref64, low in zip(
        ("dq", "dk", "dv"), grads, *backward_refs(dout, *host, layout), strict=True
    ):
        assert got.shape == {"dq": q.shape, "dk": k.shape, "dv": v.shape}[name]
        check_close(name, got.numpy(), ref64, low, dtype=dtype)


def test_rows_that_attend_to_nothing_give_zero_and_minus_infinity():
    host, dout, layout, (q, k, v, do) = torch_qkv("random_per_head_empty_rows", np.float32)
    empty = ~layout.to_dense().any(axis=-1)  # [B, H, Sq]
    assert empty.any()
    for backend in ("sdpa", "flex"):
        out, lse = cusparseattn.attention_forward(q, k, v, layout, backend=backend)
        assert (out.numpy()[empty] == 0).all() and (lse.numpy()[empty] == -np.inf).all()
        assert np.isfinite(out.numpy()).all()
    dq, dk, dv = cusparseattn.attention_backward(do, q, k, v, out, lse, layout, backend="sdpa")
    assert (dq.numpy()[empty] == 0).all()
    assert all(np.isfinite(g.numpy()).all() for g in (dq, dk, dv))


def test_a_window_with_an_origin_matches_the_reference():
    rng = np.random.default_rng(3)
    whole = patterns.local(window=40, block=16).layout(128)
    layout = whole.window(32, 96, 16, 80)
    assert layout.origin == (32, 16)
    host = random_qkv(rng, 1, 2, 2, 64, 64, 16, np.float32)
    (out64, lse64), (out_low, lse_low) = forward_refs(*host, layout)
    for backend in ("sdpa", "flex"):
        out, lse = cusparseattn.attention_forward(*map(torch.from_numpy, host), layout, backend=backend)
        check_close(f"{backend} out", out.numpy(), out64, out_low, dtype=np.float32)
        check_close(f"{backend} lse", lse.numpy(), lse64, lse_low, dtype=np.float32)


# ---- score mods (flex) ---------------------------------------------------------------------------------


SCORE_MODS = {
    "softcap": mods.softcap(2.0),
    "alibi": mods.alibi(mods.alibi_slopes(4)),
    "relative_bias": mods.relative_bias(np.random.default_rng(4).standard_normal((4, 31)).astype(np.float32)),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_flex_applies_a_score_mod_like_the_reference(name):
    rng = np.random.default_rng(5)
    layout = patterns.causal(block=16).layout(70)
    host = random_qkv(rng, 1, 4, 2, 70, 70, 16, np.float32)
    mod = mods.score_mod(SCORE_MODS[name])
    out, lse = cusparseattn.attention_forward(
        *map(torch.from_numpy, host), layout, score_mod=mod, backend="flex"
    )
    ref = reference.forward(*host, layout, score_mod=mod)
    np.testing.assert_allclose(out.numpy(), ref[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), ref[1], rtol=1e-5, atol=1e-5)


def test_flex_score_mods_see_global_positions_in_a_window():
    rng = np.random.default_rng(6)
    whole = patterns.causal(block=16).layout(96)
    q, k, v = random_qkv(rng, 1, 4, 4, 96, 96, 16, np.float32)
    mod = mods.score_mod(mods.alibi(mods.alibi_slopes(4)))
    full_out, full_lse = reference.forward(q, k, v, whole, score_mod=mod)
    # Queries 48..95 against every key: the same rows of the whole computation.
    window = whole.window(48, 96, 0, 96)
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q[:, :, 48:], k, v))
    out, lse = cusparseattn.attention_forward(qt, kt, vt, window, score_mod=mod, backend="flex")
    np.testing.assert_allclose(out.numpy(), full_out[:, :, 48:], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), full_lse[:, :, 48:], rtol=1e-5, atol=1e-5)


# ---- selection and the torch adapter -------------------------------------------------------------------


def test_automatic_selection_never_picks_them_by_default():
    q = torch.randn(1, 2, 32, 16)
    assert current_backend(q, q, q) == "reference"
    assert why_not(q, q, q)["sdpa"] == [] and why_not(q, q, q)["flex"] == []


def test_use_backends_puts_them_first_for_torch_tensors_only():
    q = torch.randn(1, 2, 32, 16)
    with use_backends("sdpa", "reference", set_priority=True):
        assert current_backend(q, q, q) == "sdpa"
        assert current_backend(q.numpy(), q.numpy(), q.numpy()) == "reference"
    with use_backends("flex", "reference", set_priority=True):
        assert current_backend(q, q, q) == "flex"
        assert current_backend(q, q, q, op="backward") == "reference"  # no Flex backward on the CPU


@pytest.mark.parametrize("recompute", [False, True])
def test_the_torch_adapter_runs_sdpa_forward_and_backward(recompute):
    host, dout, layout, (q, k, v, do) = torch_qkv("local_gqa_bshd", np.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ca_torch.attention(q, k, v, layout, backend="sdpa", recompute=recompute)
    out.backward(do)
    ref64, _ = backward_refs(dout, *host, layout)
    for t, want in zip((q, k, v), ref64, strict=True):
        np.testing.assert_allclose(t.grad.numpy(), want, rtol=1e-10, atol=1e-10)


def test_the_torch_adapter_refuses_a_forced_flex_backward_on_the_cpu():
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    with pytest.raises(ValueError, match="FlexAttention has no backward on the CPU"):
        ca_torch.attention(q, q, q, backend="flex")
    with torch.no_grad():  # no backward wanted: the forward runs
        assert ca_torch.attention(q, q, q, backend="flex").shape == q.shape


# ---- reasons -------------------------------------------------------------------------------------------


def inputs_of(q, **kwargs):
    return call.prepare(q, q, q, None, causal=False, scale=None, **kwargs)


def test_reasons_for_arrays_that_are_not_torch_tensors():
    q = np.ones((1, 1, 16, 8), np.float32)
    for name in ("sdpa", "flex"):
        assert why_not(q, q, q)[name] == ["the inputs are not torch tensors (they are numpy arrays)"]


def test_reasons_without_pytorch(monkeypatch):
    inputs = inputs_of(torch.ones(1, 1, 16, 8))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if it were not installed
    for name in ("sdpa", "flex"):
        backend = backends.BACKENDS[name]
        assert backend.available() == ["PyTorch is not installed"]
        assert backend.not_supported_reasons(inputs, "forward") == ["PyTorch is not installed"]


def test_reason_for_a_torch_without_flex_attention(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    want = [f"FlexAttention needs torch 2.5 or newer, found torch {torch.__version__}"]
    assert backends.BACKENDS["flex"].available() == want
    q = torch.ones(1, 1, 16, 8)
    assert why_not(q, q, q)["flex"] == want


def test_reason_for_the_flex_backward_on_the_cpu():
    q = torch.ones(1, 1, 16, 8)
    assert why_not(q, q, q, op="backward")["flex"] == [
        f"FlexAttention has no backward on the CPU (torch {torch.__version__})"
    ]


def test_reason_for_a_rule_that_does_not_run_on_torch_tensors():
    def numpy_only(b, h, q, k):
        return (q - k).astype(np.int64) >= 0  # torch tensors have no astype

    rule = TokenRule("numpy_only", numpy_only)
    layout = BlockLayout(np.tril(np.ones((2, 2), bool)), block_size=16, seq_q=32, rule=rule)
    q = torch.ones(1, 1, 32, 8)
    (reason,) = why_not(q, q, q, layout)["flex"]
    assert reason.startswith(
        "the layout's rule 'numpy_only' does not run on torch tensors, so FlexAttention cannot apply it ("
    )
    assert why_not(q, q, q, layout)["sdpa"] == []  # SDPA's dense mask comes from the NumPy rule


def test_reason_for_a_head_dim_too_small_for_compiled_flex():
    q = torch.ones(1, 1, 16, 8)
    inputs = inputs_of(q)
    assert FlexBackend(compiled=True).not_supported_reasons(inputs, "forward") == [
        "FlexAttention's compiled kernels take a head dim of at least 16, got 8"
    ]
    assert FlexBackend().not_supported_reasons(inputs, "forward") == []  # eager on the CPU: any head dim


def test_reason_for_a_score_mod_in_sdpa():
    q = torch.ones(1, 1, 16, 8)
    assert why_not(q, q, q, score_mod=mods.softcap(5.0))["sdpa"] == ["SDPA takes no score_mod"]
    assert why_not(q, q, q, score_mod=mods.softcap(5.0))["flex"] == []


def test_reason_for_a_dense_mask_over_the_limit(monkeypatch):
    sdpa = backends.BACKENDS["sdpa"]
    monkeypatch.setattr(sdpa, "max_mask_bytes", 100_000)
    q = torch.ones(2, 4, 300, 8)
    layout = random_blocks(np.random.default_rng(0), 2, 4, 300, 300)
    assert why_not(q, q, q, layout)["sdpa"] == [
        "the dense mask would take 0.7 MiB (2 x 4 x 300 x 300 booleans), over SDPA's limit of 0.1 MiB "
        "(SdpaBackend.max_mask_bytes)"
    ]
    assert why_not(q, q, q)["sdpa"] == []  # a dense layout is shared by the batch and heads: 90,000 bytes


def test_forcing_them_goes_through_the_same_check():
    q = np.ones((1, 1, 16, 8), np.float32)
    with pytest.raises(
        ValueError, match=r"backend 'sdpa' cannot run the forward .*\n  - the inputs are not torch"
    ):
        select(inputs_of(q), "forward", "sdpa")


def test_the_mask_and_block_mask_are_kept_for_the_next_call_on_the_same_layout():
    sdpa, flex = SdpaBackend(), FlexBackend()
    layout = patterns.local(window=32, block=16).layout(64)
    cpu = torch.device("cpu")
    assert sdpa._mask(layout, cpu)[0] is sdpa._mask(layout, cpu)[0]
    assert flex._block_mask(layout, cpu) is flex._block_mask(layout, cpu)
    other = patterns.local(window=48, block=16).layout(64)
    assert sdpa._mask(other, cpu)[0] is not sdpa._mask(layout, cpu)[0]


# ---- GPU ----------------------------------------------------------------------------------------------


def gpu_case(dtype, case="local_gqa_bshd", seed=7):
    """Host arrays in ``dtype`` (bfloat16 from ml_dtypes), their CUDA tensors ([B, S, H, D] views kept), and
    the layout."""
    sizes, order, make_layout = CASES[case]
    rng = np.random.default_rng(seed)
    host = random_qkv(rng, *sizes, np_dtype(dtype), layout=order)
    dout = rng.standard_normal(host[0].shape).astype(np_dtype(dtype))
    layout = make_layout(rng, sizes[0], sizes[1], sizes[3], sizes[4])
    return (*host, dout), [to_device(x) for x in (*host, dout)], layout


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "dtype"),
    [("local_gqa_bshd", "float16"), ("random_per_head_empty_rows", "bfloat16"), ("document_rule", "float16")],
)
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_gpu_forward_and_backward_match_the_reference(backend, case, dtype):
    (qh, kh, vh, doh), (q, k, v, do), layout = gpu_case(dtype, case)
    out, lse = cusparseattn.attention_forward(q, k, v, layout, backend=backend)
    assert out.device == q.device and out.dtype == q.dtype and lse.dtype == torch.float32
    (out64, lse64), (out_low, lse_low) = forward_refs(qh, kh, vh, layout)
    check_close("out", to_host(out), out64, out_low, dtype=dtype)
    check_close("lse", to_host(lse), lse64, lse_low, dtype=dtype)
    grads = cusparseattn.attention_backward(do, q, k, v, out, lse, layout, backend=backend)
    refs = backward_refs(doh, qh, kh, vh, layout)
    for name, got, ref64, low in zip(("dq", "dk", "dv"), grads, *refs, strict=True):
        assert got.device == q.device and got.dtype == q.dtype and got.shape == ref64.shape
        check_close(name, to_host(got), ref64, low, dtype=dtype)


@pytest.mark.gpu
def test_gpu_torch_backends_agree_with_the_cuda_kernels():
    dtype = "bfloat16"
    (qh, kh, vh, doh), (q, k, v, do), layout = gpu_case(dtype)
    (out64, lse64), (out_low, lse_low) = forward_refs(qh, kh, vh, layout)
    refs = backward_refs(doh, qh, kh, vh, layout)
    for backend in ("cuda", "sdpa", "flex"):
        out, lse = cusparseattn.attention_forward(q, k, v, layout, backend=backend)
        check_close(f"{backend} out", to_host(out), out64, out_low, dtype=dtype)
        check_close(f"{backend} lse", to_host(lse), lse64, lse_low, dtype=dtype)
        grads = cusparseattn.attention_backward(do, q, k, v, out, lse, layout, backend=backend)
        for name, got, ref64, low in zip(("dq", "dk", "dv"), grads, *refs, strict=True):
            check_close(f"{backend} {name}", to_host(got), ref64, low, dtype=dtype)


@pytest.mark.gpu
def test_gpu_flex_with_a_score_mod_matches_the_reference():
    (qh, kh, vh, doh), (q, k, v, do), layout = gpu_case("float16", "causal")
    mod = mods.score_mod(mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(5.0)))
    out, lse = cusparseattn.attention_forward(q, k, v, layout, score_mod=mod, backend="flex")
    host64 = [x.astype(np.float64) for x in (qh, kh, vh, doh)]
    out64, lse64 = reference.forward(*host64[:3], layout, score_mod=mod, precision=np.float64)
    out_low, lse_low = reference.forward(qh, kh, vh, layout, score_mod=mod)
    check_close("out", to_host(out), out64, out_low, dtype="float16")
    check_close("lse", to_host(lse), lse64, lse_low, dtype="float16")
    grads = cusparseattn.attention_backward(do, q, k, v, out, lse, layout, score_mod=mod, backend="flex")
    ref64 = reference.backward(
        host64[3], *host64[:3], out64, lse64, layout, score_mod=mod, precision=np.float64
    )
    low = reference.backward(doh, qh, kh, vh, out_low, lse_low, layout, score_mod=mod)
    for name, got, want64, want_low in zip(("dq", "dk", "dv"), grads, ref64, low, strict=True):
        check_close(name, to_host(got), want64, want_low, dtype="float16")


@pytest.mark.gpu
def test_gpu_compiled_flex_needs_a_head_dim_of_16():
    q = torch.ones(1, 1, 64, 8, device="cuda", dtype=torch.float16)
    assert why_not(q, q, q)["flex"] == [
        "FlexAttention's compiled kernels take a head dim of at least 16, got 8"
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_gpu_the_torch_adapter_runs_them_with_autograd(backend):
    dtype = "bfloat16"
    (qh, kh, vh, doh), (q, k, v, do), layout = gpu_case(dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ca_torch.attention(*leaves, layout, backend=backend)
    out.backward(do)
    (out64, _), (out_low, _) = forward_refs(qh, kh, vh, layout)
    check_close("out", to_host(out), out64, out_low, dtype=dtype)
    for name, leaf, ref64, low in zip(
        ("dq", "dk", "dv"), leaves, *backward_refs(doh, qh, kh, vh, layout), strict=True
    ):
        check_close(name, to_host(leaf.grad), ref64, low, dtype=dtype)
