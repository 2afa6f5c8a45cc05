"""Ring attention's forward and backward on one rank, over a `Plan` (the schedule seen by this rank).

Forward: every window is one single-GPU attention call (`cusparseattn.attention_forward`) on views of the
local queries and the visiting keys and values, with the layout's window for that rectangle (its rule sees
global positions). Partial outputs merge into float32 accumulators by their log-sum-exp:
``lse = logaddexp(lse, lse_i)``, ``out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)``.

Backward: with the final ``out`` and ``lse``, each window's backward (`cusparseattn.attention_backward`) gives
exactly that window's share of dq, dk and dv. dq stays local; the dk/dv of a visiting shard's pieces go home
to their owner, who adds them in float32 (as PyTorch's ring backward accumulates in float32).

K/V of a rank live packed as one contiguous ``[S_local, 2, B, Hkv, D]`` tensor, so every piece the schedule
sends is a contiguous run of rows; k and v are strided views of it (last dimension contiguous), which the
kernels take as they are. Received pieces lie one after another in buffers sized for the largest step (a
sliding window's neighbour piece, not a whole shard).

Transfers: ``rotate="ring"`` posts step ``i + 1``'s sends and receives before computing step ``i`` (two
receive buffers alternate); ``rotate="allgather"`` gathers every shard once while step 0 (the local shard)
computes. Every rank posts its batches in the order of the shared schedule's steps, even steps where it has
nothing to do, so messages between two ranks always match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import api
from ..layout import BlockLayout
from .comm import Comm, Pending, counters
from .schedule import Piece, Schedule, Window


class WindowCall(NamedTuple):
    """One window of a rank's step: its layout, whether it is the first to write its query rows, and where
    its first key sits among the step's received pieces."""

    window: Window
    layout: BlockLayout
    first: bool
    received_at: int


@dataclass(frozen=True)
class RankStep:
    """One step of the schedule for one rank: its calls on the K/V of ``src``, the pieces it receives from
    ``src`` and sends to ``dst``, and where each lies in the step's buffer of pieces (one after another)."""

    shift: int
    src: int
    dst: int
    calls: tuple[WindowCall, ...]
    recv: tuple[tuple[Piece, int], ...]
    send: tuple[tuple[Piece, int], ...]

    @property
    def active(self) -> bool:
        return bool(self.calls or self.recv or self.send)


@dataclass(frozen=True)
class Plan:
    """Everything one rank needs to run: the whole schedule's steps as this rank sees them, and the rows of
    the largest step's received (``recv_rows``) and sent (``send_rows``) pieces."""

    comm: Comm
    schedule: Schedule
    steps: tuple[RankStep, ...]
    recv_rows: int
    send_rows: int


def _stacked(pieces: tuple[Piece, ...]) -> tuple[tuple[Piece, int], ...]:
    """Each piece with its row in a buffer that holds them one after another."""
    out, at = [], 0
    for p in pieces:
        out.append((p, at))
        at += p.length
    return tuple(out)


def _received_at(recv: tuple[tuple[Piece, int], ...], w: Window) -> int:
    """The row of ``w``'s first key in the step's buffer of received pieces (0 at step 0: nothing comes)."""
    for p, at in recv:
        if p.start <= w.k_start < p.start + p.length:
            return at + w.k_start - p.start
    return 0


def make_plan(layout: BlockLayout, schedule: Schedule, comm: Comm) -> Plan:
    """This rank's view of ``schedule``; window layouts come from ``layout.window`` (made once per plan)."""
    rank, covered = comm.rank, []  # local query rows [a, b) that earlier windows wrote
    steps = []
    for step in schedule.steps:
        recv, send = _stacked(step.pieces[rank]), _stacked(step.pieces[step.target(rank)])
        calls = []
        for w in step.windows[rank]:
            lay = layout.window(w.q_start, w.q_start + w.q_len, w.k_start, w.k_start + w.k_len)
            a, b = w.q_offset, w.q_offset + w.q_len
            calls.append(
                WindowCall(w, lay, not any(x < b and a < y for x, y in covered), _received_at(recv, w))
            )
            covered.append((a, b))
        steps.append(RankStep(step.shift, step.source(rank), step.target(rank), tuple(calls), recv, send))
    rows = [sum(p.length for p, _ in s.recv) for s in steps] + [0]
    sent = [sum(p.length for p, _ in s.send) for s in steps] + [0]
    return Plan(comm, schedule, tuple(steps), max(rows), max(sent))


