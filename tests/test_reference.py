"""The NumPy reference against plain dense attention, torch autograd and finite differences."""

import time
import tracemalloc
from dataclasses import dataclass
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import reference
from cusparseattn.layout import BlockLayout
from cusparseattn.mods import mask_rule
from cusparseattn.rules import TokenRule
from cusparseattn.testing import backward_refs, check_close, forward_refs, random_qkv

RULES = {
    "mod3": TokenRule("mod3", lambda b, h, q, k: (q + k) % 3 != 0),
    "causal": mask_rule(lambda b, h, q, k: k <= q, name="causal"),
    # depends on the absolute batch and query-head indices, so the mask differs per batch element and head
    "by_head": TokenRule("by_head", lambda b, h, q, k: (q + 2 * k + b + h) % 4 != 0),
}


@dataclass
class Case:
    """One random problem: shapes, a random block layout and how the reference is asked to run."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    block: tuple
    layout_batch: int
    layout_heads: int
    density: float
    rule: str | None
    order: str
    scale: float | None
    chunk_bytes: int
    seed: int

    def layout(self, rng) -> BlockLayout:
        nq, nk = -(-self.Sq // self.block[0]), -(-self.Sk // self.block[1])
        shape = (self.layout_batch, self.layout_heads, nq, nk)
        blocks = rng.random(shape) < self.density
        blocks[:, :, rng.random(nq) < 0.25] = False  # block rows that attend to nothing
        rule = RULES[self.rule] if self.rule else None
        partial = blocks & (rng.random(shape) < 0.5) if rule else None
        return BlockLayout(
            blocks, block_size=self.block, seq_q=self.Sq, seq_k=self.Sk, partial=partial, rule=rule
        )


@st.composite
def cases(draw, max_seq=300):
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return Case(
        B=b,
        Hq=hkv * group,
        Hkv=hkv,
        Sq=draw(st.integers(1, max_seq)),
        Sk=draw(st.integers(1, max_seq)),
        D=draw(st.sampled_from([8, 16, 24, 64])),
        block=(draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32, 64]))),
        layout_batch=draw(st.sampled_from([1, b])),
        layout_heads=draw(st.sampled_from([1, hkv * group])),
        density=draw(st.floats(0.05, 1.0)),
        rule=draw(st.sampled_from([None, *RULES])),
        order=draw(st.sampled_from(["bhsd", "bshd"])),
        scale=draw(st.none() | st.floats(0.05, 2.0)),
        # 1 byte: one query row per band; 20000: a few block rows; the default: one band per layout slice
        chunk_bytes=draw(st.sampled_from([1, 20_000, reference.CHUNK_BYTES])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def torch_attention(q, k, v, mask, scale):
    """Dense masked softmax attention in torch (autograd), with GQA by repeating k/v heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, -torch.inf)
    m = s.amax(dim=-1, keepdim=True).detach()
    p = torch.exp(s - torch.where(torch.isinf(m), 0, m))
    denom = p.sum(dim=-1, keepdim=True)
    return (p @ v) / torch.where(denom > 0, denom, 1)


