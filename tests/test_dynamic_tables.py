"""Dynamic layouts on the CUDA kernels (``pytest -m gpu``): the tables built on the GPU against the host's
plan of the same selection, and attention, gradients, determinism, no host sync and graph replay against the
reference."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import check_jitted_dynamic_steps, hopper_path, to_host

import cusparseattn as ca
from cusparseattn import BlockLayout, backends, dynamic, patterns, plan
from cusparseattn.testing import backward_refs, check_close, check_step, forward_refs, random_qkv

pytestmark = pytest.mark.gpu


def _indices(rng, shape, n_k, bad=True):
    """Random key blocks with padding (-1), repeats and, with `bad`, entries the kernels must ignore."""
    idx = rng.integers(-1, n_k, shape)
    if bad:
        idx[rng.random(shape) < 0.1] = n_k + 2
        idx[rng.random(shape) < 0.1] = -5
    return idx.astype(np.int32)


def _first_blocks(seq_q, seq_k, block, n=1):
    """A block-granular static part: every query attends the first `n` key blocks (sinks); `block` a size or a
    (query, key) pair."""
    bq, bk = (block, block) if np.isscalar(block) else block
    mask = np.zeros((1, 1, -(-seq_q // bq), -(-seq_k // bk)), bool)
    mask[..., :n] = True
    return BlockLayout(mask, block_size=block, seq_q=seq_q, seq_k=seq_k)


@st.composite
def table_cases(draw):
    # (query, key) blocks: square as MoBA's, and tall ones as grouped rows' (a token of 16 rows, keys of 64)
    block = draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64, 128]))
    tiles = draw(st.sampled_from([(64, 64), (128, 64), (64, 128), (128, 128), (64, 32), (128, 32)]))
    return dict(
        block=block, tiles=tiles, batch=draw(st.integers(1, 2)), heads=draw(st.sampled_from([1, 3])),
        seq_q=draw(st.integers(1, 700)), seq_k=draw(st.integers(1, 700)), width=draw(st.integers(1, 6)),
        counts=draw(st.booleans()), within=draw(st.sampled_from([None, "causal", "local"])),
        plus=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


@settings(max_examples=60)
@given(case=table_cases())
def test_tables_built_on_the_gpu_are_the_host_plan_of_the_selection(case):
    import cupy

    from cusparseattn import dynamic_tables

    print("case:", case)
    rng = np.random.default_rng(case["seed"])
    block, (tm, tn), sq, sk = case["block"], case["tiles"], case["seq_q"], case["seq_k"]
    if plan.tile_cells(tm, tn, block) > plan.MAX_CELLS:
        return
    n_q, n_k = -(-sq // block[0]), -(-sk // block[1])
    shape = (case["batch"], case["heads"], n_q, case["width"])
    idx = _indices(rng, shape, n_k)
    counts = rng.integers(0, case["width"] + 1, shape[:3]).astype(np.int32) if case["counts"] else None
    lay = dynamic.block_indices(
        cupy.asarray(idx), None if counts is None else cupy.asarray(counts), block=block
    )
    if case["within"] == "causal":
        lay = lay & patterns.causal(block=block).layout(sq, sk)
    elif case["within"] == "local":
        lay = lay & patterns.local(window=40, block=block).layout(sq, sk)
    if case["plus"]:
        lay = lay | _first_blocks(sq, sk, block)
    sizes = (case["batch"], case["heads"], case["heads"], sq, sk)
    tables = dynamic_tables.tables(lay, sizes, tm, tn, 0)
    tables.refresh(cupy.cuda.get_current_stream().ptr, lay)
    got = {name: cupy.asnumpy(a) for name, a in tables.arrays.items()}
    want = plan.build(lay.to_layout(sq, sk), tm, tn)

    np.testing.assert_array_equal(got["row_ptr"], want.row_ptr)
    np.testing.assert_array_equal(got["col_ptr"], want.col_ptr)
    nnz = want.nnz
    entries, col_entries = got["entries"].reshape(-1, 2)[:nnz], got["col_entries"].reshape(-1, 2)[:nnz]
    np.testing.assert_array_equal(entries[:, 0], want.entries[:, 0])
    np.testing.assert_array_equal(col_entries[:, 0], want.col_entries[:, 0])
    sub_bits = got["sub_bits"].reshape(-1, 2)
    for mine, theirs, name in ((entries, want.entries, "rows"), (col_entries, want.col_entries, "columns")):
        np.testing.assert_array_equal(mine[:, 1] >= 0, theirs[:, 1] >= 0, err_msg=f"partial tiles ({name})")
        partial = theirs[:, 1] >= 0
        np.testing.assert_array_equal(sub_bits[mine[partial, 1]], want.sub_bits[theirs[partial, 1]])


def _case_layout(idx, counts, block, seq_q, seq_k, plus):
    lay = dynamic.block_indices(idx, counts, block=block) & patterns.causal(block=block)
    return lay | _first_blocks(seq_q, seq_k, block, 2) if plus else lay


@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
@pytest.mark.parametrize(
    "head_dim,dtype,heads,plus",
    [(64, "bfloat16", "q", False), (128, "float16", "kv", True), (128, "bfloat16", "shared", False)],
)
def test_attention_and_gradients_match_the_reference(monkeypatch, hopper, head_dim, dtype, heads, plus):
    import torch

    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(head_dim + hopper)
    B, Hq, Hkv, S, block = 2, 4, 2, 777, 64
    q, k, v = random_qkv(rng, B, Hq, Hkv, S, S, head_dim, np.float32)
    n = -(-S // block)
    idx = _indices(rng, (B, {"q": Hq, "kv": Hkv, "shared": 1}[heads], n, 5), n)
    counts = rng.integers(0, 6, idx.shape[:3]).astype(np.int32)
    lay_host = _case_layout(idx, counts, block, S, S, plus)
    dev = dict(device="cuda", dtype=getattr(torch, dtype))
    tq, tk, tv = (torch.tensor(x, **dev, requires_grad=True) for x in (q, k, v))
    lay = _case_layout(*(torch.tensor(x, device="cuda") for x in (idx, counts)), block, S, S, plus)
    assert backends.runs_on(tq, tk, tv, lay).startswith("cuda")
    out = ca.attention(tq, tk, tv, lay)
    dout = torch.randn_like(out)
    out.backward(dout)
    held = [to_host(x) for x in (tq, tk, tv, dout)]
    ref64, low_ref = forward_refs(*held[:3], lay_host)
    check_close("out", to_host(out), ref64[0], low_ref[0], dtype=dtype)
    check_close(
        "lse", to_host(ca.attention_forward(tq, tk, tv, lay)[1]), ref64[1], low_ref[1], dtype="float32"
    )
    g64, g_low = backward_refs(held[3], *held[:3], lay_host)
    for name, t, want, want_low in zip(("dq", "dk", "dv"), (tq, tk, tv), g64, g_low, strict=True):
        check_close(name, to_host(t.grad), want, want_low, dtype=dtype)
    assert any(name.endswith("_sm90") for name in launched) == hopper
    # The same selection again: the same gradient bits.
    first = [t.grad.clone() for t in (tq, tk, tv)]
    for t in (tq, tk, tv):
        t.grad = None
    ca.attention(tq, tk, tv, lay).backward(dout)
    for a, t in zip(first, (tq, tk, tv), strict=True):
        assert torch.equal(a, t.grad)


def test_a_step_neither_syncs_nor_breaks_a_cuda_graph_and_reads_refilled_indices():
    import torch

    rng = np.random.default_rng(5)
    B, H, S, D, block = 1, 4, 1024, 128, 128
    n = S // block
    q, k, v = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    idx = torch.tensor(_indices(rng, (B, H, n, 3), n, bad=False), device="cuda")
    lay = dynamic.block_indices(idx, block=block) & patterns.causal(block=block)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    def step():
        out = ca.attention(q, k, v, lay)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    step()  # plans, tables and kernels made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            results = step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        idx.copy_(torch.tensor(_indices(rng, (B, H, n, 3), n, bad=False), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        host = dynamic.block_indices(idx.cpu().numpy(), block=block) & patterns.causal(block=block)
        held = [to_host(x) for x in (dout, q, k, v)]
        check_step([to_host(r) for r in results], *held, host, dtype="bfloat16")


def test_a_new_layout_each_step_reuses_the_plan_and_reads_its_own_indices():
    import torch

    from cusparseattn import plans

    rng = np.random.default_rng(9)
    B, H, S, D, block = 2, 2, 500, 64, 64
    n = -(-S // block)
    q, k, v = random_qkv(rng, B, H, H, S, S, D, np.float16)
    tq, tk, tv = (torch.tensor(x, device="cuda", requires_grad=True) for x in (q, k, v))
    made = None
    for step in range(3):
        idx = _indices(rng, (B, H, n, 4), n)
        lay = dynamic.block_indices(torch.tensor(idx, device="cuda"), block=block)
        out = ca.attention(tq, tk, tv, lay, causal=True)
        dout = torch.randn_like(out)
        (dq,) = torch.autograd.grad(out, (tq,), dout)
        if step == 1:
            made = plans.builds()
        host = dynamic.block_indices(idx, block=block) & patterns.causal(block=block)
        ref64, low_ref = forward_refs(q, k, v, host)
        check_close(f"out, step {step}", to_host(out), ref64[0], low_ref[0], dtype="float16")
        g64, g_low = backward_refs(to_host(dout), q, k, v, host)
        check_close(f"dq, step {step}", to_host(dq), g64[0], g_low[0], dtype="float16")
    assert plans.builds() == made  # the third step made no plan


@pytest.mark.parametrize("hopper", [False, True])
def test_jax_jit_runs_the_kernels_on_traced_indices(monkeypatch, hopper):
    """Inside jax.jit the indices are traced operands of the XLA calls: each step's new ones refill the
    tables on XLA's stream, without tracing again."""
    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(21 + hopper)
    B, H, S, D, block = 1, 2, 640, 128, 64
    n = S // block
    host = random_qkv(rng, B, H, H, S, S, D, ml_dtypes.bfloat16)
    dout = rng.standard_normal(host[0].shape).astype(ml_dtypes.bfloat16)
    draw = functools.partial(_indices, rng, (B, H, n, 3), n)
    check_jitted_dynamic_steps(host, dout, dynamic.block_indices, draw, block)
    assert launched and any(name.endswith("_sm90") for name in launched) == hopper
