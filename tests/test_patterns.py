"""Patterns against their token-level definitions, written here independently of cusparseattn.patterns.

Every pattern's ``layout(...).to_dense()`` must equal the definition (a dense NumPy mask at small sizes, with
lengths that are not multiples of the block and ``seq_q != seq_k``), and its block classification must be
sound: full blocks are all True, every block holding a True is set. Token-level patterns classify exactly (a
block is set iff some pair attends, full iff every pair does). DeepSpeed and OpenAI patterns are compared with
literal ports of the original loops and with small layouts written out by hand. Rules' C expressions are
compiled with the C compiler when there is one and compared with the NumPy rules.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cusparseattn import block_patterns, patterns
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule

BLOCKS = st.sampled_from([16, 32, 64])
LENGTHS = st.integers(1, 300)


# ---- helpers -----------------------------------------------------------------------------------------------
def block_truth(mask: np.ndarray, bq: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of a token mask [..., sq, sk]: does some pair attend, does every pair attend."""
    *lead, sq, sk = mask.shape
    nq, nk = -(-sq // bq), -(-sk // bk)
    pad = [(0, 0)] * len(lead) + [(0, nq * bq - sq), (0, nk * bk - sk)]
    valid = np.pad(np.ones((sq, sk), bool), pad[-2:])
    shape = (*lead, nq, bq, nk, bk)
    some = np.pad(mask, pad).reshape(shape).any(axis=(-3, -1))
    every = (np.pad(mask, pad) | ~valid).reshape(shape).all(axis=(-3, -1))
    return some, every


def check(lay: BlockLayout, expected: np.ndarray, *, exact: bool = True, block_level: bool = False) -> None:
    """The layout's token mask equals ``expected`` and its classification is sound (exact if asked)."""
    dense = lay.to_dense()
    expected = np.broadcast_to(expected, dense.shape)
    assert np.array_equal(dense, expected), f"{lay}: token mask differs from the definition"
    some, every = block_truth(expected, *lay.block_size)
    blocks, full = np.broadcast_to(lay.blocks, some.shape), np.broadcast_to(lay.full, some.shape)
    assert not (full & ~every).any(), "a full block holds a pair that does not attend"
    assert not (some & ~blocks).any(), "a block holding an attending pair is not set"
    if not block_level:
        assert not (blocks & ~some).any(), "a set block has no attending pair"
    if exact:
        assert np.array_equal(blocks, some) and np.array_equal(full, every & some)


def tokens(sq: int, sk: int):
    return np.arange(sq)[:, None], np.arange(sk)[None, :]


def expand(blocks: np.ndarray, block: int, seq: int) -> np.ndarray:
    """Block mask [..., nb, nb] to token mask [..., seq, seq]."""
    return blocks.repeat(block, axis=-2).repeat(block, axis=-1)[..., :seq, :seq].astype(bool)


def run_c(rule: TokenRule, batch: int, heads: int, sq: int, sk: int, tmp_path, expr=None) -> np.ndarray:
    """Evaluate ``rule.c_expr`` (or `expr`, over the rule's parameters) with the C compiler over every
    in-range (b, h, q, k)."""
    lines = ["#include <stdbool.h>", "#include <stdio.h>", "typedef long long RuleInt;"]
    lines += ["#define min(a, b) ((a) < (b) ? (a) : (b))", "#define max(a, b) ((a) > (b) ? (a) : (b))"]
    lines += [f"#define P{i} ({int(v)}LL)" for i, v in enumerate(rule.params)]
    for i, arr in enumerate(rule.arrays):
        lines.append(f"static const int A{i}[{arr.size}] = {{{', '.join(map(str, arr.tolist()))}}};")
    lines += [
        "int main(void) {",
        f"  for (long long b = 0; b < {batch}; b++) for (long long h = 0; h < {heads}; h++)",
        f"  for (long long q = 0; q < {sq}; q++) for (long long k = 0; k < {sk}; k++)",
        f"    putchar(({expr or rule.c_expr}) ? '1' : '0');",
        "  return 0;",
        "}",
    ]
    src, exe = tmp_path / "rule.c", tmp_path / "rule"
    src.write_text("\n".join(lines))
    subprocess.run([CC, "-std=c99", "-O0", "-o", str(exe), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True).stdout
    return (np.frombuffer(out, dtype=np.uint8) == ord("1")).reshape(batch, heads, sq, sk)


CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc) to evaluate the rules' C expressions")


# ---- token-level patterns ----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, bq=BLOCKS, bk=BLOCKS)
def test_causal_dense(sq, sk, bq, bk):
    q, k = tokens(sq, sk)
    check(patterns.causal(block=(bq, bk)).layout(sq, sk), k <= q + (sk - sq))
    check(patterns.dense(block=(bq, bk)).layout(sq, sk), np.ones((sq, sk), bool))


@settings(max_examples=60, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, block=BLOCKS, window=st.integers(1, 200), causal=st.booleans())
def test_local(sq, sk, block, window, causal):
    q, k = tokens(sq, sk)
    if causal:
        d = q + (sk - sq) - k
        expected = (d >= 0) & (d < window)
    else:
        expected = np.abs(q - k) < window
    check(patterns.local(window, causal, block=block).layout(sq, sk), expected)


@settings(max_examples=60, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, block=BLOCKS, window=st.integers(1, 150), sinks=st.integers(0, 80))
def test_streaming(sq, sk, block, window, sinks):
    q, k = tokens(sq, sk)
    d = q + (sk - sq) - k
    check(
        patterns.streaming(window, sinks, block=block).layout(sq, sk), (d >= 0) & ((k < sinks) | (d < window))
    )


def openai_strided_mask(n: int, stride: int) -> np.ndarray:
    """OpenAI sparse_attention's get_attn_mask(n, 'strided', stride), in NumPy."""
    x = np.arange(n).reshape(n, 1)
    z = np.zeros((n, n), dtype=np.int64)
    q, k = z + x, z + x.T
    return (q >= k) & (np.mod(q - k, stride) == 0)


@settings(max_examples=60, deadline=None)
@given(n=LENGTHS, block=BLOCKS, stride=st.integers(1, 40))
def test_strided_is_openai_get_attn_mask(n, block, stride):
    check(patterns.strided(stride, block=block).layout(n), openai_strided_mask(n, stride))


@settings(max_examples=60, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, block=BLOCKS, stride=st.integers(1, 40), window=st.none() | st.integers(1, 90))
def test_strided_lengths_and_local(sq, sk, block, stride, window):
    q, k = tokens(sq, sk)
    d = q + (sk - sq) - k
    expected = (d >= 0) & ((d % stride == 0) | ((d < window) if window else False))
    check(patterns.strided(stride, local=window, block=block).layout(sq, sk), expected)


@settings(max_examples=60, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, block=BLOCKS, stride=st.integers(1, 6))
def test_strided_blocks(sq, sk, block, stride):
    q, k = tokens(sq, sk)
    a = q + (sk - sq)
    expected = (a >= k) & ((a // block - k // block < stride) | (k // block % stride == stride - 1))
    check(patterns.strided_blocks(stride, block=block).layout(sq, sk), expected)


def test_strided8_benchmark_layout():
    """ANCHORS' strided8 at S = 4096: density 0.249 of the 128 x 128 blocks."""
    lay = patterns.strided_blocks(8, block=128).layout(4096)
    assert round(lay.density, 3) == 0.249
    assert np.array_equal(lay.partial[0, 0], np.eye(32, dtype=bool))


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(1, 90), min_size=1, max_size=6), min_size=1, max_size=3),
    block=BLOCKS,
    causal=st.booleans(),
)
def test_document(docs, block, causal):
    total = max(sum(d) for d in docs)
    ids = np.stack(
        [np.pad(np.repeat(np.arange(len(d)), d), (0, total - sum(d)), constant_values=len(d)) for d in docs]
    )
    q, k = tokens(total, total)
    expected = ids[:, None, :, None] == ids[:, None, None, :]
    if causal:
        expected &= k <= q
    by_lengths = patterns.document(seq_lens=docs, causal=causal, block=block).layout(total)
    check(by_lengths, expected)
    by_ids = patterns.document(ids * 3 + 7, causal=causal, block=block).layout(total)
    assert by_ids.batch == len(docs) and by_ids == by_lengths


