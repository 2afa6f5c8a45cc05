"""Per-token layouts over grouped rows: the grouped call equals the per-token one in the reference (host, any
shapes and static parts), what is refused, and on the GPU the kernels against the reference, in torch (with
autograd, no host sync) and under jax.jit."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import check_jitted_dynamic_steps, hopper_path, to_host

import cusparseattn as ca
from cusparseattn import backends, call, dynamic, patterns, token_groups
from cusparseattn.testing import check_step, random_qkv


def _static(name, block):
    if name == "local":
        return patterns.local(window=20, block=block)
    if name == "sinks":
        return patterns.streaming(window=8, sinks=4, block=block)
    return None


@st.composite
def cases(draw):
    hkv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(1, 2)), Hkv=hkv, G=draw(st.sampled_from([16, 32])), Sq=draw(st.integers(1, 48)),
        Sk=draw(st.integers(1, 48)), D=draw(st.sampled_from([4, 8])), block=draw(st.sampled_from([16, 32])),
        heads=draw(st.sampled_from([1, hkv])), k=draw(st.integers(1, 4)), counts=draw(st.booleans()),
        causal=draw(st.booleans()), within=draw(st.sampled_from([None, "local"])),
        plus=draw(st.sampled_from([None, "local", "sinks"])), seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(cases())
def test_grouped_rows_give_the_per_token_layouts_attention_and_gradients(case):
    print("case:", case)
    rng = np.random.default_rng(case["seed"])
    B, G, Sq, block = case["B"], case["G"], case["Sq"], case["block"]
    n_k = -(-case["Sk"] // block)
    q, k, v = random_qkv(rng, B, case["Hkv"] * G, case["Hkv"], Sq, case["Sk"], case["D"], np.float64)
    dout = rng.standard_normal(q.shape)
    shape = (B, case["heads"], Sq, case["k"])
    idx = rng.integers(-1, n_k, shape).astype(np.int32)
    counts = rng.integers(0, case["k"] + 1, shape[:3]).astype(np.int32) if case["counts"] else None
    lay = dynamic.token_indices(idx, counts, block=block)
    if case["within"]:
        lay = lay & _static(case["within"], block)
    if case["plus"]:
        lay = lay | _static(case["plus"], block)
    out, lse = ca.attention_forward(q, k, v, lay, causal=case["causal"])
    grads = ca.attention_backward(dout, q, k, v, out, lse, lay, causal=case["causal"])

    grouped = token_groups.Grouping(call.prepare(q, k, v, lay, causal=case["causal"], scale=None), lay)
    assert grouped.layout.per == "block" and grouped.layout.block_size == (G, block)
    g_out, g_lse = ca.attention_forward(grouped.rows(q), k, v, grouped.layout, scale=grouped.scale)
    np.testing.assert_allclose(grouped.tokens(g_out), out, atol=1e-12)
    np.testing.assert_allclose(grouped.tokens(g_lse), lse, atol=1e-12)
    rows = [grouped.rows(x) for x in (dout, q)]
    g_dq, g_dk, g_dv = ca.attention_backward(*rows, k, v, g_out, g_lse, grouped.layout, scale=grouped.scale)
    for name, got, want in zip(("dq", "dk", "dv"), (grouped.tokens(g_dq), g_dk, g_dv), grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-10, err_msg=name)


def test_rows_and_tokens_are_inverse_permutations():
    lay = dynamic.token_indices(np.zeros((1, 2, 3, 1), np.int32), block=16)
    x = np.arange(32 * 3 * 2, dtype=np.float64).reshape(1, 32, 3, 2)
    q, k = x, np.zeros((1, 2, 3, 2))
    grouped = token_groups.Grouping(call.prepare(q, k, k, lay, causal=False, scale=None), lay)
    rows = grouped.rows(x)
    assert rows.shape == (1, 2, 48, 2)
    # row t * G + j of KV head hk is query head hk * G + j at token t
    np.testing.assert_array_equal(rows[0, 1, 2 * 16 + 5], x[0, 16 + 5, 2])
    np.testing.assert_array_equal(grouped.tokens(rows), x)
    np.testing.assert_array_equal(grouped.tokens(grouped.rows(x[..., 0])), x[..., 0])


def test_what_stays_per_token_and_why():
    def inputs(hq, hkv, heads, **kw):
        q, k = np.zeros((1, hq, 64, 8), np.float32), np.zeros((1, hkv, 64, 8), np.float32)
        lay = dynamic.token_indices(np.zeros((1, heads, 64, 1), np.int32), block=16)
        return call.prepare(q, k, k, lay, causal=False, scale=None, **kw)

    assert token_groups.reasons(inputs(32, 2, 2)) == []
    assert token_groups.reasons(inputs(16, 1, 1)) == []
    assert "a KV group of 8 query heads" in token_groups.reasons(inputs(16, 2, 2))[0]
    assert "per query head" in token_groups.reasons(inputs(32, 2, 32))[0]
    mod = token_groups.reasons(inputs(16, 1, 1, score_mod=lambda s, b, h, q, k: s * 2))
    assert "score mod" in mod[0]
    # on the host the per-token call runs as it is (the reference takes it directly)
    q, k = np.zeros((1, 16, 64, 8), np.float32), np.zeros((1, 1, 64, 8), np.float32)
    lay = dynamic.token_indices(np.zeros((1, 1, 64, 1), np.int32), block=16)
    assert token_groups.grouping(q, k, k, lay, causal=True, scale=None, backend=None, score_mod=None) is None


def test_a_step_finds_the_grouped_static_parts_of_the_step_before():
    q, k = np.zeros((1, 16, 64, 8), np.float32), np.zeros((1, 1, 64, 8), np.float32)
    local = patterns.local(window=20, block=16)

    def grouped(seed):
        idx = np.random.default_rng(seed).integers(0, 4, (1, 1, 64, 2)).astype(np.int32)
        lay = dynamic.token_indices(idx, block=16) & local
        return token_groups.Grouping(call.prepare(q, k, k, lay, causal=True, scale=None), lay).layout

    a, b = grouped(0), grouped(1)
    assert a.within is b.within and a.within.seq_q == 64 * 16


# ---- the kernels (pytest -m gpu) ---------------------------------------------------------------------------
def _nsa_like(rng, B, heads, S, block, k):
    """Each token's k key blocks: its own and the one before always in, the rest random (padding, repeats and
    out-of-range entries that the kernels ignore)."""
    n = -(-S // block)
    own = np.arange(S) // block
    idx = rng.integers(-1, n + 2, (B, heads, S, k))
    idx[..., 0], idx[..., 1] = own, np.maximum(own - 1, 0)
    return idx.astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
@pytest.mark.parametrize("head_dim,dtype,heads", [(128, "bfloat16", "kv"), (64, "float16", "shared")])
def test_the_kernels_run_grouped_rows_and_match_the_reference(monkeypatch, hopper, head_dim, dtype, heads):
    import torch

    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(head_dim + hopper)
    B, Hq, Hkv, S, block = 2, 32, 2, 333, 64
    q, k, v = random_qkv(rng, B, Hq, Hkv, S, S, head_dim, np.float32)
    idx = _nsa_like(rng, B, Hkv if heads == "kv" else 1, S, block, 5)
    counts = rng.integers(2, 6, idx.shape[:3]).astype(np.int32)
    host = dynamic.token_indices(idx, counts, block=block) & patterns.causal(block=block)
    dev = dict(device="cuda", dtype=getattr(torch, dtype))
    tq, tk, tv = (torch.tensor(x, **dev, requires_grad=True) for x in (q, k, v))
    t_idx, t_counts = (torch.tensor(x, device="cuda") for x in (idx, counts))
    lay = dynamic.token_indices(t_idx, t_counts, block=block)
    assert backends.runs_on(tq, tk, tv, lay, causal=True).startswith("cuda")
    out = ca.attention(tq, tk, tv, lay, causal=True)
    assert launched and any(name.endswith("_sm90") for name in launched) == hopper
    dout = torch.randn_like(out)
    out.backward(dout)
    results = [to_host(x) for x in (out, tq.grad, tk.grad, tv.grad)]
    check_step(results, *(to_host(x) for x in (dout, tq, tk, tv)), host, dtype=dtype)

    if dtype == "float16":  # CuPy arrays (it has no bfloat16): the same kernels, the same bits
        import cupy

        c_lay = dynamic.token_indices(cupy.from_dlpack(t_idx), cupy.from_dlpack(t_counts), block=block)
        c_out, _ = ca.attention_forward(
            *(cupy.from_dlpack(t.detach()) for t in (tq, tk, tv)), c_lay, causal=True
        )
        np.testing.assert_array_equal(cupy.asnumpy(c_out), to_host(out))

    # The next step, new indices in a new layout: no host sync, the same gradient bits run to run.
    t_idx = torch.tensor(_nsa_like(rng, B, idx.shape[1], S, block, 5), device="cuda")

    def step():
        lay = dynamic.token_indices(t_idx, t_counts, block=block)
        out = ca.attention(tq, tk, tv, lay, causal=True)
        return torch.autograd.grad(out, (tq, tk, tv), dout)

    first = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_jax_jit_runs_grouped_rows_on_traced_indices(monkeypatch):
    launched = hopper_path(monkeypatch, True)
    rng = np.random.default_rng(3)
    B, Hq, Hkv, S, D, block = 1, 16, 1, 256, 128, 64
    host = random_qkv(rng, B, Hq, Hkv, S, S, D, ml_dtypes.bfloat16)
    dout = rng.standard_normal(host[0].shape).astype(ml_dtypes.bfloat16)
    draw = functools.partial(_nsa_like, rng, B, Hkv, S, block, 3)
    check_jitted_dynamic_steps(host, dout, dynamic.token_indices, draw, block)
    assert any(name.endswith("_sm90") for name in launched)
