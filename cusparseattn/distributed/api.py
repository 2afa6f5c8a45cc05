"""The public functions of context parallelism: ring attention on sequence shards, and shard / unshard.

Each rank passes its LOCAL shards of q, k, v (``[B, H, S / N, D]``, in the order `shard` made) and the
GLOBAL layout (a Pattern, a BlockLayout of the whole sequence, a mask function of global positions, or None
for dense; ``causal=True`` intersects it with the causal mask), and gets its local output shard back. Every
rank of the group must call with the same layout, causal, balance, rotate and scale, and shards of one shape.

``balance`` orders the sequence before it is cut (`cusparseattn.distributed.balance`): None keeps it
contiguous, ``"zigzag"`` gives each rank a head and a tail chunk (even causal work), ``"work"`` balances the
layout's own per-row work, or pass an `Ordering`. `shard` and `unshard` take the same arguments, so the
shards and the attention agree.

``rotate="ring"`` sends each K/V piece straight from its owner to the rank that needs it, one step at a time,
overlapped with the previous step's compute, and never sends what no rank's layout rows touch;
``rotate="allgather"`` gathers every shard once (overlapped with the local step). Arrays: PyTorch tensors
(differentiable), CuPy and NumPy arrays (through torch.distributed, without a copy).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from typing import NamedTuple

import numpy as np

from .. import backends
from .. import call as core
from ..arrays import DTYPES
from ..call import check_layout, validate
from ..layout import MAX_BLOCK, MIN_BLOCK, BlockLayout
from . import ring, schedule
from .balance import Ordering, resolve
from .comm import Comm, framework, from_torch, to_torch

ROTATES = ("ring", "allgather")
FRAMEWORKS = ("torch", "cupy", "numpy")

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Call(NamedTuple):
    """One validated call: this rank's plan and the call's scale, rotate method, backend and score mod."""

    plan: ring.Plan
    scale: float
    rotate: str
    backend: str | None
    score_mod: object

    @property
    def options(self) -> dict:
        """The keyword arguments of `ring.forward` and `ring.backward`."""
        return {
            "scale": self.scale,
            "backend": self.backend,
            "rotate": self.rotate,
            "score_mod": self.score_mod,
        }


def ring_attention(
    q,
    k,
    v,
    layout=None,
    *,
    causal=False,
    balance=None,
    group=None,
    rotate="ring",
    scale=None,
    return_lse=False,
    backend=None,
    score_mod=None,
):
    """Block-sparse attention over a sequence sharded across the ranks of ``group``; this rank's output.

    Args:
        q: this rank's queries ``[B, Hq, S / N, D]``; k, v: its keys and values ``[B, Hkv, S / N, D]``, the
            shards that `shard` gives for the same ``layout``, ``causal``, ``balance`` and ``group``.
        layout: the whole sequence's layout: None (dense), a Pattern, a BlockLayout of ``S`` tokens, or a
            mask function ``fn(b, h, q_idx, kv_idx)`` of global positions (as in `cusparseattn.attention`).
        causal: intersect the layout with the causal mask.
        balance: None, ``"zigzag"``, ``"work"`` or an `Ordering` (see the module's docstring).
        group: the ``torch.distributed`` process group (default: the whole world).
        rotate: ``"ring"`` or ``"allgather"``.
        scale, backend, score_mod: as in `cusparseattn.attention`; a score mod sees global positions.
        return_lse: also return this rank's log-sum-exp ``[B, Hq, S / N]`` (float32, not differentiable).

    Returns:
        ``out`` (and ``lse``) for this rank's queries, in the caller's framework. Differentiable for torch
        tensors: every rank must then run the backward.

    Under torchrun, one process per GPU::

        lay = patterns.local(window=4096, block=128)
        q, k, v = (shard(x, lay) for x in (q_all, k_all, v_all))
        out = unshard(ring_attention(q, k, v, lay), lay)
    """
    kind = framework(q)
    call = _prepare(q, k, v, layout, causal, balance, group, rotate, scale, backend, score_mod, "forward")
    if kind == "torch":
        import torch

        from .autograd import RingAttention

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            _check_backend(call, q, k, v, "backward")
        out, lse = RingAttention.apply(q, k, v, call)
    else:
        out, lse = _forward(call, q, k, v)
    return (out, lse) if return_lse else out


def ring_attention_forward(
    q,
    k,
    v,
    layout=None,
    *,
    causal=False,
    balance=None,
    group=None,
    rotate="ring",
    scale=None,
    backend=None,
    score_mod=None,
):
    """The forward alone: this rank's ``(out, lse)`` (no autograd); arguments as in `ring_attention`."""
    call = _prepare(q, k, v, layout, causal, balance, group, rotate, scale, backend, score_mod, "forward")
    return _forward(call, q, k, v)


def ring_attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    layout=None,
    *,
    causal=False,
    balance=None,
    group=None,
    rotate="ring",
    scale=None,
    backend=None,
    score_mod=None,
):
    """This rank's ``(dq, dk, dv)`` from ``dout`` and the ``out``, ``lse`` of `ring_attention_forward`."""
    arrays = {"dout": dout, "out": out, "lse": lse}
    call = _prepare(
        q, k, v, layout, causal, balance, group, rotate, scale, backend, score_mod, "backward", **arrays
    )
    kind = framework(q)
    args = [to_torch(x) for x in (dout, q, k, v, out, lse)]
    grads = ring.backward(call.plan, *args, **call.options)
    return tuple(from_torch(g, kind) for g in grads)


