"""Block-level patterns from DeepSpeed (`deepspeed_fixed`, `bigbird`, `longformer`, `variable`) and OpenAI
(`fixed`), defined on blocks of self-attention; `cusparseattn.patterns` names them with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import pattern as base
from .layout import BlockLayout
from .mods import mask_rule
from .pattern import Pattern
from .traced import CapturedArray


def _block_pattern(name: str, block, make: Callable[[int], np.ndarray]) -> Pattern:
    """A pattern defined on the blocks of self-attention: ``make(num_blocks) -> bool [H, nb, nb]``."""
    bb = base.square_block(block)

    def build(sq, sk):
        base.self_attention(name.split("(")[0], sq, sk)
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
    return base.positive("num_heads", num_heads) if different_layout_per_head else 1


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
        base.positive("stride", stride),
        base.positive("num_verts", num_verts),
        base.positive("vertsize", vertsize),
    )
    if st % vs:
        raise ValueError(f"stride ({st}) must be a multiple of vertsize ({vs})")
    if nv > st // vs:
        raise ValueError(f"num_verts ({nv}) must be at most stride // vertsize = {st // vs}")
    heads = 1 if nv == 1 else (nv if num_heads is None else base.positive("num_heads", num_heads))
    if heads % nv:
        raise ValueError(f"num_heads ({heads}) must be a multiple of num_verts ({nv})")
    bb = base.square_block(block)

    def build(sq, sk):
        base.self_attention("fixed", sq, sk)
        i, j = _block_index(-(-sq // bb))
        r = (np.arange(heads) % nv)[:, None, None]
        verts = (j % st >= st - (r + 1) * vs) & (j % st < st - r * vs)
        blocks = (verts | (i // st == j // st)) & (j <= i)
        rule = mask_rule(lambda b, h, q, k: k <= q, name="causal")
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
        base.positive("num_local_blocks", num_local_blocks),
        base.positive("num_global_blocks", num_global_blocks),
    )
    uni = base.attention_kind(attention)
    npat = base.positive("num_different_global_patterns", num_different_global_patterns)
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
    nr = base.positive("num_random_blocks", num_random_blocks, 0)
    nsw = base.positive("num_sliding_window_blocks", num_sliding_window_blocks)
    ng = base.positive("num_global_blocks", num_global_blocks, 0)
    uni = base.attention_kind(attention)
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
    starts = [base.positive("global_block_indices entry", s, 0) for s in starts]
    if ends is None:
        return [(s, s + 1) for s in starts]
    ends = [base.positive("global_block_end_indices entry", e, 0) for e in ends]
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
    nsw = base.positive("num_sliding_window_blocks", num_sliding_window_blocks)
    ranges = _global_ranges(global_block_indices, global_block_end_indices)
    tokens = np.asarray(
        [base.positive("global_tokens entry", t, 0) for t in (global_tokens or ())], dtype=np.int64
    )
    uni = base.attention_kind(attention)
    bb = base.square_block(block)
    w = nsw // 2

    def build(sq, sk):
        base.self_attention("longformer", sq, sk)
        nb = -(-sq // bb)
        if nb < nsw:
            raise ValueError(f"num_sliding_window_blocks ({nsw}) must be at most the number of blocks ({nb})")
        flags = np.zeros(nb * bb, dtype=np.int32)
        for s, e in ranges:  # a handful of ranges
            flags[s * bb : min(e, nb) * bb] = 1
        flags[tokens[tokens < sq]] = 1
        flags = np.ascontiguousarray(flags[:sq])
        counts = np.add.reduceat(flags, np.arange(0, sq, bb))
        table = CapturedArray(flags)  # looked up clamped, on NumPy, torch or traced indices alike
        sizes = np.minimum(bb, sq - np.arange(0, sq, bb))
        i, j = _block_index(nb)
        window = np.abs(i - j) <= w
        any_ = window | (counts > 0)[:, None] | (counts > 0)[None, :]
        all_ = window | (counts == sizes)[:, None] | (counts == sizes)[None, :]
        if uni:
            any_, all_ = any_ & (j <= i), all_ & (j <= i)

        def fn(b, h, q, k):
            qb, kb = q // bb, k // bb
            out = ((qb - kb <= w) & (kb - qb <= w)) | (table[q] != 0) | (table[k] != 0)
            return out & (kb <= qb) if uni else out

        rule = mask_rule(fn, name=f"longformer({nsw})", block_size=(bb, bb))
        return base.classified(any_, all_, rule, (bb, bb), sq, sk, exact=True)

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
    nr = base.positive("num_random_blocks", num_random_blocks, 0)
    sizes = [base.positive("local_window_blocks entry", n) for n in local_window_blocks]
    if not sizes:
        raise ValueError("local_window_blocks needs at least one window size")
    ranges = _global_ranges(global_block_indices, global_block_end_indices)
    uni = base.attention_kind(attention)
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
