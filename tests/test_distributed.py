"""Context parallelism: orderings, schedules, and ring attention across processes (gloo, reference backend).

The multi-process tests start one group of 2 and one of 4 processes; each rank runs every case (layouts x
balance x rotate) and writes what it measured to a file, and the test asserts on all ranks' results: the
sharded outputs, LSEs and gradients equal single-process attention on the whole sequence, kernel calls equal
the schedule's windows (empty slices are skipped), and a sliding window sends a fraction of a dense ring's
bytes.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import json
import multiprocessing
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import BlockLayout, TokenRule, patterns
from cusparseattn.distributed import Ordering, balance, ring_attention, schedule, shard

S, B, HQ, HKV, D, BLOCK = 256, 1, 2, 1, 16, 16
BALANCES = (None, "zigzag", "work")
ROTATES = ("ring", "allgather")
SPAWN_TIMEOUT = 150  # seconds for one group to start, run every case and exit; a hang fails, not hangs


# ---- layouts shared by the unit and the multi-process tests ------------------------------------------------
def random_layout(seq: int = S, heads: int = HQ, block: int = BLOCK, seed: int = 3) -> BlockLayout:
    """Random blocks per head, some partial under a token rule, and an empty row (its output must be 0)."""
    rng = np.random.default_rng(seed)
    n = seq // block
    blocks = rng.random((1, heads, n, n)) < 0.3
    blocks[:, :, np.arange(n), np.arange(n)] = True
    blocks[:, 0, n // 3] = False
    partial = blocks & (rng.random(blocks.shape) < 0.5)
    rule = TokenRule("hash", lambda b, h, q, k: (q * 7 + k * 3 + h) % 5 != 0)
    return BlockLayout(blocks, block_size=block, seq_q=seq, partial=partial, rule=rule)


@functools.cache
def case_layout(name: str, seq: int = S, heads: int = HQ, block: int = BLOCK):
    """``(layout argument, causal)`` of a named case (a window of 2.5 blocks: partial blocks on both ends)."""
    return {
        "dense": (None, False),
        "causal": (None, True),
        "local": (patterns.local(5 * block // 2, block=block), False),
        "strided": (patterns.strided_blocks(4, block=block), False),
        "random": (random_layout(seq, heads, block), False),
    }[name]


def resolved(name: str, seq: int = S, heads: int = HQ, block: int = BLOCK) -> BlockLayout:
    lay, causal = case_layout(name, seq, heads, block)
    if lay is None:
        lay = (patterns.causal if causal else patterns.dense)(block=block)
    return lay.layout(seq) if not isinstance(lay, BlockLayout) else lay


# ---- orderings ---------------------------------------------------------------------------------------------
def test_docstring_examples():
    for name in ("balance", "schedule", "comm"):
        mod = importlib.import_module(f"cusparseattn.distributed.{name}")
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, name


def test_contiguous_and_zigzag_orderings():
    c = Ordering.contiguous(64, 4)
    assert c.ranks == ((0,), (1,), (2,), (3,)) and c.shard_len == 16
    assert c.spans(2) == ((32, 48, 0),)
    z = Ordering.zigzag(64, 4)
    assert z.ranks == ((0, 7), (1, 6), (2, 5), (3, 4)) and z.chunk == 8
    assert z.spans(3) == ((24, 40, 0),)  # chunks 3 and 4 touch: one run
    assert z.spans(0) == ((0, 8, 0), (56, 64, 8))
    assert sorted(z.index().tolist()) == list(range(64))
    assert z.index()[:16].tolist() == [*range(8), *range(56, 64)]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "work"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_unshard_roundtrip(kind, world):
    order = {
        "contiguous": lambda: Ordering.contiguous(S, world),
        "zigzag": lambda: Ordering.zigzag(S, world),
        "work": lambda: Ordering.by_work(random_layout(), world),
    }[kind]()
    x = np.random.default_rng(0).standard_normal((2, 3, S, 4))
    shards = [order.shard(x, r) for r in range(world)]
    np.testing.assert_array_equal(np.concatenate(shards, axis=2), x[:, :, order.index()])
    np.testing.assert_array_equal(order.unshard(shards), x)
    t = torch.from_numpy(x).transpose(1, 2)  # [B, S, H, D]: the sequence along dim 1, a strided view
    back = order.unshard([order.shard(t, r, dim=1) for r in range(world)], dim=1)
    assert torch.equal(back, t)


def test_by_work_balances_causal_and_keeps_windows_contiguous():
    causal = patterns.causal(block=BLOCK).layout(S)
    contiguous = Ordering.contiguous(S, 4).work(causal)
    order = Ordering.by_work(causal, 4)
    assert order.work(causal).max() == order.work(causal).min() < contiguous.max()
    local = patterns.local(40, block=BLOCK).layout(S)
    assert Ordering.by_work(local, 4) == Ordering.contiguous(S, 4)  # gains < 5%: contiguity wins
    assert Ordering.by_work(causal, 4) is Ordering.by_work(causal, 4)  # cached per layout


def test_by_work_greedy_beats_zigzag_on_skewed_rows():
    # Global rows in chunks 0, 1, 6 and 7 of 8 attend everything, the others their diagonal block: contiguous
    # and zigzag both give rank 0 two heavy chunks, the greedy assignment one per rank.
    n = S // BLOCK
    blocks = np.eye(n, dtype=bool)
    blocks[[0, 1, 2, 3, 12, 13, 14, 15]] = True
    lay = BlockLayout(blocks, block_size=BLOCK, seq_q=S)
    order = Ordering.by_work(lay, 4)
    assert order.name == "work"
    best = min(Ordering.contiguous(S, 4).work(lay).max(), Ordering.zigzag(S, 4).work(lay).max())
    assert order.work(lay).max() < best
    assert sorted(c for r in order.ranks for c in r) == list(range(8))


def test_ordering_errors():
    with pytest.raises(ValueError, match="zigzag ordering cuts the sequence into 8 equal chunks.*100 tokens"):
        Ordering.zigzag(100, 4)
    with pytest.raises(ValueError, match="ranks must hold the 4 chunks once each"):
        Ordering(64, 16, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="balance must be None, 'zigzag', 'work' or an Ordering"):
        balance.resolve("headtail", S, 2, None)
    with pytest.raises(ValueError, match="ordering of 256 positions over 2 ranks"):
        balance.resolve(Ordering.zigzag(S, 2), S, 4, None)


# ---- schedules ---------------------------------------------------------------------------------------------
def test_schedule_dense_sends_every_shard_whole():
    sched = schedule.build(resolved("dense"), Ordering.contiguous(S, 4))
    assert [s.shift for s in sched.steps] == [0, 1, 2, 3]
    transfers = sched.transfers()
    assert len(transfers) == 12 and all(tokens == S // 4 for *_, tokens in transfers)
    assert all(sched.calls(r) == 4 for r in range(4))


def test_schedules_and_orderings_are_found_again_without_comparing_layouts(monkeypatch):
    lay = patterns.local(window=4096, block=128).layout(1 << 17)
    order = Ordering.by_work(lay, 2)
    sched = schedule.build(lay, order)
    monkeypatch.setattr(BlockLayout, "token_mask", lambda *a: pytest.fail("token masks evaluated"))
    assert Ordering.by_work(lay, 2) == order and schedule.build(lay, order) is sched


def test_schedule_causal_skips_empty_slices():
    sched = schedule.build(resolved("causal"), Ordering.contiguous(S, 4))
    assert {(src, dst) for _, src, dst, _ in sched.transfers()} == {
        (s, d) for d in range(4) for s in range(d)
    }
    assert [sched.calls(r) for r in range(4)] == [1, 2, 3, 4]
    # zigzag: equal work everywhere; a rank ahead of its source needs only the source's head chunk
    lay = resolved("causal")
    zig = schedule.build(lay, Ordering.zigzag(S, 4))
    work = [
        sum(
            lay.window(w.q_start, w.q_start + w.q_len, w.k_start, w.k_start + w.k_len).nnz
            for step in zig.steps
            for w in step.windows[rank]
        )
        for rank in range(4)
    ]
    assert len(set(work)) == 1
    for _, src, dst, tokens in zig.transfers():
        assert tokens == (S // 8 if src < dst else S // 4)


def test_schedule_local_window_talks_to_the_next_rank_only():
    sched = schedule.build(resolved("local"), Ordering.contiguous(S, 4))
    assert [s.shift for s in sched.steps] == [0, 1]
    # A window of 40 tokens reaches back 3 blocks of 16: the last 48 tokens of the previous shard.
    assert sched.transfers() == [(1, 0, 1, 48), (1, 1, 2, 48), (1, 2, 3, 48)]
    assert sched.steps[1].pieces[1] == (schedule.Piece(offset=16, start=16, length=48),)


def check_schedule(lay: BlockLayout, order: Ordering) -> None:
    """Every visited block is computed by exactly one window, every window reads only received rows, and
    every window's layout has a visited block."""
    sched = schedule.build(lay, order)
    touched = lay.blocks.any(axis=(0, 1))
    n = order.world_size
    for rank in range(n):
        rows = list(order.spans(rank))
        counted = np.zeros_like(touched, dtype=int)
        for step in sched.steps:
            src = step.source(rank)
            have = set()
            for p in step.pieces[rank]:
                assert p.offset + p.length <= order.shard_len
                have.update(range(p.offset, p.offset + p.length))
            for w in step.windows[rank]:
                assert any(
                    s.offset <= w.q_offset and w.q_offset + w.q_len <= s.offset + s.stop - s.start
                    for s in rows
                )
                assert step.shift == 0 or set(range(w.k_offset, w.k_offset + w.k_len)) <= have
                assert order.index()[src * order.shard_len + w.k_offset] == w.k_start
                assert order.index()[rank * order.shard_len + w.q_offset] == w.q_start
                window = lay.window(w.q_start, w.q_start + w.q_len, w.k_start, w.k_start + w.k_len)
                assert window.nnz > 0
                counted[
                    w.q_start // BLOCK : (w.q_start + w.q_len) // BLOCK,
                    w.k_start // BLOCK : (w.k_start + w.k_len) // BLOCK,
                ] += 1
        mine = np.zeros(touched.shape[0], dtype=bool)
        for s in rows:
            mine[s.start // BLOCK : s.stop // BLOCK] = True
        assert counted.max() <= 1
        assert np.all(counted[mine][touched[mine]] == 1), f"rank {rank}: a visited block has no window"
        assert not counted[~mine].any()


@settings(max_examples=30, deadline=None)
@given(
    world=st.sampled_from([2, 3, 4]),
    kind=st.sampled_from(["contiguous", "zigzag", "work"]),
    density=st.floats(0.0, 0.6),
    seed=st.integers(0, 2**16),
)
def test_schedule_covers_every_visited_block_once(world, kind, density, seed):
    seq = 2 * world * 2 * BLOCK
    rng = np.random.default_rng(seed)
    blocks = rng.random((1, 2, seq // BLOCK, seq // BLOCK)) < density
    lay = BlockLayout(blocks, block_size=BLOCK, seq_q=seq)
    order = {
        "contiguous": lambda: Ordering.contiguous(seq, world),
        "zigzag": lambda: Ordering.zigzag(seq, world),
        "work": lambda: Ordering.by_work(lay, world),
    }[kind]()
    check_schedule(lay, order)


def test_schedule_needs_shards_in_whole_blocks():
    lay = patterns.local(16, block=BLOCK).layout(96)
    with pytest.raises(ValueError, match=r"chunks of 24 tokens .*96 tokens over 2 ranks.*block size 16"):
        schedule.build(lay, Ordering.zigzag(96, 2))
    with pytest.raises(ValueError, match="seq_q 96 and seq_k 96, but the shards hold a sequence of 128"):
        schedule.build(lay, Ordering.contiguous(128, 2))


def test_ring_attention_needs_torch_distributed():
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(RuntimeError, match="torch.distributed, which is not initialised"):
        ring_attention(q, q, q)


def test_shard_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(torch.randn(1, 2, 32, 16))


# ---- every rank in one process: the ring's compute without torch.distributed -------------------------------
class Loopback:
    """The ranks of a group in one process, run one after another: a receive gets what its sender posted in
    the previous pass. Messages depend only on earlier ones (K/V on nothing, dk/dv on received K/V), so two
    passes make a forward right and three a backward; `stable` checks that the last pass changed nothing. The
    backward's first pass starts `fresh`: the forward's messages on the same channels are not its own."""

    def __init__(self, world: int):
        self.world, self.posted, self.previous = world, {}, {}
        self.comms = [_LoopComm(self, r) for r in range(world)]

    def new_pass(self, *, fresh: bool = False) -> None:
        self.previous, self.posted = ({} if fresh else self.posted), {}
        for c in self.comms:
            c.taken.clear()

    def stable(self) -> bool:
        return self.posted.keys() == self.previous.keys() and all(
            len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            for a, b in ((self.posted[key], self.previous[key]) for key in self.posted)
        )


class _Done:
    def wait(self) -> None:
        pass


class _LoopComm:
    """`cusparseattn.distributed.comm.Comm`'s interface for one rank of a `Loopback`."""

    group = None

    def __init__(self, hub: Loopback, rank: int):
        self.hub, self.rank, self.world_size, self.taken = hub, rank, hub.world, {}

    def _take(self, key, like: torch.Tensor) -> torch.Tensor:
        messages = self.hub.previous.get(key, [])
        i = self.taken[key] = self.taken.get(key, -1) + 1
        return messages[i] if i < len(messages) else torch.zeros_like(like)

    def exchange(self, sends, recvs) -> _Done:
        for dst, t in sends:
            self.hub.posted.setdefault((self.rank, dst), []).append(t.clone())
        for src, t in recvs:
            t.copy_(self._take((src, self.rank), t))
        return _Done()

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> _Done:
        self.hub.posted[("gather", self.rank)] = [x.clone()]
        parts = out.view(self.world_size, *x.shape)
        for r in range(self.world_size):
            parts[r].copy_(self._take(("gather", r), x))
        return _Done()


def loopback(lay: BlockLayout, order: Ordering, q, k, v, dout, *, backend, rotate) -> dict:
    """Ring attention of every rank of ``order``'s group in this process: the whole sequence's out, lse
    and gradients."""
    from cusparseattn.distributed import ring

    world = order.world_size
    hub = Loopback(world)
    sched = schedule.build(lay, order)
    plans = [ring.make_plan(lay, sched, hub.comms[r]) for r in range(world)]
    parts = [[order.shard(x, r) for r in range(world)] for x in (q, k, v, dout)]
    opts = {"scale": q.shape[-1] ** -0.5, "backend": backend, "rotate": rotate}
    for _ in range(2):
        hub.new_pass()
        fwd = [ring.forward(plans[r], *(p[r] for p in parts[:3]), **opts) for r in range(world)]
    assert hub.stable()
    for i in range(3):
        hub.new_pass(fresh=i == 0)
        bwd = [
            ring.backward(plans[r], parts[3][r], *(p[r] for p in parts[:3]), *fwd[r], **opts)
            for r in range(world)
        ]
    assert hub.stable()
    out = {"out": order.unshard([f[0] for f in fwd]), "lse": order.unshard([f[1] for f in fwd], dim=2)}
    for i, name in enumerate(("dq", "dk", "dv")):
        out[name] = order.unshard([g[i] for g in bwd])
    return out


def test_plan_buffers_hold_the_largest_step_only():
    from cusparseattn.distributed import ring

    lay = resolved("local")
    sched = schedule.build(lay, Ordering.contiguous(S, 4))
    plans = [ring.make_plan(lay, sched, comm) for comm in Loopback(4).comms]
    # the window's 48 keys from the previous rank, not its whole shard of 64
    assert [(p.recv_rows, p.send_rows) for p in plans] == [(0, 48), (48, 48), (48, 48), (48, 0)]
    assert [len(step.calls) for step in plans[1].steps] == [1, 1]
    remote = plans[1].steps[1].calls[0]
    assert remote.window.k_start == 16 and remote.received_at == 0
    assert remote.layout.origin == (64, 16) and remote.layout.nnz > 0


@pytest.mark.parametrize("rotate", ROTATES)
@pytest.mark.parametrize("bal", BALANCES)
@pytest.mark.parametrize("name", ["causal", "local", "random"])
def test_loopback_ring_on_three_ranks(name, bal, rotate):
    import cusparseattn as ca

    seq = 3 * 2 * 2 * BLOCK  # zigzag over 3 ranks: 6 chunks of 2 blocks
    lay = resolved(name, seq)
    order = balance.resolve(bal, seq, 3, lay)
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(2, HQ, seq, D, generator=g, dtype=torch.float64) for _ in range(2))  # 2 batches
    k, v = (torch.randn(2, HKV, seq, D, generator=g, dtype=torch.float64) for _ in range(2))
    got = loopback(lay, order, q, k, v, do, backend="reference", rotate=rotate)
    out, lse = ca.attention_forward(q, k, v, lay, backend="reference")
    dq, dk, dv = ca.attention_backward(do, q, k, v, out, lse, lay, backend="reference")
    for n, want in {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}.items():
        assert _max_err(got[n], want) <= TOLERANCE, n


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "name, bal",
    [("causal", "zigzag"), ("causal", None), ("local", None), ("strided", "zigzag"), ("random", "work")],
)
def test_loopback_ring_on_gpu_matches_one_gpu(name, bal, world):
    """bf16 on the CUDA kernels, every rank on one GPU: windows at global offsets, K/V as strided views of
    the packed buffers. Error against float32 at most twice the single-GPU kernel's, plus bf16 rounding."""
    import cusparseattn as ca

    seq, heads, heads_kv, dim, block = 2048, 4, 2, 64, 64
    lay = resolved(name, seq, heads, block)
    order = balance.resolve(bal, seq, world, lay)
    g = torch.Generator().manual_seed(2)
    q, do = (torch.randn(1, heads, seq, dim, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(1, heads_kv, seq, dim, generator=g).cuda().bfloat16() for _ in range(2))
    got = loopback(lay, order, q, k, v, do, backend="cuda", rotate="ring")
    out, lse = ca.attention_forward(q, k, v, lay, backend="cuda")
    dq, dk, dv = ca.attention_backward(do, q, k, v, out, lse, lay, backend="cuda")
    single = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    want = float32_attention(q, k, v, do, lay)
    for n, ref in want.items():
        finite = torch.isfinite(ref)
        err = (got[n].float() - ref).abs()[finite].max().item()
        base = (single[n].float() - ref).abs()[finite].max().item()
        limit = 2 * base + 2**-8 * ref[finite].abs().max().item()
        assert err <= limit, (
            f"{name}/{bal}/{world}: {n} error {err:.3g}, one GPU {base:.3g}, limit {limit:.3g}"
        )


def float32_attention(q, k, v, dout, lay: BlockLayout) -> dict:
    """Masked attention in float32 with torch autograd: out, lse, dq, dk, dv (the GPU tests' oracle)."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    mask = torch.from_numpy(lay.to_dense(heads=lay.heads)).to(q.device)
    s = (q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key: 0, as the kernels give
    out = p @ v.repeat_interleave(group, dim=1)
    out.backward(dout.float())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# ---- multi-process: every case on one group of processes ---------------------------------------------------
def _max_err(a, b) -> float:
    a, b = (torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x for x in (a, b))
    a, b = a.detach().double(), b.detach().double()
    both_inf = torch.isneginf(a) & torch.isneginf(b)
    return float(torch.where(both_inf, 0, (a - b).abs()).max())


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(B, HQ, S, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, HKV, S, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, do


@functools.cache
def _oracle(name: str) -> dict:
    """Single-process attention on the whole sequence: out, lse and the gradients of ``(out * do).sum()``."""
    import cusparseattn as ca

    lay, causal = case_layout(name)
    q, k, v, do = _inputs()
    kw = {"causal": causal, "backend": "reference"}
    out, lse = ca.attention_forward(q, k, v, lay, **kw)
    dq, dk, dv = ca.attention_backward(do, q, k, v, out, lse, lay, **kw)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _case(name: str, bal, rotate: str, rank: int) -> dict:
    """One layout x balance x rotate: errors against single-process attention, and the counters."""
    from cusparseattn.distributed import counters, unshard
    from cusparseattn.distributed.api import _layout

    lay, causal = case_layout(name)
    q, k, v, do = _inputs()
    want = _oracle(name)
    kw = {"causal": causal, "balance": bal}
    ql, kl, vl = (shard(x, lay, **kw).clone().requires_grad_() for x in (q, k, v))
    counters.reset()
    out, lse = ring_attention(ql, kl, vl, lay, rotate=rotate, return_lse=True, backend="reference", **kw)
    fwd = counters.as_dict()
    counters.reset()
    (out * shard(do, lay, **kw)).sum().backward()
    bwd = counters.as_dict()

    world = torch.distributed.get_world_size()
    glay = _layout(lay, causal, S, world, bal)
    sched = schedule.build(glay, balance.resolve(bal, S, world, glay))
    got = {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    errors = {n: _max_err(got[n], shard(want[n], lay, **kw)) for n in got}
    errors["unshard"] = _max_err(unshard(out.detach(), lay, **kw), want["out"])
    return {
        "case": f"{name}/{bal}/{rotate}",
        "errors": errors,
        "fwd": fwd,
        "bwd": bwd,
        "calls": sched.calls(rank),
        "kv_bytes": 2 * B * HKV * (S // world) * D * 8,
    }


def _frameworks_case(rank: int) -> dict:
    """NumPy float32 through the functional pair, against the NumPy reference on the whole sequence."""
    from cusparseattn import reference
    from cusparseattn.distributed import ring_attention_backward, ring_attention_forward

    lay = patterns.local(40, block=BLOCK)
    q, k, v, do = (x.numpy().astype(np.float32) for x in _inputs())
    out_g, lse_g = reference.forward(q, k, v, lay.layout(S))
    dq_g, dk_g, dv_g = reference.backward(do, q, k, v, out_g, lse_g, lay.layout(S))
    kw = {"balance": "zigzag", "backend": "reference"}
    ql, kl, vl, dol = (shard(x, lay, balance="zigzag") for x in (q, k, v, do))
    out, lse = ring_attention_forward(ql, kl, vl, lay, **kw)
    dq, dk, dv = ring_attention_backward(dol, ql, kl, vl, out, lse, lay, **kw)
    sh = lambda x: shard(x, lay, balance="zigzag")  # noqa: E731
    return {
        "case": "numpy",
        "types": sorted({type(x).__name__ for x in (out, lse, dq, dk, dv)}),
        "errors": {
            "out": _max_err(out, sh(out_g)),
            "lse": _max_err(lse, sh(lse_g)),
            "dq": _max_err(dq, sh(dq_g)),
            "dk": _max_err(dk, sh(dk_g)),
            "dv": _max_err(dv, sh(dv_g)),
        },
    }


def _error_cases(rank: int) -> dict:
    """Errors raised on every rank before anything is sent (the next collective still matches)."""
    out = {}
    q = torch.randn(1, 2, 24, 16, dtype=torch.float64)
    try:
        ring_attention(q, q, q, patterns.local(16, block=BLOCK))
    except ValueError as err:
        out["blocks"] = str(err)
    q = torch.randn(1, 2, S // torch.distributed.get_world_size(), 16, dtype=torch.float64)
    try:  # the ranks pass different layouts: the plan's agreement check catches it
        ring_attention(q, q, q, patterns.local(40 if rank == 0 else 100, block=BLOCK), backend="reference")
    except ValueError as err:
        out["disagree"] = str(err)
    return out


def _score_mod_case(rank: int) -> dict | None:
    """A score mod of relative positions (ALiBi) over zigzag shards: windows must show it global positions.
    None where `cusparseattn.attention_forward` takes no score mod yet."""
    import inspect

    import cusparseattn as ca

    if "score_mod" not in inspect.signature(ca.attention_forward).parameters:
        return None
    from cusparseattn import mods

    bias = mods.alibi(mods.alibi_slopes(HQ))
    lay = patterns.causal(block=BLOCK)
    q, k, v, do = _inputs()
    out_g, lse_g = ca.attention_forward(q, k, v, lay, score_mod=bias, backend="reference")
    grads = ca.attention_backward(do, q, k, v, out_g, lse_g, lay, score_mod=bias, backend="reference")
    kw = {"balance": "zigzag"}
    ql, kl, vl = (shard(x, lay, **kw).clone().requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, lay, score_mod=bias, return_lse=True, backend="reference", **kw)
    (out * shard(do, lay, **kw)).sum().backward()
    got = (out, lse, ql.grad, kl.grad, vl.grad)
    want = (out_g, lse_g, *grads)
    names = ("out", "lse", "dq", "dk", "dv")
    return {n: _max_err(a, shard(b, lay, **kw)) for n, a, b in zip(names, got, want, strict=True)}


def _window_of_head(b, h, q_idx, kv_idx):
    """A mask function of global positions: a causal window that widens with the head."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 24 * (h + 1))


def _mask_function_case(rank: int) -> dict:
    """A mask function as the layout (traced once, per head), over zigzag shards, forward and backward."""
    import cusparseattn as ca

    q, k, v, do = _inputs()
    out_g, lse_g = ca.attention_forward(q, k, v, _window_of_head, backend="reference")
    grads = ca.attention_backward(do, q, k, v, out_g, lse_g, _window_of_head, backend="reference")
    kw = {"balance": "zigzag"}
    ql, kl, vl = (shard(x, _window_of_head, **kw).clone().requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, _window_of_head, return_lse=True, backend="reference", **kw)
    (out * shard(do, _window_of_head, **kw)).sum().backward()
    got = (out, lse, ql.grad, kl.grad, vl.grad)
    want = (out_g, lse_g, *grads)
    names = ("out", "lse", "dq", "dk", "dv")
    return {n: _max_err(a, shard(b, _window_of_head, **kw)) for n, a, b in zip(names, got, want, strict=True)}


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    results: dict = {"rank": rank}
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        results["cases"] = [
            _case(name, bal, rotate, rank)
            for name in ("dense", "causal", "local", "strided", "random")
            for bal in BALANCES
            for rotate in ROTATES
        ]
        results["numpy"] = _frameworks_case(rank)
        results["score_mod"] = _score_mod_case(rank)
        results["mask_function"] = _mask_function_case(rank)
        results["raised"] = _error_cases(rank)
        torch.distributed.destroy_process_group()
    except Exception:  # reported by the test, which has no other view into this process
        results["failure"] = traceback.format_exc()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def group(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """``(world size, every rank's results)`` of one group of gloo processes running every case."""
    world, tmp_path = request.param, tmp_path_factory.mktemp(f"group{request.param}")
    # Ranks fork from a server that imported torch and cusparseattn once, not each on its own as spawned ones.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cusparseattn", __name__])
    procs = [
        ctx.Process(target=_worker, args=(r, world, str(tmp_path / "store"), str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} of {world} did not finish within {SPAWN_TIMEOUT} s"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for res in results:
        assert "failure" not in res, f"rank {res['rank']} failed:\n{res['failure']}"
    return world, results


def by_case(results: list[dict]) -> dict[str, list[dict]]:
    """Each case's results in rank order."""
    out: dict[str, list[dict]] = {}
    for res in results:
        for case in res["cases"]:
            out.setdefault(case["case"], []).append(case)
    return out


TOLERANCE = 1e-10  # float64 against float64: only summation order differs


def test_sharded_results_equal_single_process_attention(group):
    world, results = group
    cases = by_case(results)
    assert len(cases) == 5 * len(BALANCES) * len(ROTATES)
    for name, ranks in cases.items():
        for rank, case in enumerate(ranks):
            bad = {k: e for k, e in case["errors"].items() if not e <= TOLERANCE}
            assert not bad, f"{name}, rank {rank} of {world}: errors {bad}"


def test_empty_slices_are_skipped(group):
    world, results = group
    cases = by_case(results)
    for name, ranks in cases.items():
        for rank, case in enumerate(ranks):
            # one kernel call per non-empty window, forward and backward
            assert case["fwd"]["calls"] == case["bwd"]["calls"] == case["calls"], (name, rank, case)
    # causal over contiguous shards: rank r computes r + 1 windows (its own and the r ranks before it)
    for rotate in ROTATES:
        assert [c["fwd"]["calls"] for c in cases[f"causal/None/{rotate}"]] == list(range(1, world + 1))
    # a sliding window over contiguous shards: the local step and one step with the previous rank
    assert [c["fwd"]["steps"] for c in cases["local/None/ring"]] == [2] * world


def test_bytes_sent(group):
    world, results = group
    cases = by_case(results)

    def sent(case: str, phase: str = "fwd") -> int:
        return sum(c[phase]["bytes_sent"] for c in cases[case])

    shard_bytes = cases["dense/None/ring"][0]["kv_bytes"]
    assert sent("dense/None/ring") == sent("dense/None/allgather") == world * (world - 1) * shard_bytes
    assert sent("local/None/ring") <= sent("dense/None/ring") / (world - 1)
    assert sent("local/None/ring") < sent("local/None/allgather")
    # the backward sends K/V again and the dk/dv of every piece home: twice the forward's ring traffic
    assert sent("local/None/ring", "bwd") == 2 * sent("local/None/ring")
    # causal zigzag: a rank ahead of its source fetches only the source's head chunk
    assert sent("causal/zigzag/ring") < sent("dense/zigzag/ring")


def test_numpy_arrays_through_the_functional_pair(group):
    _, results = group
    for res in results:
        case = res["numpy"]
        assert case["types"] == ["ndarray"]
        assert max(case["errors"].values()) < 1e-5, case


def test_errors_before_any_transfer(group):
    _, results = group
    for res in results:
        raised = res["raised"]
        assert "chunks of 24 tokens" in raised["blocks"] and "block size 16" in raised["blocks"]
        assert "disagree on the shard shapes, dtype and layout" in raised["disagree"]


def test_score_mod_sees_global_positions(group):
    _, results = group
    if results[0]["score_mod"] is None:
        pytest.skip("cusparseattn.attention_forward takes no score_mod in this version")
    for res in results:
        bad = {k: e for k, e in res["score_mod"].items() if not e <= TOLERANCE}
        assert not bad, f"rank {res['rank']}: errors {bad}"


def test_mask_functions_as_ring_layouts(group):
    world, results = group
    for res in results:
        bad = {n: e for n, e in res["mask_function"].items() if not e <= TOLERANCE}
        assert not bad, f"rank {res['rank']} of {world}: errors {bad}"