def shard(x, layout=None, *, causal=False, balance=None, group=None, dim=2):
    """This rank's shard of the whole-sequence array ``x`` (sequence along ``dim``), in the order ``balance``
    makes; pass the arguments that `ring_attention` gets. A view when the shard is one run of positions.

    Under torchrun: ``q_local = shard(q, patterns.causal(), balance="zigzag")``.
    """
    comm = Comm(group)
    order = _ordering(layout, causal, balance, x.shape[dim], comm.world_size)
    return order.shard(x, comm.rank, dim)


def unshard(x, layout=None, *, causal=False, balance=None, group=None, dim=2):
    """The whole-sequence array from every rank's shard ``x`` (gathered over ``group``), order undone; not
    differentiable (as PyTorch's ``context_parallel_unshard``).

    Under torchrun: ``out = unshard(ring_attention(q, k, v, causal=True, balance="zigzag"), causal=True,
    balance="zigzag")``.
    """
    comm = Comm(group)
    order = _ordering(layout, causal, balance, x.shape[dim] * comm.world_size, comm.world_size)
    kind = framework(x)
    moved = to_torch(x).detach().movedim(dim, 0)
    parts = [from_torch(p.movedim(0, dim), kind) for p in comm.gather_list(moved)]
    return order.unshard(parts, dim)


# ---- validation and planning -------------------------------------------------------------------------------
def _forward(call: Call, q, k, v):
    kind = framework(q)
    out, lse = ring.forward(call.plan, *(to_torch(x) for x in (q, k, v)), **call.options)
    return from_torch(out, kind), from_torch(lse, kind)


def _prepare(q, k, v, layout, causal, balance, group, rotate, scale, backend, score_mod, op, **extra) -> Call:
    """Check every argument (nothing is sent before this passes) and return the call's plan."""
    kind = framework(q)
    if kind not in FRAMEWORKS:
        raise TypeError(
            f"ring attention takes torch tensors, CuPy or NumPy arrays (it communicates over "
            f"torch.distributed), got a {kind} array for q"
        )
    sizes = validate(q, k, v, **extra)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if rotate not in ROTATES:
        raise ValueError(f"rotate must be one of {', '.join(map(repr, ROTATES))}, got {rotate!r}")
    if sizes.seq_q != sizes.seq_k:
        raise ValueError(
            f"ring attention shards one sequence for queries and keys: q has {sizes.seq_q} tokens per rank, "
            f"k has {sizes.seq_k}"
        )
    comm = Comm(group)
    seq = sizes.seq_q * comm.world_size
    lay = _layout(layout, causal, seq, comm.world_size, balance, sizes.batch, sizes.heads_q)
    check_layout(lay, sizes._replace(seq_q=seq, seq_k=seq))
    order = resolve(balance, seq, comm.world_size, lay)
    sched = schedule.build(lay, order)
    if score_mod is not None:
        from .. import mods

        score_mod = mods.score_mod(score_mod)  # traced once, for every window's call
    plan = _plan(lay, sched, comm, sizes)
    call = Call(plan, core.check_scale(scale, sizes.head_dim), rotate, backend, score_mod)
    _check_backend(call, q, k, v, op, **extra)
    return call