# ---- packing -----------------------------------------------------------------------------------------------
def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[S, 2, B, Hkv, D]`` holding k and v: every run of sequence rows is contiguous."""
    b, h, s, d = k.shape
    kv = torch.empty((s, 2, b, h, d), dtype=k.dtype, device=k.device)
    kv[:, 0].copy_(k.permute(2, 0, 1, 3))
    kv[:, 1].copy_(v.permute(2, 0, 1, 3))
    return kv


def _unpack(kv: torch.Tensor, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = kv[offset : offset + length]
    return rows[:, 0].permute(1, 2, 0, 3), rows[:, 1].permute(1, 2, 0, 3)


def _rows(piece: Piece) -> slice:
    return slice(piece.offset, piece.offset + piece.length)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- K/V sources -------------------------------------------------------------------------------------------
def _buffers(kv: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Two buffers of ``rows`` rows like ``kv``'s, which alternate between steps (none for no rows)."""
    return [kv.new_empty((rows, *kv.shape[1:])) for _ in range(2)] if rows else []


class _Ring:
    """K/V of step ``i``'s source, received point to point; step ``i + 1``'s transfers are posted first."""

    def __init__(self, plan: Plan, kv: torch.Tensor):
        self.plan, self.kv, self.pending = plan, kv, {}
        self.slots = _buffers(kv, plan.recv_rows)
        self._post(0)

    def _post(self, i: int) -> None:
        if i >= len(self.plan.steps):
            return
        step = self.plan.steps[i]
        sends = [(step.dst, self.kv[_rows(p)]) for p, _ in step.send]
        recvs = [(step.src, self.slots[i % 2][at : at + p.length]) for p, at in step.recv]
        self.pending[i] = self.plan.comm.exchange(sends, recvs)

    def visit(self, i: int) -> None:
        self._post(i + 1)
        self.pending.pop(i).wait()

    def keys(self, i: int, call: WindowCall) -> tuple[torch.Tensor, torch.Tensor]:
        w = call.window
        if self.plan.steps[i].shift == 0:
            return _unpack(self.kv, w.k_offset, w.k_len)
        return _unpack(self.slots[i % 2], call.received_at, w.k_len)


class _Gathered:
    """Every rank's K/V, gathered once; the gather runs while the local step computes."""

    def __init__(self, plan: Plan, kv: torch.Tensor):
        self.plan, self.kv = plan, kv
        n = plan.comm.world_size
        self.all = kv.new_empty((n, *kv.shape))
        self.pending: Pending | None = None
        if any(s.shift for s in plan.steps):  # a collective: decided from the shared schedule
            self.pending = plan.comm.all_gather(self.all.view(n * kv.shape[0], *kv.shape[1:]), kv)

    def visit(self, i: int) -> None:
        if self.plan.steps[i].shift and self.pending is not None:
            self.pending.wait()
            self.pending = None

    def keys(self, i: int, call: WindowCall) -> tuple[torch.Tensor, torch.Tensor]:
        step, w = self.plan.steps[i], call.window
        return _unpack(self.kv if step.shift == 0 else self.all[step.src], w.k_offset, w.k_len)


def _source(plan: Plan, kv: torch.Tensor, rotate: str):
    return _Ring(plan, kv) if rotate == "ring" else _Gathered(plan, kv)


# ---- forward -----------------------------------------------------------------------------------------------
def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor, first: bool) -> None:
    """Fold one window's ``(o, lse_o)`` into the accumulator views ``out``, ``lse`` of the same rows."""
    if first:
        out.copy_(o)
        lse.copy_(lse_o)
        return
    new = torch.logaddexp(lse, lse_o)
    # A row that nothing has reached yet keeps lse = -inf: weigh both sides 0 there, never -inf - -inf.
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(o * torch.exp(lse_o.to(base.dtype) - base).unsqueeze(-1))
    lse.copy_(new)


def _mod(score_mod) -> dict:
    return {} if score_mod is None else {"score_mod": score_mod}


def forward(plan: Plan, q, k, v, *, scale: float, backend, rotate: str, score_mod=None):
    """This rank's ``(out, lse)``: out like q, lse ``[B, Hq, S_local]`` float32 (float64 for float64)."""
    acc = _accumulator_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    source = _source(plan, pack(k, v), rotate)
    for i, step in enumerate(plan.steps):
        source.visit(i)
        counters.steps += step.active
        for call in step.calls:
            w = call.window
            rows = slice(w.q_offset, w.q_offset + w.q_len)
            kw, vw = source.keys(i, call)
            o, lse_o = api.attention_forward(
                q[:, :, rows], kw, vw, call.layout, scale=scale, backend=backend, **_mod(score_mod)
            )
            _merge(out[:, :, rows], lse[:, :, rows], o, lse_o, call.first)
            counters.calls += 1
    return out.to(q.dtype), lse


