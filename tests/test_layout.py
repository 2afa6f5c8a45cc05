"""BlockLayout: compressed forms, set algebra, equality, indexing, pictures and interchange with
FlexAttention and DeepSpeed. Random layouts carry a rule written with operators only, so NumPy and torch both
evaluate it."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_patterns import CC, needs_cc, run_c

from cusparseattn import patterns
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule

BLOCKS = st.sampled_from([16, 32, 64])


def hashed(b, h, q, k):
    return (q * 7 + k * 3 + b * 5 + h * 11) % 4 != 0


HASHED = TokenRule("hashed", hashed)


@st.composite
def shapes(draw):
    return draw(BLOCKS), draw(BLOCKS), draw(st.integers(1, 150)), draw(st.integers(1, 150))


def random_layout(draw, shape, batch=None, heads=None, rule=True) -> BlockLayout:
    bq, bk, sq, sk = shape
    nb = draw(st.sampled_from([1, 2])) if batch is None else batch
    nh = draw(st.sampled_from([1, 3])) if heads is None else heads
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dims = (nb, nh, -(-sq // bq), -(-sk // bk))
    blocks = rng.random(dims) < draw(st.floats(0.1, 0.9))
    partial = blocks & (rng.random(dims) < 0.5) if rule else None
    return BlockLayout(
        blocks, block_size=(bq, bk), seq_q=sq, seq_k=sk, partial=partial, rule=HASHED if rule else None
    )


@st.composite
def layouts(draw):
    return random_layout(draw, draw(shapes()), rule=draw(st.booleans()))


def full_blocks_hold_the_rule(lay: BlockLayout) -> bool:
    """The invariant patterns keep: the rule is True on every pair inside a full block."""
    if lay.rule is None:
        return True
    b, h, qb, kb = np.nonzero(lay.full)
    bq, bk = lay.block_size
    q = np.minimum(qb[:, None, None] * bq + np.arange(bq)[None, :, None], lay.seq_q - 1)
    k = np.minimum(kb[:, None, None] * bk + np.arange(bk)[None, None, :], lay.seq_k - 1)
    return bool(lay.rule(b[:, None, None], h[:, None, None], q, k).all())


# ---- compressed forms --------------------------------------------------------------------------------------
def decompress(comp, lines: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    assert comp.indptr.dtype == comp.indices.dtype == np.int32 and comp.partial.dtype == bool
    counts = np.diff(comp.indptr)
    assert counts.size == lines and (counts >= 0).all()
    rows = np.repeat(np.arange(lines), counts)
    assert np.unique(rows * width + comp.indices).size == comp.indices.size, "a block listed twice"
    blocks, partial = np.zeros((lines, width), bool), np.zeros((lines, width), bool)
    blocks[rows, comp.indices] = True
    partial[rows, comp.indices] = comp.partial
    return blocks, partial


@settings(max_examples=60, deadline=None)
@given(lay=layouts())
def test_csr_csc_round_trip(lay):
    nb, nh, nq, nk = lay.blocks.shape
    blocks, partial = decompress(lay.csr(), nb * nh * nq, nk)
    assert np.array_equal(blocks.reshape(lay.blocks.shape), lay.blocks)
    assert np.array_equal(partial.reshape(lay.blocks.shape), lay.partial)
    blocks, partial = decompress(lay.csc(), nb * nh * nk, nq)
    assert np.array_equal(blocks.reshape(nb, nh, nk, nq), lay.blocks.swapaxes(2, 3))
    assert np.array_equal(partial.reshape(nb, nh, nk, nq), lay.partial.swapaxes(2, 3))
    assert lay.csr() is lay.csr()


# ---- set algebra -------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_algebra_token_masks(data):
    shape = data.draw(shapes())
    a = random_layout(data.draw, shape, rule=data.draw(st.booleans()))
    b = random_layout(data.draw, shape, rule=data.draw(st.booleans()))
    if (
        1 not in (a.batch, b.batch)
        and a.batch != b.batch
        or 1 not in (a.heads, b.heads)
        and a.heads != b.heads
    ):
        return
    nb, nh = max(a.batch, b.batch), max(a.heads, b.heads)
    da, db = a.to_dense(nb, nh), b.to_dense(nb, nh)
    union, inter = a | b, a & b
    assert np.array_equal(union.to_dense(nb, nh), da | db)
    assert np.array_equal(inter.to_dense(nb, nh), da & db)
    assert np.array_equal(np.broadcast_to(union.full, (nb, nh, *a.num_blocks)), a.full | b.full)
    assert np.array_equal(np.broadcast_to(inter.full, (nb, nh, *a.num_blocks)), a.full & b.full)
    assert not (union.partial & ~union.blocks).any()


@pytest.mark.parametrize(
    "a, b",
    [
        (patterns.local(40, block=16), patterns.causal(block=16)),
        (patterns.local(40, causal=False, block=16), patterns.strided(7, block=16)),
        (patterns.bigbird(1, 3, 1, block=16), patterns.local(30, block=16)),
        (patterns.streaming(30, 5, block=16), patterns.document([0] * 60 + [1] * 40, block=16)),
        (patterns.fixed(2, block=16), patterns.local(50, causal=False, block=16)),
    ],
)
def test_algebra_keeps_the_invariant(a, b):
    self_only = any(name in repr(p) for p in (a, b) for name in ("bigbird", "fixed", "document"))
    for sq, sk in ((100, 100),) if self_only else ((100, 100), (70, 100), (100, 70)):
        la, lb = a.layout(sq, sk), b.layout(sq, sk)
        nh = max(la.heads, lb.heads)
        da, db = la.to_dense(heads=nh), lb.to_dense(heads=nh)
        for lay, want in ((la | lb, da | db), (la & lb, da & db), (lb | la, da | db), (lb & la, da & db)):
            assert full_blocks_hold_the_rule(lay), lay
            assert np.array_equal(lay.to_dense(heads=nh), want)


def test_algebra_joins_c_expressions():
    local, causal = (
        patterns.local(64, causal=False, block=32).layout(300),
        patterns.causal(block=32).layout(300),
    )
    both = local & causal
    assert both.rule.c_expr == "((((q - k) < P0) && ((k - q) < P0)) && (k <= (q + P1)))"
    assert both.rule.params == (64, 0) and both._exact_rule
    doc = patterns.document([0] * 150 + [1] * 150, block=32).layout(300)
    mixed = doc | causal
    assert mixed.rule.c_expr.count("A0") == 2 and "P1" in mixed.rule.c_expr


def test_algebra_with_dense_and_block_layouts():
    causal = patterns.causal(block=32).layout(200, 300)
    dense = patterns.dense(block=32).layout(200, 300)
    assert (dense & causal).rule is causal.rule and (dense & causal)._exact_rule
    assert (causal | dense).rule is dense.rule and not (causal | dense).partial.any()
    blocks = patterns.bigbird(block=32).layout(256)
    causal_square = patterns.causal(block=32).layout(256)
    assert (
        blocks & causal_square
    ).rule is causal_square.rule  # a block layout leaves the token test to causal
    assert np.array_equal((blocks & causal_square).to_dense(), blocks.to_dense() & causal_square.to_dense())


def test_algebra_errors():
    a = patterns.causal(block=32).layout(100)
    with pytest.raises(ValueError, match="different lengths or block sizes"):
        a | patterns.causal(block=32).layout(101)
    with pytest.raises(ValueError, match="different lengths or block sizes"):
        a & patterns.causal(block=16).layout(100)
    two = BlockLayout(np.ones((2, 1, 4, 4), bool), block_size=32, seq_q=100)
    three = BlockLayout(np.ones((3, 1, 4, 4), bool), block_size=32, seq_q=100)
    with pytest.raises(ValueError, match="batch elements do not match"):
        two | three
    assert (two | a).batch == 2
    with pytest.raises(TypeError):
        a | 1


# ---- equality ----------------------------------------------------------------------------------------------
def test_equality():
    causal = patterns.causal(block=32).layout(200)
    same_mask = patterns.from_mask(lambda b, h, q, k: q >= k, block=32).layout(200)
    assert causal.rule is not same_mask.rule and causal == same_mask
    shifted = patterns.from_mask(lambda b, h, q, k: (q >= k) & ((q != 150) | (k != 130)), block=32).layout(
        200
    )
    assert causal != shifted
    assert causal != patterns.causal(block=32).layout(201)
    assert causal != patterns.causal(block=16).layout(200)
    assert causal == patterns.local(1000, block=32).layout(200)  # a window longer than the sequence
    assert (causal == 3) is False
    per_batch = BlockLayout(
        np.repeat(causal.blocks, 2, axis=0),
        block_size=32,
        seq_q=200,
        partial=causal.partial,
        rule=causal.rule,
    )
    assert per_batch == causal and causal == per_batch
    assert hash(causal) == hash(same_mask) == hash(per_batch) and len({causal: 1, same_mask: 2}) == 1


def test_a_layout_equals_itself_without_comparing_masks(monkeypatch):
    """Weak-keyed caches (schedules, orderings, causal intersections) compare the layout they look up with
    itself: that costs nothing, however many partial blocks it has."""
    lay = patterns.local(4096, block=128).layout(1 << 17)

    def fail(*args):
        raise AssertionError("token masks evaluated")

    monkeypatch.setattr(BlockLayout, "token_mask", fail)
    assert lay == lay


@settings(max_examples=40, deadline=None)
@given(lay=layouts())
def test_equality_random(lay):
    copy = BlockLayout(
        lay.blocks.copy(),
        block_size=lay.block_size,
        seq_q=lay.seq_q,
        seq_k=lay.seq_k,
        partial=lay.partial.copy(),
        rule=None if lay.rule is None else TokenRule("copy", hashed),
    )
    assert lay == copy
    if lay.partial.any():
        other = BlockLayout(
            lay.blocks,
            block_size=lay.block_size,
            seq_q=lay.seq_q,
            seq_k=lay.seq_k,
            partial=lay.partial,
            rule=TokenRule("other", lambda b, h, q, k: (q * 7 + k * 3 + b * 5 + h * 11) % 4 != 1),
        )
        assert (lay == other) == np.array_equal(lay.to_dense(), other.to_dense())


# ---- indexing ----------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_indexing(data):
    lay = random_layout(data.draw, data.draw(shapes()), batch=2, heads=3)
    dense = lay.to_dense()
    for b in range(2):
        one = lay[b]
        assert (one.batch, one.heads) == (1, 3)
        assert np.array_equal(one.to_dense()[0], dense[b])
        for h in (0, 2, -1):
            sub = lay[b, h]
            assert (sub.batch, sub.heads) == (1, 1)
            assert np.array_equal(sub.to_dense()[0, 0], dense[b, h])


def test_indexing_shared_layouts_and_errors():
    lay = BlockLayout(
        np.ones((1, 1, 3, 3), bool), block_size=16, seq_q=48, partial=np.eye(3, dtype=bool), rule=HASHED
    )
    assert np.array_equal(lay[5, 4].to_dense()[0, 0], lay.to_dense(6, 5)[5, 4])
    two = BlockLayout(np.ones((2, 1, 3, 3), bool), block_size=16, seq_q=48)
    assert np.array_equal(two[-1].blocks, two.blocks[1:])
    with pytest.raises(IndexError, match="out of range"):
        two[2]
    with pytest.raises(IndexError, match=">= 0"):
        lay[-1]
    with pytest.raises(TypeError, match="integer"):
        lay["0"]
    with pytest.raises(IndexError, match="batch, head"):
        lay[0, 0, 0]


@pytest.mark.skipif(CC is None, reason="no C compiler (cc) to evaluate the rules' C expressions")
def test_indexing_shifts_c_expressions(tmp_path):
    lay = patterns.document(seq_lens=[[20, 30], [40, 10], [5, 45]], causal=True, block=16).layout(50)
    sub = lay[2]
    assert "(b + P0)" in sub.rule.c_expr and sub.rule.params == (2, 3, 50)
    assert np.array_equal(run_c(sub.rule, 1, 1, 50, 50, tmp_path)[0, 0], lay.to_dense()[2, 0])
    assert np.array_equal(sub.to_dense()[0, 0], lay.to_dense()[2, 0])


# ---- windows -----------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_window(data):
    lay = random_layout(data.draw, data.draw(shapes()))
    bq, bk = lay.block_size
    cuts = []
    for seq, block in ((lay.seq_q, bq), (lay.seq_k, bk)):
        n = -(-seq // block)
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        cuts.append((a * block, min(b * block, seq)))
    (q0, q1), (k0, k1) = cuts
    win = lay.window(q0, q1, k0, k1)
    assert (win.seq_q, win.seq_k, win.origin) == (q1 - q0, k1 - k0, (q0, k0))
    assert np.array_equal(win.to_dense(), lay.to_dense()[:, :, q0:q1, k0:k1])
    assert win.nnz == np.count_nonzero(lay.blocks[:, :, q0 // bq : -(-q1 // bq), k0 // bk : -(-k1 // bk)])
    inner = win.window(0, win.seq_q, 0, win.seq_k)
    assert inner.origin == win.origin and np.array_equal(inner.to_dense(), win.to_dense())


@needs_cc
def test_window_shifts_c_expressions(tmp_path):
    lay = patterns.local(40, block=16).layout(160)
    win = lay.window(64, 128, 32, 96)
    assert "(q + P" in win.rule.c_expr and "(k + P" in win.rule.c_expr
    assert np.array_equal(run_c(win.rule, 1, 1, 64, 64, tmp_path)[0, 0], lay.to_dense()[0, 0, 64:128, 32:96])


def test_window_errors():
    lay = patterns.causal(block=16).layout(100)
    with pytest.raises(ValueError, match="multiples of the block size 16"):
        lay.window(8, 32, 0, 32)
    with pytest.raises(ValueError, match="k_start and k_stop must be multiples"):
        lay.window(0, 32, 0, 40)
    assert lay.window(96, 100, 0, 100).seq_q == 4  # a stop at the sequence's end needs no alignment
    with pytest.raises(ValueError, match="q_start, q_stop must satisfy 0 <= start < stop <= 100"):
        lay.window(32, 32, 0, 16)
    with pytest.raises(TypeError, match="k_stop must be an integer"):
        lay.window(0, 16, 0, 16.0)
    with pytest.raises(ValueError, match="different origins"):
        lay.window(0, 32, 0, 32) | lay.window(32, 64, 32, 64)


def test_token_mask_past_the_end():
    """Kernel tiles overhang the sequence: rules see clamped indices, pairs past the end are False."""
    lay = patterns.document(seq_lens=[[70, 30], [50, 50]], block=32) | patterns.local(20, block=32)
    lay = lay.layout(100)
    q, k = np.arange(128)[:, None], np.arange(128)[None, :]
    mask = lay.token_mask(np.arange(2)[:, None, None, None], 0, q, k)
    assert np.array_equal(mask[:, 0, :100, :100], lay.to_dense(heads=1)[:, 0]) and not mask[:, 0, 100:].any()


# ---- pictures ----------------------------------------------------------------------------------------------
def test_to_string():
    lay = patterns.causal(block=16).layout(64)
    text = str(lay)
    assert text == lay.to_string()
    lines = text.splitlines()
    assert lines[0] == repr(lay)
    assert "shared by all heads" in lines[1]
    assert lines[2:] == [
        "\u2592\u00b7\u00b7\u00b7",
        "\u2588\u2592\u00b7\u00b7",
        "\u2588\u2588\u2592\u00b7",
        "\u2588\u2588\u2588\u2592",
    ]


def test_to_string_heads_and_downsampling():
    mix = patterns.head_mix([patterns.causal(block=16), None, patterns.causal(block=16), None]).layout(64)
    text = mix.to_string()
    assert "head 0, 2:" in text and "head 1, 3:" in text and len(text.splitlines()) == 1 + 2 * 5
    big = patterns.local(1024, block=128).layout(131072)
    lines = big.to_string().splitlines()
    assert "16x16 blocks" in lines[1]
    grid = lines[3:]
    assert len(grid) == 64 and all(len(row) == 64 for row in grid)
    assert grid[0][0] == "\u2592" and grid[5][0] == "\u00b7"  # the band: mixed at the diagonal, empty far off


def test_save_png(tmp_path):
    from PIL import Image

    lay = patterns.causal(block=16).layout(64)
    path = lay.save_png(tmp_path / "causal.png")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == (300, 320)  # one 256 px panel under a 40 px header
        centre = [[img.getpixel((10 + c * 64 + 30, 54 + r * 64 + 30)) for c in range(4)] for r in range(4)]
        assert centre[1][0] == (31, 96, 180)  # full
        assert centre[0][0] == (245, 150, 40)  # partial
        assert centre[0][3] == (236, 236, 236)  # empty
    big = patterns.head_mix([patterns.local(4096, block=128)] * 2 + [None] * 3).layout(131072)
    with Image.open(big.save_png(tmp_path / "big.png", max_pixels=128)) as img:
        assert img.size == (300, 40 + 152)  # two distinct layouts (2 + 3 heads), each pooled to 128 x 128 px


def test_save_png_without_pillow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"cusparseattn\[plot\]"):
        patterns.causal(block=16).layout(64).save_png(tmp_path / "x.png")


# ---- FlexAttention and DeepSpeed ---------------------------------------------------------------------------
flex = pytest.importorskip("torch.nn.attention.flex_attention")
torch = pytest.importorskip("torch")


def flex_dense(lay: BlockLayout, batch: int, heads: int) -> np.ndarray:
    bm = lay.to_flex()
    return flex.create_mask(bm.mask_mod, batch, heads, lay.seq_q, lay.seq_k, device="cpu").numpy()


def test_from_flex():
    docs = torch.tensor(np.repeat([0, 1, 2], [70, 100, 63]))

    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < 50 + 20 * h) & (kv_idx - q_idx < 50 + 20 * b)

    for mask_mod, batch, heads, sq, sk in ((document, None, None, 233, 233), (sliding, 2, 3, 200, 333)):
        bm = flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu", BLOCK_SIZE=32)
        lay = BlockLayout.from_flex(bm)
        want = flex.create_mask(mask_mod, batch or 1, heads or 1, sq, sk, device="cpu").numpy()
        assert np.array_equal(lay.to_dense(batch or 1, heads or 1), want)
        assert np.array_equal(lay.blocks, bm.to_dense().numpy().astype(bool))


TO_FLEX = [
    patterns.local(50, block=32).layout(200, 300),
    patterns.document(seq_lens=[[50, 150], [120, 80]], causal=True, block=16).layout(200),
    patterns.head_mix([None, patterns.strided(5, block=32), patterns.causal(block=32)]).layout(150),
    patterns.bigbird(block=32).layout(256) | patterns.local(40, block=32).layout(256),
    patterns.fixed(2, num_verts=2, num_heads=2, block=16).layout(96)[0, 1],
    patterns.longformer(3, [0], global_tokens=[70], block=16).layout(100),
]


@pytest.mark.parametrize("lay", TO_FLEX, ids=lambda lay: lay.rule.name[:30])
def test_to_flex(lay):
    bm = lay.to_flex()
    assert tuple(bm.BLOCK_SIZE) == lay.block_size and tuple(bm.seq_lengths) == (lay.seq_q, lay.seq_k)
    assert np.array_equal(bm.to_dense().numpy().astype(bool), lay.blocks)
    heads = 2 if lay.heads == 1 else lay.heads  # a shared head axis stands for any number of heads
    assert np.array_equal(flex_dense(lay, lay.batch, heads), lay.to_dense(lay.batch, heads))
    back = BlockLayout.from_flex(bm)
    assert back == lay and np.array_equal(back.full, lay.full)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]
FLEX_RUNS = [  # a rule, a layout inside another's rule (set algebra), per-head layouts
    patterns.local(40, block=16).layout(100, 130),
    patterns.bigbird(block=16).layout(130) | patterns.local(30, block=16).layout(130),
    patterns.head_mix([patterns.strided(5, block=16), patterns.causal(block=16)]).layout(100, 130),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lay", FLEX_RUNS, ids=lambda lay: lay.rule.name[:30])
def test_flex_attention_with_to_flex(lay, device):
    rng = np.random.default_rng(0)
    q, k, v = (
        torch.from_numpy(rng.standard_normal((1, 2, n, 16), dtype=np.float32)).to(device)
        for n in (lay.seq_q, lay.seq_k, lay.seq_k)
    )
    out = flex.flex_attention(q, k, v, block_mask=lay.to_flex(device)).cpu().numpy()
    q, k, v = (x.cpu().numpy() for x in (q, k, v))
    scores = np.einsum("bhqd,bhkd->bhqk", q, k).astype(np.float64) / 4.0
    scores[~np.broadcast_to(lay.to_dense(1, 2), scores.shape)] = -np.inf
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(axis=-1, keepdims=True), v)
    assert np.abs(out - want).max() < (1e-4 if device == "cuda" else 1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("device", DEVICES)
def test_to_flex_without_its_tables_says_so(device):
    """FlexAttention's tracing cannot make the lookup tables: a mask moved to another device than to_flex's
    (or, on the CPU, one whose tables were dropped) gets an error that says what to do."""
    # Dynamo's code cache of an earlier test's FlexAttention call would otherwise serve this one.
    torch._dynamo.reset()
    lay = patterns.local(40, block=16).layout(128)
    block_mask = lay.to_flex().to(device)
    if device == "cpu":
        lay._torch_cache.clear()
    q = torch.zeros((1, 1, 128, 16), device=device)
    with pytest.raises(Exception, match=r"make the BlockMask for that device with layout.to_flex\(device="):
        flex.flex_attention(q, q, q, block_mask=block_mask)


def test_to_flex_needs_a_torch_rule():
    rule = TokenRule("numpy only", lambda b, h, q, k: np.less_equal(np.asarray(k), np.asarray(q)))
    lay = BlockLayout(np.ones((2, 2), bool), block_size=16, seq_q=32, rule=rule)
    with pytest.raises(ValueError, match="torch ops"):
        lay.to_flex()


def test_from_deepspeed():
    layout = np.zeros((2, 4, 4), np.int64)
    layout[0] = np.tril(np.ones((4, 4)))
    layout[1] = np.eye(4)
    lay = BlockLayout.from_deepspeed(torch.from_numpy(layout), 16, 64)
    assert (lay.batch, lay.heads, lay.nnz) == (1, 2, 14) and not lay.partial.any()
    assert np.array_equal(lay.blocks[0], layout.astype(bool))
    with pytest.raises(ValueError, match="num_heads, num_blocks, num_blocks"):
        BlockLayout.from_deepspeed(layout[0], 16, 64)
    with pytest.raises(ValueError, match="expected"):
        BlockLayout.from_deepspeed(layout, 16, 100)


# ---- speed -------------------------------------------------------------------------------------------------
def test_128k_layout_builds_fast():
    start = time.perf_counter()
    lay = patterns.local(1024, block=128).layout(131072)
    lay.csr(), lay.csc()
    elapsed = time.perf_counter() - start
    assert lay.num_blocks == (1024, 1024) and lay.nnz == 9 * 1024 - 36
    assert elapsed < 2.0, f"128k local layout took {elapsed:.2f} s to build and compress"
