"""Ready-made mods against the patterns they mirror and their definitions; mods' functions on NumPy and
torch; `patterns.from_mask` with traced rules; the reference's score_mod against direct NumPy math, torch
autograd and PyTorch's FlexAttention; the API's ``score_mod`` and mask-function layouts.
"""

from __future__ import annotations

import doctest
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cusparseattn as ca
from cusparseattn import mods, patterns, reference
from cusparseattn.traced import TraceError

IDS = np.repeat([0, 1, 2, 3], [70, 1, 90, 39])  # 200 tokens, a one-token document
IDS2 = np.stack([IDS, np.repeat([0, 1], [150, 50])])


def tokens(sq, sk):
    return np.arange(sq)[:, None], np.arange(sk)[None, :]


# ---- ready-made mask mods ----------------------------------------------------------------------------------
MASK_PAIRS = {
    "causal": (mods.causal_mask, lambda b: patterns.causal(block=b), 1),
    "sliding": (mods.sliding_window(50), lambda b: patterns.local(50, block=b), 1),
    "sliding_two_sided": (
        mods.sliding_window(33, causal=False),
        lambda b: patterns.local(33, False, block=b),
        1,
    ),
    "document": (mods.document_mask(IDS), lambda b: patterns.document(IDS, block=b), 1),
    "document_batch": (mods.document_mask(IDS2), lambda b: patterns.document(IDS2, block=b), 2),
    "causal_document": (
        mods.and_masks(mods.causal_mask, mods.document_mask(IDS2)),
        lambda b: patterns.document(IDS2, causal=True, block=b),
        2,
    ),
    "dilated": (mods.dilated(8), lambda b: patterns.strided(8, block=b), 1),
    "window_or_sinks": (
        mods.and_masks(mods.causal_mask, mods.or_masks(mods.sliding_window(40), lambda b, h, q, k: k < 16)),
        lambda b: patterns.streaming(40, 16, block=b),
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(MASK_PAIRS))
@pytest.mark.parametrize("block", [16, 64])
def test_ready_made_masks_match_patterns(name, block):
    fn, pattern, batch = MASK_PAIRS[name]
    lay = patterns.from_mask(fn, block=block, batch=batch if batch > 1 else None).layout(200)
    want = pattern(block).layout(200)
    assert lay.rule.c_expr is not None, "the ready-made mod did not trace"
    assert lay == want
    assert lay.full.sum() == np.broadcast_to(want.full, lay.full.shape).sum()


def test_prefix_lm_and_combinators_match_their_definitions():
    q, k = tokens(90, 90)
    prefix = patterns.from_mask(mods.prefix_lm(20), block=16).layout(90)
    assert np.array_equal(prefix.to_dense()[0, 0], (k < 20) | (q >= k))
    parts = [mods.sliding_window(10, causal=False), mods.dilated(7, causal=False), mods.prefix_lm(5)]
    values = [np.asarray(p(0, 0, q, k), dtype=bool) for p in parts]
    both = mods.mask_rule(mods.and_masks(*parts))
    either = mods.mask_rule(mods.or_masks(*parts))
    assert np.array_equal(both(0, 0, q, k), values[0] & values[1] & values[2])
    assert np.array_equal(either(0, 0, q, k), values[0] | values[1] | values[2])
    assert np.array_equal(mods.and_masks(*parts)(0, 0, q, k), both(0, 0, q, k))  # the plain function
    assert np.array_equal(mods.and_masks(either, parts[0])(0, 0, q, k), values[0])  # a traced rule joins


def test_ready_made_argument_errors():
    for call, message in (
        (lambda: mods.sliding_window(0), "window must be an integer >= 1"),
        (lambda: mods.prefix_lm(-1), "prefix_len"),
        (lambda: mods.dilated(2.5), "stride"),
        (lambda: mods.document_mask(np.zeros((2, 2, 2), int)), "doc_ids"),
        (lambda: mods.document_mask(np.linspace(0, 1, 5)), "doc_ids"),
        (lambda: mods.alibi(np.ones((2, 2))), "slopes"),
        (lambda: mods.softcap(-1.0), "positive"),
        (lambda: mods.relative_bias(np.arange(5)), "float array"),
        (lambda: mods.and_masks(), "at least one"),
        (lambda: mods.compose(), "at least one"),
        (lambda: mods.alibi_slopes(0), "num_heads"),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match="softcap|cap"):
        mods.softcap("30")
    with pytest.raises(TypeError, match="mask_mod functions"):
        mods.or_masks(mods.causal_mask, 3)


# ---- ready-made score mods ---------------------------------------------------------------------------------
def test_alibi_slopes():
    assert np.allclose(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    six = mods.alibi_slopes(6)  # those of 4 heads, then every other one of 8 heads (Press et al.'s code)
    assert np.allclose(six, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def test_score_mods_match_their_definitions():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 3, 20, 30)).astype(np.float32) * 8
    b, h = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None]
    q, k = np.arange(40, 60)[:, None], np.arange(30)[None, :]
    slopes, table = np.array([0.5, 0.25, 0.125]), rng.standard_normal((3, 41))
    cases = {
        "alibi": (mods.alibi(slopes), s + slopes.astype(np.float32)[h] * (k - q)),
        "softcap": (mods.softcap(4.0), 4 * np.tanh(s / 4)),
        "relative_bias": (
            mods.relative_bias(table),
            s + table.astype(np.float32)[h, np.clip(q - k + 20, 0, 40)],
        ),
        "composed": (
            mods.compose(mods.alibi(slopes), mods.softcap(4.0)),
            4 * np.tanh((s + slopes.astype(np.float32)[h] * (k - q)) / 4),
        ),
    }
    for name, (fn, want) in cases.items():
        sm = mods.score_mod(fn)
        for dtype, rtol in ((np.float32, 2e-6), (np.float64, 1e-6)):
            got = sm.evaluate(s.astype(dtype), b, h, q, k)
            assert got.dtype == dtype and got.shape == s.shape, name
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=name)
        np.testing.assert_allclose(fn(s.astype(np.float64), b, h, q, k), want, rtol=1e-6, atol=1e-6)
    assert repr(mods.score_mod(mods.softcap(4.0))).startswith("ScoreMod('softcap_mod': (SF0 * tanhf(")


