"""Dynamic layouts (index arrays per query block or token): the reference on them against dense attention
with a mask built entry by entry, their algebra with static layouts, the call's checks, the backends' answers,
and gradients through torch and JAX."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cusparseattn as ca
from cusparseattn import backends, dynamic, patterns, reference, selectors


@dataclass
class Case:
    """One random problem: shapes, a random selection (padding, duplicates, out-of-range entries, counts) and
    the static parts it is combined with."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    per: str
    block: int
    heads: str  # "shared", "q" or "kv": what the index array's head axis counts
    shared_batch: bool
    k: int
    counts: bool
    bad: bool  # out-of-range entries (ignored by the reference; the call's host check refuses them)
    within: str | None
    plus: str | None
    seed: int

    @property
    def n_k(self) -> int:
        return -(-self.Sk // self.block)

    @property
    def rows(self) -> int:
        return -(-self.Sq // self.block) if self.per == "block" else self.Sq

    def arrays(self, rng):
        nh = {"shared": 1, "q": self.Hq, "kv": self.Hkv}[self.heads]
        shape = (1 if self.shared_batch else self.B, nh, self.rows, self.k)
        idx = rng.integers(-1, self.n_k, shape)  # -1 pads; repeats happen (duplicates)
        if self.bad:
            idx[rng.random(shape) < 0.2] = self.n_k + 3
            idx[rng.random(shape) < 0.1] = -7
            idx.flat[rng.integers(idx.size)] = self.n_k  # at least one
        counts = rng.integers(0, self.k + 1, shape[:3]).astype(np.int32) if self.counts else None
        return idx.astype(np.int32), counts

    def static(self, name):
        if name == "causal":
            return patterns.causal(block=self.block)
        if name == "local":
            return patterns.local(window=20, block=self.block)
        if name == "sinks":
            return patterns.streaming(window=8, sinks=4, block=self.block)
        return None

    def layout(self, idx, counts):
        make = dynamic.block_indices if self.per == "block" else dynamic.token_indices
        lay = make(idx, counts, block=self.block)
        if self.within:
            lay = lay & self.static(self.within)
        if self.plus:
            lay = lay | self.static(self.plus)
        return lay

    def mask(self, idx, counts) -> np.ndarray:
        """The token mask, entry by entry: the oracle's own reading of the index rules."""
        out = np.zeros((self.B, self.Hq, self.Sq, self.Sk), dtype=bool)
        group = self.Hq // self.Hkv
        for b in range(self.B):
            for h in range(self.Hq):
                bl = 0 if idx.shape[0] == 1 else b
                hl = {"shared": 0, "q": h, "kv": h // group}[self.heads]
                for r in range(self.rows):
                    n = self.k if counts is None else int(counts[bl, hl, r])
                    for j in range(n):
                        e = int(idx[bl, hl, r, j])
                        if 0 <= e < self.n_k:
                            rows = slice(r * self.block, (r + 1) * self.block) if self.per == "block" else r
                            out[b, h, rows, e * self.block : (e + 1) * self.block] = True
        for name, op in ((self.within, np.logical_and), (self.plus, np.logical_or)):
            if name:
                out = op(out, self.static(name).layout(self.Sq, self.Sk).to_dense())
        return out


@st.composite
def cases(draw, max_seq=90):
    hkv = draw(st.integers(1, 2))
    return Case(
        B=draw(st.integers(1, 2)),
        Hq=hkv * draw(st.integers(1, 3)),
        Hkv=hkv,
        Sq=draw(st.integers(1, max_seq)),
        Sk=draw(st.integers(1, max_seq)),
        D=draw(st.sampled_from([4, 8])),
        per=draw(st.sampled_from(["block", "token"])),
        block=draw(st.sampled_from([16, 32])),
        heads=draw(st.sampled_from(["shared", "q", "kv"])),
        shared_batch=draw(st.booleans()),
        k=draw(st.integers(1, 4)),
        counts=draw(st.booleans()),
        bad=draw(st.booleans()),
        within=draw(st.sampled_from([None, "causal", "local"])),
        plus=draw(st.sampled_from([None, "local", "sinks"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _qkv(case, rng):
    q = rng.standard_normal((case.B, case.Hq, case.Sq, case.D))
    k, v = rng.standard_normal((2, case.B, case.Hkv, case.Sk, case.D))
    return q, k, v


def _dense_torch(q, k, v, mask):
    """Masked softmax attention in torch float64 (GQA by repeated heads; an empty row gives 0)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, -torch.inf)
    m = s.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0).clamp_min(-1e300)
    p = torch.exp(s - m) * mask
    denom = p.sum(dim=-1, keepdim=True)
    return (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))


@settings(max_examples=40)
@given(cases())
def test_reference_forward_matches_dense_attention_on_the_mask_entry_by_entry(case):
    rng = np.random.default_rng(case.seed)
    idx, counts = case.arrays(rng)
    q, k, v = _qkv(case, rng)
    lay = case.layout(idx, counts)
    out, lse = reference.forward(q, k, v, lay, precision=np.float64)
    ref_out, ref_lse = reference.dense_forward(q, k, v, case.mask(idx, counts))
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))  # empty rows: -inf
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-12)
    assert not out[np.isinf(lse)].any()  # and output 0


@settings(max_examples=25)
@given(cases(max_seq=70))
def test_reference_backward_matches_torch_autograd_on_the_mask(case):
    rng = np.random.default_rng(case.seed)
    idx, counts = case.arrays(rng)
    q, k, v = _qkv(case, rng)
    dout = rng.standard_normal(q.shape)
    lay = case.layout(idx, counts)
    out, lse = reference.forward(q, k, v, lay, precision=np.float64)
    grads = reference.backward(dout, q, k, v, out, lse, lay, precision=np.float64)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    _dense_torch(tq, tk, tv, torch.from_numpy(case.mask(idx, counts))).backward(torch.from_numpy(dout))
    for name, got, want in zip("qkv", grads, (tq.grad, tk.grad, tv.grad), strict=True):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-10, err_msg=f"d{name}")


@settings(max_examples=20)
@given(cases(max_seq=64))
def test_the_public_call_runs_the_reference_and_refuses_bad_host_values(case):
    rng = np.random.default_rng(case.seed)
    idx, counts = case.arrays(rng)
    q, k, v = _qkv(case, rng)
    lay = case.layout(idx, counts)
    if case.bad:
        with pytest.raises(ValueError, match=r"indices\[.*expected a key block 0\.\."):
            ca.attention_forward(q, k, v, lay)
        return
    out, lse = ca.attention_forward(q, k, v, lay, causal=True)
    mask = case.mask(idx, counts) & patterns.causal(block=case.block).layout(case.Sq, case.Sk).to_dense()
    ref_out, _ = reference.dense_forward(q, k, v, mask)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)


def test_algebra_distributes_over_the_static_parts():
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, 4, (1, 2, 64, 3)).astype(np.int32)
    dyn = dynamic.token_indices(idx, block=16)
    a, b = patterns.local(window=24, block=16), patterns.causal(block=16)
    left = ((dyn | a) & b).to_dense(64, 64)
    right = ((dyn & b) | a.layout(64) & b.layout(64)).to_dense(64, 64)
    np.testing.assert_array_equal(left, right)
    assert (a | dyn).plus is a and (b & dyn).within is b


def test_kv_heads_share_the_selection_of_their_group():
    idx = np.array([[[[0]], [[1]]]], np.int32)  # 2 KV heads, 1 query block, blocks 0 and 1
    dense = dynamic.block_indices(idx, block=16).to_dense(16, 32, heads_q=4, heads_kv=2)
    assert [int(dense[0, h, 0].argmax()) for h in range(4)] == [0, 0, 16, 16]


def test_indices_refilled_in_place_are_read_by_the_next_call():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 1, 1, 32, 8))
    idx = np.zeros((1, 1, 2, 1), np.int32)
    lay = dynamic.block_indices(idx, block=16)
    first = ca.attention(q, k, v, lay)
    idx[...] = 1
    second = ca.attention(q, k, v, lay)
    want, _ = reference.dense_forward(q, k, v, np.arange(32)[None, :] >= 16)
    np.testing.assert_allclose(second, want, atol=1e-12)
    assert not np.allclose(first, second)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int64)), "indices must be int32"),
        (lambda: dynamic.block_indices(np.zeros((1, 4, 2), np.int32)), r"indices must be 4-D"),
        (lambda: dynamic.block_indices(np.zeros((1, 1, 0, 2), np.int32)), "empty dimension"),
        (
            lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int32), np.zeros((1, 1, 3), np.int32)),
            r"counts must have shape indices.shape\[:3\]",
        ),
        (
            lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int32), torch.zeros(1, 1, 4).int()),
            "counts must be an array of indices' framework and device",
        ),
        (lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int32), block=48), "power of two"),
        (
            lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int32), block=16) & patterns.causal(),
            r"within has blocks of \(128, 128\), expected the dynamic layout's \(16, 16\)",
        ),
        (lambda: dynamic.block_indices(np.zeros((1, 1, 4, 2), np.int32)) | 3, "must be a Pattern or a"),
    ],
)
def test_construction_errors_name_the_argument(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_call_errors_name_what_does_not_fit():
    q = np.zeros((2, 4, 64, 8), np.float32)
    k = np.zeros((2, 2, 64, 8), np.float32)
    zeros = np.zeros((1, 1, 4, 2), np.int32)
    checks = [
        (dynamic.block_indices(np.zeros((1, 1, 3, 2), np.int32), block=16), "3 rows, expected one per query"),
        (dynamic.block_indices(np.zeros((3, 1, 4, 2), np.int32), block=16), "batch 3, expected 1"),
        (dynamic.block_indices(np.zeros((1, 3, 4, 2), np.int32), block=16), "3 heads, expected 1 .shared."),
        (dynamic.block_indices(torch.zeros(1, 1, 4, 2, dtype=torch.int32), block=16), "q's framework"),
        (dynamic.block_indices(zeros, np.full((1, 1, 4), 3, np.int32), block=16), r"counts\[0, 0, 0\] is 3"),
        (
            dynamic.token_indices(np.zeros((1, 1, 64, 2), np.int32) + 9, block=16),
            r"indices\[0, 0, 0, 0\] is 9",
        ),
    ]
    for lay, match in checks:
        with pytest.raises((TypeError, ValueError), match=match):
            ca.attention(q, k, k, lay)


def test_backends_say_why_the_kernels_cannot_take_it_and_the_reference_runs():
    q = np.zeros((1, 2, 64, 8), np.float32)
    lay = dynamic.block_indices(np.zeros((1, 1, 4, 1), np.int32), block=16)
    why = backends.why_not(q, q, q, lay)
    assert why["reference"] == []
    per_token = dynamic.token_indices(np.zeros((1, 1, 64, 1), np.int32), block=16)
    assert any("per query block" in r for r in backends.why_not(q, q, q, per_token)["cuda"])
    both = lay & patterns.causal(block=16) | patterns.local(window=20, block=16)
    assert any("both static parts" in r for r in backends.why_not(q, q, q, both)["cuda"])
    assert backends.runs_on(q, q, q, lay) == "reference (NumPy, on the host)"


def _assert_matches_dense_autograd(q, k, v, out, mask):
    """`out` (float64, of q, k, v) and its gradients equal masked dense attention's under torch autograd."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    want = _dense_torch(qd, kd, vd, mask)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    for got, ref in zip(grads, torch.autograd.grad(want, (qd, kd, vd), dout), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)


def test_torch_gradients_through_a_dynamic_layout_match_dense_autograd():
    rng = np.random.default_rng(3)
    q = torch.tensor(rng.standard_normal((1, 4, 80, 8)), requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((1, 2, 80, 8)), requires_grad=True) for _ in range(2))
    idx = torch.tensor(rng.integers(-1, 3, (1, 2, 80, 2)), dtype=torch.int32)  # per token, per KV head
    lay = dynamic.token_indices(idx, block=32) | patterns.local(window=16, block=32)
    out = ca.attention(q, k, v, lay, causal=True)
    mask = torch.from_numpy(
        (dynamic.token_indices(idx.numpy(), block=32) & patterns.causal(block=32)).to_dense(80, 80, 4, 2)
        | (patterns.local(window=16, block=32) & patterns.causal(block=32)).layout(80).to_dense()
    )
    _assert_matches_dense_autograd(q, k, v, out, mask)


def test_gradients_through_the_layout_that_moba_chooses_match_dense_autograd():
    # As a training step takes it: the gate picks the blocks from q and k (no gradient through the choice),
    # the attention on them is differentiated.
    rng = np.random.default_rng(4)
    q, k, v = (torch.tensor(rng.standard_normal((2, 2, 100, 8)), requires_grad=True) for _ in range(3))
    idx = selectors.moba(q, k, block=16, topk=2)
    lay = dynamic.block_indices(idx, block=16) & patterns.causal(block=16)
    out = ca.attention(q, k, v, lay)
    mask = torch.from_numpy(lay.to_dense(100, 100))
    assert mask.any(dim=-1).all() and not mask.all()  # every query sees its own block, none sees all
    _assert_matches_dense_autograd(q, k, v, out, mask)


def test_jax_gradients_through_a_dynamic_layout(jax_on_cpu, x64):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(x) for x in rng.standard_normal((3, 1, 2, 64, 8)))
    idx = jnp.asarray(rng.integers(-1, 4, (1, 1, 4, 2)), dtype=jnp.int32)
    lay = dynamic.block_indices(idx, block=16)
    grad = jax.grad(lambda q: ca.attention(q, k, v, lay, causal=True).sum())(q)
    mask = (dynamic.block_indices(np.asarray(idx), block=16) & patterns.causal(block=16)).to_dense(64, 64)
    tq = torch.tensor(np.asarray(q), requires_grad=True)
    tk, tv = (torch.tensor(np.asarray(x)) for x in (k, v))
    _dense_torch(tq, tk, tv, torch.from_numpy(mask)).sum().backward()
    np.testing.assert_allclose(np.asarray(grad), tq.grad.numpy(), atol=1e-10)


@pytest.mark.parametrize("callback", ["buffer_callback", "pure_callback"])
@pytest.mark.parametrize("per", ["block", "token"])
def test_jax_jit_takes_traced_indices_and_new_ones_without_tracing_again(
    jax_on_cpu, x64, monkeypatch, per, callback
):
    """Under jax.jit the indices (and counts) are operands of the XLA calls: a jitted step gives each new
    selection's answer, forward and gradients, traced once; out-of-range entries are ignored as on a GPU."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from cusparseattn import jax as ca_jax

    if callback == "pure_callback":
        monkeypatch.setattr(ca_jax, "buffer_callback", None)
    rng = np.random.default_rng(8)
    q = jnp.asarray(rng.standard_normal((2, 4, 64, 8)))
    k, v = (jnp.asarray(x) for x in rng.standard_normal((2, 2, 2, 64, 8)))  # GQA: one selection a KV head
    rows, make = (4, dynamic.block_indices) if per == "block" else (64, dynamic.token_indices)
    traces = []

    def step(q, idx, counts):
        traces.append(1)
        lay = make(idx, counts, block=16) | patterns.local(window=8, block=16)
        out = ca.attention(q, k, v, lay, causal=True)
        return out, jax.grad(lambda q: (ca.attention(q, k, v, lay, causal=True) ** 2).sum())(q)

    jitted = jax.jit(step)
    for seed in range(3):
        pick = np.random.default_rng(seed)
        idx = pick.integers(-1, 6, (2, 2, rows, 3)).astype(np.int32)  # 4 and 5: past the last key block
        counts = pick.integers(0, 4, (2, 2, rows)).astype(np.int32)
        out, grad = jitted(q, jnp.asarray(idx), jnp.asarray(counts))
        clean = np.where(idx < 4, idx, -1).astype(np.int32)
        lay = make(clean, counts, block=16) | patterns.local(window=8, block=16)
        mask = (lay & patterns.causal(block=16)).to_dense(64, 64, 4, 2)
        tq = torch.tensor(np.asarray(q), requires_grad=True)
        tk, tv = (torch.tensor(np.asarray(x)) for x in (k, v))
        want = _dense_torch(tq, tk, tv, torch.from_numpy(mask))
        (want**2).sum().backward()
        np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), atol=1e-12)
        np.testing.assert_allclose(np.asarray(grad), tq.grad.numpy(), atol=1e-10)
    assert len(traces) == 1


@pytest.mark.gpu
def test_on_a_gpu_the_reference_runs_in_cupy_and_ignores_bad_entries():
    import cupy

    case = Case(2, 4, 2, 200, 180, 16, "token", 32, "kv", False, 3, True, True, "causal", "sinks", 11)
    rng = np.random.default_rng(case.seed)
    idx, counts = case.arrays(rng)
    q, k, v = _qkv(case, rng)
    want, want_lse = reference.forward(q, k, v, case.layout(idx, counts), precision=np.float64)
    lay = case.layout(cupy.asarray(idx), cupy.asarray(counts))
    out, lse = reference.forward(*(cupy.asarray(x) for x in (q, k, v)), lay, precision=np.float64)
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out), want, atol=1e-12)
    # -inf where a row attends to nothing; elsewhere CuPy's exp and log may round the last bit otherwise.
    np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, rtol=1e-14, atol=0)
    # torch CUDA tensors: the call reads nothing on the device (bad entries are ignored, not refused)
    tq, tk, tv = (torch.tensor(x, device="cuda") for x in (q, k, v))
    t_lay = case.layout(torch.tensor(idx, device="cuda"), torch.tensor(counts, device="cuda"))
    assert backends.runs_on(tq, tk, tv, t_lay).startswith("reference (CuPy, on cuda:")
    out = ca.attention(tq, tk, tv, t_lay)
    np.testing.assert_allclose(out.cpu().numpy(), want, atol=1e-12)


def test_causal_and_joined_parts_are_the_same_objects_step_to_step():
    """Plans and device tables are keyed by the static parts' identities: a step's new layout over new
    indices, with causal=True or the same Pattern joined, must find the parts of the step before."""
    from cusparseattn import call

    q = np.zeros((1, 2, 64, 8), np.float32)
    local = patterns.local(window=20, block=16)

    def parts(seed):
        idx = np.random.default_rng(seed).integers(0, 4, (1, 1, 4, 2)).astype(np.int32)
        lay = dynamic.block_indices(idx, block=16) & local | local
        fitted = call.prepare(q, q, q, lay, causal=True, scale=None).layout
        return fitted.within, fitted.plus

    assert all(a is b for a, b in zip(parts(0), parts(1), strict=True))