def test_document_errors():
    with pytest.raises(ValueError, match="non-decreasing"):
        patterns.document([0, 0, 1, 0])
    with pytest.raises(ValueError, match="exactly one"):
        patterns.document()
    with pytest.raises(ValueError, match="64 tokens"):
        patterns.document(seq_lens=[32, 32]).layout(128)


# ---- OpenAI's fixed ----------------------------------------------------------------------------------------
def openai_fixed_layout(nb: int, n_heads: int, stride: int, num_verts: int, vertsize: int) -> np.ndarray:
    """The 'fixed' branch of OpenAI sparse_attention's get_blocksparse_obj, ported line by line."""
    indices = np.array(list(range(stride - 1, -1, -1))).reshape([-1, vertsize])
    if num_verts == 1:
        layout = np.zeros([nb, nb], dtype=bool)
        for idx in indices[0]:
            layout[:, idx::stride] = 1
        for q_idx in range(nb):
            row = q_idx // stride
            layout[q_idx, row * stride : (row + 1) * stride] = 1
            layout[q_idx, q_idx + 1 :] = 0
        return layout[None]
    layouts = []
    indices = indices[:num_verts]
    for h in range(n_heads):
        layout = np.zeros([nb, nb], dtype=bool)
        for idx in indices[h % num_verts]:
            layout[:, idx::stride] = 1
        for q_idx in range(nb):
            row = q_idx // stride
            layout[q_idx, row * stride : (row + 1) * stride] = 1
            layout[q_idx, q_idx + 1 :] = 0
        layouts.append(layout)
    return np.array(layouts)


