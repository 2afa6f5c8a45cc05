"""From a layout's blocks to the kernel's tiles: which key tiles each query tile visits, and how to mask them.

The layout's block size is the user's unit of sparsity; the kernel's tile is its own. A tile is visited when
any layout block inside it is set, runs with no mask when every block inside it is full and it ends before the
sequence does, and is *partial* otherwise. A partial tile carries:

- ``sub_bits``: two words of one bit per layout block inside the tile (row-major): where the block is set,
  and where it is partial (the rule decides only there);
- in ``bits`` mode (a rule with no C expression), the token mask of the whole tile, one bit per pair.

Everything here is vectorised NumPy over tiles, computed once per (layout, tile shape, device) by
`cusparseattn.cuda`, which caches the uploaded result for as long as the layout lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .layout import BlockLayout

MAX_BITS_TILES = 1 << 20  # partial tiles evaluated per chunk in bits mode (memory: chunk * TILE_M * TILE_N)


@dataclass(frozen=True)
class TilePlan:
    tile_m: int
    tile_n: int
    tiles_q: int
    tiles_k: int
    rule_mode: str  # "none", "expr" or "bits"
    row_ptr: np.ndarray  # int32 [batch * heads * tiles_q + 1]
    entries: np.ndarray  # int32 [nnz, 2]: key tile, partial index or -1
    col_ptr: np.ndarray  # int32 [batch * heads * tiles_k + 1]: the same tiles by key tile (dK/dV pass)
    col_entries: np.ndarray  # int32 [nnz, 2]: query tile, partial index or -1
    sub_bits: np.ndarray  # uint64 [n_partial, 2]: set cells, partial cells
    bit_mask: np.ndarray  # uint64 [n_partial, tile_m, words] (bits mode) or [0]
    sub_q_shift: int
    sub_k_shift: int
    sub_k_count: int

    @property
    def nnz(self) -> int:
        return int(self.entries.shape[0])


def rule_mode(layout: BlockLayout) -> str:
    if layout.rule is None or not layout.partial.any():
        return "none"
    return "expr" if layout.rule.c_expr is not None else "bits"


def elementwise_rule(layout: BlockLayout) -> bool:
    """Whether the kernels evaluate the layout's rule at each element of a partial tile: a rule they take as
    an expression (`rule_mode` "expr") that is no band of keys (`analyses.KernelRule.key_band`)."""
    return rule_mode(layout) == "expr" and layout.rule.kernel.key_band is None


def kernel_rule(layout: BlockLayout) -> tuple:
    """(rule mode, the rule's `analyses.KernelRule` where the kernels evaluate it, else None)."""
    mode = rule_mode(layout)
    return mode, layout.rule.kernel if mode == "expr" else None


def _fine(mask: np.ndarray, rep_q: int, rep_k: int, rows: int, cols: int) -> np.ndarray:
    """Blocks repeated onto a grid of cells no larger than a tile, cut to `rows` x `cols` cells."""
    return mask.repeat(rep_q, axis=2).repeat(rep_k, axis=3)[:, :, :rows, :cols]


# A partial tile's cells are bits of one word (sub_bits).
MAX_CELLS = 64


def tile_cells(tile_m: int, tile_n: int, block_size: tuple[int, int]) -> int:
    """How many cells a tile has: the largest units inside which nothing changes, in tiles and blocks."""
    return tile_m // math.gcd(block_size[0], tile_m) * (tile_n // math.gcd(block_size[1], tile_n))


@dataclass(frozen=True)
class _Grid:
    """A layout's cells (the largest units inside which nothing changes, in tiles and blocks) and tiles."""

    layout: BlockLayout
    tile_m: int
    tile_n: int

    def __post_init__(self):
        bq, bk = self.layout.block_size
        if tile_cells(self.tile_m, self.tile_n, self.layout.block_size) > MAX_CELLS:
            raise ValueError(
                f"tiles of {self.tile_m} x {self.tile_n} hold more than {MAX_CELLS} cells of {bq} x {bk} "
                "blocks: take smaller tiles"
            )

    @property
    def cell(self) -> tuple[int, int]:
        bq, bk = self.layout.block_size
        return math.gcd(bq, self.tile_m), math.gcd(bk, self.tile_n)

    @property
    def rows(self) -> int:
        return -(-self.layout.seq_q // self.cell[0])

    @property
    def tiles(self) -> tuple[int, int]:
        return -(-self.layout.seq_q // self.tile_m), -(-self.layout.seq_k // self.tile_n)

    @property
    def per_tile(self) -> tuple[int, int]:
        return self.tile_m // self.cell[0], self.tile_n // self.cell[1]

    def cells(self, mask: np.ndarray) -> np.ndarray:
        """A [B, H, blocks_q, blocks_k] mask of the layout's blocks on the cells."""
        (bq, bk), (cq, ck) = self.layout.block_size, self.cell
        return _fine(mask, bq // cq, bk // ck, self.rows, -(-self.layout.seq_k // ck))

    def full_tiles(self) -> np.ndarray:
        """[B, H, tiles_q, tiles_k]: the tiles that need no mask (every cell full, inside the keys)."""
        (tiles_q, tiles_k), (per_q, _) = self.tiles, self.per_tile
        # Rows past the sequence's end don't matter (nothing is written for them), so they pad as full.
        row_pad = np.arange(tiles_q * per_q).reshape(tiles_q, per_q) >= self.rows
        full = _every_cell(self.tiled(self.cells(self.layout.full)) | row_pad[None, None, :, :, None, None])
        return full & ((np.arange(tiles_k) + 1) * self.tile_n <= self.layout.seq_k)  # ends before the keys do

    def tiled(self, cells: np.ndarray) -> np.ndarray:
        """Cells as [B, H, tiles_q, per_q, tiles_k, per_k] (padded with False)."""
        nb, nh, rows, cols = cells.shape
        (tiles_q, tiles_k), (per_q, per_k) = self.tiles, self.per_tile
        out = np.zeros((nb, nh, tiles_q * per_q, tiles_k * per_k), cells.dtype)
        out[:, :, :rows, :cols] = cells
        return out.reshape(nb, nh, tiles_q, per_q, tiles_k, per_k)


def _any_cell(tiled: np.ndarray) -> np.ndarray:
    """[B, H, tiles_q, tiles_k] of `_Grid.tiled` cells: whether any cell of each tile is set. A tile's cells
    (MAX_CELLS at most) one slice at a time: NumPy reduces such small axes of this shape several times
    slower."""
    return _fold(np.logical_or, tiled)


def _every_cell(tiled: np.ndarray) -> np.ndarray:
    """Whether every cell of each tile is set (`_any_cell`)."""
    return _fold(np.logical_and, tiled)


def _fold(op, tiled: np.ndarray) -> np.ndarray:
    out = tiled[:, :, :, 0, :, 0].copy()
    for i, j in np.ndindex(tiled.shape[3], tiled.shape[5]):
        if i or j:
            op(out, tiled[:, :, :, i, :, j], out=out)
    return out


def visits(layout: BlockLayout, tile_m: int, tile_n: int, partial_cost: float = 0) -> np.ndarray:
    """How many key tiles each query tile visits: [layout batch, layout heads, tiles_q] (a row of `build`'s
    plan), for weighing tilings against each other without building their plans; a partial tile (masked)
    counts 1 + `partial_cost`."""
    grid = _Grid(layout, tile_m, tile_n)
    visited = _any_cell(grid.tiled(grid.cells(layout.blocks)))
    counts = np.count_nonzero(visited, axis=3)
    if not partial_cost:
        return counts
    return counts + partial_cost * np.count_nonzero(visited & ~grid.full_tiles(), axis=3)


def build(layout: BlockLayout, tile_m: int, tile_n: int) -> TilePlan:
    grid = _Grid(layout, tile_m, tile_n)
    (cq, ck), (tiles_q, tiles_k), (per_q, per_k) = grid.cell, grid.tiles, grid.per_tile

    set_cells = grid.cells(layout.blocks)
    partial_cells = set_cells & ~grid.cells(layout.full)
    visited = _any_cell(grid.tiled(set_cells))
    full_tile = grid.full_tiles()

    counts = np.count_nonzero(visited, axis=3).reshape(-1)
    row_ptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=row_ptr[1:])
    b_i, h_i, tq_i, tk_i = np.nonzero(visited)
    partial = ~full_tile[b_i, h_i, tq_i, tk_i]
    pidx = np.full(b_i.size, -1, dtype=np.int64)
    pidx[partial] = np.arange(np.count_nonzero(partial))

    # Which cells of each partial tile are set, and which are partial, as bits (row-major inside the tile).
    weights = np.left_shift(np.uint64(1), np.arange(per_q * per_k, dtype=np.uint64))
    sub_bits = np.zeros((np.count_nonzero(partial), 2), dtype=np.uint64)
    for word, cell_mask in enumerate((set_cells, partial_cells)):
        cells = grid.tiled(cell_mask)
        sel = cells[b_i[partial], h_i[partial], tq_i[partial], :, tk_i[partial], :].reshape(-1, per_q * per_k)
        sub_bits[:, word] = (sel.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)

    # The transpose, for passes that walk the key tiles' columns: same tiles, same partial indices.
    order = np.lexsort((tq_i, tk_i, h_i, b_i))
    col_counts = np.count_nonzero(visited, axis=2).reshape(-1)
    col_ptr = np.zeros(col_counts.size + 1, dtype=np.int64)
    np.cumsum(col_counts, out=col_ptr[1:])

    mode = rule_mode(layout)
    bit_mask = np.zeros(1, dtype=np.uint64)
    if mode == "bits":
        bit_mask = _bit_masks(
            layout, b_i[partial], h_i[partial], tq_i[partial], tk_i[partial], tile_m, tile_n
        )

    return TilePlan(
        tile_m=tile_m,
        tile_n=tile_n,
        tiles_q=tiles_q,
        tiles_k=tiles_k,
        rule_mode=mode,
        row_ptr=row_ptr.astype(np.int32),
        entries=np.stack([tk_i, pidx], axis=1).astype(np.int32),
        col_ptr=col_ptr.astype(np.int32),
        col_entries=np.stack([tq_i[order], pidx[order]], axis=1).astype(np.int32),
        sub_bits=sub_bits if sub_bits.size else np.zeros((1, 2), dtype=np.uint64),
        bit_mask=bit_mask,
        sub_q_shift=int(cq).bit_length() - 1,
        sub_k_shift=int(ck).bit_length() - 1,
        sub_k_count=per_k,
    )


def _bit_masks(layout, b, h, tq, tk, tile_m, tile_n) -> np.ndarray:
    """The layout's token mask over each partial tile, packed little-endian into 64-bit words per row."""
    words = -(-tile_n // 64)
    out = np.zeros((b.size, tile_m, words), dtype=np.uint64)
    r = np.arange(tile_m)[None, :, None]
    c = np.arange(words * 64)[None, None, :]
    step = max(1, MAX_BITS_TILES // (tile_m * tile_n))
    for s in range(0, b.size, step):
        sl = slice(s, s + step)
        q = tq[sl, None, None] * tile_m + r
        k = tk[sl, None, None] * tile_n + c
        # The layout's head index: batch/head index 0 of a shared layout stands for all of them.
        mask = layout.token_mask(b[sl, None, None], h[sl, None, None], q, k) & (c < tile_n)
        packed = np.packbits(mask, axis=2, bitorder="little")  # [n, tile_m, words * 8] bytes
        out[sl] = packed.view(np.uint64).reshape(-1, tile_m, words)
    return out
