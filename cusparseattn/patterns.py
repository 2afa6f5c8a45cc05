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

import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from .layout import MAX_ARRAYS, MAX_PARAMS, BlockLayout, TokenRule, check_block, is_torch
from .mods import mask_rule
from .trace import NotCompilable, TraceError, untraced_mask

_CACHE_SIZE = 64  # layouts kept per pattern (distinct length pairs)

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


class Pattern:
    """An attention pattern independent of length; ``layout(seq_q, seq_k)`` builds it for given lengths.

    ``build(seq_q, seq_k) -> BlockLayout`` does the work; layouts are cached per pair of lengths (the last
    64), so the same lengths give the same object. Combine patterns with ``|`` (union) and ``&``
    (intersection).

    >>> p = causal(block=64) & local(window=100, causal=False, block=64)
    >>> p.layout(256) is p.layout(256, 256)
    True
    """

    def __init__(self, name: str, build: Callable[[int, int], BlockLayout], *, block):
        self.name = name
        self.block_size = _block_pair(block)
        self._build = build
        self._cache: OrderedDict[tuple[int, int], BlockLayout] = OrderedDict()
        self._lock = threading.Lock()

    def layout(self, seq_q: int, seq_k: int | None = None) -> BlockLayout:
        """The layout for ``seq_q`` queries and ``seq_k`` keys (default ``seq_q``)."""
        sq = _length("seq_q", seq_q)
        key = (sq, sq if seq_k is None else _length("seq_k", seq_k))
        with self._lock:
            lay = self._cache.get(key)
            if lay is not None:
                self._cache.move_to_end(key)
                return lay
        lay = self._build(*key)
        with self._lock:  # a concurrent build of the same lengths gives way to the first one stored
            lay = self._cache.setdefault(key, lay)
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return lay

    def token_rule(self, seq_q: int, seq_k: int | None = None) -> TokenRule:
        """The whole pattern as a token rule for these lengths (True exactly where a query attends a key).

        >>> causal().token_rule(4).c_expr
        'k <= q + P0'
        """
        lay = self.layout(seq_q, seq_k)
        if lay.rule is not None and lay._exact_rule:
            return lay.rule
        return TokenRule(self.name, _LayoutMask(lay))

    def __or__(self, other: Pattern) -> Pattern:
        return self._join(other, "|")

    def __and__(self, other: Pattern) -> Pattern:
        return self._join(other, "&")

    def _join(self, other, op: str) -> Pattern:
        if not isinstance(other, Pattern):
            return NotImplemented
        if other.block_size != self.block_size:
            raise ValueError(
                f"patterns with block sizes {self.block_size} and {other.block_size} cannot be combined; "
                "build both with the same block"
            )
        a, b, join = self, other, operator.or_ if op == "|" else operator.and_
        return Pattern(
            f"({a.name} {op} {b.name})",
            lambda sq, sk: join(a.layout(sq, sk), b.layout(sq, sk)),
            block=a.block_size,
        )

    def __repr__(self) -> str:
        return self.name


class _LayoutMask:
    """A layout's token mask as a rule function, on NumPy or torch indices."""

    def __init__(self, layout: BlockLayout):
        self.layout = layout

    def __call__(self, b, h, q, k):
        if any(is_torch(x) for x in (b, h, q, k)):
            return self.layout._torch_token_mask(b, h, q, k)
        return self.layout.token_mask(b, h, q, k)


# ---- helpers -----------------------------------------------------------------------------------------------
def _length(name: str, s) -> int:
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
        raise ValueError(f"{name} must be a positive integer, got {s!r}")
    return int(s)


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _block_pair(block) -> tuple[int, int]:
    if isinstance(block, tuple):
        if len(block) != 2:
            raise ValueError(f"block must be an int or a pair (bq, bk), got {block!r}")
        return check_block("block (query)", block[0]), check_block("block (key)", block[1])
    b = check_block("block", block)
    return b, b


def _square_block(block) -> int:
    bq, bk = _block_pair(block)
    if bq != bk:
        raise ValueError(f"this pattern is defined on square blocks: block must be one int, got {block!r}")
    return bq


def _self_attention(name: str, sq: int, sk: int) -> None:
    if sq != sk:
        raise ValueError(f"{name} is defined for self-attention: seq_q ({sq}) must equal seq_k ({sk})")


def _attention_kind(attention: str) -> bool:
    """True for 'unidirectional' (block-causal), False for 'bidirectional'."""
    if attention not in ("unidirectional", "bidirectional"):
        raise ValueError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")
    return attention == "unidirectional"