@settings(max_examples=40, deadline=None)
@given(
    nb=st.integers(1, 12),
    vertsize=st.integers(1, 3),
    per=st.integers(1, 3),
    num_verts=st.integers(1, 3),
    copies=st.integers(1, 2),
    block=st.sampled_from([16, 32]),
)
def test_fixed_is_openai(nb, vertsize, per, num_verts, copies, block):
    stride = vertsize * max(per, num_verts)
    heads = num_verts * copies
    blocks = openai_fixed_layout(nb, heads, stride, num_verts, vertsize)
    seq = nb * block
    q, k = tokens(seq, seq)
    # The original callback: causal token by token inside the diagonal blocks, everything in the others.
    expected = expand(blocks, block, seq) & ((q // block != k // block) | (k <= q))
    lay = patterns.fixed(stride, num_verts, vertsize, num_heads=heads, block=block).layout(seq)
    check(lay, expected, exact=False)
    assert lay.heads == blocks.shape[0]
    assert np.array_equal(lay.partial[0], np.broadcast_to(np.eye(nb, dtype=bool), lay.partial[0].shape))


def test_fixed_by_hand():
    lay = patterns.fixed(2, block=16).layout(64)
    expected = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert np.array_equal(lay.blocks[0, 0], np.array(expected, bool))
    lay = patterns.fixed(4, num_verts=2, vertsize=2, num_heads=2, block=16).layout(128)
    head1 = lay.blocks[0, 1, 4:, :]  # second window's rows: head 1 summarises with blocks 0, 1 of each window
    assert np.array_equal(head1[:, :4], np.array([[1, 1, 0, 0]] * 4, bool))


def test_fixed_errors():
    with pytest.raises(ValueError, match="multiple of vertsize"):
        patterns.fixed(3, vertsize=2)
    with pytest.raises(ValueError, match="num_verts"):
        patterns.fixed(2, num_verts=3)
    with pytest.raises(ValueError, match="multiple of num_verts"):
        patterns.fixed(4, num_verts=2, num_heads=3)
    with pytest.raises(ValueError, match="self-attention"):
        patterns.fixed(2, block=16).layout(64, 32)


# ---- DeepSpeed ---------------------------------------------------------------------------------------------
def ds_fixed(nb, heads, loc, glob, attention, horizontal, npat, different):
    """DeepSpeed FixedSparsityConfig.make_layout, ported to NumPy."""
    layout = np.zeros((heads, nb, nb), dtype=np.int64)
    for h in range(heads if different else 1):
        for i in range(0, nb, loc):
            end = min(i + loc, nb)
            for row in range(i, end):
                for col in range(i, (row + 1 if attention == "unidirectional" else end)):
                    layout[h, row, col] = 1
        first = loc - (1 + h % npat) * glob
        end = nb - (nb % loc)
        for i in range(first, end, loc):
            first_row = 0 if attention == "bidirectional" else i
            layout[h, first_row:, i : i + glob] = 1
            if horizontal:
                layout[h, i : i + glob, :] = 1
        if end < nb:
            start = min(end + first, nb - glob)
            end = start + glob
            first_row = 0 if attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
            if horizontal:
                layout[h, start:end, :] = 1
    if not different:
        layout[1:] = layout[0]
    return layout.astype(bool)


def ds_sliding(layout, h, nsw):
    nb = layout.shape[1]
    w = nsw // 2
    for row in range(nb):
        layout[h, row, max(0, row - w) : min(row + w + 1, nb)] = 1


def ds_bigbird_no_random(nb, nsw, ng, attention):
    layout = np.zeros((1, nb, nb), dtype=np.int64)
    ds_sliding(layout, 0, nsw)
    layout[0, :ng, :] = 1
    layout[0, :, :ng] = 1
    return np.tril(layout).astype(bool) if attention == "unidirectional" else layout.astype(bool)


def ds_longformer(nb, nsw, starts, ends, attention):
    layout = np.zeros((1, nb, nb), dtype=np.int64)
    ds_sliding(layout, 0, nsw)
    for s, e in zip(starts, ends or [s + 1 for s in starts], strict=True):
        if s < nb:
            layout[0, s : min(e, nb), :] = 1
            layout[0, :, s : min(e, nb)] = 1
    return np.tril(layout).astype(bool) if attention == "unidirectional" else layout.astype(bool)


def ds_variable_no_random(nb, sizes, starts, ends, attention, horizontal):
    layout = np.zeros((1, nb, nb), dtype=np.int64)
    start = end = 0
    for size in sizes:
        end = min(end + size, nb)
        for row in range(start, end):
            for col in range(start, (row + 1 if attention == "unidirectional" else end)):
                layout[0, row, col] = 1
        start += size
    for i in range(start, nb, sizes[-1]):
        end = min(i + sizes[-1], nb)
        for row in range(i, end):
            for col in range(i, (row + 1 if attention == "unidirectional" else end)):
                layout[0, row, col] = 1
    for s, e in zip(starts, ends or [s + 1 for s in starts], strict=True):
        if s < nb:
            e = min(e, nb)
            if horizontal:
                layout[0, s:e, :] = 1
            first_row = 0 if attention == "bidirectional" else s
            layout[0, first_row:, s:e] = 1
    return layout.astype(bool)


ATTENTION = st.sampled_from(["unidirectional", "bidirectional"])


@settings(max_examples=60, deadline=None)
@given(
    nb=st.integers(1, 14),
    glob=st.integers(1, 2),
    per=st.integers(1, 3),
    attention=ATTENTION,
    horizontal=st.booleans(),
    npat=st.integers(1, 3),
    heads=st.integers(1, 4),
)
def test_deepspeed_fixed(nb, glob, per, attention, horizontal, npat, heads):
    loc = glob * max(per, npat)
    horizontal = horizontal and attention == "bidirectional"
    different = npat > 1 or heads > 1
    if nb < glob:
        return  # DeepSpeed slices from a negative start there: not a layout anyone uses
    expected = ds_fixed(nb, heads, loc, glob, attention, horizontal, npat, different)
    pat = patterns.deepspeed_fixed(
        loc,
        glob,
        attention=attention,
        horizontal_global_attention=horizontal,
        num_different_global_patterns=npat,
        different_layout_per_head=different,
        num_heads=heads,
        block=16,
    )
    lay = pat.layout(nb * 16)
    assert lay.heads == (heads if different else 1) and not lay.partial.any()
    assert np.array_equal(np.broadcast_to(lay.blocks[0], expected.shape), expected)
    check(lay, expand(expected, 16, nb * 16)[None], block_level=True)


@settings(max_examples=40, deadline=None)
@given(nb=st.integers(3, 14), nsw=st.integers(1, 3), ng=st.integers(0, 3), attention=ATTENTION)
def test_bigbird_without_random_blocks(nb, nsw, ng, attention):
    expected = ds_bigbird_no_random(nb, nsw, ng, attention)
    lay = patterns.bigbird(0, nsw, ng, attention=attention, block=32).layout(nb * 32 - 5)
    assert np.array_equal(lay.blocks[0], expected)
    check(lay, expand(expected, 32, nb * 32 - 5)[None], block_level=True)


@settings(max_examples=30, deadline=None)
@given(nb=st.integers(3, 20), nr=st.integers(1, 3), attention=ATTENTION, seed=st.integers(0, 2**31))
def test_bigbird_random_blocks(nb, nr, attention, seed):
    pat = patterns.bigbird(
        nr, 3, 1, attention=attention, different_layout_per_head=True, num_heads=3, seed=seed
    )
    lay = pat.layout(nb * 128)
    base = ds_bigbird_no_random(nb, 3, 1, attention)
    extra = lay.blocks[0] & ~base
    assert lay.heads == 3 and (lay.blocks[0] >= base).all()
    assert (extra.sum(axis=-1) <= nr).all()  # at most nr random blocks per row, beyond the fixed part
    if attention == "unidirectional":
        assert not np.triu(lay.blocks[0, 0], 1).any()
    again = patterns.bigbird(
        nr, 3, 1, attention=attention, different_layout_per_head=True, num_heads=3, seed=seed
    )
    assert np.array_equal(again.layout(nb * 128).blocks, lay.blocks)


def test_random_blocks_are_distinct_and_uniform():
    rng = np.random.default_rng(0)
    population = np.array([5, 1, 3, 8] * 2000)
    picked = block_patterns._random_blocks(rng, population, 3, 8)
    assert np.array_equal(picked.sum(axis=1), np.minimum(3, population))
    assert not (picked & (np.arange(8) >= population[:, None])).any()
    freq = picked[population == 8].mean(axis=0)  # each column with probability 3/8
    assert np.allclose(freq, 3 / 8, atol=0.05)


def test_deepspeed_by_hand():
    """4 x 4 block layouts written out from DeepSpeed's definitions."""
    cases = [
        (
            patterns.deepspeed_fixed(2, 1, attention="unidirectional", block=16),
            [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]],
        ),
        (patterns.bigbird(0, 3, 1, block=16), [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]),
        (patterns.longformer(3, [2], block=16), [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]]),
        (
            patterns.variable(0, [1, 2], [0], block=16),
            [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 1]],
        ),
    ]
    for pat, expected in cases:
        assert np.array_equal(pat.layout(64).blocks[0, 0], np.array(expected, bool)), pat


