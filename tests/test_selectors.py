"""The selectors (MoBA's gate, NSA's selection) against a plain dense computation of their scores and a
row-by-row choice, `torch.topk`'s set on the same scores, ties, agreement across frameworks, bounded memory,
and gradients through the layout they choose."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cusparseattn as ca
from cusparseattn import dynamic, patterns, reference, selectors


@dataclass
class Case:
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    block: int
    topk: int
    seed: int

    def qk(self):
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal((self.B, self.Hq, self.Sq, self.D)), rng.standard_normal(
            (self.B, self.Hkv, self.Sk, self.D)
        )


@st.composite
def cases(draw):
    hkv = draw(st.integers(1, 2))
    sk = draw(st.integers(1, 200))
    return Case(
        B=draw(st.integers(1, 2)),
        Hq=hkv * draw(st.integers(1, 3)),
        Hkv=hkv,
        Sq=draw(st.sampled_from([sk, draw(st.integers(1, 200))])),
        Sk=sk,
        D=draw(st.sampled_from([4, 8])),
        block=draw(st.sampled_from([16, 32])),
        topk=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _means(x, block):
    n = -(-x.shape[2] // block)
    return np.stack([x[:, :, j * block : (j + 1) * block].mean(axis=2) for j in range(n)], axis=2)


def _choose(scores, width):
    """Row by row: the ``width`` best columns but -inf ones, ties to the smaller index, ascending, -1 pads."""
    out = np.full((*scores.shape[:-1], width), -1, np.int32)
    for at in np.ndindex(scores.shape[:-1]):
        row = scores[at]
        picked = sorted(sorted(range(row.size), key=lambda j: (-row[j], j))[:width])
        picked = [j for j in picked if row[j] != -np.inf]
        out[at][: len(picked)] = picked
    return out


def _moba_scores(q, k, block, per, causal):
    queries = _means(q, block) if per == "block" else q
    means = np.repeat(_means(k, block), q.shape[1] // k.shape[1], axis=1)
    s = queries @ means.swapaxes(-1, -2)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        rows = np.arange(s.shape[2])
        last = np.minimum((rows + 1) * block, sq) - 1 if per == "block" else rows
        aligned = last + sk - sq
        own = np.where(aligned >= 0, aligned // block, -1)[:, None]
        cols = np.arange(s.shape[3])[None, :]
        s = np.where(cols == own, np.inf, np.where(cols > own, -np.inf, s))
    return s


def _nsa_scores(q, k, block, init_blocks, local_blocks):
    sq, sk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    s = q @ np.repeat(_means(k, block), group, axis=1).swapaxes(-1, -2) / math.sqrt(q.shape[3])
    t = np.arange(sq)[:, None] + sk - sq
    cols = np.arange(s.shape[3])[None, :]
    visible = (cols + 1) * block - 1 <= t
    own = np.where(t >= 0, t // block, -1)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(m), 0, m))
    p /= np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    score = p.reshape(q.shape[0], k.shape[1], group, sq, -1).sum(axis=2)
    forced = ((cols < init_blocks) | (cols > own - local_blocks)) & (cols <= own)
    return np.where(forced, np.inf, np.where(visible, score, -np.inf))


@settings(max_examples=40)
@given(cases(), st.sampled_from(["block", "token"]), st.booleans())
def test_moba_matches_a_dense_gate_chosen_row_by_row(case, per, causal):
    q, k = case.qk()
    got = selectors.moba(q, k, block=case.block, topk=case.topk, causal=causal, per=per)
    want = _choose(_moba_scores(q, k, case.block, per, causal), case.topk + causal)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=40)
@given(cases(), st.integers(0, 2), st.integers(0, 3))
def test_nsa_matches_dense_group_scores_chosen_row_by_row(case, init_blocks, local_blocks):
    q, k = case.qk()
    topk = case.topk + init_blocks + local_blocks
    got = selectors.nsa(q, k, block=case.block, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    assert got.shape == (case.B, case.Hkv, case.Sq, topk) and got.dtype == np.int32
    np.testing.assert_array_equal(
        got, _choose(_nsa_scores(q, k, case.block, init_blocks, local_blocks), topk)
    )


@pytest.mark.parametrize("selector", ["moba", "nsa"])
def test_the_set_is_torch_topks_on_the_same_scores(selector):
    case = Case(B=1, Hq=4, Hkv=2, Sq=300, Sk=300, D=16, block=16, topk=5, seed=7)
    q, k = case.qk()
    if selector == "moba":
        got = selectors.moba(torch.from_numpy(q), torch.from_numpy(k), block=16, topk=5, per="token")
        scores, width = _moba_scores(q, k, 16, "token", True), 6
    else:
        got = selectors.nsa(torch.from_numpy(q), torch.from_numpy(k), block=16, topk=5)
        scores, width = _nsa_scores(q, k, 16, 1, 2), 5
    top = torch.topk(torch.from_numpy(scores), min(width, scores.shape[-1]), dim=-1)
    for at in np.ndindex(scores.shape[:-1]):
        want = {int(j) for j, s in zip(top.indices[at], top.values[at], strict=True) if s != -math.inf}
        assert set(got[at].tolist()) - {-1} == want, at


def test_ties_go_to_the_smaller_block_index():
    q = np.ones((1, 1, 128, 8))
    k = np.ones((1, 1, 128, 8))  # every block's mean key is the same: every score ties
    assert selectors.moba(q, k, block=16, topk=3, causal=False)[0, 0, 0].tolist() == [0, 1, 2]
    assert selectors.moba(q, k, block=16, topk=3)[0, 0, 7].tolist() == [0, 1, 2, 7]
    assert selectors.nsa(q, k, block=16, topk=5)[0, 0, 127].tolist() == [0, 1, 2, 6, 7]


def test_frameworks_choose_the_same_blocks():
    jax = pytest.importorskip("jax")
    case = Case(B=1, Hq=2, Hkv=1, Sq=200, Sk=200, D=8, block=32, topk=3, seed=3)
    q, k = case.qk()
    with jax.default_device(jax.devices("cpu")[0]):
        for fn in (selectors.moba, selectors.nsa):
            want = fn(q, k, block=32, topk=3)
            got = fn(torch.from_numpy(q), torch.from_numpy(k), block=32, topk=3)
            np.testing.assert_array_equal(got, want)
            q32, k32 = q.astype(np.float32), k.astype(np.float32)
            got = fn(jax.numpy.asarray(q32), jax.numpy.asarray(k32), block=32, topk=3)
            np.testing.assert_array_equal(got, fn(q32, k32, block=32, topk=3))


def test_memory_stays_bounded_by_the_band():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 2048, 16), dtype=np.float32)
    for fn, kwargs in ((selectors.moba, dict(per="token")), (selectors.nsa, {})):
        with mock.patch.object(selectors, "BAND_BYTES", 1 << 30):
            whole = fn(q, q, block=16, topk=4, **kwargs)  # one band
        with mock.patch.object(selectors, "BAND_BYTES", 1 << 20):
            tracemalloc.start()
            banded = fn(q, q, block=16, topk=4, **kwargs)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 2048 * 2048 * 4 / 2, peak  # well under one [S, S] float32 score matrix
        np.testing.assert_array_equal(banded, whole)


def test_torch_gradients_through_the_layout_a_selector_chose():
    rng = np.random.default_rng(5)
    q = torch.tensor(rng.standard_normal((1, 4, 96, 8)), requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((1, 2, 96, 8)), requires_grad=True) for _ in range(2))
    idx = selectors.nsa(q, k, block=16, topk=3)  # per KV head: the group shares it
    lay = dynamic.token_indices(idx, block=16)
    out = ca.attention(q, k, v, lay, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    static = (dynamic.token_indices(idx.numpy(), block=16) & patterns.causal(block=16)).to_layout(
        96, 96, 4, 2
    )
    args = [x.detach().numpy() for x in (q, k, v)]
    ref_out, lse = reference.forward(*args, static, precision=np.float64)
    ref = reference.backward(dout.numpy(), *args, ref_out, lse, static, precision=np.float64)
    np.testing.assert_allclose(out.detach().numpy(), ref_out, atol=1e-12)
    for got, want in zip(grads, ref, strict=True):
        np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda q: selectors.moba(q, q, topk=0), "topk must be an integer >= 1"),
        (lambda q: selectors.moba(q, q, per="head"), "per must be 'block' or 'token'"),
        (lambda q: selectors.nsa(q, q, topk=2), r"init_blocks \+ local_blocks = 3"),
        (lambda q: selectors.nsa(q, q, block=16, k_cmp=q), r"k_cmp must have shape \[B, Hkv, nK, D\]"),
        (lambda q: selectors.moba(q, torch.from_numpy(q)), "q and k must be arrays of one framework"),
        (lambda q: selectors.moba(q, q[:, :3]), "heads are not a multiple"),
        (lambda q: selectors.moba(q[0], q[0]), "must be 4-D"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(np.zeros((1, 4, 64, 8), np.float32))