def local_layout(seq, window, block):
    """Causal sliding window ``0 <= q - k < window`` as a banded block mask with partial edge blocks."""
    i, j = np.indices((seq // block,) * 2)
    reach = window // block
    blocks = (j <= i) & (i - j <= reach)
    partial = blocks & ((j == i) | (i - j == reach))
    rule = TokenRule("local", lambda b, h, q, k: (k <= q) & (q - k < window))
    return BlockLayout(blocks, block_size=block, seq_q=seq, partial=partial, rule=rule)


# ---- forward -----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cases())
def test_forward_matches_dense(case):
    rng = np.random.default_rng(case.seed)
    lay = case.layout(rng)
    q, k, v = random_qkv(rng, case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, np.float64, case.order)
    with mock.patch.object(reference, "CHUNK_BYTES", case.chunk_bytes):
        out, lse = reference.forward(q, k, v, lay, scale=case.scale, precision=np.float64)
    mask = lay.to_dense(case.B, case.Hq)
    want_out, want_lse = reference.dense_forward(q, k, v, mask, scale=case.scale)
    assert out.dtype == lse.dtype == np.float64
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-10)
    empty = ~mask.any(axis=-1)
    empty = np.broadcast_to(empty, lse.shape)
    assert np.all(lse[empty] == -np.inf) and np.all(np.isfinite(lse[~empty]))
    assert np.all(out[empty] == 0) and not np.isnan(out).any()


def test_lse_is_logsumexp_of_masked_scores():
    rng = np.random.default_rng(1)
    rule = RULES["causal"]
    blocks = rng.random((1, 4, 7, 5)) < 0.6
    blocks[:, :, 2] = False
    lay = BlockLayout(blocks, block_size=(16, 32), seq_q=100, seq_k=150, rule=rule)
    q, k, v = random_qkv(rng, 2, 4, 2, 100, 150, 24, np.float32)
    out, lse = reference.forward(q, k, v, lay, scale=0.3)
    mask = torch.from_numpy(lay.to_dense(2, 4))
    kk = torch.from_numpy(k.astype(np.float64)).repeat_interleave(2, dim=1)
    s = (torch.from_numpy(q.astype(np.float64)) @ kk.transpose(-1, -2)) * 0.3
    want = torch.logsumexp(s.masked_fill(~mask, -torch.inf), dim=-1).numpy()
    empty = ~mask.numpy().any(axis=-1)
    assert empty[:, :, 32:48].all() and empty.sum() > 64  # a whole empty block row and causal-empty rows
    assert lse.dtype == np.float32
    np.testing.assert_array_equal(lse[empty], -np.inf)
    np.testing.assert_allclose(lse[~empty], want[~empty], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[empty], 0)
    assert not np.isnan(out).any() and not np.isnan(lse).any()


def test_dense_forward_matches_torch():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 6, 3, 33, 45, 16, np.float64)
    mask = rng.random((2, 1, 33, 45)) < 0.3
    mask[:, :, 5] = False
    out, lse = reference.dense_forward(q, k, v, mask, scale=0.7)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    want = torch_attention(tq, tk, tv, torch.from_numpy(mask), 0.7).numpy()
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    assert np.all(lse[:, :, 5] == -np.inf) and np.isfinite(np.delete(lse, 5, axis=2)).all()


def test_unused_key_blocks_are_never_read():
    """The band walk gathers only the key blocks its rows set: NaN in key blocks no row uses stays out."""
    rng = np.random.default_rng(3)
    blocks = rng.random((1, 2, 6, 8)) < 0.5
    blocks[..., [1, 6]] = False
    lay = BlockLayout(blocks, block_size=32, seq_q=180, seq_k=250, rule=RULES["mod3"])
    q, k, v = random_qkv(rng, 1, 2, 1, 180, 250, 16, np.float32)
    want = reference.forward(q, k, v, lay)
    k[:, :, 32:64] = v[:, :, 32:64] = np.nan
    k[:, :, 192:224] = v[:, :, 192:224] = np.nan
    got = reference.forward(q, k, v, lay)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    dq, dk, dv = reference.backward(q, q, k, v, *got, lay)
    assert not np.isnan(dq).any()
    np.testing.assert_array_equal(dk[:, :, 192:224], 0)


def test_strided_inputs_match_contiguous():
    rng = np.random.default_rng(4)
    lay = local_layout(256, 64, 16)
    q, k, v = random_qkv(rng, 2, 4, 2, 256, 256, 16, ml_dtypes.bfloat16, layout="bshd")
    assert not q.flags.c_contiguous
    dout = rng.standard_normal(q.shape).astype(ml_dtypes.bfloat16)
    got = reference.forward(q, k, v, lay)
    want = reference.forward(*(np.ascontiguousarray(x) for x in (q, k, v)), lay)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.astype(np.float32), w.astype(np.float32))
    grads = reference.backward(dout, q, k, v, *got, lay)
    want = reference.backward(*(np.ascontiguousarray(x) for x in (dout, q, k, v)), *got, lay)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_array_equal(g.astype(np.float32), w.astype(np.float32))