@settings(max_examples=40, deadline=None)
@given(
    nb=st.integers(3, 14),
    nsw=st.integers(1, 3),
    starts=st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True),
    widths=st.none() | st.lists(st.integers(1, 3), min_size=3, max_size=3),
    attention=ATTENTION,
)
def test_longformer(nb, nsw, starts, widths, attention):
    ends = None if widths is None else [s + w for s, w in zip(starts, widths, strict=False)]
    expected = ds_longformer(nb, nsw, starts, ends, attention)
    lay = patterns.longformer(nsw, starts, ends, attention=attention, block=16).layout(nb * 16)
    assert np.array_equal(lay.blocks[0, 0], expected[0]) and not lay.partial.any()
    check(lay, expand(expected, 16, nb * 16)[None], block_level=True)


@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(96, 250),
    global_tokens=st.lists(st.integers(0, 260), max_size=6),
    attention=ATTENTION,
    block=st.sampled_from([16, 32]),
)
def test_longformer_global_tokens(seq, global_tokens, attention, block):
    nb = -(-seq // block)
    blocks = ds_longformer(nb, 3, [0], None, attention)[0]
    q, k = tokens(seq, seq)
    g = np.isin(np.arange(seq), global_tokens)
    expected = expand(blocks, block, seq) | g[:, None] | g[None, :]
    if attention == "unidirectional":
        expected &= k // block <= q // block
    check(
        patterns.longformer(3, [0], global_tokens=global_tokens, attention=attention, block=block).layout(
            seq
        ),
        expected,
    )


@settings(max_examples=40, deadline=None)
@given(
    nb=st.integers(1, 14),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    starts=st.lists(st.integers(0, 15), min_size=1, max_size=3, unique=True),
    ranged=st.booleans(),
    attention=ATTENTION,
    horizontal=st.booleans(),
)
def test_variable(nb, sizes, starts, ranged, attention, horizontal):
    horizontal = horizontal and attention == "bidirectional"
    ends = [s + 2 for s in starts] if ranged else None
    expected = ds_variable_no_random(nb, sizes, starts, ends, attention, horizontal)
    pat = patterns.variable(
        0, sizes, starts, ends, attention=attention, horizontal_global_attention=horizontal, block=16
    )
    lay = pat.layout(nb * 16)
    assert np.array_equal(lay.blocks[0, 0], expected[0])
    check(lay, expand(expected, 16, nb * 16)[None], block_level=True)


def test_variable_random_blocks():
    pat = patterns.variable(2, [2], [0], different_layout_per_head=True, num_heads=2, seed=1, block=16)
    lay = pat.layout(16 * 10)
    base = ds_variable_no_random(10, [2], [0], None, "bidirectional", False)[0]
    assert lay.heads == 2 and (lay.blocks[:, :] >= base).all()
    assert ((lay.blocks[0] & ~base).sum(axis=-1) <= 2).all()


def test_deepspeed_errors():
    with pytest.raises(ValueError, match="multiple of num_global_blocks"):
        patterns.deepspeed_fixed(3, 2)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        patterns.deepspeed_fixed(4, 1, num_different_global_patterns=2)
    with pytest.raises(ValueError, match="bidirectional"):
        patterns.variable(attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match="attention must be"):
        patterns.bigbird(attention="causal")
    with pytest.raises(ValueError, match="sliding window"):
        patterns.bigbird(0, 5, 1, block=16).layout(64)
    with pytest.raises(ValueError, match="must match"):
        patterns.longformer(3, [0, 4], [2])
    with pytest.raises(ValueError, match="smaller than its end"):
        patterns.variable(0, [4], [3], [3])


def test_from_deepspeed_layout():
    expected = ds_fixed(8, 2, 4, 1, "bidirectional", True, 2, True)
    lay = BlockLayout.from_deepspeed(expected.astype(np.int64), 16, 128)
    pat = patterns.deepspeed_fixed(
        4,
        1,
        horizontal_global_attention=True,
        num_different_global_patterns=2,
        different_layout_per_head=True,
        num_heads=2,
        block=16,
    )
    assert lay == pat.layout(128)


# ---- mixes, user rules, fixed blocks -----------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, window=st.integers(1, 100))
def test_head_mix(sq, sk, window):
    heads = [None, patterns.causal(block=32), patterns.local(window, block=32), patterns.causal(block=32)]
    lay = patterns.head_mix(heads).layout(sq, sk)
    assert lay.heads == 4
    expected = np.stack([(p or patterns.dense(block=32)).layout(sq, sk).to_dense()[0, 0] for p in heads])
    check(lay, expected[None])
    assert lay.rule.c_expr is not None and lay._exact_rule


def test_head_mix_errors():
    with pytest.raises(ValueError, match="block size"):
        patterns.head_mix([patterns.causal(block=32), patterns.causal(block=64)])
    with pytest.raises(ValueError, match="one-head"):
        patterns.head_mix([patterns.fixed(4, num_verts=2, block=16)]).layout(128)


@settings(max_examples=20, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, block=BLOCKS)
def test_from_mask(sq, sk, block):
    def rule(b, h, q, k):
        return ((q * 3 + k + h) % 5 != 0) & (k <= q + b * 7)

    lay = patterns.from_mask(rule, block=block, batch=2, heads=3).layout(sq, sk)
    b, h = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None]
    q, k = tokens(sq, sk)
    check(lay, rule(b, h, q, k))
    shared = patterns.from_mask(lambda b, h, q, k: k <= q, block=block, batch=4, heads=4).layout(sq, sk)
    assert (shared.batch, shared.heads) == (1, 1)  # the rule does not vary with b or h: one shared layout
    assert shared == patterns.causal(block=block).layout(sq, sq) if sq == sk else True