# ---- backward ----------------------------------------------------------------------------------------------
class _Home:
    """Sends the dk/dv of visiting pieces back to their owner and adds what comes back into ``dkv``."""

    def __init__(self, plan: Plan, kv: torch.Tensor, dkv: torch.Tensor):
        self.plan, self.dkv, self.pending = plan, dkv, {}
        self.out, self.back = _buffers(kv, plan.recv_rows), _buffers(kv, plan.send_rows)

    def send(self, i: int, grads) -> None:
        """Post step ``i``'s dk/dv of the pieces received from its source, and the receive of ours."""
        step = self.plan.steps[i]
        sends = []
        for p, at in step.recv:
            target = self.out[i % 2][at : at + p.length]
            _sum_into(target, p, grads)
            sends.append((step.src, target))
        recvs = [(step.dst, self.back[i % 2][at : at + p.length]) for p, at in step.send]
        self.pending[i] = self.plan.comm.exchange(sends, recvs)

    def collect(self, i: int) -> None:
        """Wait for step ``i``'s transfers and add the gradients of our pieces that came back."""
        if i not in self.pending:
            return
        self.pending.pop(i).wait()
        for p, at in self.plan.steps[i].send:
            self.dkv[_rows(p)].add_(self.back[i % 2][at : at + p.length])


def _sum_into(target: torch.Tensor, piece: Piece, grads) -> None:
    """``target`` (the piece's rows, ``[L, 2, B, Hkv, D]``) = the sum of the windows' dk/dv that fall in it;
    one window that covers the piece exactly is copied, several are summed in float32 first."""
    inside = [(w, dk, dv) for w, dk, dv in grads if piece.start <= w.k_start < piece.start + piece.length]
    if len(inside) == 1 and (inside[0][0].k_start, inside[0][0].k_len) == (piece.start, piece.length):
        _, dk, dv = inside[0]
        target[:, 0].copy_(dk.permute(2, 0, 1, 3))
        target[:, 1].copy_(dv.permute(2, 0, 1, 3))
        return
    total = torch.zeros(target.shape, dtype=_accumulator_dtype(target.dtype), device=target.device)
    _add_windows(total, piece.start, inside)
    target.copy_(total)


def _add_windows(dkv: torch.Tensor, start: int, grads) -> None:
    """Add each window's dk/dv into ``dkv``, whose row 0 is global key position ``start``."""
    for w, dk, dv in grads:
        rows = slice(w.k_start - start, w.k_start - start + w.k_len)
        dkv[rows, 0].add_(dk.permute(2, 0, 1, 3))
        dkv[rows, 1].add_(dv.permute(2, 0, 1, 3))


def backward(plan: Plan, dout, q, k, v, out, lse, *, scale: float, backend, rotate: str, score_mod=None):
    """This rank's ``(dq, dk, dv)`` given the final ``out`` and ``lse`` of its queries."""
    acc = _accumulator_dtype(q.dtype)
    kv = pack(k, v)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    source, home = _source(plan, kv, rotate), _Home(plan, kv, dkv)
    for i, step in enumerate(plan.steps):
        source.visit(i)
        counters.steps += step.active
        grads = []
        for call in step.calls:
            w = call.window
            kw, vw = source.keys(i, call)
            at = (slice(None), slice(None), slice(w.q_offset, w.q_offset + w.q_len))
            dq_w, dk_w, dv_w = api.attention_backward(
                dout[at],
                q[at],
                kw,
                vw,
                out[at],
                lse[at],
                call.layout,
                scale=scale,
                backend=backend,
                **_mod(score_mod),
            )
            dq[at].add_(dq_w)
            grads.append((w, dk_w, dv_w))
            counters.calls += 1
        if step.shift == 0:
            # Our own keys: their offsets in the shard are where the windows' keys sit in dkv.
            _add_windows(dkv, 0, [(w._replace(k_start=w.k_offset), dk, dv) for w, dk, dv in grads])
        else:
            home.send(i, grads)
        home.collect(i - 1)
    home.collect(len(plan.steps) - 1)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dk.copy_(dkv[:, 0].permute(1, 2, 0, 3))
    dv.copy_(dkv[:, 1].permute(1, 2, 0, 3))
    return dq.to(q.dtype), dk, dv
