"""Patterns a user assembles: per-head mixes (`head_mix`), a rule written as a mask function (`from_mask`,
traced to a C expression where it can be, classified block by block on the GPU when the layout is large) and
a fixed block mask (`from_blocks`); `cusparseattn.patterns` names them with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import pattern as base
from .layout import BlockLayout
from .mods import mask_rule
from .pattern import Pattern, dense
from .rules import TokenRule, is_torch
from .trace import untraced_mask
from .traced import CapturedArray, Expr, NotCompilable, TraceError


class _HeadSelect:
    """Head ``h`` applies ``fns[group[h]]`` (None: every pair attends), on NumPy, torch or traced indices."""

    def __init__(self, fns: list, group: np.ndarray):
        self.fns, self.table = fns, CapturedArray(group)

    def __call__(self, b, h, q, k):
        traced = isinstance(h, Expr)
        g = self.table[h]
        out = None
        for i, fn in enumerate(self.fns):
            # A group's number is part of the rule's structure, no parameter.
            term = g == (h.graph.literal(i, "int") if traced else i)
            if fn is not None:
                value = fn(b, h, q, k)
                term = term & (value if traced or is_torch(value) else np.asarray(value, dtype=bool))
            out = term if out is None else out | term
        return out


def _head_rule(rules: list[TokenRule | None]) -> TokenRule | None:
    """One rule for heads with rules of their own: head ``h`` applies ``rules[h]`` (None: nothing to test),
    traced where every one of them is."""
    if all(r is None for r in rules):
        return None
    distinct, group = [], np.zeros(len(rules), dtype=np.int32)
    for h, r in enumerate(rules):
        if r not in distinct:
            distinct.append(r)
        group[h] = distinct.index(r)
    select = _HeadSelect([None if r is None else r.fn for r in distinct], group)
    name = "head_mix(" + ", ".join("-" if r is None else r.name for r in rules) + ")"
    if all(r is None or r.program is not None for r in distinct):
        try:
            return mask_rule(select if len(distinct) > 1 else distinct[0].fn, name=name)
        except NotCompilable:  # more parameters or arrays than the kernels take: bits
            pass
    return TokenRule(name, select)


def head_mix(patterns: Sequence[Pattern | None], *, block=None) -> Pattern:
    """Different patterns per head (Block-Sparse-Attention's ``head_mask_type``): head ``h`` follows
    ``patterns[h]``, ``None`` is a dense head. Each entry must be a single-head pattern; the layout has
    ``len(patterns)`` heads. ``block`` is needed only when every entry is None.

    >>> from cusparseattn.patterns import causal, local
    >>> lay = head_mix([None, causal(block=64), local(64, block=64)]).layout(256)
    >>> lay.heads, lay.nnz
    (3, 33)
    """
    entries = list(patterns)
    if not entries:
        raise ValueError("head_mix needs one pattern (or None for a dense head) per head")
    for i, p in enumerate(entries):
        if p is not None and not isinstance(p, Pattern):
            raise TypeError(f"head_mix entry {i} must be a Pattern or None, got {type(p).__name__}")
    sizes = {p.block_size for p in entries if p is not None}
    if block is not None:
        sizes.add(base.block_pair(block))
    if len(sizes) > 1:
        raise ValueError(f"head_mix patterns must share one block size, got {sorted(sizes)}")
    bs = sizes.pop() if sizes else (128, 128)
    full = dense(block=bs)

    def build(sq, sk):
        lays = [(full if p is None else p).layout(sq, sk) for p in entries]
        for i, lay in enumerate(lays):
            if lay.heads != 1:
                raise ValueError(
                    f"head_mix entry {i} ({entries[i]!r}) has {lay.heads} heads; give one-head patterns"
                )
        nb = max(lay.batch for lay in lays)
        if any(lay.batch not in (1, nb) for lay in lays):
            raise ValueError(
                f"head_mix patterns have batch sizes {sorted({lay.batch for lay in lays})}: use 1 or one size"
            )
        shape = (nb, 1, *lays[0].num_blocks)
        blocks = np.concatenate([np.broadcast_to(lay.blocks, shape) for lay in lays], axis=1)
        partial = np.concatenate([np.broadcast_to(lay.partial, shape) for lay in lays], axis=1)
        rules = [lay.rule if lay.partial.any() or lay._exact_rule else None for lay in lays]
        rule = _head_rule(rules)
        out = BlockLayout(blocks, block_size=bs, seq_q=sq, seq_k=sk, partial=partial, rule=rule)
        out._exact_rule = rule is not None and all(lay._exact_rule for lay in lays)
        return out

    names = ", ".join("dense" if p is None else repr(p) for p in entries)
    return Pattern(f"head_mix([{names}])", build, block=bs)


def from_mask(
    fn: Callable, *, block=128, batch: int | None = None, heads: int | None = None, name: str | None = None
) -> Pattern:
    """Any token rule ``fn(b, h, q, k) -> bool`` (a FlexAttention ``mask_mod``), as a pattern.

    ``fn`` is traced when it can be (Python operators, captured arrays and tensors, torch's, jax.numpy's and
    `cusparseattn.mods`' functions; see `cusparseattn.mods.mask_rule`): the kernels then compile its C
    expression, and new captured values (a window, document ids) never recompile. Otherwise (``np.*`` calls,
    an unknown function) it is evaluated as FlexAttention does, a rule that reaches torch on torch index
    tensors and one that reaches JAX on jax arrays, vmapped (`cusparseattn.trace.untraced_mask`; a rule that
    cannot be evaluated so either is refused here, naming the line), other rules on NumPy index arrays; the
    kernels then get its partial blocks as bit masks.

    The layout evaluates the rule on every token pair, a band of query blocks at a time: O(seq_q * seq_k)
    evaluations but O(band * seq_k) memory, never a seq_q x seq_k mask. ``batch`` and ``heads`` are the
    batch elements and query heads to evaluate (1 when not given); when the rule does not vary along one of
    them, the layout shares it. A traced rule that uses ``b`` or ``h`` needs ``batch`` or ``heads``.

    >>> from cusparseattn.patterns import local
    >>> lay = from_mask(lambda b, h, q, k: (q >= k) & (q - k < 64), block=32).layout(256)
    >>> lay == local(64, block=32).layout(256), lay.rule.c_expr
    (True, '((q >= k) && ((q - k) < P0))')
    """
    bs = base.block_pair(block)
    nbatch = 1 if batch is None else base.positive("batch", batch)
    nheads = 1 if heads is None else base.positive("heads", heads)
    label = name or getattr(fn, "__name__", "mask")
    rule = fn if isinstance(fn, TokenRule) else _traced_rule(fn, label, bs)
    if isinstance(rule, Exception):
        rule = untraced_mask(fn, label, rule)
    elif not isinstance(fn, TokenRule):
        for var, arg, given, what in (
            ("b", "batch", batch, "batch element"),
            ("h", "heads", heads, "query head"),
        ):
            if var in rule.fn.variables and given is None:
                raise ValueError(
                    f"from_mask: the mask function {label!r} uses {var} (the {what}), so {arg} must be "
                    f"given: pass {arg}=<number of {what}s> (with the default of 1, every {what} would share "
                    f"the blocks of {var} = 0)"
                )

    def build(sq, sk):
        any_, all_ = _classify_blocks(rule, nbatch, nheads, sq, sk, bs)
        return base.classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"from_mask({label}, block={block})", build, block=bs)


def _traced_rule(fn, label: str, block_size: tuple[int, int]) -> TokenRule | Exception:
    """``fn`` traced into a rule with a C expression (and what it decides in the partial blocks of its
    layouts, whose blocks `_classify_blocks` classifies exactly), or why it cannot be traced or compiled."""
    try:
        return mask_rule(fn, name=label, block_size=block_size)
    except (TraceError, NotCompilable) as err:
        return err


# Token pairs from which a rule with a C expression is classified on the GPU (one kernel per rule structure,
# compiled once) rather than with NumPy on the host.
GPU_CLASSIFY_PAIRS = 1 << 26


def _gpu() -> bool:
    try:
        from . import devices
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.devices":
            raise
        return False
    return not devices.available()


def _classify_blocks(rule, batch: int, heads: int, seq_q: int, seq_k: int, block_size: tuple[int, int]):
    """Per block ``[B|1, H|1, nQ, nK]``: does some token pair attend (``any_``), does every pair (``all_``).

    Evaluates ``rule`` on every pair: on the GPU when there is one and the rule has a C expression (large
    layouts whose lines and block rows the kernel's grid holds), else in bands of query blocks (vectorised
    inside a band). The batch and head axes stay 1 where the rule's result does not vary along them.
    """
    (bq, bk), nq, nk = block_size, -(-seq_q // block_size[0]), -(-seq_k // block_size[1])
    if rule.c_expr is not None and batch * heads * seq_q * seq_k >= GPU_CLASSIFY_PAIRS and _gpu():
        from . import cuda, devices

        uses = getattr(rule.fn, "variables", {"b", "h"})
        nb, nh = (batch if "b" in uses else 1), (heads if "h" in uses else 1)
        if max(nb * nh, nq) <= devices.GRID_YZ:  # its grid: lines on z, block rows on y
            return cuda.classify_blocks(rule, nb, nh, seq_q, seq_k, block_size, devices.current_device())
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    kraw = np.arange(nk * bk)[None, None, None, :]
    k = np.minimum(kraw, seq_k - 1)
    band = max(1, (1 << 24) // (batch * heads * bq * nk * bk))
    any_parts, all_parts = [], []
    for r0 in range(0, nq, band):  # bands of query blocks; everything inside a band is vectorised
        r1 = min(nq, r0 + band)
        qraw = np.arange(r0 * bq, r1 * bq)[None, None, :, None]
        m = np.asarray(rule(b, h, np.minimum(qraw, seq_q - 1), k), dtype=bool)
        valid = (qraw < seq_q) & (kraw < seq_k)
        shape = np.broadcast_shapes(m.shape, valid.shape)
        m, valid = np.broadcast_to(m, shape), np.broadcast_to(valid, shape)
        view = (shape[0], shape[1], r1 - r0, bq, nk, bk)
        any_parts.append((m & valid).reshape(view).any(axis=(3, 5)))
        all_parts.append((m | ~valid).reshape(view).all(axis=(3, 5)))
    return np.concatenate(any_parts, axis=2), np.concatenate(all_parts, axis=2)


def from_blocks(blocks, *, block=128) -> Pattern:
    """A fixed block mask (``[nQ, nK]``, ``[H, nQ, nK]`` or ``[B, H, nQ, nK]``, all blocks full): valid only
    for lengths with that many blocks.

    >>> import numpy as np
    >>> from_blocks(np.eye(4, dtype=bool), block=16).layout(64).nnz
    4
    """
    bs = base.block_pair(block)
    arr = np.asarray(blocks)
    if arr.ndim not in (2, 3, 4):
        raise ValueError(f"blocks must have shape [nQ, nK], [H, nQ, nK] or [B, H, nQ, nK], got {arr.shape}")
    arr = np.array(arr != 0) if arr.dtype != bool else arr.copy()
    nq, nk = arr.shape[-2:]

    def build(sq, sk):
        got = (-(-sq // bs[0]), -(-sk // bs[1]))
        if got != (nq, nk):
            raise ValueError(
                f"this from_blocks pattern has {nq}x{nk} blocks of {bs[0]}x{bs[1]}: it fits seq_q in "
                f"{(nq - 1) * bs[0] + 1}..{nq * bs[0]} and seq_k in {(nk - 1) * bs[1] + 1}..{nk * bs[1]}, "
                f"got seq_q={sq}, seq_k={sk}"
            )
        return BlockLayout(arr, block_size=bs, seq_q=sq, seq_k=sk)

    return Pattern(f"from_blocks({'x'.join(map(str, arr.shape))}, block={block})", build, block=bs)