# ---- backward ----------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(cases(max_seq=160))
def test_backward_matches_torch_autograd(case):
    rng = np.random.default_rng(case.seed)
    lay = case.layout(rng)
    q, k, v = random_qkv(rng, case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, np.float64, case.order)
    dout = rng.standard_normal(q.shape)
    with mock.patch.object(reference, "CHUNK_BYTES", case.chunk_bytes):
        out, lse = reference.forward(q, k, v, lay, scale=case.scale, precision=np.float64)
        dq, dk, dv = reference.backward(dout, q, k, v, out, lse, lay, scale=case.scale, precision=np.float64)
    scale = 1 / np.sqrt(case.D) if case.scale is None else case.scale
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tout = torch_attention(tq, tk, tv, torch.from_numpy(lay.to_dense(case.B, case.Hq)), scale)
    (tout * torch.from_numpy(dout)).sum().backward()
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=1e-10)
    for name, got, want in (("dq", dq, tq.grad), ("dk", dk, tk.grad), ("dv", dv, tv.grad)):
        assert got.dtype == np.float64 and not np.isnan(got).any(), name
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-9, err_msg=name)
    empty = np.broadcast_to(lse == -np.inf, q.shape[:3])
    assert np.all(dq[empty] == 0)


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(5)
    blocks = np.ones((1, 2, 2, 3), bool)
    blocks[0, 1, 1] = False  # query rows 16..20 of head 1 attend nothing
    lay = BlockLayout(blocks, block_size=16, seq_q=21, seq_k=37, rule=RULES["by_head"])
    q, k, v = random_qkv(rng, 1, 2, 1, 21, 37, 8, np.float64)
    weights = rng.standard_normal(q.shape)

    def loss(q, k, v):
        return float(np.sum(reference.forward(q, k, v, lay, precision=np.float64)[0] * weights))

    out, lse = reference.forward(q, k, v, lay, precision=np.float64)
    grads = reference.backward(weights, q, k, v, out, lse, lay, precision=np.float64)
    eps = 1e-6
    for x, grad in zip((q, k, v), grads, strict=True):
        coords = [tuple(rng.integers(0, n) for n in x.shape) for _ in range(8)]
        if x is q:
            coords += [(0, 1, 16, 3), (0, 1, 20, 0)]  # empty rows: exactly zero gradient
        for c in coords:
            saved = x[c]
            x[c] = saved + eps
            up = loss(q, k, v)
            x[c] = saved - eps
            down = loss(q, k, v)
            x[c] = saved
            assert grad[c] == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8), c
    assert np.all(grads[0][0, 1, 16:] == 0) and np.all(lse[0, 1, 16:] == -np.inf)


def test_empty_rows_give_zero_gradients():
    rng = np.random.default_rng(6)
    blocks = np.zeros((2, 1, 4, 4), bool)
    blocks[0, :, 1:3, 1:] = True  # batch 1 attends to nothing at all
    lay = BlockLayout(blocks, block_size=32, seq_q=128, seq_k=100)
    q, k, v = random_qkv(rng, 2, 2, 2, 128, 100, 16, np.float16)
    out, lse = reference.forward(q, k, v, lay)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, lay)
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(x.astype(np.float32)).any()
    assert (
        np.all(lse[1] == -np.inf)
        and np.all(lse[0, :, :32] == -np.inf)
        and np.isfinite(lse[0, :, 32:96]).all()
    )
    for g in (dq[1], dq[0, :, :32], dq[0, :, 96:], dk[1], dv[1], dk[0, :, :32], dv[0, :, :32]):
        np.testing.assert_array_equal(g, 0)
    assert np.abs(dq[0, :, 32:96].astype(np.float32)).min(axis=-1).max() > 0


# ---- dtypes and precision ----------------------------------------------------------------------------------

LOW_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("precision", [np.float32, np.float64])
def test_dtypes(dtype, precision):
    rng = np.random.default_rng(7)
    lay = local_layout(96, 32, 16)
    q, k, v = random_qkv(rng, 1, 2, 1, 96, 96, 16, dtype)
    out, lse = reference.forward(q, k, v, lay, precision=precision)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.dtype(precision)
    grads = reference.backward(out, q, k, v, out, lse, lay, precision=precision)
    assert [g.dtype for g in grads] == [np.dtype(dtype)] * 3
    if precision is np.float64:
        # inputs upcast exactly, the output rounded once at the end
        out64, _ = reference.forward(*(x.astype(np.float64) for x in (q, k, v)), lay, precision=np.float64)
        np.testing.assert_array_equal(out.astype(np.float64), out64.astype(dtype).astype(np.float64))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=lambda t: np.dtype(t).name)
def test_low_precision_reference_is_close_to_float64(dtype):
    """On low-precision inputs the float32-softmax reference is float64's answer rounded once (plus float32
    accumulation noise), and its gradients are within a few units of the dtype's last place."""
    rng = np.random.default_rng(8)
    lay = local_layout(160, 64, 32)
    q, k, v = random_qkv(rng, 2, 4, 2, 160, 160, 64, dtype, layout="bshd")
    dout = rng.standard_normal(q.shape).astype(dtype)
    (out64, lse64), (out, lse) = forward_refs(q, k, v, lay)
    ulp = float(ml_dtypes.finfo(dtype).eps)
    assert np.all(np.abs(out.astype(np.float64) - out64) <= 0.5 * ulp * np.abs(out64) + 2e-6)
    np.testing.assert_allclose(lse, lse64, rtol=1e-6, atol=1e-6)
    ref64, low = backward_refs(dout, q, k, v, lay)
    for name, g64, g in zip(("dq", "dk", "dv"), ref64, low, strict=True):
        scale = np.abs(g64).max()
        assert np.abs(g.astype(np.float64) - g64).max() <= 8 * ulp * scale, name