def test_from_mask_in_bands():
    """More pairs than one band holds: the layout is assembled from several bands of query blocks."""
    lay = patterns.from_mask(
        lambda b, h, q, k: (q >= k) & (q - k < 300) & (h >= b), block=16, batch=4, heads=4
    )
    lay = lay.layout(1500)
    expected = patterns.local(300, block=16).layout(1500)
    assert lay.batch == lay.heads == 4
    assert lay[2, 3] == expected[0, 0] and not lay.blocks[3, 2].any()


def test_from_blocks():
    blocks = np.tril(np.ones((2, 4, 3), bool))
    pat = patterns.from_blocks(blocks, block=32)
    lay = pat.layout(100, 70)
    assert lay.heads == 2 and lay.nnz == int(blocks.sum()) and not lay.partial.any()
    assert pat.layout(128, 96).nnz == lay.nnz
    with pytest.raises(ValueError, match="97..128"):
        pat.layout(129, 70)


# ---- Pattern objects ---------------------------------------------------------------------------------------
def test_pattern_cache_repr_and_rule():
    pat = patterns.local(64, block=32)
    assert pat.layout(200) is pat.layout(200, 200) is pat.layout(np.int64(200))
    assert pat.layout(200, 100) is not pat.layout(200)
    assert repr(pat) == "local(window=64, causal=True, block=32)"
    rule = pat.token_rule(200, 100)
    assert rule.c_expr == "((k <= (q + P0)) && (((q + P0) - k) < P1))" and rule.params == (-100, 64)
    block_rule = patterns.bigbird(block=16).token_rule(64)
    assert block_rule.c_expr is None
    q, k = tokens(64, 64)
    assert np.array_equal(block_rule(0, 0, q, k), patterns.bigbird(block=16).layout(64).to_dense()[0, 0])
    with pytest.raises(ValueError, match="positive integer"):
        pat.layout(0)
    with pytest.raises(ValueError, match="power of two"):
        patterns.causal(block=48)


