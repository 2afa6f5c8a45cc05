"""Sequence orderings for context parallelism: which chunks of the sequence each rank holds.

An `Ordering` cuts a sequence into equal chunks and gives each rank the same number of them, so every rank
holds a shard of the same length: the concatenation of its chunks in sequence order. `contiguous` gives rank
``r`` the ``r``-th slice (the natural split, and the one that keeps sliding windows talking to neighbours
only); `zigzag` gives it chunks ``r`` and ``2N - 1 - r`` of ``2N`` (PyTorch's head-tail load balancer: every
rank gets an early and a late part of a causal triangle, hence equal work); `by_work` balances the work that
an arbitrary layout's rows cost.

`shard` and `unshard` on an ordering apply and undo it on any array (NumPy, CuPy, PyTorch) locally; the
functions of `cusparseattn.distributed` do the same across a process group.

>>> o = Ordering.zigzag(16, 2)
>>> o.ranks, [tuple(s) for s in o.spans(0)]
(((0, 3), (1, 2)), [(0, 4, 0), (12, 16, 4)])
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..layout import BlockLayout

# A reordering that breaks contiguity must cut the busiest rank's work by this fraction to be chosen over the
# contiguous split: contiguous shards keep local layouts talking to their neighbours only, and a reordering
# that saves a few percent of compute costs more in communication than it saves.
MIN_GAIN = 0.05

_work_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Span(NamedTuple):
    """A run of consecutive sequence positions that one rank holds: ``[start, stop)`` of the whole sequence,
    stored from ``offset`` on in that rank's shard."""

    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Ordering:
    """Which chunks of ``chunk`` tokens each rank holds, ``ranks[r]`` in ascending order.

    Every rank holds the same number of chunks and every chunk belongs to one rank. Orderings are immutable
    and hashable (plans are cached by them); build them with `contiguous`, `zigzag` or `by_work`.

    >>> o = Ordering.contiguous(12, 3)
    >>> o.shard_len, o.index().tolist()
    (4, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    """

    seq_len: int
    chunk: int
    ranks: tuple[tuple[int, ...], ...]
    name: str = "custom"

    def __post_init__(self):
        n_chunks = self.seq_len // self.chunk if self.chunk > 0 else 0
        if self.chunk <= 0 or n_chunks * self.chunk != self.seq_len:
            raise ValueError(f"chunk must divide seq_len: got chunk {self.chunk}, seq_len {self.seq_len}")
        counts = {len(r) for r in self.ranks}
        held = sorted(c for r in self.ranks for c in r)
        if len(counts) != 1 or held != list(range(n_chunks)):
            raise ValueError(
                f"ranks must hold the {n_chunks} chunks once each, the same number per rank; got {self.ranks}"
            )
        if any(list(r) != sorted(r) for r in self.ranks):
            raise ValueError(f"each rank's chunks must be in ascending order, got {self.ranks}")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def shard_len(self) -> int:
        """Tokens per rank."""
        return self.seq_len // self.world_size

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, seq_len: int, world_size: int) -> Ordering:
        """Rank ``r`` holds positions ``[r * S / N, (r + 1) * S / N)``.

        >>> Ordering.contiguous(8, 2).ranks
        ((0,), (1,))
        """
        _check_split(seq_len, world_size, world_size, "contiguous")
        return cls(seq_len, seq_len // world_size, tuple((r,) for r in range(world_size)), "contiguous")

    @classmethod
    def zigzag(cls, seq_len: int, world_size: int) -> Ordering:
        """``2N`` chunks; rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` (head and tail): equal causal work.

        >>> Ordering.zigzag(16, 4).ranks
        ((0, 7), (1, 6), (2, 5), (3, 4))
        """
        _check_split(seq_len, world_size, 2 * world_size, "zigzag")
        n = 2 * world_size
        return cls(seq_len, seq_len // n, tuple((r, n - 1 - r) for r in range(world_size)), "zigzag")

    @classmethod
    def by_work(cls, layout: BlockLayout, world_size: int, chunks_per_rank: int = 2) -> Ordering:
        """The ordering that evens out the work of ``layout``'s rows (visited blocks, over batch and heads).

        Candidates: `contiguous`, `zigzag`, and a greedy assignment of ``world_size * chunks_per_rank``
        equal chunks (heaviest first, each to the least loaded rank that still has room). The contiguous
        split is kept unless another candidate cuts the busiest rank's work by `MIN_GAIN` or more.

        >>> from cusparseattn import patterns
        >>> Ordering.by_work(patterns.causal(block=16).layout(128), 2).ranks
        ((0, 3), (1, 2))
        """
        if layout.seq_q != layout.seq_k:
            raise ValueError(
                f"context parallelism shards one sequence for queries and keys; the layout has seq_q "
                f"{layout.seq_q} and seq_k {layout.seq_k}"
            )
        if not isinstance(chunks_per_rank, int) or chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank must be a positive integer, got {chunks_per_rank!r}")
        key = (world_size, chunks_per_rank)
        cached = _work_cache.setdefault(layout, {})
        if key not in cached:
            cached[key] = _balanced(layout, world_size, chunks_per_rank)
        return cached[key]

    # ---- positions -----------------------------------------------------------------------------------------
    def spans(self, rank: int) -> tuple[Span, ...]:
        """The runs of consecutive positions that ``rank`` holds (adjacent chunks merged), in shard order."""
        out: list[Span] = []
        for i, c in enumerate(self.ranks[rank]):
            start = c * self.chunk
            if out and out[-1].stop == start:
                out[-1] = Span(out[-1].start, start + self.chunk, out[-1].offset)
            else:
                out.append(Span(start, start + self.chunk, i * self.chunk))
        return tuple(out)

    def index(self) -> np.ndarray:
        """Global positions in shard order: ``x[..., index(), :]`` is every rank's shard, concatenated."""
        return np.concatenate(
            [np.arange(s.start, s.stop) for r in range(self.world_size) for s in self.spans(r)]
        )

    def work(self, layout: BlockLayout) -> np.ndarray:
        """Each rank's work under ``layout``: its query rows' visited blocks, over batch and heads."""
        return _chunk_work(layout, self.chunk)[np.array(self.ranks)].sum(axis=1)

    # ---- applying it -------------------------------------------------------------------------------------
    def shard(self, x, rank: int, dim: int = 2):
        """Rank ``rank``'s shard of the whole-sequence array ``x`` along ``dim`` (a view when it is one run).

        >>> import numpy as np
        >>> Ordering.zigzag(8, 2).shard(np.arange(8), 1, dim=0).tolist()
        [2, 3, 4, 5]
        """
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"x has {x.shape[dim]} positions along dim {dim}, expected {self.seq_len}")
        return _concat([_take(x, dim, s.start, s.stop) for s in self.spans(rank)], dim)

    def unshard(self, shards, dim: int = 2):
        """The whole-sequence array from every rank's shard (a list in rank order), positions restored.

        >>> import numpy as np
        >>> o = Ordering.zigzag(8, 2)
        >>> o.unshard([o.shard(np.arange(8), r, dim=0) for r in range(2)], dim=0).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
        """
        if len(shards) != self.world_size:
            raise ValueError(f"expected {self.world_size} shards (one per rank), got {len(shards)}")
        pieces = []
        for r, x in enumerate(shards):
            if x.shape[dim] != self.shard_len:
                raise ValueError(
                    f"rank {r}'s shard has {x.shape[dim]} positions along dim {dim}, "
                    f"expected {self.shard_len}"
                )
            for s in self.spans(r):
                pieces.append((s.start, _take(x, dim, s.offset, s.offset + s.stop - s.start)))
        return _concat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim)

    def __repr__(self) -> str:
        return f"Ordering({self.name}, seq_len={self.seq_len}, chunk={self.chunk}, ranks={self.ranks})"