# ---- the tolerance helper ----------------------------------------------------------------------------------


def test_check_close_rule():
    rng = np.random.default_rng(9)
    ref64 = rng.standard_normal((2, 3, 40))
    ref64[0, 1, 5] = -np.inf
    low = (ref64 + rng.uniform(-1e-3, 1e-3, ref64.shape)).astype(np.float16)
    check_close("lse", low, ref64, low, dtype=np.float16)
    check_close("lse", ref64, ref64, low, dtype=np.float16)
    worse = ref64 + 5e-3
    worse[1, 2, 7] += 1
    with pytest.raises(AssertionError, match=r"lse \(float16\): diff_max 1\.005e\+00.*worst at \(1, 2, 7\)"):
        check_close("lse", worse, ref64, low, dtype=np.float16)
    finite = ref64.copy()
    finite[0, 1, 5] = 0
    with pytest.raises(AssertionError, match=r"non-finite mismatch at \(0, 1, 5\)"):
        check_close("lse", finite, ref64, low, dtype=np.float16)
    nan = ref64.copy()
    nan[1, 0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"NaN at \(1, 0, 0\)"):
        check_close("out", nan, ref64, low, dtype=np.float16)


def test_random_qkv_orders():
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 2, 6, 3, 10, 12, 8, ml_dtypes.bfloat16, layout="bshd")
    assert q.shape == (2, 6, 10, 8) and k.shape == v.shape == (2, 3, 12, 8)
    assert q.dtype == ml_dtypes.bfloat16 and q.base.flags.c_contiguous and q.base.shape == (2, 10, 6, 8)
    assert np.std(q.astype(np.float32)) == pytest.approx(1, abs=0.2)
    with pytest.raises(ValueError, match="layout must be"):
        random_qkv(rng, 1, 1, 1, 4, 4, 8, np.float32, layout="sbhd")


# ---- array API namespaces ----------------------------------------------------------------------------------
# The reference runs in the namespace of its arrays (CuPy on a GPU). array_api_strict arrays hold NumPy data
# but refuse everything outside the standard, so a reference that runs on them uses nothing else; its
# operations are NumPy's, so its results are NumPy's, bit for bit.


def strict_arrays(*arrays):
    xp = pytest.importorskip("array_api_strict")
    return xp, [xp.asarray(x) for x in arrays]


def assert_same_bits(got, want, xp) -> None:
    assert type(got) is type(xp.asarray(0.0)), f"a result of {type(got).__module__}, not of the namespace"
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got).dtype == want.dtype


@settings(max_examples=30, deadline=None)
@given(cases(max_seq=160), st.sampled_from([np.float32, np.float64]))
def test_array_api_strict_arrays_give_numpy_bits(case, dtype):
    rng = np.random.default_rng(case.seed)
    lay = case.layout(rng)
    q, k, v = random_qkv(rng, case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, dtype, case.order)
    dout = rng.standard_normal(q.shape).astype(dtype)
    with mock.patch.object(reference, "CHUNK_BYTES", case.chunk_bytes):
        want = reference.forward(q, k, v, lay, scale=case.scale, precision=dtype)
        want_grads = reference.backward(dout, q, k, v, *want, lay, scale=case.scale, precision=dtype)
        xp, strict = strict_arrays(dout, q, k, v, *want)
        got = reference.forward(*strict[1:4], lay, scale=case.scale, precision=dtype)
        grads = reference.backward(*strict, lay, scale=case.scale, precision=dtype)
    for g, w in zip((*got, *grads), (*want, *want_grads), strict=True):
        assert_same_bits(g, w, xp)


def test_array_api_strict_empty_rows_and_precision():
    """Rows that attend to nothing (a block row, a whole batch element), float32 inputs in float64."""
    rng = np.random.default_rng(13)
    blocks = np.zeros((2, 1, 4, 4), bool)
    blocks[0, :, 1:3, 1:] = True
    lay = BlockLayout(blocks, block_size=32, seq_q=128, seq_k=100)
    q, k, v, dout = random_qkv(rng, 2, 2, 2, 128, 100, 16, np.float32) + (
        rng.standard_normal((2, 2, 128, 16)).astype(np.float32),
    )
    want = reference.forward(q, k, v, lay, precision=np.float64)
    want_grads = reference.backward(dout, q, k, v, *want, lay, precision=np.float64)
    xp, strict = strict_arrays(dout, q, k, v, *want)
    got = reference.forward(*strict[1:4], lay, precision=np.float64)
    assert got[0].dtype == xp.float32 and got[1].dtype == xp.float64
    grads = reference.backward(*strict, lay, precision=np.float64)
    for g, w in zip((*got, *grads), (*want, *want_grads), strict=True):
        assert_same_bits(g, w, xp)
    assert np.all(np.asarray(got[1])[1] == -np.inf)