def test_functions_on_numpy_torch_and_traced_values():
    x = np.array([-2.0, 0.5, 3.0])
    t = torch.from_numpy(x)
    for name, args in (
        ("where", (x > 0, x, -1.0)),
        ("minimum", (x, 1.0)),
        ("maximum", (x, 1.0)),
        ("abs", (x,)),
        ("exp", (x,)),
        ("log", (np.abs(x),)),
        ("tanh", (x,)),
        ("sqrt", (np.abs(x),)),
    ):
        fn = getattr(mods, name)
        want = getattr(np, name)(*args)
        as_torch = tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args)
        assert np.allclose(fn(*args), want), name
        assert np.allclose(fn(*as_torch).numpy(), want), name
    assert isinstance(mods.minimum(t, 2), torch.Tensor)
    traced = mods.score_mod(lambda s, b, h, q, k: mods.maximum(mods.minimum(s, 1.0), -1.0) + abs(q - k))
    assert "fmaxf(fminf(s, SF0), SF1)" in traced.c_expr and "max((q - k), (-(q - k)))" in traced.c_expr


def test_mods_run_on_torch_indices():
    """What FlexAttention does: call the user's functions on torch tensors (captured arrays follow)."""
    q, k = torch.arange(200)[:, None], torch.arange(200)[None, :]
    for name, (fn, _, _) in MASK_PAIRS.items():
        if name in ("document_batch", "causal_document"):
            continue
        got = fn(torch.tensor(0), torch.tensor(0), q, k)
        assert np.array_equal(got.numpy(), mods.mask_rule(fn)(0, 0, q.numpy(), k.numpy())), name
    sm = mods.score_mod(mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(3.0)))
    s = torch.randn(2, 1, 1, dtype=torch.float64) * 5
    h = torch.arange(2)[:, None, None]
    got = sm(s, 0, h, q[:5], k[:, :7])
    want = sm.evaluate(s.numpy(), 0, h.numpy(), q[:5].numpy(), k[:, :7].numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


# ---- from_mask with traced rules ---------------------------------------------------------------------------
def test_from_mask_traces_and_checks_batch_and_heads():
    lay = patterns.from_mask(mods.sliding_window(64), block=32).layout(256)
    assert lay.rule.c_expr == "(((q - k) >= P0) && ((q - k) < P1))" and lay.rule.params == (0, 64)
    with pytest.raises(ValueError, match="uses h .* heads must be given"):
        patterns.from_mask(lambda b, h, q, k: (q >= k) | (h == 0))
    with pytest.raises(ValueError, match="uses b .* batch must be given"):
        patterns.from_mask(mods.document_mask(IDS2))
    per_head = patterns.from_mask(lambda b, h, q, k: q - k < 10 * (h + 1), heads=3, block=16).layout(64)
    assert per_head.heads == 3 and per_head.rule.c_expr is not None
    assert patterns.from_mask(lambda b, h, q, k: q >= k, heads=1).layout(64).heads == 1


def test_new_values_give_new_layouts_and_the_same_rule_structure():
    a = patterns.from_mask(mods.sliding_window(32), block=16).layout(128)
    b = patterns.from_mask(mods.sliding_window(48), block=16).layout(128)
    assert a.rule.structure == b.rule.structure and a.rule.params != b.rule.params
    assert a != b and a == patterns.local(32, block=16).layout(128)


# ---- the reference with a score_mod ------------------------------------------------------------------------
SCORE_MODS = {
    "alibi": mods.alibi(mods.alibi_slopes(4)),
    "softcap": mods.softcap(2.0),
    "relative_bias": mods.relative_bias(np.random.default_rng(2).standard_normal((4, 63))),
    "alibi_softcap": mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(3.0)),
    "masking": lambda s, b, h, q, k: mods.where((q + h) % 5 == 0, float("-inf"), s * 1.5),
    "per_batch": lambda s, b, h, q, k: s + mods.exp(-abs(q - k) / 16.0) * (b + 1),
    "reciprocal": lambda s, b, h, q, k: s + 0.1 * mods.tanh(1.0 / s),
}


