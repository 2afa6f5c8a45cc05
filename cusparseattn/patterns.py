"""Attention patterns: rules independent of length that build a `BlockLayout` for any pair of lengths.

A `Pattern` is what a user usually passes around: ``patterns.local(window=1024).layout(seq_q, seq_k)`` gives
the `BlockLayout` for those lengths (cached: the same object for the same lengths, so per-device caches keyed
by layout identity keep working). Patterns combine with ``|`` and ``&``.

Every pattern classifies its blocks analytically from the first and last token of each block, vectorised over
all blocks at once: nothing evaluates every token pair (except `from_mask`, whose rule is opaque).

Conventions:

- Token-level patterns (`causal`, `local`, `streaming`, `strided`, `strided_blocks`, `document`) have a
  NumPy rule and the same rule as a C expression whose values (window sizes, offsets) are run-time
  parameters, so a new window never recompiles a kernel. Causal patterns align the last query with the last
  key when ``seq_q != seq_k`` (as FlashAttention): query ``q`` attends key ``k`` only if ``k <= q + seq_k -
  seq_q``.
- Block-level patterns from DeepSpeed (`deepspeed_fixed`, `bigbird`, `longformer`, `variable`) and OpenAI's
  `fixed` are defined on blocks of self-attention (``seq_q == seq_k``); their ``attention="unidirectional"``
  is causal at block level, as in DeepSpeed (tokens see the whole diagonal block): intersect with `causal`
  for token-level causality.
- ``block`` (default 128) is a power of two from 16 to 128; token-level patterns also take ``(bq, bk)``.

>>> lay = local(window=256, block=64).layout(1024)
>>> lay.num_blocks, lay.nnz
((16, 16), 70)
"""

from __future__ import annotations

import numpy as np

from . import pattern as base
from .block_patterns import bigbird, deepspeed_fixed, fixed, longformer, variable
from .mods import mask_rule
from .pattern import Pattern, dense
from .traced import CapturedArray
from .user_patterns import from_blocks, from_mask, head_mix

__all__ = [
    "Pattern",
    "bigbird",
    "causal",
    "deepspeed_fixed",
    "dense",
    "document",
    "fixed",
    "from_blocks",
    "from_mask",
    "head_mix",
    "local",
    "longformer",
    "streaming",
    "strided",
    "strided_blocks",
    "variable",
]


# ---- token-level patterns ----------------------------------------------------------------------------------


def causal(*, block=128) -> Pattern:
    """Query ``q`` attends key ``k`` iff ``k <= q + (seq_k - seq_q)`` (bottom-right aligned, as FlashAttention
    does).

    >>> lay = causal(block=64).layout(256)
    >>> lay.nnz, int(lay.partial.sum())
    (10, 4)
    """
    bs = base.block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = base.grid(sq, sk, bs)
        rule = mask_rule(lambda b, h, q, k: k <= q + off, name="causal", block_size=bs)
        return base.classified(k0 <= q1 + off, k1 <= q0 + off, rule, bs, sq, sk, exact=True)

    return Pattern(f"causal(block={block})", build, block=bs)


def local(window: int, causal: bool = True, *, block=128) -> Pattern:
    """A sliding window of ``window`` keys.

    Causal: ``0 <= (q + off) - k < window`` with ``off = seq_k - seq_q`` (each query sees itself and the
    ``window - 1`` keys before it, bottom-right aligned). Two-sided (``causal=False``): ``|q - k| < window``
    (no offset: queries and keys are aligned at the start).

    >>> local(window=128, block=64).layout(512).nnz
    21
    """
    w = base.positive("window", window)
    bs = base.block_pair(block)

    def build(sq, sk):
        q0, q1, k0, k1 = base.grid(sq, sk, bs)
        if causal:
            off = sk - sq
            dmin, dmax = q0 + off - k1, q1 + off - k0
            rule = mask_rule(lambda b, h, q, k: (k <= q + off) & (q + off - k < w), name=f"local({w})")
            return base.classified(
                (dmax >= 0) & (dmin < w), (dmin >= 0) & (dmax < w), rule, bs, sq, sk, exact=True
            )
        dmin, dmax = q0 - k1, q1 - k0
        rule = mask_rule(lambda b, h, q, k: (q - k < w) & (k - q < w), name=f"local({w}, two-sided)")
        return base.classified(
            (dmin < w) & (dmax > -w), (dmin > -w) & (dmax < w), rule, bs, sq, sk, exact=True
        )

    return Pattern(f"local(window={w}, causal={bool(causal)}, block={block})", build, block=bs)