def _spans(seq: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last token of every block of a sequence."""
    lo = np.arange(0, seq, block, dtype=np.int64)
    return lo, np.minimum(lo + block, seq) - 1


def _grid(sq: int, sk: int, block_size: tuple[int, int]):
    """First/last query token per block row ([nQ, 1]) and first/last key token per block column ([1, nK])."""
    q0, q1 = _spans(sq, block_size[0])
    k0, k1 = _spans(sk, block_size[1])
    return q0[:, None], q1[:, None], k0[None, :], k1[None, :]


def _classified(any_, all_, rule, block_size, sq, sk, *, exact: bool) -> BlockLayout:
    """A layout from per-block "some pair attends" and "every pair attends" ([nQ, nK], [H, nQ, nK] or 4-D)."""
    n = (-(-sq // block_size[0]), -(-sk // block_size[1]))
    shape = np.broadcast_shapes(np.shape(any_), np.shape(all_), n)
    blocks = np.array(np.broadcast_to(any_, shape))
    lay = BlockLayout(
        blocks,
        block_size=block_size,
        seq_q=sq,
        seq_k=sk,
        partial=blocks & ~np.broadcast_to(all_, shape),
        rule=rule,
    )
    lay._exact_rule = exact and rule is not None
    return lay


def _take(table: np.ndarray, index):
    """``table[index]`` for NumPy or torch indices, clamped into the table (masked-out pairs past a sequence's
    end still get evaluated by callers that work on whole tiles)."""
    if is_torch(index):
        import torch

        return torch.from_numpy(table).to(index.device)[torch.clamp(index, 0, table.size - 1)]
    return table[np.clip(index, 0, table.size - 1)]


def _clamp(var: str, limit: str) -> str:
    """C text for ``var`` clamped below ``limit`` (kernels evaluate whole tiles, past a sequence's end)."""
    return f"({var} < {limit} ? {var} : {limit} - 1)"


def _everything(b, h, q, k):
    return (q == q) & (k == k)


_DENSE_RULE = TokenRule("dense", _everything, c_expr="true")


# ---- token-level patterns ----------------------------------------------------------------------------------
def dense(*, block=128) -> Pattern:
    """Every query attends every key.

    >>> dense(block=64).layout(100, 300).num_blocks
    (2, 5)
    """
    bs = _block_pair(block)
    return Pattern(
        f"dense(block={block})",
        lambda sq, sk: _classified(True, True, _DENSE_RULE, bs, sq, sk, exact=True),
        block=bs,
    )


def causal(*, block=128) -> Pattern:
    """Query ``q`` attends key ``k`` iff ``k <= q + (seq_k - seq_q)`` (bottom-right aligned, as FlashAttention
    does).

    >>> lay = causal(block=64).layout(256)
    >>> lay.nnz, int(lay.partial.sum())
    (10, 4)
    """
    bs = _block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = _grid(sq, sk, bs)
        rule = TokenRule("causal", lambda b, h, q, k: k <= q + off, c_expr="k <= q + P0", params=(off,))
        return _classified(k0 <= q1 + off, k1 <= q0 + off, rule, bs, sq, sk, exact=True)

    return Pattern(f"causal(block={block})", build, block=bs)


def local(window: int, causal: bool = True, *, block=128) -> Pattern:
    """A sliding window of ``window`` keys.

    Causal: ``0 <= (q + off) - k < window`` with ``off = seq_k - seq_q`` (each query sees itself and the
    ``window - 1`` keys before it, bottom-right aligned). Two-sided (``causal=False``): ``|q - k| < window``
    (no offset: queries and keys are aligned at the start).

    >>> local(window=128, block=64).layout(512).nnz
    21
    """
    w = _positive("window", window)
    bs = _block_pair(block)

    def build(sq, sk):
        q0, q1, k0, k1 = _grid(sq, sk, bs)
        if causal:
            off = sk - sq
            dmin, dmax = q0 + off - k1, q1 + off - k0
            rule = TokenRule(
                f"local({w})",
                lambda b, h, q, k: (q + off - k >= 0) & (q + off - k < w),
                c_expr="q + P0 - k >= 0 && q + P0 - k < P1",
                params=(off, w),
            )
            return _classified(
                (dmax >= 0) & (dmin < w), (dmin >= 0) & (dmax < w), rule, bs, sq, sk, exact=True
            )
        dmin, dmax = q0 - k1, q1 - k0
        rule = TokenRule(
            f"local({w}, two-sided)",
            lambda b, h, q, k: (q - k < w) & (k - q < w),
            c_expr="q - k < P0 && q - k > -P0",  # one difference for both bounds
            params=(w,),
        )
        return _classified((dmin < w) & (dmax > -w), (dmin > -w) & (dmax < w), rule, bs, sq, sk, exact=True)

    return Pattern(f"local(window={w}, causal={bool(causal)}, block={block})", build, block=bs)


def streaming(window: int, sinks: int, *, block=128) -> Pattern:
    """Attention sinks plus a causal window (StreamingLLM): the first ``sinks`` keys are always visible
    (causally), plus the ``window`` most recent keys:
    ``k <= q + off and (k < sinks or q + off - k < window)`` with ``off = seq_k - seq_q``.

    >>> streaming(window=64, sinks=16, block=16).layout(256).nnz
    81
    """
    w, s = _positive("window", window), _positive("sinks", sinks, 0)
    bs = _block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = _grid(sq, sk, bs)
        dmin, dmax = q0 + off - k1, q1 + off - k0
        any_ = (dmax >= 0) & ((k0 < s) | (dmin < w))
        # Every pair attends if causal holds throughout and the keys past the sinks are all in the window.
        all_ = (dmin >= 0) & ((k1 < s) | (q1 + off - np.maximum(k0, s) < w))
        rule = TokenRule(
            f"streaming({w}, sinks={s})",
            lambda b, h, q, k: (k <= q + off) & ((k < s) | (q + off - k < w)),
            c_expr="k <= q + P0 && (k < P2 || q + P0 - k < P1)",
            params=(off, w, s),
        )
        return _classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"streaming(window={w}, sinks={s}, block={block})", build, block=bs)


def strided(stride: int, local: int | None = None, *, block=128) -> Pattern:
    """OpenAI's ``strided`` attention (``get_attn_mask(n, 'strided', stride)``): ``k <= q`` and ``(q - k) %
    stride == 0``, bottom-right aligned for ``seq_q != seq_k``. With ``local``, also the causal window of the
    ``local`` most recent keys (the Sparse Transformer's two strided heads in one).

    >>> lay = strided(4, block=16).layout(64)
    >>> lay.nnz, int(lay.partial.sum())
    (10, 10)
    """
    st = _positive("stride", stride)
    lw = None if local is None else _positive("local", local)
    bs = _block_pair(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = _grid(sq, sk, bs)
        dmin, dmax = q0 + off - k1, q1 + off - k0  # q + off - k takes every value in between
        lo = np.maximum(dmin, 0)
        any_ = (dmax >= 0) & ((dmax // st) * st >= lo)
        single = dmin == dmax
        if lw is None:
            all_ = (dmin >= 0) & ((st == 1) | (single & (dmin % st == 0)))
            rule = TokenRule(
                f"strided({st})",
                lambda b, h, q, k: (k <= q + off) & ((q + off - k) % st == 0),
                c_expr="k <= q + P0 && (q + P0 - k) % P1 == 0",
                params=(off, st),
            )
        else:
            any_ |= (dmax >= 0) & (dmin < lw)
            past = np.maximum(dmin, lw)  # the differences the window does not cover: all must be multiples
            all_ = (dmin >= 0) & ((dmax < lw) | (st == 1) | ((past == dmax) & (dmax % st == 0)))
            rule = TokenRule(
                f"strided({st}, local={lw})",
                lambda b, h, q, k: (k <= q + off) & (((q + off - k) % st == 0) | (q + off - k < lw)),
                c_expr="k <= q + P0 && ((q + P0 - k) % P1 == 0 || q + P0 - k < P2)",
                params=(off, st, lw),
            )
        return _classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"strided(stride={st}, local={lw}, block={block})", build, block=bs)


def strided_blocks(stride_blocks: int, *, block=128) -> Pattern:
    """The block-sparse strided pattern (the ``strided8`` benchmark layout): causal tokens, and key block
    ``kb`` seen from query block ``qb`` when ``qb - kb < s`` or ``kb % s == s - 1`` (``s = stride_blocks``):
    ``(q >= k) & ((q//B - k//B < s) | (k//B % s == s - 1))`` with ``B = block`` (``q`` shifted by
    ``seq_k - seq_q`` when the lengths differ).

    >>> strided_blocks(2, block=16).layout(128).nnz
    24
    """
    s = _positive("stride_blocks", stride_blocks)
    bb = _square_block(block)

    def build(sq, sk):
        off = sk - sq
        q0, q1, k0, k1 = _grid(sq, sk, (bb, bb))
        a0, a1, kb = q0 + off, q1 + off, k0 // bb
        column = kb % s == s - 1
        near_any = np.maximum(a0, k0) <= np.minimum(a1, (kb + s) * bb - 1)
        any_ = np.where(column, a1 >= k0, near_any)
        all_ = (k1 <= a0) & (column | (a1 // bb - kb < s))
        # With the offset a multiple of the block, the partial blocks are those that the diagonal crosses, and
        # their block term holds: the kernels compile the causal term alone (64-bit divisions are long
        # subroutines, whose code alone slows the kernel).
        rule = TokenRule(
            f"strided_blocks({s})",
            lambda b, h, q, k: (k <= q + off) & (((q + off) // bb - k // bb < s) | ((k // bb) % s == s - 1)),
            c_expr="k <= q + P0 && ((q + P0) / P1 - k / P1 < P2 || (k / P1) % P2 == P2 - 1)",
            params=(off, bb, s),
            c_partial="k <= q + P0" if off % bb == 0 else None,
        )
        return _classified(any_, all_, rule, (bb, bb), sq, sk, exact=True)

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
    bs = _block_pair(block)
    flat = np.ascontiguousarray(ids.reshape(-1))

    def build(sq, sk):
        if (sq, sk) != (s, s):
            raise ValueError(
                f"this document pattern is for self-attention of {s} tokens (its document ids), "
                f"got seq_q={sq}, seq_k={sk}"
            )
        q0, q1, k0, k1 = _grid(sq, sk, bs)
        qf, ql, kf, kl = ids[:, q0[:, 0]], ids[:, q1[:, 0]], ids[:, k0[0]], ids[:, k1[0]]
        # Ids are monotone along one sequence: blocks share a document iff their id ranges overlap.
        any_ = (qf[:, :, None] <= kl[:, None, :]) & (kf[:, None, :] <= ql[:, :, None])
        all_ = (qf == ql)[:, :, None] & (kf == kl)[:, None, :] & (qf[:, :, None] == kf[:, None, :])
        if causal:
            any_, all_ = any_ & (k0 <= q1), all_ & (k1 <= q0)
        row = "" if nb == 1 else "b * P0 + "  # a batch of one is shared: its ids serve every batch element
        expr = f"A0[{row}{_clamp('q', 'P0')}] == A0[{row}{_clamp('k', 'P0')}]"

        def fn(b, h, q, k):
            start = 0 if nb == 1 else b * s
            same = _take(flat, start + q) == _take(flat, start + k)
            return same & (k <= q) if causal else same

        rule = TokenRule(
            f"document({'causal' if causal else 'bidirectional'})",
            fn,
            c_expr=f"{expr} && k <= q" if causal else expr,
            params=(s,),
            arrays=(flat,),
        )
        return _classified(any_[:, None], all_[:, None], rule, bs, sq, sk, exact=True)

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
                _positive("every document length in seq_lens", n)
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


# ---- block-level patterns ----------------------------------------------------------------------------------
def _block_pattern(name: str, block, make: Callable[[int], np.ndarray]) -> Pattern:
    """A pattern defined on the blocks of self-attention: ``make(num_blocks) -> bool [H, nb, nb]``."""
    bb = _square_block(block)

    def build(sq, sk):
        _self_attention(name.split("(")[0], sq, sk)
        return BlockLayout(make(-(-sq // bb))[None], block_size=bb, seq_q=sq)

    return Pattern(name, build, block=bb)


def _block_index(nb: int):
    return np.arange(nb)[:, None], np.arange(nb)[None, :]


def _random_blocks(rng: np.random.Generator, population: np.ndarray, count: int, nb: int) -> np.ndarray:
    """Per row, ``min(count, population[row])`` distinct columns drawn uniformly from
    ``range(population[row])``: Floyd's sampling vectorised over rows (the loop runs over the draws only)."""
    rows = population.size
    take = np.minimum(count, population)
    chosen = np.full((rows, max(count, 1)), -1, dtype=np.int64)
    for i in range(count):
        top = np.maximum(population - take + i, 0)
        t = rng.integers(0, top + 1)
        seen = (chosen[:, :i] == t[:, None]).any(axis=1)
        chosen[:, i] = np.where(i < take, np.where(seen, top, t), -1)
    out = np.zeros((rows, nb), dtype=bool)
    r, c = np.nonzero(chosen >= 0)
    out[r, chosen[r, c]] = True
    return out


def _layout_heads(num_heads, different_layout_per_head: bool) -> int:
    return _positive("num_heads", num_heads) if different_layout_per_head else 1


def fixed(
    stride: int, num_verts: int = 1, vertsize: int = 1, *, num_heads: int | None = None, block=128
) -> Pattern:
    """OpenAI's blocksparse ``fixed`` pattern (``get_blocksparse_obj(..., 'fixed')``), in blocks.

    ``stride`` is the window in blocks (OpenAI's ``local_attn_ctx // blocksize``): each query block sees its
    own window of ``stride`` blocks and, in every window, the ``vertsize`` "vertical" blocks that head ``h``
    summarises with (counting from the window's end, set ``h % num_verts``); never a later block, and inside
    the diagonal blocks causally token by token, as the original's callback. Heads: 1 when
    ``num_verts == 1``, else ``num_heads`` (default ``num_verts``, a multiple of it). See `deepspeed_fixed`
    for DeepSpeed's variant.

    >>> fixed(4, block=16).layout(128).nnz
    24
    """
    st, nv, vs = (
        _positive("stride", stride),
        _positive("num_verts", num_verts),
        _positive("vertsize", vertsize),
    )
    if st % vs:
        raise ValueError(f"stride ({st}) must be a multiple of vertsize ({vs})")
    if nv > st // vs:
        raise ValueError(f"num_verts ({nv}) must be at most stride // vertsize = {st // vs}")
    heads = 1 if nv == 1 else (nv if num_heads is None else _positive("num_heads", num_heads))
    if heads % nv:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_verts ({nv})")
    bb = _square_block(block)

    def build(sq, sk):
        _self_attention("fixed", sq, sk)
        i, j = _block_index(-(-sq // bb))
        r = (np.arange(heads) % nv)[:, None, None]
        verts = (j % st >= st - (r + 1) * vs) & (j % st < st - r * vs)
        blocks = (verts | (i // st == j // st)) & (j <= i)
        rule = TokenRule("causal", lambda b, h, q, k: k <= q, c_expr="k <= q")
        lay = BlockLayout(blocks[None], block_size=bb, seq_q=sq, partial=(i == j)[None, None], rule=rule)
        return lay

    return Pattern(
        f"fixed(stride={st}, num_verts={nv}, vertsize={vs}, heads={heads}, block={block})", build, block=bb
    )


def deepspeed_fixed(
    num_local_blocks: int = 4,
    num_global_blocks: int = 1,
    *,
    attention: str = "bidirectional",
    horizontal_global_attention: bool = False,
    num_different_global_patterns: int = 1,
    different_layout_per_head: bool = False,
    num_heads: int = 1,
    block=128,
) -> Pattern:
    """DeepSpeed's ``FixedSparsityConfig``: local windows of ``num_local_blocks`` blocks, and per window its
    ``num_global_blocks`` global blocks (the last ones for head 0, earlier ones for heads ``h %
    num_different_global_patterns``) seen by every later (unidirectional) or every (bidirectional) block row;
    ``horizontal_global_attention`` lets global blocks see everything (bidirectional only). A short last
    window gets its global blocks as DeepSpeed places them. Heads: ``num_heads`` with
    ``different_layout_per_head``, else 1.

    >>> deepspeed_fixed(2, attention="unidirectional", block=16).layout(128).nnz
    24
    """
    loc, glob = (
        _positive("num_local_blocks", num_local_blocks),
        _positive("num_global_blocks", num_global_blocks),
    )
    uni = _attention_kind(attention)
    npat = _positive("num_different_global_patterns", num_different_global_patterns)
    if loc % glob:
        raise ValueError(f"num_local_blocks ({loc}) must be a multiple of num_global_blocks ({glob})")
    if uni and horizontal_global_attention:
        raise ValueError("horizontal_global_attention needs attention='bidirectional'")
    if npat > 1 and not different_layout_per_head:
        raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True")
    if npat > loc // glob:
        raise ValueError(
            f"num_different_global_patterns ({npat}) must be at most {loc} // {glob} = {loc // glob}"
        )
    heads = _layout_heads(num_heads, different_layout_per_head)

    def make(nb):
        i, j = _block_index(nb)
        blocks = np.broadcast_to((i // loc == j // loc) & ((j <= i) if uni else True), (heads, nb, nb)).copy()
        first = (loc - (1 + np.arange(heads) % npat) * glob)[:, None, None]
        end = nb - nb % loc
        col = (j < end) & (j % loc >= first) & (j % loc < first + glob)
        start = j - j % loc + first  # the first block of the global group a column belongs to
        blocks |= col & ((i >= start) if uni else True)
        if horizontal_global_attention:
            blocks |= (i < end) & (i % loc >= first) & (i % loc < first + glob)
        if end < nb:  # the last, short window
            last = np.maximum(np.minimum(end + first, nb - glob), 0)
            blocks |= (j >= last) & (j < last + glob) & ((i >= last) if uni else True)
            if horizontal_global_attention:
                blocks |= (i >= last) & (i < last + glob)
        return blocks

    name = (
        f"deepspeed_fixed(num_local_blocks={loc}, num_global_blocks={glob}, attention={attention!r}, "
        f"horizontal_global_attention={bool(horizontal_global_attention)}, "
        f"num_different_global_patterns={npat}, heads={heads}, block={block})"
    )
    return _block_pattern(name, block, make)


def bigbird(
    num_random_blocks: int = 1,
    num_sliding_window_blocks: int = 3,
    num_global_blocks: int = 1,
    *,
    attention: str = "bidirectional",
    different_layout_per_head: bool = False,
    num_heads: int = 1,
    seed: int = 0,
    block=128,
) -> Pattern:
    """DeepSpeed's ``BigBirdSparsityConfig``: per block row ``num_random_blocks`` random blocks (seeded; per
    head with ``different_layout_per_head``), a sliding window of ``num_sliding_window_blocks`` blocks
    centred on the diagonal, and the first ``num_global_blocks`` block rows and columns; unidirectional keeps
    the lower block triangle. Random blocks come from NumPy's generator (``seed``), not Python's ``random``
    as in DeepSpeed; unidirectional rows with fewer candidates than ``num_random_blocks`` take all of them
    (where DeepSpeed raises).

    >>> lay = bigbird(2, different_layout_per_head=True, num_heads=4, block=16).layout(256)
    >>> lay.heads, lay.blocks.sum(axis=(2, 3)).ravel().tolist()
    (4, [94, 100, 94, 100])
    """
    nr = _positive("num_random_blocks", num_random_blocks, 0)
    nsw = _positive("num_sliding_window_blocks", num_sliding_window_blocks)
    ng = _positive("num_global_blocks", num_global_blocks, 0)
    uni = _attention_kind(attention)
    heads = _layout_heads(num_heads, different_layout_per_head)

    def make(nb):
        for what, n in (("random", nr), ("sliding window", nsw), ("global", ng)):
            if nb < n:
                raise ValueError(
                    f"number of {what} blocks ({n}) must be at most the number of blocks in a row ({nb})"
                )
        i, j = _block_index(nb)
        population = np.tile(np.arange(1, nb + 1) if uni else np.full(nb, nb), heads)
        blocks = _random_blocks(np.random.default_rng(seed), population, nr, nb).reshape(heads, nb, nb)
        blocks |= (np.abs(i - j) <= nsw // 2) | (i < ng) | (j < ng)
        return blocks & (j <= i) if uni else blocks

    name = (
        f"bigbird(num_random_blocks={nr}, num_sliding_window_blocks={nsw}, num_global_blocks={ng}, "
        f"attention={attention!r}, heads={heads}, seed={seed}, block={block})"
    )
    return _block_pattern(name, block, make)


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> list[tuple[int, int]]:
    """DeepSpeed's global blocks: ``starts`` alone are single blocks, with ``ends`` they are ranges."""
    starts = [_positive("global_block_indices entry", s, 0) for s in starts]
    if ends is None:
        return [(s, s + 1) for s in starts]
    ends = [_positive("global_block_end_indices entry", e, 0) for e in ends]
    if len(ends) != len(starts):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries and global_block_indices {len(starts)}: "
            "they must match"
        )
    for s, e in zip(starts, ends, strict=True):
        if s >= e:
            raise ValueError(f"a global block start ({s}) must be smaller than its end ({e})")
    return list(zip(starts, ends, strict=True))


def longformer(
    num_sliding_window_blocks: int = 3,
    global_block_indices: Sequence[int] = (0,),
    global_block_end_indices: Sequence[int] | None = None,
    *,
    global_tokens: Sequence[int] | None = None,
    attention: str = "bidirectional",
    block=128,
) -> Pattern:
    """DeepSpeed's ``BSLongformerSparsityConfig``: a sliding window of ``num_sliding_window_blocks`` blocks
    centred on the diagonal, and global blocks (``global_block_indices``, or ranges up to
    ``global_block_end_indices``) that see and are seen by everything. ``global_tokens`` adds global *tokens*
    (Longformer's own, token-level): their rows and columns attend fully. Unidirectional keeps the lower block
    triangle.

    >>> lay = longformer(3, global_tokens=[40], block=16).layout(128)
    >>> lay.nnz, int(lay.partial.sum())
    (42, 8)
    """
    nsw = _positive("num_sliding_window_blocks", num_sliding_window_blocks)
    ranges = _global_ranges(global_block_indices, global_block_end_indices)
    tokens = np.asarray(
        [_positive("global_tokens entry", t, 0) for t in (global_tokens or ())], dtype=np.int64
    )
    uni = _attention_kind(attention)
    bb = _square_block(block)
    w = nsw // 2

    def build(sq, sk):
        _self_attention("longformer", sq, sk)
        nb = -(-sq // bb)
        if nb < nsw:
            raise ValueError(f"num_sliding_window_blocks ({nsw}) must be at most the number of blocks ({nb})")
        flags = np.zeros(nb * bb, dtype=np.int32)
        for s, e in ranges:  # a handful of ranges
            flags[s * bb : min(e, nb) * bb] = 1
        flags[tokens[tokens < sq]] = 1
        flags = np.ascontiguousarray(flags[:sq])
        counts = np.add.reduceat(flags, np.arange(0, sq, bb))
        sizes = np.minimum(bb, sq - np.arange(0, sq, bb))
        i, j = _block_index(nb)
        window = np.abs(i - j) <= w
        any_ = window | (counts > 0)[:, None] | (counts > 0)[None, :]
        all_ = window | (counts == sizes)[:, None] | (counts == sizes)[None, :]
        if uni:
            any_, all_ = any_ & (j <= i), all_ & (j <= i)

        def fn(b, h, q, k):
            qb, kb = q // bb, k // bb
            near = (qb - kb <= w) & (kb - qb <= w)
            out = near | (_take(flags, q) != 0) | (_take(flags, k) != 0)
            return out & (kb <= qb) if uni else out

        near = "q / P0 - k / P0 <= P1 && k / P0 - q / P0 <= P1"
        expr = f"({near}) || A0[{_clamp('q', 'P2')}] || A0[{_clamp('k', 'P2')}]"
        rule = TokenRule(
            f"longformer({nsw})",
            fn,
            c_expr=f"({expr}) && k / P0 <= q / P0" if uni else expr,
            params=(bb, w, sq),
            arrays=(flags,),
        )
        return _classified(any_, all_, rule, (bb, bb), sq, sk, exact=True)

    name = (
        f"longformer(num_sliding_window_blocks={nsw}, global_blocks={ranges}, "
        f"global_tokens={tokens.tolist()}, attention={attention!r}, block={block})"
    )
    return Pattern(name, build, block=bb)


def variable(
    num_random_blocks: int = 0,
    local_window_blocks: Sequence[int] = (4,),
    global_block_indices: Sequence[int] = (0,),
    global_block_end_indices: Sequence[int] | None = None,
    *,
    attention: str = "bidirectional",
    horizontal_global_attention: bool = False,
    different_layout_per_head: bool = False,
    num_heads: int = 1,
    seed: int = 0,
    block=128,
) -> Pattern:
    """DeepSpeed's ``VariableSparsityConfig``: per row ``num_random_blocks`` random blocks (from the whole
    row, as DeepSpeed, even unidirectional; seeded NumPy draws), consecutive local windows of the sizes in
    ``local_window_blocks`` (the last size repeats to the end), and global blocks (``global_block_indices``,
    or ranges up to ``global_block_end_indices``) seen by every row (bidirectional) or every later row
    (unidirectional), and seeing everything with ``horizontal_global_attention``.

    >>> variable(0, [1, 2], [0], block=16).layout(128).nnz
    21
    """
    nr = _positive("num_random_blocks", num_random_blocks, 0)
    sizes = [_positive("local_window_blocks entry", n) for n in local_window_blocks]
    if not sizes:
        raise ValueError("local_window_blocks needs at least one window size")
    ranges = _global_ranges(global_block_indices, global_block_end_indices)
    uni = _attention_kind(attention)
    if uni and horizontal_global_attention:
        raise ValueError("horizontal_global_attention needs attention='bidirectional'")
    heads = _layout_heads(num_heads, different_layout_per_head)

    def make(nb):
        if nb < nr:
            raise ValueError(f"num_random_blocks ({nr}) must be at most the number of blocks in a row ({nb})")
        i, j = _block_index(nb)
        blocks = _random_blocks(np.random.default_rng(seed), np.full(heads * nb, nb), nr, nb).reshape(
            heads, nb, nb
        )
        bounds = np.cumsum(sizes)
        x = np.arange(nb)
        listed = np.concatenate([[0], bounds[:-1]])[
            np.minimum(np.searchsorted(bounds, x, side="right"), len(sizes) - 1)
        ]
        start = np.where(x < bounds[-1], listed, bounds[-1] + (x - bounds[-1]) // sizes[-1] * sizes[-1])
        blocks |= (start[:, None] == start[None, :]) & ((j <= i) if uni else True)
        first_row = np.full(nb, nb)  # per column: the first row that sees it as global
        for s, e in ranges:  # a handful of ranges
            if s < nb:
                first_row[s : min(e, nb)] = np.minimum(first_row[s : min(e, nb)], s if uni else 0)
                if horizontal_global_attention:
                    blocks[:, s : min(e, nb), :] = True
        return blocks | (i >= first_row[None, :])

    name = (
        f"variable(num_random_blocks={nr}, local_window_blocks={sizes}, global_blocks={ranges}, "
        f"attention={attention!r}, horizontal_global_attention={bool(horizontal_global_attention)}, "
        f"heads={heads}, seed={seed}, block={block})"
    )
    return _block_pattern(name, block, make)


# ---- mixes and user-defined patterns -----------------------------------------------------------------------
class _HeadSelect:
    """Head ``h`` applies ``fns[group[h]]`` (None: every pair attends), on NumPy or torch indices."""

    def __init__(self, fns: list, group: np.ndarray):
        self.fns, self.group = fns, group

    def __call__(self, b, h, q, k):
        g = _take(self.group, h)
        out = None
        for i, fn in enumerate(self.fns):
            term = g == i
            if fn is not None:
                value = fn(b, h, q, k)
                term = term & (value if is_torch(value) else np.asarray(value, dtype=bool))
            out = term if out is None else out | term
        return out


def _head_rule(rules: list[TokenRule | None]) -> TokenRule | None:
    """One rule for heads with rules of their own: head ``h`` applies ``rules[h]`` (None: nothing to test)."""
    if all(r is None for r in rules):
        return None
    distinct, group = [], np.zeros(len(rules), dtype=np.int32)
    for h, r in enumerate(rules):
        if r not in distinct:
            distinct.append(r)
        group[h] = distinct.index(r)
    fns = [None if r is None else r.fn for r in distinct]
    name = "head_mix(" + ", ".join("-" if r is None else r.name for r in rules) + ")"
    exprs = ["true" if r is None else r.c_expr for r in distinct]
    params = [p for r in distinct if r is not None for p in r.params]
    arrays = [a for r in distinct if r is not None for a in r.arrays]
    if (
        any(e is None for e in exprs)
        or len(params) > MAX_PARAMS
        or len(arrays) + (len(distinct) > 1) > MAX_ARRAYS
    ):
        return TokenRule(name, _HeadSelect(fns, group))
    if len(distinct) == 1:
        return TokenRule(
            name, _HeadSelect(fns, group), c_expr=exprs[0], params=tuple(params), arrays=tuple(arrays)
        )
    shifted, np_, na = [], 0, 0
    for r, e in zip(distinct, exprs, strict=True):
        offs = (np_, na)
        shifted.append(re.sub(r"\b([PA])(\d+)\b", lambda m, o=offs: f"{m[1]}{int(m[2]) + o[m[1] == 'A']}", e))
        if r is not None:
            np_, na = np_ + len(r.params), na + len(r.arrays)
    sel = f"A{len(arrays)}[h]"
    expr = f"({shifted[-1]})"
    for g in range(len(distinct) - 2, -1, -1):
        expr = f"{sel} == {g} ? ({shifted[g]}) : {expr}"
    return TokenRule(
        name, _HeadSelect(fns, group), c_expr=expr, params=tuple(params), arrays=(*arrays, group)
    )


def head_mix(patterns: Sequence[Pattern | None], *, block=None) -> Pattern:
    """Different patterns per head (Block-Sparse-Attention's ``head_mask_type``): head ``h`` follows
    ``patterns[h]``, ``None`` is a dense head. Each entry must be a single-head pattern; the layout has
    ``len(patterns)`` heads. ``block`` is needed only when every entry is None.

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
        sizes.add(_block_pair(block))
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

    >>> lay = from_mask(lambda b, h, q, k: (q >= k) & (q - k < 64), block=32).layout(256)
    >>> lay == local(64, block=32).layout(256), lay.rule.c_expr
    (True, '((q >= k) && ((q - k) < P0))')
    """
    bs = _block_pair(block)
    nbatch = 1 if batch is None else _positive("batch", batch)
    nheads = 1 if heads is None else _positive("heads", heads)
    label = name or getattr(fn, "__name__", "mask")
    rule = fn if isinstance(fn, TokenRule) else _traced_rule(fn, label)
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
        return _classified(any_, all_, rule, bs, sq, sk, exact=True)

    return Pattern(f"from_mask({label}, block={block})", build, block=bs)


def _traced_rule(fn, label: str) -> TokenRule | Exception:
    """``fn`` traced into a rule with a C expression, or the reason it cannot be traced or compiled."""
    try:
        return mask_rule(fn, name=label)
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
    layouts only), else in bands of query blocks (vectorised inside a band). The batch and head axes stay 1
    where the rule's result does not vary along them.
    """
    if rule.c_expr is not None and batch * heads * seq_q * seq_k >= GPU_CLASSIFY_PAIRS and _gpu():
        from . import cuda, devices

        uses = getattr(rule.fn, "variables", {"b", "h"})
        nb, nh = (batch if "b" in uses else 1), (heads if "h" in uses else 1)
        return cuda.classify_blocks(rule, nb, nh, seq_q, seq_k, block_size, devices.current_device())
    (bq, bk), nq, nk = block_size, -(-seq_q // block_size[0]), -(-seq_k // block_size[1])
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
    bs = _block_pair(block)
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