def random_inputs(rng, batch, hq, hkv, sq, sk, d, dtype=np.float64):
    q = rng.standard_normal((batch, hq, sq, d)).astype(dtype)
    k, v = (rng.standard_normal((batch, hkv, sk, d)).astype(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
@pytest.mark.parametrize("layout_kind", ["dense", "local", "document"])
def test_reference_forward_matches_dense_math(name, layout_kind, monkeypatch):
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1 << 16)  # several bands
    rng = np.random.default_rng(1)
    fn = SCORE_MODS[name]
    seq = 200
    lay = {
        "dense": patterns.dense(block=32),
        "local": patterns.local(70, block=16),
        "document": patterns.document(IDS2, causal=True, block=32),
    }[layout_kind].layout(seq)
    q, k, v = random_inputs(rng, 2, 4, 2, seq, seq, 16)
    want_out, want_lse = reference.dense_forward(q, k, v, lay.to_dense(2, 4), scale=0.4, score_mod=fn)
    out, lse = reference.forward(q, k, v, lay, scale=0.4, precision=np.float64, score_mod=fn)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)
    out32, lse32 = reference.forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), lay,
                                     scale=0.4, score_mod=mods.score_mod(fn))  # fmt: skip
    assert lse32.dtype == np.float32
    np.testing.assert_allclose(out32, want_out, atol=2e-4)


