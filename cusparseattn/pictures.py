"""Pictures of a layout: the text grid of ``str(layout)`` and the PNG of ``layout.save_png``, pooled to a
readable size, one grid per distinct (batch element, head) mask.
"""

from __future__ import annotations

import numpy as np

GLYPHS = ("\u00b7", "\u2588", "\u2592")  # codes: 0 empty, 1 full, 2 partial
MAX_PICTURES, MAX_PANELS = 8, 16
PNG_COLOURS = np.array([[236, 236, 236], [31, 96, 180], [245, 150, 40]], dtype=np.uint8)
PNG_LINE = np.array([255, 255, 255], dtype=np.uint8)
PNG_PAD, PNG_LABEL, PNG_HEADER, PNG_COLUMNS, PNG_MIN_WIDTH, PNG_MIN_PANEL = 10, 14, 40, 4, 300, 256


def distinct_grids(layout) -> list[list[tuple[int, int]]]:
    """The (batch, head) pairs grouped by identical blocks and partial flags, in order of first appearance."""
    nb, nh = layout.batch, layout.heads
    flat = np.concatenate([layout.blocks.reshape(nb * nh, -1), layout.partial.reshape(nb * nh, -1)], axis=1)
    groups: dict[bytes, list[tuple[int, int]]] = {}
    for i, row in enumerate(np.packbits(flat, axis=1)):  # one row per (batch, head), each hashed whole
        groups.setdefault(row.tobytes(), []).append(divmod(i, nh))
    return list(groups.values())


def _ranges(values: list[int]) -> str:
    parts, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None], strict=True):
        if cur != prev + 1 if cur is not None else True:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def describe(members: list[tuple[int, int]], n_batch: int, n_heads: int) -> str:
    bs, hs = sorted({b for b, _ in members}), sorted({h for _, h in members})
    if len(members) != len(bs) * len(hs):
        shown = ", ".join(f"({b}, {h})" for b, h in members[:8])
        return f"(batch, head) in {shown}{', ...' if len(members) > 8 else ''}"
    bdesc = "* (shared by all batch elements)" if n_batch == 1 else _ranges(bs)
    hdesc = "* (shared by all heads)" if n_heads == 1 else _ranges(hs)
    if n_heads > 1 and len(hs) == n_heads:
        hdesc += " (shared by all heads)"
    return f"batch {bdesc}, head {hdesc}"


def pool_step(num_blocks: tuple[int, int], max_side: int) -> int:
    return max(1, -(-max(num_blocks) // max_side))


def pooled_codes(blocks: np.ndarray, full: np.ndarray, step: int) -> np.ndarray:
    """Codes (0 empty, 1 full, 2 partial) of squares of ``step`` x ``step`` blocks: full if all are full,
    empty if none is set, partial otherwise."""
    if step == 1:
        return np.where(full, 1, np.where(blocks, 2, 0)).astype(np.uint8)
    nq, nk = blocks.shape
    rq, rk = -(-nq // step), -(-nk // step)
    pad = ((0, rq * step - nq), (0, rk * step - nk))
    any_set = np.pad(blocks, pad).reshape(rq, step, rk, step).any(axis=(1, 3))
    all_full = np.pad(full, pad, constant_values=True).reshape(rq, step, rk, step).all(axis=(1, 3))
    return np.where(all_full, 1, np.where(any_set, 2, 0)).astype(np.uint8)


def png_geometry(shapes: list[tuple[int, int]]) -> tuple[int, int, list[tuple[int, int]]]:
    """Image size and each panel's top-left corner: panels on a grid of at most 4 columns under a header."""
    ph, pw = max(s[0] for s in shapes), max(s[1] for s in shapes)
    cols = min(len(shapes), PNG_COLUMNS)
    rows = -(-len(shapes) // cols)
    cell_w, cell_h = pw + PNG_PAD, PNG_LABEL + ph + PNG_PAD
    spots = [
        (PNG_PAD + (i % cols) * cell_w, PNG_HEADER + (i // cols) * cell_h + PNG_LABEL)
        for i in range(len(shapes))
    ]
    return max(PNG_MIN_WIDTH, PNG_PAD + cols * cell_w), PNG_HEADER + rows * cell_h, spots


def png_title(layout, step: int) -> str:
    title = (
        f"seq {layout.seq_q}x{layout.seq_k}, block {layout.block_size[0]}x{layout.block_size[1]}, "
        f"{layout.num_blocks[0]}x{layout.num_blocks[1]} blocks, density {layout.density:.4f}"
    )
    return title + (f", 1 px = {step}x{step} blocks" if step > 1 else "")