def resolve(balance, seq_len: int, world_size: int, layout: BlockLayout) -> Ordering:
    """The ordering that ``balance`` names: None (contiguous), ``"zigzag"``, ``"work"`` or an `Ordering`."""
    if isinstance(balance, Ordering):
        if (balance.seq_len, balance.world_size) != (seq_len, world_size):
            raise ValueError(
                f"balance is an ordering of {balance.seq_len} positions over {balance.world_size} ranks, but "
                f"the sequence has {seq_len} positions over {world_size} ranks"
            )
        return balance
    if balance is None:
        return Ordering.contiguous(seq_len, world_size)
    if balance == "zigzag":
        return Ordering.zigzag(seq_len, world_size)
    if balance == "work":
        return Ordering.by_work(layout, world_size)
    raise ValueError(f"balance must be None, 'zigzag', 'work' or an Ordering, got {balance!r}")


# ---- helpers -----------------------------------------------------------------------------------------------
def _check_split(seq_len: int, world_size: int, n_chunks: int, name: str) -> None:
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1 or seq_len % n_chunks:
        raise ValueError(
            f"the {name} ordering cuts the sequence into {n_chunks} equal chunks ({world_size} ranks), "
            f"but the sequence has {seq_len} tokens, not a multiple of {n_chunks}"
        )


def _chunk_work(layout: BlockLayout, chunk: int) -> np.ndarray:
    """Visited blocks of each chunk's query rows, summed over batch and heads (float64)."""
    bq = layout.block_size[0]
    if chunk % bq:
        raise ValueError(f"chunks of {chunk} tokens are not a multiple of the layout's query block size {bq}")
    counts = np.count_nonzero(layout.blocks, axis=3).sum(axis=(0, 1)).astype(np.float64)
    return counts.reshape(-1, chunk // bq).sum(axis=1)


def _greedy(work: np.ndarray, world_size: int, per_rank: int) -> tuple[tuple[int, ...], ...]:
    """Longest-processing-time first: heaviest chunk to the least loaded rank with room (ties: lower rank)."""
    heap = [(0.0, r) for r in range(world_size)]
    held: list[list[int]] = [[] for _ in range(world_size)]
    for c in sorted(range(work.size), key=lambda i: (-work[i], i)):
        load, r = heapq.heappop(heap)
        held[r].append(c)
        if len(held[r]) < per_rank:
            heapq.heappush(heap, (load + work[c], r))
    return tuple(tuple(sorted(h)) for h in held)


def _balanced(layout: BlockLayout, world_size: int, per_rank: int) -> Ordering:
    seq = layout.seq_q
    _check_split(seq, world_size, world_size * per_rank, "work-balanced")
    chunk = seq // (world_size * per_rank)
    greedy = Ordering(seq, chunk, _greedy(_chunk_work(layout, chunk), world_size, per_rank), "work")
    base = Ordering.contiguous(seq, world_size)
    candidates = [greedy]
    if seq % (2 * world_size) == 0 and (seq // (2 * world_size)) % layout.block_size[0] == 0:
        candidates.insert(0, Ordering.zigzag(seq, world_size))
    busiest = base.work(layout).max()
    best = min(candidates, key=lambda o: o.work(layout).max())  # min keeps the first of equals: zigzag
    return best if best.work(layout).max() <= (1 - MIN_GAIN) * busiest else base


def _take(x, dim: int, start: int, stop: int):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _concat(parts: list, dim: int):
    if len(parts) == 1:
        return parts[0]
    module = type(parts[0]).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.cat(parts, dim=dim)
    if module == "cupy":
        import cupy

        return cupy.concatenate(parts, axis=dim)
    return np.concatenate(parts, axis=dim)
