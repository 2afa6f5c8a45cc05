"""MoBA's gate as a CUDA kernel: what it refuses, and (the GPU tests, ``pytest -m gpu``) `selectors.moba`
on GPU arrays against the array-API code on the same values on the host (exactly, on inputs whose scores
are exact in float32, ties included; on random ones, up to rounding where two scores nearly tie), with no
host sync, in a CUDA graph, on CuPy arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import moba_kernel, selectors
from cusparseattn.arrays import wrap

DTYPES = ["bfloat16", "float16", "float32"]


@st.composite
def gate_cases(draw):
    block = draw(st.sampled_from([16, 32, 64, 128]))
    hkv = draw(st.integers(1, 2))
    return dict(
        batch=draw(st.integers(1, 2)), hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 4])), block=block,
        blocks_q=draw(st.integers(1, 40)), blocks_k=draw(st.integers(1, 40)),
        head_dim=draw(st.sampled_from([16, 40, 64, 128, 256])), topk=draw(st.integers(1, 40)),
        per=draw(st.sampled_from(["block", "token"])), causal=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)), strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def _gpu_qk(case, values):
    """q and k on the GPU from host `values` [B, Hq + Hkv, S, D]-shaped, with `strided` as a view of a wider
    array (the pooling kernel's unaligned loads)."""
    import torch

    dtype = getattr(torch, case["dtype"])
    q, k = (torch.tensor(x, device="cuda").to(dtype) for x in values)
    if case["strided"]:
        q = torch.nn.functional.pad(q, (1, 0))[..., 1:]
    return q, k


def _host(x):
    return x.float().cpu().numpy()


def test_reasons_name_what_the_kernel_cannot_take():
    q = np.zeros((1, 2, 64, 300))
    reasons = moba_kernel.reasons(wrap(q), wrap(q), 5000)
    assert reasons == [
        "the kernel takes PyTorch and CuPy arrays on a GPU",
        "the kernel takes q and k of one dtype among ['bfloat16', 'float16', 'float32']",
        "the kernel takes head dims up to 256",
        "the kernel holds a row's scores of at most 4096 key blocks",
    ]


@pytest.mark.gpu
@settings(max_examples=60, deadline=None)
@given(case=gate_cases())
def test_the_kernel_chooses_what_the_array_api_code_chooses_on_exact_scores(case):
    """Integer inputs in [-2, 2], lengths a multiple of the block (a power of two): every mean and score is
    exact in float32 in any order of the sums, so the two agree bit for bit, ties and all."""
    print("case:", case)
    rng = np.random.default_rng(case["seed"])
    b, block, d = case["batch"], case["block"], case["head_dim"]
    sq, sk = case["blocks_q"] * block, case["blocks_k"] * block
    shapes = ((b, case["hq"], sq, d), (b, case["hkv"], sk, d))
    values = [rng.integers(-2, 3, shape).astype(np.float32) for shape in shapes]
    q, k = _gpu_qk(case, values)
    kwargs = dict(block=block, topk=case["topk"], causal=case["causal"], per=case["per"])
    assert moba_kernel.reasons(wrap(q), wrap(k), case["blocks_k"]) == []
    got = selectors.moba(q, k, **kwargs)
    assert got.device == q.device and str(got.dtype) == "torch.int32" and got.is_contiguous()
    np.testing.assert_array_equal(got.cpu().numpy(), selectors.moba(_host(q), _host(k), **kwargs))


def _scores(q, k, block, per, causal):
    """float64 gate scores [B, Hq, rows, nK] of host arrays, -inf where a block is out (causal)."""

    def means(x):
        n = -(-x.shape[2] // block)
        return np.stack([x[:, :, j * block : (j + 1) * block].mean(axis=2) for j in range(n)], axis=2)

    queries = means(q) if per == "block" else q
    keys = np.repeat(means(k), q.shape[1] // k.shape[1], axis=1)
    s = queries @ keys.swapaxes(-1, -2)
    if causal:
        rows = np.arange(s.shape[2])
        last = np.minimum((rows + 1) * block, q.shape[2]) - 1 if per == "block" else rows
        aligned = last + k.shape[2] - q.shape[2]
        own = np.where(aligned >= 0, aligned // block, -1)[:, None]
        s = np.where(np.arange(s.shape[3])[None, :] >= own, -np.inf, s)
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per", ["block", "token"])
def test_on_random_inputs_only_near_ties_differ(dtype, per):
    """Ragged lengths and random values: where the kernel's choice differs from the array-API code's, the
    blocks swapped score the same up to float32 rounding."""
    rng = np.random.default_rng(11)
    case = dict(dtype=dtype, strided=False)
    values = [rng.standard_normal((2, h, s, 64)).astype(np.float32) for h, s in ((4, 1000), (2, 1300))]
    q, k = _gpu_qk(case, values)
    got = selectors.moba(q, k, block=64, topk=6, per=per).cpu().numpy()
    hq, hk = _host(q), _host(k)
    want = selectors.moba(hq, hk, block=64, topk=6, per=per)
    scores = _scores(hq.astype(np.float64), hk.astype(np.float64), 64, per, True)
    differ = np.argwhere((got != want).any(axis=-1))
    assert len(differ) <= 0.01 * got[..., 0].size, len(differ)
    for at in map(tuple, differ):
        mine, theirs = set(got[at].tolist()), set(want[at].tolist())
        gap = abs(max(scores[at][j] for j in mine - theirs) - min(scores[at][j] for j in theirs - mine))
        assert gap <= 1e-2 * np.abs(scores[at][np.isfinite(scores[at])]).max(), (at, gap)


@pytest.mark.gpu
def test_every_entry_is_written_and_nothing_syncs_and_a_graph_replays():
    import torch

    rng = np.random.default_rng(3)
    shape = (1, 4, 4096, 128)
    q, k = (torch.tensor(rng.standard_normal(shape), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # Poison: the caching allocator hands the output (its shape) the memory of this freed block.
    torch.full((1, 4, 32, 9), 0x7F7F7F7F, device="cuda", dtype=torch.int32)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = selectors.moba(q, k, block=128, topk=8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = selectors.moba(_host(q), _host(k), block=128, topk=8)
    np.testing.assert_array_equal(got.cpu().numpy(), want)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        selectors.moba(q, k, block=128, topk=8)  # warm: loaded before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = selectors.moba(q, k, block=128, topk=8)
    q.copy_(torch.flip(q, dims=[2]))
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(
        captured.cpu().numpy(), selectors.moba(_host(q), _host(k), block=128, topk=8)
    )


@pytest.mark.gpu
def test_cupy_arrays_in_cupy_indices_out():
    import cupy

    rng = np.random.default_rng(4)
    q, k = (rng.integers(-2, 3, (1, 2, 512, 32)).astype(np.float32) for _ in range(2))
    got = selectors.moba(cupy.asarray(q), cupy.asarray(k), block=64, topk=3, per="token")
    assert isinstance(got, cupy.ndarray) and got.dtype == np.int32
    np.testing.assert_array_equal(cupy.asnumpy(got), selectors.moba(q, k, block=64, topk=3, per="token"))