def torch_attention(q, k, v, mask, scale, fn):
    """Attention in torch float64 with the mod called on torch tensors: autograd's gradients."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the mod's own int / float divisions, as the reference's
    try:
        return _torch_attention(q, k, v, mask, scale, fn)
    finally:
        torch.set_default_dtype(default)


def _torch_attention(q, k, v, mask, scale, fn):
    b, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ kr.transpose(-1, -2)
    idx = (torch.arange(b)[:, None, None, None], torch.arange(hq)[None, :, None, None])
    s = fn(s, *idx, torch.arange(sq)[:, None], torch.arange(k.shape[2])[None, :])
    s = s.masked_fill(~torch.from_numpy(mask), float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e300).detach()
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    return (p @ vr) / torch.where(denom > 0, denom, torch.ones_like(denom))


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_reference_backward_matches_autograd(name):
    rng = np.random.default_rng(4)
    fn = SCORE_MODS[name]
    lay = patterns.document(IDS2, causal=True, block=32).layout(200)
    q, k, v = random_inputs(rng, 2, 4, 2, 200, 200, 8)
    dout = rng.standard_normal(q.shape)
    out, lse = reference.forward(q, k, v, lay, scale=0.3, precision=np.float64, score_mod=fn)
    dq, dk, dv = reference.backward(
        dout, q, k, v, out, lse, lay, scale=0.3, precision=np.float64, score_mod=fn
    )
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tout = torch_attention(tq, tk, tv, lay.to_dense(2, 4), 0.3, fn)
    tout.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), atol=1e-12)
    for got, t in zip((dq, dk, dv), (tq, tk, tv), strict=True):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, t.grad.numpy(), atol=1e-10)


def test_rows_modified_to_minus_inf_are_empty():
    """A score_mod that sends a whole row to -inf: output 0, lse -inf, zero gradients, no NaN."""
    rng = np.random.default_rng(5)
    fn = lambda s, b, h, q, k: mods.where((q >= 10) & (q < 20), float("-inf"), s)  # noqa: E731
    lay = patterns.causal(block=16).layout(64)
    q, k, v = random_inputs(rng, 1, 2, 1, 64, 64, 8, np.float32)
    out, lse = reference.forward(q, k, v, lay, score_mod=fn)
    assert (out[:, :, 10:20] == 0).all() and np.isneginf(lse[:, :, 10:20]).all()
    assert np.isfinite(lse[:, :, 20:]).all()
    grads = reference.backward(rng.standard_normal(q.shape).astype(np.float32), q, k, v, out, lse, lay,
                               score_mod=fn)  # fmt: skip
    for g in grads:
        assert not np.isnan(g).any()
    assert (grads[0][:, :, 10:20] == 0).all()


def test_score_mod_sees_global_positions_in_a_window():
    """A window of a layout (context parallelism's shards) keeps the positions of the whole sequence."""
    rng = np.random.default_rng(6)
    fn = mods.compose(mods.alibi(mods.alibi_slopes(2)), lambda s, b, h, q, k: s + (q - 2 * k) / 50.0)
    lay = patterns.causal(block=32).layout(256)
    q, k, v = random_inputs(rng, 1, 2, 2, 256, 256, 8)
    full, full_lse = reference.forward(q, k, v, lay, precision=np.float64, score_mod=fn)
    window = lay.window(128, 256, 0, 256)
    part, part_lse = reference.forward(q[:, :, 128:], k, v, window, precision=np.float64, score_mod=fn)
    np.testing.assert_allclose(part, full[:, :, 128:], atol=1e-12)
    np.testing.assert_allclose(part_lse, full_lse[:, :, 128:], atol=1e-12)


def test_reference_matches_flex_attention():
    """The same mask_mod and score_mod through PyTorch's FlexAttention (eager, on the CPU) and the
    reference: the functions run unchanged on torch tensors there."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rng = np.random.default_rng(7)
    mask = mods.and_masks(mods.causal_mask, mods.document_mask(IDS))
    score = mods.compose(mods.relative_bias(rng.standard_normal((4, 41))), mods.softcap(5.0))
    q, k, v = random_inputs(rng, 2, 4, 4, 200, 200, 16)
    block_mask = flex.create_block_mask(mask, None, None, 200, 200, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        want = flex.flex_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), score_mod=score, block_mask=block_mask
        )
    lay = patterns.from_mask(mask, block=32).layout(200)
    out, _ = reference.forward(q, k, v, lay, precision=np.float64, score_mod=score)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-12)


# ---- the API -----------------------------------------------------------------------------------------------
def test_api_score_mod_and_mask_function_layouts():
    rng = np.random.default_rng(8)
    q, k, v = random_inputs(rng, 2, 4, 2, 150, 150, 16, np.float32)
    mask = mods.and_masks(mods.causal_mask, mods.sliding_window(60))
    score = mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(8.0))
    out, lse = ca.attention_forward(q, k, v, mask, score_mod=score, backend="reference")
    lay = patterns.from_mask(mask).layout(150)
    want, want_lse = reference.forward(q, k, v, lay, score_mod=score)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    grads = ca.attention_backward(dout, q, k, v, out, lse, mask, score_mod=score, backend="reference")
    for got, ref in zip(
        grads, reference.backward(dout, q, k, v, out, lse, lay, score_mod=score), strict=True
    ):
        np.testing.assert_array_equal(got, ref)
    traced = mods.score_mod(score)
    assert np.array_equal(ca.attention(q, k, v, mask, score_mod=traced), out)
    from cusparseattn import call

    layout_of = call.resolve_layout  # the same function gives the same layout object (device caches)
    sizes = ca.call.validate(*(ca.arrays.wrap(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))))
    assert layout_of(mask, False, sizes) is layout_of(mask, False, sizes)
    per_head = ca.attention(q, k, v, lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 5 * h)
    lay_h = patterns.from_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 5 * h, heads=4).layout(150)
    np.testing.assert_array_equal(per_head, reference.forward(q, k, v, lay_h)[0])


def test_api_score_mod_errors():
    q = np.ones((1, 2, 32, 8), np.float32)
    with pytest.raises(TypeError, match="score_mod '<lambda>' cannot be traced"):
        ca.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s if s > 0 else -s)
    with pytest.raises(TypeError, match="score_mod must take 5 positional arguments"):
        ca.attention(q, q, q, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        ca.attention_forward(q, q, q, score_mod=2.0)
    with pytest.raises(ValueError, match="score_mod .* 9 float parameters"):
        ca.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: sum(s * (i + 0.5) for i in range(9)))
    with pytest.raises(TraceError):
        mods.score_mod(lambda s, b, h, q_idx, kv_idx: np.tanh(s))


@settings(max_examples=20, deadline=None)
@given(window=st.integers(1, 120), cap=st.floats(0.5, 50), seq=st.integers(1, 150))
def test_values_change_results_not_structure(window, cap, seq):
    """Any window and softcap: the same compiled structure as fixed ones, and the reference's answer."""
    rule = mods.mask_rule(mods.sliding_window(window))
    sm = mods.score_mod(mods.softcap(cap))
    assert rule.structure == mods.mask_rule(mods.sliding_window(7)).structure
    assert sm.structure == mods.score_mod(mods.softcap(1.0)).structure
    q, k = tokens(seq, seq)
    assert np.array_equal(rule(0, 0, q, k), (q - k >= 0) & (q - k < window))
    s = np.linspace(-100, 100, 11, dtype=np.float32)
    np.testing.assert_allclose(sm.evaluate(s, 0, 0, 0, 0), cap * np.tanh(s / np.float32(cap)), rtol=1e-5)


def test_docstring_examples():
    result = doctest.testmod(mods, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- reusing traces ----------------------------------------------------------------------------------------
@pytest.fixture
def traces(monkeypatch):
    """Counts the traces mods.score_mod runs, from an empty cache."""
    monkeypatch.setattr(mods, "_traced", type(mods._traced)(mods._traced.size))
    calls = []
    original = mods.ScoreMod.trace

    def counted(fn, name=None):
        calls.append(fn)
        return original(fn, name)

    monkeypatch.setattr(mods.ScoreMod, "trace", counted)
    return calls


def _offset_mod(offset):
    def mod(score, b, h, q_idx, kv_idx):
        return score + offset

    return mod


def test_the_same_function_is_traced_once(traces):
    fn = mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(20.0))
    first = mods.score_mod(fn)
    assert mods.score_mod(fn) is first and len(traces) == 1
    assert mods.score_mod(fn, name="other") is not first  # the name is part of what is cached


def test_a_changed_closure_value_is_traced_again(traces):
    fn = _offset_mod(1.5)
    assert mods.score_mod(fn).float_params == (1.5,)
    fn.__closure__[0].cell_contents = 2.5
    assert mods.score_mod(fn).float_params == (2.5,) and len(traces) == 2


def test_a_changed_global_is_traced_again(traces):
    global GLOBAL_OFFSET
    GLOBAL_OFFSET = 0.25

    def fn(score, b, h, q_idx, kv_idx):
        return score * GLOBAL_OFFSET

    assert mods.score_mod(fn).float_params == (0.25,)
    GLOBAL_OFFSET = 0.75
    assert mods.score_mod(fn).float_params == (0.75,) and len(traces) == 2


def test_tables_changed_in_place_are_traced_again(traces):
    # A learnable bias updated by an optimizer step: PyTorch's version counter shows the in-place change.
    bias = torch.zeros(16)
    small = np.zeros(16, np.float32)

    def fn(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx] + small[kv_idx]

    first = mods.score_mod(fn)
    assert mods.score_mod(fn) is first
    with torch.no_grad():
        bias += 1.0
    second = mods.score_mod(fn)
    assert second is not first and np.all(second.arrays[0] == 1.0)
    small[3] = 5.0
    third = mods.score_mod(fn)
    assert third is not second and third.arrays[1][3] == 5.0 and len(traces) == 3


def test_values_it_cannot_watch_are_traced_every_call(traces):
    tables = {"bias": mods.captured(np.arange(8.0))}
    large = np.zeros(4096, np.float32)  # writable and larger than what is compared by content

    def in_dict(score, b, h, q_idx, kv_idx):
        return score + tables["bias"][q_idx - kv_idx]

    def in_large(score, b, h, q_idx, kv_idx):
        return score + large[q_idx]

    for fn in (in_dict, in_large, in_dict, in_large):
        mods.score_mod(fn)
    assert len(traces) == 4


def test_the_cache_keeps_the_last_functions_only(traces):
    fns = [_offset_mod(float(i)) for i in range(mods._traced.size + 4)]
    for fn in fns:
        mods.score_mod(fn)
    assert len(mods._traced) == mods._traced.size
    mods.score_mod(fns[-1])
    mods.score_mod(fns[0])  # dropped: traced again
    assert len(traces) == len(fns) + 1


def test_mask_functions_give_new_layouts_when_their_values_change():
    """The api's layout of a mask function is cached per function, and rebuilt when what it captures changes:
    document ids refilled in place in a torch tensor (a reused buffer), or a closure number."""
    from cusparseattn import call

    rng = np.random.default_rng(9)
    q, k, v = random_inputs(rng, 1, 2, 2, 256, 256, 16, np.float32)
    sizes = ca.call.validate(*(ca.arrays.wrap(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))))
    docs = torch.zeros(256, dtype=torch.int64)

    def same_document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    first = call.resolve_layout(same_document, False, sizes)
    assert call.resolve_layout(same_document, False, sizes) is first and first.density == 1.0
    docs[128:] = 1  # two documents of one 128-block each
    second = call.resolve_layout(same_document, False, sizes)
    assert second is not first and second.density == 0.5
    window = mods.sliding_window(32)
    narrow = call.resolve_layout(window, False, sizes)
    window.__closure__[[c.cell_contents for c in window.__closure__].index(32)].cell_contents = 96
    wide = call.resolve_layout(window, False, sizes)
    assert wide is not narrow and 96 in wide.rule.params and 32 in narrow.rule.params
