"""The `Pattern`: a rule independent of length that builds a `BlockLayout` for any pair of lengths (cached
per pair), and what the families of patterns (`cusparseattn.patterns`, `block_patterns`, `user_patterns`)
share: argument checks, the classification of blocks into full and partial, C text helpers, `dense`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np

from .layout import BlockLayout, check_block
from .mods import mask_rule
from .recent import Recent
from .rules import TokenRule, is_torch

_CACHE_SIZE = 64  # layouts kept per pattern (distinct length pairs)


class Pattern:
    """An attention pattern independent of length; ``layout(seq_q, seq_k)`` builds it for given lengths.

    ``build(seq_q, seq_k) -> BlockLayout`` does the work; layouts are cached per pair of lengths (the last
    64), so the same lengths give the same object. Combine patterns with ``|`` (union) and ``&``
    (intersection).

    >>> from cusparseattn.patterns import causal, local
    >>> p = causal(block=64) & local(window=100, causal=False, block=64)
    >>> p.layout(256) is p.layout(256, 256)
    True
    """

    def __init__(self, name: str, build: Callable[[int, int], BlockLayout], *, block):
        self.name = name
        self.block_size = block_pair(block)
        self._build = build
        self._cache = Recent(_CACHE_SIZE)

    def layout(self, seq_q: int, seq_k: int | None = None) -> BlockLayout:
        """The layout for ``seq_q`` queries and ``seq_k`` keys (default ``seq_q``)."""
        sq = _length("seq_q", seq_q)
        key = (sq, sq if seq_k is None else _length("seq_k", seq_k))
        lay = self._cache.get(key)
        if lay is None:
            # a concurrent build of the same lengths gives way to the first one stored
            lay = self._cache.put(key, self._build(*key), first=True)
        return lay

    def token_rule(self, seq_q: int, seq_k: int | None = None) -> TokenRule:
        """The whole pattern as a token rule for these lengths (True exactly where a query attends a key).

        >>> from cusparseattn.patterns import causal
        >>> causal().token_rule(4).c_expr
        '(k <= (q + P0))'
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


def positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def block_pair(block) -> tuple[int, int]:
    if isinstance(block, tuple):
        if len(block) != 2:
            raise ValueError(f"block must be an int or a pair (bq, bk), got {block!r}")
        return check_block("block (query)", block[0]), check_block("block (key)", block[1])
    b = check_block("block", block)
    return b, b


def square_block(block) -> int:
    bq, bk = block_pair(block)
    if bq != bk:
        raise ValueError(f"this pattern is defined on square blocks: block must be one int, got {block!r}")
    return bq


def self_attention(name: str, sq: int, sk: int) -> None:
    if sq != sk:
        raise ValueError(f"{name} is defined for self-attention: seq_q ({sq}) must equal seq_k ({sk})")


def attention_kind(attention: str) -> bool:
    """True for 'unidirectional' (block-causal), False for 'bidirectional'."""
    if attention not in ("unidirectional", "bidirectional"):
        raise ValueError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")
    return attention == "unidirectional"


def _spans(seq: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last token of every block of a sequence."""
    lo = np.arange(0, seq, block, dtype=np.int64)
    return lo, np.minimum(lo + block, seq) - 1


def grid(sq: int, sk: int, block_size: tuple[int, int]):
    """First/last query token per block row ([nQ, 1]) and first/last key token per block column ([1, nK])."""
    q0, q1 = _spans(sq, block_size[0])
    k0, k1 = _spans(sk, block_size[1])
    return q0[:, None], q1[:, None], k0[None, :], k1[None, :]


def classified(any_, all_, rule, block_size, sq, sk, *, exact: bool) -> BlockLayout:
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


def take(table: np.ndarray, index):
    """``table[index]`` for NumPy or torch indices, clamped into the table (masked-out pairs past a sequence's
    end still get evaluated by callers that work on whole tiles)."""
    if is_torch(index):
        import torch

        return torch.from_numpy(table).to(index.device)[torch.clamp(index, 0, table.size - 1)]
    return table[np.clip(index, 0, table.size - 1)]


def clamp(var: str, limit: str) -> str:
    """C text for ``var`` clamped below ``limit`` (kernels evaluate whole tiles, past a sequence's end)."""
    return f"({var} < {limit} ? {var} : {limit} - 1)"


def _everything(b, h, q, k):
    return (q == q) & (k == k)


DENSE_RULE = mask_rule(_everything, name="dense")


def dense(*, block=128) -> Pattern:
    """Every query attends every key.

    >>> dense(block=64).layout(100, 300).num_blocks
    (2, 5)
    """
    bs = block_pair(block)
    return Pattern(
        f"dense(block={block})",
        lambda sq, sk: classified(True, True, DENSE_RULE, bs, sq, sk, exact=True),
        block=bs,
    )