@settings(max_examples=30, deadline=None)
@given(sq=LENGTHS, sk=LENGTHS, window=st.integers(1, 120), stride=st.integers(1, 30))
def test_pattern_algebra(sq, sk, window, stride):
    a, b = patterns.local(window, causal=False, block=32), patterns.strided(stride, block=32)
    da, db = a.layout(sq, sk).to_dense(), b.layout(sq, sk).to_dense()
    # The algebra works on blocks: two partial blocks may join into an all-True (|) or all-False (&) block.
    check((a | b).layout(sq, sk), da | db, exact=False)
    check((a & b).layout(sq, sk), da & db, exact=False, block_level=True)
    assert (a & b).layout(sq, sk).rule.c_expr is not None  # both exact: their C expressions join
    with pytest.raises(ValueError, match="block sizes"):
        a | patterns.causal(block=64)


# ---- C expressions -----------------------------------------------------------------------------------------
C_CASES = [
    (patterns.causal(block=16), 70, 90),
    (patterns.dense(block=16), 20, 30),
    (patterns.local(20, block=16), 90, 70),
    (patterns.local(20, causal=False, block=16), 70, 90),
    (patterns.streaming(15, 4, block=16), 70, 90),
    (patterns.strided(6, block=16), 90, 70),
    (patterns.strided(6, local=10, block=16), 70, 90),
    (patterns.strided_blocks(3, block=16), 100, 120),
    (patterns.strided_blocks(1, block=16), 96, 128),
    (patterns.document(seq_lens=[[30, 40], [5, 60, 5]], causal=True, block=16), 70, 70),
    (patterns.document([0] * 33 + [1] * 37, block=16), 70, 70),
    (patterns.longformer(3, [1], global_tokens=[50], attention="unidirectional", block=16), 90, 90),
    (patterns.longformer(3, [1], global_tokens=[50], block=16), 90, 90),
    (patterns.fixed(2, block=16), 64, 64),
    (
        patterns.head_mix(
            [None, patterns.local(9, block=16), patterns.document([0] * 40 + [1] * 40, block=16)]
        ),
        80,
        80,
    ),
    (patterns.head_mix([patterns.causal(block=16), patterns.causal(block=16)]), 40, 40),
    (patterns.local(30, causal=False, block=16) & patterns.causal(block=16), 70, 90),
    (patterns.strided(5, block=16) | patterns.local(12, block=16), 70, 90),
]