def _check_backend(call: Call, q, k, v, op: str, **extra) -> None:
    """Raise now, not after the first transfer, when no backend (or not the forced one) can run ``op``
    on this call's windows."""
    first = next((c for step in call.plan.steps for c in step.calls), None)
    if first is None:
        return
    w = first.window
    rows = (slice(None), slice(None), slice(w.q_offset, w.q_offset + w.q_len))
    keys = (slice(None), slice(None), slice(w.k_offset, w.k_offset + w.k_len))
    parts = {name: x[rows] for name, x in extra.items()}
    if call.score_mod is not None:
        parts["score_mod"] = call.score_mod
    inputs = core.prepare(q[rows], k[keys], v[keys], first.layout, causal=False, scale=call.scale, **parts)
    backends.select(inputs, op, call.backend)


def _plan(layout: BlockLayout, sched: schedule.Schedule, comm: Comm, sizes) -> ring.Plan:
    """This rank's plan, made once per (layout, ordering, group, shapes); making it checks that every rank
    of the group agrees on the call."""
    key = (sched.ordering, comm.group, comm.rank, comm.world_size, sizes)
    per_layout = _plans.setdefault(layout, {})
    if key not in per_layout:
        comm.agree(
            "the shard shapes, dtype and layout",
            [sizes.batch, sizes.heads_q, sizes.heads_kv, sizes.seq_q, sizes.head_dim]
            + [list(DTYPES).index(sizes.dtype), _digest(layout, sched.ordering)],
            _torch_device(sizes.device),
        )
        per_layout[key] = ring.make_plan(layout, sched, comm)
    return per_layout[key]


def _digest(layout: BlockLayout, order: Ordering) -> int:
    """63 bits that differ, in practice, between different block patterns, block sizes or orderings."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.packbits(layout.blocks.any(axis=(0, 1))).tobytes())
    h.update(repr((layout.block_size, layout.num_blocks, order.chunk, order.ranks)).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _torch_device(device) -> str:
    return "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"


def _ordering(layout, causal: bool, balance, seq: int, world_size: int) -> Ordering:
    lay = _layout(layout, causal, seq, world_size, balance) if balance == "work" else None
    return resolve(balance, seq, world_size, lay)


def _layout(layout, causal: bool, seq: int, world_size: int, balance, batch=None, heads=None) -> BlockLayout:
    """The whole sequence's BlockLayout: None is dense (or causal), a Pattern is built for ``seq``, a mask
    function becomes a Pattern over ``batch`` and ``heads`` in blocks that divide the shards (batch and heads
    are None where they are not known, in `shard` with ``balance="work"``: a function of ``b`` or ``h`` then
    asks for a Pattern from `patterns.from_mask`)."""
    from ..patterns import Pattern

    if layout is None:
        return _default_pattern(causal, _default_block(seq, world_size, balance)).layout(seq)
    if callable(layout) and not isinstance(layout, (Pattern, BlockLayout)):
        layout = core.mask_pattern(layout, batch, heads, _default_block(seq, world_size, balance))
    if isinstance(layout, Pattern):
        layout = layout.layout(seq, seq)
    elif not isinstance(layout, BlockLayout):
        raise TypeError(
            "layout must be None, a Pattern, a BlockLayout or a mask function fn(b, h, q_idx, kv_idx), got "
            f"{type(layout).__qualname__}"
        )
    elif (layout.seq_q, layout.seq_k) != (seq, seq):
        raise ValueError(
            f"layout is the whole sequence's: {world_size} ranks with {seq // world_size} tokens each make "
            f"{seq} tokens, but the layout was built for seq_q={layout.seq_q}, seq_k={layout.seq_k}; pass "
            f"pattern.layout({seq}) or the Pattern"
        )
    return core.with_causal(layout) if causal else layout


@functools.cache
def _default_pattern(causal: bool, block: int):
    from .. import patterns

    return patterns.causal(block=block) if causal else patterns.dense(block=block)


def _default_block(seq: int, world_size: int, balance) -> int:
    """The largest block size that divides the chunks ``balance`` cuts (dense and causal layouts mean the
    same at any block size)."""
    if isinstance(balance, Ordering):
        unit = balance.chunk
    elif balance in ("zigzag", "work") and seq % (2 * world_size) == 0:
        unit = seq // (2 * world_size)
    else:
        unit = seq // world_size
    block = MAX_BLOCK
    while block > MIN_BLOCK and unit % block:
        block //= 2
    return block