def streaming(window: int, sinks: int, *, block=128) -> Pattern:
    """Attention sinks plus a causal window (StreamingLLM): the first ``sinks`` keys are always visible
    (causally), plus the ``window`` most recent keys:
    ``k <= q + off and (k < sinks or q + off - k < window)`` with ``off = seq_k - seq_q``.

    >>> streaming(window=64, sinks=16, block=16).layout(256).nnz
    81
    """
    w, s = base.positive("window", window), base.positive("sinks", sinks, 0)
    bs = base.block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = base.grid(sq, sk, bs)
        dmin, dmax = q0 + off - k1, q1 + off - k0
        any_ = (dmax >= 0) & ((k0 < s) | (dmin < w))
        # Every pair attends if causal holds throughout and the keys past the sinks are all in the window.
        all_ = (dmin >= 0) & ((k1 < s) | (q1 + off - np.maximum(k0, s) < w))
        rule = mask_rule(
            lambda b, h, q, k: (k <= q + off) & ((k < s) | (q + off - k < w)),
            name=f"streaming({w}, sinks={s})",
        )
        return base.classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"streaming(window={w}, sinks={s}, block={block})", build, block=bs)


def strided(stride: int, local: int | None = None, *, block=128) -> Pattern:
    """OpenAI's ``strided`` attention (``get_attn_mask(n, 'strided', stride)``): ``k <= q`` and ``(q - k) %
    stride == 0``, bottom-right aligned for ``seq_q != seq_k``. With ``local``, also the causal window of the
    ``local`` most recent keys (the Sparse Transformer's two strided heads in one).

    >>> lay = strided(4, block=16).layout(64)
    >>> lay.nnz, int(lay.partial.sum())
    (10, 10)
    """
    st = base.positive("stride", stride)
    lw = None if local is None else base.positive("local", local)
    bs = base.block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = base.grid(sq, sk, bs)
        dmin, dmax = q0 + off - k1, q1 + off - k0  # q + off - k takes every value in between
        lo = np.maximum(dmin, 0)
        any_ = (dmax >= 0) & ((dmax // st) * st >= lo)
        single = dmin == dmax
        if lw is None:
            all_ = (dmin >= 0) & ((st == 1) | (single & (dmin % st == 0)))
            rule = mask_rule(
                lambda b, h, q, k: (k <= q + off) & ((q + off - k) % st == 0), name=f"strided({st})"
            )
        else:
            any_ |= (dmax >= 0) & (dmin < lw)
            past = np.maximum(dmin, lw)  # the differences the window does not cover: all must be multiples
            all_ = (dmin >= 0) & ((dmax < lw) | (st == 1) | ((past == dmax) & (dmax % st == 0)))
            rule = mask_rule(
                lambda b, h, q, k: (k <= q + off) & (((q + off - k) % st == 0) | (q + off - k < lw)),
                name=f"strided({st}, local={lw})",
            )
        return base.classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"strided(stride={st}, local={lw}, block={block})", build, block=bs)


def strided_blocks(stride_blocks: int, *, block=128) -> Pattern:
    """The block-sparse strided pattern (the ``strided8`` benchmark layout): causal tokens, and key block
    ``kb`` seen from query block ``qb`` when ``qb - kb < s`` or ``kb % s == s - 1`` (``s = stride_blocks``):
    ``(q >= k) & ((q//B - k//B < s) | (k//B % s == s - 1))`` with ``B = block`` (``q`` shifted by
    ``seq_k - seq_q`` when the lengths differ).

    >>> strided_blocks(2, block=16).layout(128).nnz
    24
    """
    s = base.positive("stride_blocks", stride_blocks)
    bb = base.square_block(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = base.grid(sq, sk, (bb, bb))
        a0, a1, kb = q0 + off, q1 + off, k0 // bb
        column = kb % s == s - 1
        near_any = np.maximum(a0, k0) <= np.minimum(a1, (kb + s) * bb - 1)
        any_ = np.where(column, a1 >= k0, near_any)
        all_ = (k1 <= a0) & (column | (a1 // bb - kb < s))
        # With the offset a multiple of the block, the block term holds in the partial blocks (those that the
        # diagonal crosses): the kernels compile the causal term alone there (the program's "partial").
        rule = mask_rule(
            lambda b, h, q, k: (k <= q + off) & (((q + off) // bb - k // bb < s) | ((k // bb) % s == s - 1)),
            name=f"strided_blocks({s})",
            block_size=(bb, bb),
        )
        return base.classified(any_, all_, rule, (bb, bb), sq, sk, exact=True)

    return Pattern(f"strided_blocks(stride_blocks={s}, block={block})", build, block=bb)


def document(doc_ids=None, seq_lens=None, *, causal: bool = False, block=128) -> Pattern:
    """Packed sequences: tokens attend only inside their own document (optionally causally).

    Give either ``doc_ids`` (non-decreasing integer ids per token, ``[S]`` or ``[B, S]``) or ``seq_lens``
    (document lengths per batch element, ``list[list[int]]``, or one ``list[int]``; a batch element whose
    documents are shorter than the longest total gets its remaining tokens as one more document). The layout
    has batch ``B`` and is valid for self-attention of ``S`` tokens only.

    >>> lay = document(seq_lens=[[100, 28], [64, 64]], causal=True, block=32).layout(128)
    >>> lay.batch, lay.nnz
    (2, 16)
    """
    ids = _doc_ids(doc_ids, seq_lens)
    nb, s = ids.shape
    bs = base.block_pair(block)
    # Looked up clamped, on NumPy, torch or traced indices alike; a batch of one is shared: its ids serve
    # every batch element.
    table, row = CapturedArray(ids), CapturedArray(ids[0])
    if nb == 1:

        def fn(b, h, q, k):
            return (row[q] == row[k]) & (k <= q) if causal else row[q] == row[k]
    else:

        def fn(b, h, q, k):
            return (table[b, q] == table[b, k]) & (k <= q) if causal else table[b, q] == table[b, k]

    rule = mask_rule(fn, name=f"document({'causal' if causal else 'bidirectional'})")

    def build(sq, sk):
        if (sq, sk) != (s, s):
            raise ValueError(
                f"this document pattern is for self-attention of {s} tokens (its document ids), "
                f"got seq_q={sq}, seq_k={sk}"
            )
        q0, q1, k0, k1 = base.grid(sq, sk, bs)
        qf, ql, kf, kl = ids[:, q0[:, 0]], ids[:, q1[:, 0]], ids[:, k0[0]], ids[:, k1[0]]
        # Ids are monotone along one sequence: blocks share a document iff their id ranges overlap.
        any_ = (qf[:, :, None] <= kl[:, None, :]) & (kf[:, None, :] <= ql[:, :, None])
        all_ = (qf == ql)[:, :, None] & (kf == kl)[:, None, :] & (qf[:, :, None] == kf[:, None, :])
        if causal:
            any_, all_ = any_ & (k0 <= q1), all_ & (k1 <= q0)
        return base.classified(any_[:, None], all_[:, None], rule, bs, sq, sk, exact=True)

    return Pattern(f"document(batch={nb}, seq={s}, causal={bool(causal)}, block={block})", build, block=bs)


def _doc_ids(doc_ids, seq_lens) -> np.ndarray:
    """Document ids as int32 [B, S], checked non-decreasing."""
    if (doc_ids is None) == (seq_lens is None):
        raise ValueError(
            "document needs exactly one of doc_ids (ids per token) or seq_lens (lengths per batch)"
        )
    if seq_lens is not None:
        rows = [seq_lens] if all(isinstance(x, (int, np.integer)) for x in seq_lens) else list(seq_lens)
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError(
                f"seq_lens must list at least one document length per batch element, got {seq_lens!r}"
            )
        for r in rows:
            for n in r:
                base.positive("every document length in seq_lens", n)
        total = max(sum(int(n) for n in r) for r in rows)
        ids = np.empty((len(rows), total), dtype=np.int32)
        for i, r in enumerate(rows):  # one row per batch element; the documents themselves go vectorised
            own = np.repeat(np.arange(len(r), dtype=np.int32), np.asarray(r, dtype=np.int64))
            ids[i, : own.size], ids[i, own.size :] = own, len(r)
        return ids
    arr = np.asarray(doc_ids)
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"doc_ids must be integer ids of shape [S] or [B, S], got {arr.dtype} {arr.shape}")
    arr = arr.reshape((1,) * (2 - arr.ndim) + arr.shape)
    if arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max:
        raise ValueError("doc_ids must fit in 32-bit integers")
    drops = np.argwhere(np.diff(arr, axis=1) < 0)
    if drops.size:
        b, p = drops[0]
        raise ValueError(
            f"doc_ids must be non-decreasing along the sequence (packed documents): batch {b} goes from "
            f"{arr[b, p]} to {arr[b, p + 1]} at position {p + 1}"
        )
    return arr.astype(np.int32)