def test_arrays_of_two_namespaces_are_refused():
    xp, (q,) = strict_arrays(np.zeros((1, 1, 16, 8), np.float32))
    lay = BlockLayout(np.ones((1, 1), bool), block_size=16, seq_q=16)
    k = np.zeros((1, 1, 16, 8), np.float32)
    with pytest.raises(
        TypeError, match=r"q, k, v must be arrays of one namespace, got q array_api_strict, k "
    ):
        reference.forward(q, k, k, lay)


# ---- validation --------------------------------------------------------------------------------------------


def test_validation_errors():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 6, 3, 64, 80, 16, np.float32)
    lay = BlockLayout(np.ones((4, 5), bool), block_size=16, seq_q=64, seq_k=80)
    bad = [
        ((q[0], k, v, lay), "q must have 4 dimensions"),
        ((q, k[:, :2].repeat(2, 1), v[:, :2].repeat(2, 1), lay), "k has 4 heads, and q's 6 heads are not a"),
        ((q, k, v[:, :1], lay), "v must have the shape of k"),
        ((q, k[:1], v[:1], lay), "k has batch 1, expected q's batch 2"),
        ((q, k[..., :8], v[..., :8], lay), "k has head_dim 8"),
        ((q, k, v.astype(np.float16), lay), "q, k and v must share a dtype"),
        ((q.astype(np.int32), k, v, lay), "q must be float16, bfloat16, float32 or float64"),
        ((q[:, :, :48], k, v, lay), "layout is for seq_q=64, seq_k=80, but q has 48 tokens"),
        (
            (q, k, v, BlockLayout(np.ones((3, 4, 5), bool), block_size=16, seq_q=64, seq_k=80)),
            "layout has 3 heads",
        ),
        (
            (q, k, v, BlockLayout(np.ones((3, 1, 4, 5), bool), block_size=16, seq_q=64, seq_k=80)),
            "layout has batch",
        ),
        ((q, k, v, np.ones((4, 5), bool)), "layout must be a BlockLayout"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            reference.forward(*args)
    with pytest.raises(ValueError, match="precision must be float32 or float64"):
        reference.forward(q, k, v, lay, precision=np.float16)
    out, lse = reference.forward(q, k, v, lay)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 6, 64\)"):
        reference.backward(out, q, k, v, out, lse[..., :10], lay)
    with pytest.raises(ValueError, match="mask must broadcast"):
        reference.dense_forward(q, k, v, np.ones((64, 64), bool))


# ---- memory ------------------------------------------------------------------------------------------------


def test_memory_is_bounded_at_16k():
    """S = 16384 with a 1024-token window: no S x S array (1 GiB in float32) is built, forward or backward."""
    seq, window, dim = 16384, 1024, 128
    lay = local_layout(seq, window, 128)
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 1, 1, 1, seq, seq, dim, np.float32)
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        base = tracemalloc.get_traced_memory()[0]
        out, lse = reference.forward(q, k, v, lay)
        forward_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        dq, _, _ = reference.backward(dout, q, k, v, out, lse, lay)
        backward_peak = tracemalloc.get_traced_memory()[1] - base
        elapsed = time.perf_counter() - start
    finally:
        tracemalloc.stop()
    assert forward_peak < 384 << 20, f"forward peak extra memory {forward_peak / 2**20:.0f} MiB"
    assert backward_peak < 512 << 20, f"backward peak extra memory {backward_peak / 2**20:.0f} MiB"
    assert elapsed < 30, f"forward and backward took {elapsed:.1f} s"
    for i in rng.choice(seq, 12, replace=False):
        keys = slice(max(0, i - window + 1), i + 1)
        kk, vv = k[0, 0, keys].astype(np.float64), v[0, 0, keys].astype(np.float64)
        s = kk @ q[0, 0, i] / np.sqrt(dim)
        p = np.exp(s - s.max())
        p /= p.sum()
        o = p @ vv
        np.testing.assert_allclose(out[0, 0, i], o, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse[0, 0, i], s.max() + np.log(np.exp(s - s.max()).sum()), rtol=1e-6)
        dp = vv @ dout[0, 0, i]
        want_dq = (p * (dp - dout[0, 0, i] @ o)) @ kk / np.sqrt(dim)
        np.testing.assert_allclose(dq[0, 0, i], want_dq, rtol=0, atol=1e-4 * np.abs(want_dq).max())
