"""The tile plan (layout blocks -> kernel tiles), checked on the CPU by emulating the kernel's masking.

For every query tile, the kernel visits the key tiles of its CSR row (the backward's dK/dV pass: for every key
tile, the query tiles of its CSC column); a full tile attends whole (inside the
sequence), a partial one applies its sub-block bits, then the rule in partial cells (``expr``) or its bit mask
(``bits``). Emulating exactly that and comparing with ``layout.to_dense()`` proves the plan loses nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import BlockLayout, TokenRule, patterns, plan
from cusparseattn.mods import mask_rule


def visits(p: plan.TilePlan, line: int, by: str):
    """(query tile, key tile, partial index) of every tile the kernel visits for one layout (batch, head)."""
    if by == "rows":
        for tq in range(p.tiles_q):
            row = line * p.tiles_q + tq
            for tk, pidx in p.entries[p.row_ptr[row] : p.row_ptr[row + 1]]:
                yield tq, tk, pidx
    else:
        for tk in range(p.tiles_k):
            col = line * p.tiles_k + tk
            for tq, pidx in p.col_entries[p.col_ptr[col] : p.col_ptr[col + 1]]:
                yield tq, tk, pidx


def emulate(p: plan.TilePlan, layout: BlockLayout, b: int, h: int, by: str = "rows") -> np.ndarray:
    """The token mask [seq_q, seq_k] that the kernel computes from the plan for layout batch b, head h."""
    out = np.zeros((p.tiles_q * p.tile_m, p.tiles_k * p.tile_n), dtype=bool)
    rows = np.arange(p.tile_m)[:, None]
    cols = np.arange(p.tile_n)[None, :]
    bit = ((rows >> p.sub_q_shift) * p.sub_k_count + (cols >> p.sub_k_shift)).astype(np.uint64)
    seen = np.zeros((p.tiles_q, p.tiles_k), dtype=int)
    for tq, tk, pidx in visits(p, b * layout.heads + h, by):
        seen[tq, tk] += 1
        q, k = tq * p.tile_m + rows, tk * p.tile_n + cols
        if pidx < 0:
            tile = np.ones((p.tile_m, p.tile_n), dtype=bool)
        elif p.rule_mode == "bits":
            words = p.bit_mask[pidx].view(np.uint8)  # little-endian words of each row
            tile = np.unpackbits(words.reshape(p.tile_m, -1), axis=1, bitorder="little")[:, : p.tile_n] == 1
        else:
            set_bits, partial_bits = p.sub_bits[pidx]
            tile = ((set_bits >> bit) & np.uint64(1) == 1) & (k < layout.seq_k)
            if p.rule_mode == "expr":
                in_partial = (partial_bits >> bit) & np.uint64(1) == 1
                tile &= ~in_partial | layout.rule(b, h, q, k)
        out[q[:, 0:1].ravel()[:, None], k[0:1, :].ravel()[None, :]] = tile
    assert seen.max(initial=0) <= 1, "a tile is visited twice"
    return out[: layout.seq_q, : layout.seq_k]


def assert_plan_exact(layout: BlockLayout, tile_m: int, tile_n: int):
    p = plan.build(layout, tile_m, tile_n)
    dense = layout.to_dense()
    for b in range(layout.batch):
        for h in range(layout.heads):
            for by in ("rows", "cols"):
                got = emulate(p, layout, b, h, by)
                np.testing.assert_array_equal(got, dense[b, h], err_msg=f"b={b} h={h} by {by}")
    return p


TILES = [(192, 128), (128, 128), (128, 64), (64, 32), (64, 128), (32, 64)]  # forward, dQ and dK/dV tiles


@settings(max_examples=40, deadline=None)
@given(
    seq_q=st.integers(1, 300),
    seq_k=st.integers(1, 300),
    block=st.sampled_from([16, 32, 64, 128]),
    tiles=st.sampled_from(TILES),
    with_rule=st.sampled_from(["none", "bits", "expr"]),
    seed=st.integers(0, 2**31),
)
def test_random_layouts_survive_tiling(seq_q, seq_k, block, tiles, with_rule, seed):
    rng = np.random.default_rng(seed)
    nq, nk = -(-seq_q // block), -(-seq_k // block)
    blocks = rng.random((2, 2, nq, nk)) < 0.5
    if with_rule == "none":
        layout = BlockLayout(blocks, block_size=block, seq_q=seq_q, seq_k=seq_k)
    else:
        # A rule that is not True inside full blocks: the plan must apply it only in partial cells.
        def mod3(b, h, q, k):
            return (q + 2 * k + h) % 3 != 0

        rule = mask_rule(mod3) if with_rule == "expr" else TokenRule("mod3", mod3)
        partial = blocks & (rng.random(blocks.shape) < 0.5)
        layout = BlockLayout(blocks, block_size=block, seq_q=seq_q, seq_k=seq_k, partial=partial, rule=rule)
    if plan.tile_cells(*tiles, layout.block_size) > plan.MAX_CELLS:  # 192 x 128 over 16 x 16 blocks: 96
        with pytest.raises(ValueError, match="take smaller tiles"):
            plan.build(layout, *tiles)
        return
    p = assert_plan_exact(layout, *tiles)
    assert p.rule_mode == ("none" if with_rule == "none" or not layout.partial.any() else with_rule)
    # The row lengths that tilings are weighed by, without a plan: the plan's rows, and their partial tiles.
    assert (plan.visits(layout, *tiles) == np.diff(p.row_ptr).reshape(2, 2, p.tiles_q)).all()
    partial_so_far = np.concatenate([[0], np.cumsum(p.entries[:, 1] >= 0)])[p.row_ptr]
    weighed = np.diff(p.row_ptr) + 0.5 * np.diff(partial_so_far)
    assert (plan.visits(layout, *tiles, partial_cost=0.5) == weighed.reshape(2, 2, p.tiles_q)).all()


def test_patterns_survive_tiling():
    for pattern in (patterns.causal(block=32), patterns.local(window=70, block=16), patterns.dense(block=64)):
        assert_plan_exact(pattern.layout(333, 400), 128, 128)
    # A query tile across blocks (192 rows, blocks of 128): cells of 64 rows.
    for pattern in (patterns.causal(block=128), patterns.local(300, block=128), patterns.dense(block=64)):
        p = assert_plan_exact(pattern.layout(1000, 900), 192, 128)
        assert p.sub_q_shift == 6


def test_full_tiles_need_no_mask():
    """Dense 128-blocks on a 128-multiple length: every tile is full, so no tile pays for a mask."""
    p = plan.build(patterns.dense(block=128).layout(1024), 128, 64)
    assert p.nnz == 8 * 16 and (p.entries[:, 1] == -1).all()


def test_causal_has_one_partial_tile_per_row():
    p = plan.build(patterns.causal(block=128).layout(1024), 128, 128)
    assert np.count_nonzero(p.entries[:, 1] >= 0) == 8
    assert p.rule_mode == "expr"


def test_empty_layout_rows_have_no_entries():
    blocks = np.ones((4, 4), bool)
    blocks[2] = False
    p = plan.build(BlockLayout(blocks, block_size=64, seq_q=256), 64, 64)
    assert p.row_ptr[3] == p.row_ptr[2]