@needs_cc
@pytest.mark.parametrize("pat, sq, sk", C_CASES, ids=[repr(c[0])[:40] for c in C_CASES])
def test_c_expr_matches_rule(pat, sq, sk, tmp_path):
    lay = pat.layout(sq, sk)
    rule = lay.rule
    assert rule.c_expr is not None
    batch, heads = lay.batch, lay.heads
    b, h = np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None]
    q, k = tokens(sq, sk)
    want = np.broadcast_to(rule(b, h, q, k), (batch, heads, sq, sk))
    assert np.array_equal(run_c(rule, batch, heads, sq, sk, tmp_path), want)
    if lay._exact_rule:
        assert np.array_equal(want, lay.to_dense(batch, heads))
    if partial_of(rule) is not None:
        assert_kernel_expr_holds(lay, batch, heads, tmp_path)
    for var, band in (("k", rule.kernel.key_band), ("q", rule.kernel.query_band)):
        if band is not None:
            same = f"({band_expr(band, var)}) == ({rule.kernel_expr})"
            assert run_c(rule, batch, heads, sq, sk, tmp_path, expr=same).all(), var


def partial_of(rule) -> str | None:
    """What the kernels compile of a rule inside partial blocks where it is less than the whole rule."""
    return rule.kernel_expr if "partial" in rule.program.outputs else None


def band_expr(band, var: str = "k") -> str:
    """A band of keys or of queries (`var` "q": `cusparseattn.analyses.band`) as the C expression it stands
    for."""
    first, last = band
    return " && ".join(
        [f"({first}) <= {var}"] * (first is not None) + [f"{var} <= ({last})"] * (last is not None)
    )


def assert_kernel_expr_holds(lay, batch, heads, tmp_path):
    """The kernels' expression equals the rule inside the layout's partial blocks, where they evaluate it."""
    rule, (bq, bk) = lay.rule, lay.block_size
    b, h = np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None]
    q, k = tokens(lay.seq_q, lay.seq_k)
    want = np.broadcast_to(rule(b, h, q, k), (batch, heads, lay.seq_q, lay.seq_k))
    got = run_c(rule, batch, heads, lay.seq_q, lay.seq_k, tmp_path, expr=rule.kernel_expr)
    partial = lay.partial.repeat(bq, axis=2).repeat(bk, axis=3)[:, :, : lay.seq_q, : lay.seq_k]
    partial = np.broadcast_to(partial, want.shape)
    assert partial.any()
    assert np.array_equal(got[partial], want[partial])


