"""The communication and compute schedule of ring attention, derived from the layout alone.

Ranks hold their shards in an `Ordering`. Step ``t`` pairs every rank ``r`` with the keys and values of rank
``(r - t) % N`` (step 0: its own). For each pair the schedule knows, from the layout's blocks:

- the *windows*: one kernel call per (run of local queries, run of visiting keys) whose rectangle of the
  layout holds a visited block, trimmed to the rows and columns that do (empty rectangles are never called);
- the *pieces*: the runs of the source's shard that those windows read, the only K/V rows sent (per run of
  the source's shard, the span from the first to the last key block any window reads).

A pair with no window exchanges nothing, and a step where no pair has a window is dropped: a sliding window
over contiguous shards keeps one step, neighbour to neighbour, and sends only the keys the window reaches.
Every rank computes the same schedule, so sends and receives match without negotiation. The backward runs
the same steps and sends the gradients of the pieces home the way they came.

>>> from cusparseattn import patterns
>>> from cusparseattn.distributed.balance import Ordering
>>> lay = patterns.local(window=32, block=16).layout(256)
>>> s = build(lay, Ordering.contiguous(256, 4))
>>> [step.shift for step in s.steps], s.steps[1].pieces[1]
([0, 1], (Piece(offset=32, start=32, length=32),))
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..layout import BlockLayout
from .balance import Ordering

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Piece(NamedTuple):
    """Rows ``[offset, offset + length)`` of the source's shard (global positions from ``start`` on)."""

    offset: int
    start: int
    length: int


class Window(NamedTuple):
    """One kernel call: local query rows ``[q_offset, q_offset + q_len)`` (global from ``q_start``) against
    rows ``[k_offset, k_offset + k_len)`` of the visiting shard (global from ``k_start``)."""

    q_offset: int
    q_start: int
    q_len: int
    k_offset: int
    k_start: int
    k_len: int


@dataclass(frozen=True)
class Step:
    """Rank ``r`` computes ``windows[r]`` with the K/V of rank ``(r - shift) % N`` and receives ``pieces[r]``
    of it (nothing at shift 0: the shard is its own)."""

    shift: int
    windows: tuple[tuple[Window, ...], ...]
    pieces: tuple[tuple[Piece, ...], ...]

    def source(self, rank: int) -> int:
        """Whose K/V ``rank`` computes with at this step."""
        return (rank - self.shift) % len(self.windows)

    def target(self, rank: int) -> int:
        """Who computes with ``rank``'s K/V at this step (and receives its pieces)."""
        return (rank + self.shift) % len(self.windows)


@dataclass(frozen=True)
class Schedule:
    """The steps of one (layout, ordering) pair, for every rank; see the module's docstring."""

    ordering: Ordering
    steps: tuple[Step, ...]

    @property
    def world_size(self) -> int:
        return self.ordering.world_size

    def transfers(self) -> list[tuple[int, int, int, int]]:
        """Every K/V transfer as ``(shift, src, dst, tokens)``: what a forward pass sends."""
        n = self.world_size
        return [
            (s.shift, (dst - s.shift) % n, dst, sum(p.length for p in s.pieces[dst]))
            for s in self.steps
            for dst in range(n)
            if s.shift and s.pieces[dst]
        ]

    def calls(self, rank: int) -> int:
        """Kernel calls of ``rank`` in one forward pass (one per window)."""
        return sum(len(s.windows[rank]) for s in self.steps)


def build(layout: BlockLayout, ordering: Ordering) -> Schedule:
    """The schedule of ``layout`` (the whole sequence's) over the shards of ``ordering``; cached per pair."""
    per_layout = _cache.setdefault(layout, {})
    if ordering not in per_layout:
        per_layout[ordering] = _build(layout, ordering)
    return per_layout[ordering]


def _build(layout: BlockLayout, ordering: Ordering) -> Schedule:
    n, (bq, bk) = ordering.world_size, layout.block_size
    if (layout.seq_q, layout.seq_k) != (ordering.seq_len, ordering.seq_len):
        raise ValueError(
            f"the layout has seq_q {layout.seq_q} and seq_k {layout.seq_k}, but the shards hold a sequence "
            f"of {ordering.seq_len} tokens"
        )
    for axis, block in (("query", bq), ("key", bk)):
        if ordering.chunk % block:
            raise ValueError(
                f"each rank holds chunks of {ordering.chunk} tokens ({ordering.name} ordering of "
                f"{ordering.seq_len} tokens over {n} ranks), not a multiple of the layout's {axis} block "
                f"size {block}; choose a sequence length, world size or block size that divides evenly"
            )
    touched = layout.blocks.any(axis=(0, 1))  # [nQ, nK]: visited by some batch element or head
    spans = [ordering.spans(r) for r in range(n)]
    steps = []
    for shift in range(n):
        windows, pieces = [], []
        for dst in range(n):
            w, p = _pair(touched, spans[dst], spans[(dst - shift) % n], bq, bk)
            windows.append(w)
            pieces.append(p if shift else ())
        if any(windows):
            steps.append(Step(shift, tuple(windows), tuple(pieces)))
    return Schedule(ordering, tuple(steps))


def _hull(mask: np.ndarray) -> tuple[int, int]:
    where = np.flatnonzero(mask)
    return int(where[0]), int(where[-1]) + 1


def _pair(touched, q_spans, k_spans, bq: int, bk: int):
    """Windows and pieces of one rank's queries against one source's keys."""
    windows, pieces = [], []
    for ks in k_spans:
        kb = slice(ks.start // bk, ks.stop // bk)
        found = []
        for qs in q_spans:
            sub = touched[qs.start // bq : qs.stop // bq, kb]
            if not sub.any():
                continue
            (r0, r1), (c0, c1) = _hull(sub.any(axis=1)), _hull(sub.any(axis=0))
            q0, k0 = qs.start + r0 * bq, ks.start + c0 * bk
            q_len, k_len = (r1 - r0) * bq, (c1 - c0) * bk
            found.append(Window(qs.offset + q0 - qs.start, q0, q_len, ks.offset + k0 - ks.start, k0, k_len))
        if found:
            start = min(w.k_start for w in found)
            stop = max(w.k_start + w.k_len for w in found)
            pieces.append(Piece(ks.offset + start - ks.start, start, stop - start))
            windows.extend(found)
    return tuple(windows), tuple(pieces)