@needs_cc
def test_strided_blocks_kernels_compile_the_causal_term_when_aligned(tmp_path):
    """Aligned, the partial blocks are the diagonal's, and the kernels skip the block term's divisions; its
    windows (context parallelism) keep the cheap expression, shifted."""
    lay = patterns.strided_blocks(3, block=16).layout(96, 128)
    assert partial_of(lay.rule) == "(k <= (q + P0))"
    assert_kernel_expr_holds(lay, 1, 1, tmp_path)
    window = lay.window(32, 96, 16, 128)
    assert partial_of(window.rule) is not None
    assert_kernel_expr_holds(window, 1, 1, tmp_path)
    assert partial_of(patterns.strided_blocks(3, block=16).layout(100, 120).rule) is None


# ---- what a mask function decides inside partial blocks -------------------------------------------------
def _users_strided(b, h, q, k):
    """OpenAI's strided rule as a FlexAttention user writes it: patterns.strided_blocks(8) at block 128."""
    return (q >= k) & (((q // 128) - (k // 128) < 8) | ((k // 128) % 8 == 7))


def test_a_users_strided_rule_gets_the_built_in_patterns_partial_rule():
    """The block-level terms of a mask function (q // 128, k // 128 at blocks of 128) decide whole blocks, so
    the kernels evaluate only its causal term inside partial tiles, as they do the built-in pattern's: a band
    of keys, in 32-bit arithmetic."""
    lay = patterns.from_mask(_users_strided, block=128).layout(4096)
    built_in = patterns.strided_blocks(8).layout(4096)
    assert np.array_equal(lay.blocks, built_in.blocks) and np.array_equal(lay.partial, built_in.partial)
    assert partial_of(lay.rule) == "(q >= k)"
    assert lay.rule.kernel.key_band == (None, "q") and lay.rule.narrow(4096)
    # At blocks of 32, 128 is still a multiple of the side; 96 at blocks of 64 is not: q // 96 changes inside
    # a block, and the whole rule decides there.
    assert partial_of(patterns.from_mask(_users_strided, block=32).layout(1024).rule) == "(q >= k)"
    odd = patterns.from_mask(lambda b, h, q, k: (q >= k) & ((q // 96) - (k // 96) < 8), block=64)
    assert partial_of(odd.layout(1024).rule) is None


PARTIAL_RULES = {
    "strided": lambda c: lambda b, h, q, k: (q >= k) & (((q // c) - (k // c) < 3) | ((k // c) % 3 == 2)),
    "tiled neighbourhood": lambda c: lambda b, h, q, k: (abs(q // c - k // c) <= 1) & (abs(q - k) < c + 7),
    "global key blocks": lambda c: lambda b, h, q, k: ((k // c) % 4 == 0) | ((q - k < 50) & (k - q < 50)),
    "per head": lambda c: lambda b, h, q, k: (q >= k) & ((q // c + h) % 2 == k // c % 2),
    "all per block": lambda c: lambda b, h, q, k: q // c >= k // c,
}


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(PARTIAL_RULES)),
    block=st.sampled_from([16, 32, 64]),
    multiple=st.sampled_from([1, 2, 3]),
    seq=st.integers(100, 500),
)
def test_the_partial_rule_is_the_whole_rule_inside_partial_blocks(name, block, multiple, seq):
    """Every token of every partial block: the rule the kernels compile there (the program's "partial"
    output: the traced program without its per-block terms) gives the whole rule's answer."""
    from cusparseattn.program import MASK_NAMES, Program

    fn = PARTIAL_RULES[name](block * multiple)
    lay = patterns.from_mask(fn, block=block, heads=2).layout(seq)
    program = lay.rule.fn.program
    partial = program.partial_output((block, block))
    if name == "all per block":
        assert partial is None and partial_of(lay.rule) is None and not lay.partial.any()
        return
    assert partial is not None and partial_of(lay.rule) == program.c_text_of(partial, MASK_NAMES)
    assume(lay.partial.any())
    kept = Program({"value": partial}, "mask_mod", "partial")
    for _, h, i, j in zip(*np.nonzero(lay.partial), strict=True):
        q = np.arange(i * block, min((i + 1) * block, seq))[:, None]
        k = np.arange(j * block, min((j + 1) * block, seq))[None, :]
        env = dict(b=0, h=int(h), q=q, k=k)
        assert np.array_equal(kept.evaluate("value", env), np.asarray(fn(0, int(h), q, k))), (name, h, i, j)
