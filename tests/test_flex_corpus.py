"""FlexAttention users' mask and score mods, written with torch as they write them, run here unchanged.

Each mask mod's token mask (`patterns.from_mask`, traced into a C expression) equals FlexAttention's
``create_mask``, and attention through it (the reference backend, float64) equals a dense masked softmax
made from that mask. Each score mod's attention, and its gradients (torch autograd on the CPU), equal a
dense softmax whose scores the score mod modified, evaluated as FlexAttention's eager path evaluates it:
vmapped over torch index tensors. A few JAX (``jax.numpy``) spellings of the same rules give the same
masks; rules that cannot be traced are evaluated as FlexAttention does, or refused naming the line. The
``gpu`` variants run every case through the CUDA kernels in bfloat16 (``python -m pytest -m gpu``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.numpy import where as jnp_where
from torch.nn.attention.flex_attention import and_masks, create_mask, or_masks

import cusparseattn as ca
from cusparseattn import patterns
from cusparseattn.traced import TraceError

# ---- the values the rules capture, as FlexAttention users keep them: tensors and numbers ------------------
WINDOW, DILATION, SINKS, PREFIX, BLOCK = 9, 3, 4, 13, 8
IMG_H, IMG_W = 8, 10  # an 8 x 10 image: 80 tokens
KERNEL_H, KERNEL_W = 3, 5
FRAMES, FRAME_H, FRAME_W = 3, 4, 6  # a video of 3 frames of 4 x 6 tokens: 72 tokens
TILE_T, TILE_H, TILE_W = 2, 2, 3
NOISY = 40  # block diffusion: 40 noisy tokens, then their 40 clean copies
DOC_IDS = torch.repeat_interleave(torch.arange(4), torch.tensor([20, 1, 35, 24]))  # 80 tokens
DOC_IDS_BATCH = torch.stack([DOC_IDS, torch.repeat_interleave(torch.arange(2), torch.tensor([50, 30]))])
PREFIX_LENGTHS = torch.tensor([5, 30])
HEAD_WINDOWS = torch.tensor([2, 5, 11, 80])
IMAGE_OF_QUERY = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 20, 30]))  # queries: text spans
KV_INTERVALS = torch.tensor([[0, 16], [16, 40], [40, 64]])  # each span's image tokens
TREE_PREFIX = 16
# A speculative-decoding tree after a 16-token prefix: node i's parent (the root's is itself), 64 nodes.
TREE_PARENTS = torch.tensor([0] + [(i - 1) // 3 for i in range(1, 64)])
TREE_DEPTH = 4  # nodes 0..63 of a ternary tree: depth at most 3
ANCESTORS = torch.zeros(80, 80, dtype=torch.bool)  # the same tree as a captured table [q, kv]
ANCESTORS[:, :TREE_PREFIX] = True
for _node in range(64):
    _a = _node
    while True:
        ANCESTORS[TREE_PREFIX + _node, TREE_PREFIX + _a] = True
        if _a == 0:
            break
        _a = (_a - 1) // 3
ANCESTORS[:TREE_PREFIX, :TREE_PREFIX] = torch.tril(torch.ones(TREE_PREFIX, TREE_PREFIX, dtype=torch.bool))
ANCESTORS[:TREE_PREFIX, TREE_PREFIX:] = False


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= WINDOW


def global_tokens(b, h, q_idx, kv_idx):
    return (kv_idx < SINKS) | (q_idx < SINKS)


def document(b, h, q_idx, kv_idx):
    return DOC_IDS[q_idx] == DOC_IDS[kv_idx]


def natten_1d(b, h, q_idx, kv_idx):
    center = q_idx.clamp(WINDOW // 2, 80 - 1 - WINDOW // 2)
    return (kv_idx - center).abs() <= WINDOW // 2


def natten_2d(b, h, q_idx, kv_idx):
    q_x, q_y = q_idx // IMG_W, q_idx % IMG_W
    kv_x, kv_y = kv_idx // IMG_W, kv_idx % IMG_W
    center_x = q_x.clamp(KERNEL_H // 2, (IMG_H - 1) - KERNEL_H // 2)
    center_y = q_y.clamp(KERNEL_W // 2, (IMG_W - 1) - KERNEL_W // 2)
    hori_mask = (center_x - kv_x).abs() <= KERNEL_H // 2
    vert_mask = (center_y - kv_y).abs() <= KERNEL_W // 2
    return hori_mask & vert_mask


def natten_3d(b, h, q_idx, kv_idx):
    frame = FRAME_H * FRAME_W
    q_t, q_x, q_y = q_idx // frame, (q_idx % frame) // FRAME_W, q_idx % FRAME_W
    k_t, k_x, k_y = kv_idx // frame, (kv_idx % frame) // FRAME_W, kv_idx % FRAME_W
    c_t = torch.clamp(q_t, 1, FRAMES - 2)
    c_x = torch.clamp(q_x, 1, FRAME_H - 2)
    c_y = torch.clamp(q_y, 1, FRAME_W - 2)
    return ((c_t - k_t).abs() <= 1) & ((c_x - k_x).abs() <= 1) & (torch.abs(c_y - k_y) <= 1)


def tiled_2d(b, h, q_idx, kv_idx):
    q_x, q_y = q_idx // IMG_W, q_idx % IMG_W
    kv_x, kv_y = kv_idx // IMG_W, kv_idx % IMG_W
    return (q_x // 4 == kv_x // 4) & (q_y // 5 == kv_y // 5)


def video_tiles(b, h, q_idx, kv_idx):
    frame = FRAME_H * FRAME_W

    def tile(i):
        t, x, y = i // frame, (i % frame) // FRAME_W, i % FRAME_W
        return (t // TILE_T) * 100 + (x // TILE_H) * 10 + y // TILE_W

    return tile(q_idx) == tile(kv_idx)


def block_diffusion(b, h, q_idx, kv_idx):
    """BD3-LM's mask over [noisy tokens, clean tokens]."""
    x0_flag_q = q_idx >= NOISY
    x0_flag_kv = kv_idx >= NOISY
    block_q = torch.where(x0_flag_q, (q_idx - NOISY) // BLOCK, q_idx // BLOCK)
    block_kv = torch.where(x0_flag_kv, (kv_idx - NOISY) // BLOCK, kv_idx // BLOCK)
    block_diagonal = (block_q == block_kv) & (x0_flag_q == x0_flag_kv)
    offset_block_causal = (block_q > block_kv) & x0_flag_kv & (x0_flag_q == 0)
    block_causal = (block_q >= block_kv) & x0_flag_kv & x0_flag_q
    return block_diagonal | offset_block_causal | block_causal


def shared_prefix(b, h, q_idx, kv_idx):
    """A prefix that three 22-token continuations share (each causal within itself)."""
    same = (q_idx - PREFIX) // 22 == (kv_idx - PREFIX) // 22
    return (q_idx >= kv_idx) & ((kv_idx < PREFIX) | same)


def cross_intervals(b, h, q_idx, kv_idx):
    image_idx = IMAGE_OF_QUERY[q_idx]
    return (kv_idx >= KV_INTERVALS[image_idx][0]) & (kv_idx < KV_INTERVALS[image_idx][1])


def cross_intervals_unpacked(b, h, q_idx, kv_idx):
    start, end = KV_INTERVALS[IMAGE_OF_QUERY[q_idx]]
    return torch.logical_and(kv_idx >= start, kv_idx < end)


def tree_parents(b, h, q_idx, kv_idx):
    node, key = q_idx - TREE_PREFIX, kv_idx - TREE_PREFIX
    ancestor = node == key
    for _ in range(TREE_DEPTH):
        node = TREE_PARENTS[node.clamp(min=0)]
        ancestor = ancestor | (node == key)
    in_tree = (q_idx >= TREE_PREFIX) & (kv_idx >= TREE_PREFIX) & ancestor
    return in_tree | ((kv_idx < TREE_PREFIX) & ((q_idx >= TREE_PREFIX) | (q_idx >= kv_idx)))


def tree_table(b, h, q_idx, kv_idx):
    return ANCESTORS[q_idx][kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def prefix_lm_batch(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX_LENGTHS[b]) | (q_idx >= kv_idx)


def document_batch(b, h, q_idx, kv_idx):
    return DOC_IDS_BATCH[b, q_idx] == DOC_IDS_BATCH[b, kv_idx]


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < HEAD_WINDOWS[h])


def per_head_kind(b, h, q_idx, kv_idx):
    return torch.where(h % 2 == 0, q_idx >= kv_idx, (q_idx - kv_idx).abs() < WINDOW)


def dilated(b, h, q_idx, kv_idx):
    diff = q_idx - kv_idx
    return (diff % DILATION == 0) & (diff.abs() <= WINDOW * DILATION)


def fmod_stripes(b, h, q_idx, kv_idx):
    return torch.fmod(q_idx - kv_idx, 4) == 0  # truncated: -5 fmod 4 is -1, not 3


MASK_MODS = {
    "causal": causal,
    "causal_where": lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, True, False),
    "sliding_window": sliding_window,
    "sliding_torch_abs": lambda b, h, q_idx, kv_idx: torch.abs(q_idx - kv_idx) < WINDOW,
    "sliding_causal_logical": lambda b, h, q_idx, kv_idx: torch.logical_and(
        q_idx >= kv_idx, q_idx - kv_idx < WINDOW
    ),
    "sliding_clamped": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).clamp(min=0) < WINDOW,
    "dilated": dilated,
    "dilated_remainder": lambda b, h, q_idx, kv_idx: (
        (torch.remainder(q_idx - kv_idx, DILATION) == 0) & (q_idx >= kv_idx)
    ),
    "natten_1d": natten_1d,
    "natten_2d": natten_2d,
    "natten_3d": natten_3d,
    "tiled_2d": tiled_2d,
    "video_tiles": video_tiles,
    "video_frame_causal": lambda b, h, q_idx, kv_idx: (
        torch.floor_divide(q_idx, FRAME_H * FRAME_W) >= torch.floor_divide(kv_idx, FRAME_H * FRAME_W)
    ),
    "block_diffusion": block_diffusion,
    "block_causal": lambda b, h, q_idx, kv_idx: q_idx // BLOCK >= kv_idx // BLOCK,
    "shared_prefix": shared_prefix,
    "cross_intervals": cross_intervals,
    "cross_intervals_unpacked": cross_intervals_unpacked,
    "tree_parents": tree_parents,
    "tree_table": tree_table,
    "prefix_lm": prefix_lm,
    "prefix_lm_batch": prefix_lm_batch,
    "document": document,
    "document_causal": and_masks(causal, document),
    "document_batch": document_batch,
    "global_tokens": or_masks(global_tokens, sliding_window),
    "streaming": and_masks(causal, or_masks(lambda b, h, q_idx, kv_idx: kv_idx < SINKS, sliding_window)),
    "per_head_window": per_head_window,
    "per_head_kind": per_head_kind,
    "and_or_nested": and_masks(or_masks(prefix_lm, sliding_window), document),
    "minimum_maximum": lambda b, h, q_idx, kv_idx: (
        torch.minimum(q_idx, kv_idx) >= torch.maximum(q_idx, kv_idx) - WINDOW
    ),
    "fmod_stripes": fmod_stripes,
    "bitwise_butterfly": lambda b, h, q_idx, kv_idx: torch.bitwise_and(q_idx, kv_idx) == kv_idx,
    "xor_shift": lambda b, h, q_idx, kv_idx: ((q_idx ^ kv_idx) >> 3) == 0,
    "logical_or_not": lambda b, h, q_idx, kv_idx: torch.logical_or(
        torch.logical_not(q_idx < kv_idx), torch.logical_xor(q_idx < 4, kv_idx < 4)
    ),
    "casts": lambda b, h, q_idx, kv_idx: (
        ((q_idx - kv_idx).to(torch.int32).abs() <= WINDOW) & ((q_idx - kv_idx) % 3).bool().logical_not()
    ),
    "tensor_constants": lambda b, h, q_idx, kv_idx: (
        (q_idx - kv_idx < torch.tensor(WINDOW)) & (q_idx - kv_idx >= torch.zeros_like(q_idx))
    ),
    "full_like": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < torch.full_like(q_idx, WINDOW),
    "new_ones": lambda b, h, q_idx, kv_idx: b.new_ones((), dtype=torch.bool) & (q_idx >= kv_idx),
}

# Batch and heads of each mask mod's case; sequences of 80 tokens (queries and keys), blocks of 16.
SHAPES = {
    "prefix_lm_batch": (2, 1),
    "document_batch": (2, 1),
    "per_head_window": (1, 4),
    "per_head_kind": (1, 3),
}
SEQ, BLOCK_SIZE = 80, 16


def shape_of(name: str) -> tuple[int, int]:
    return SHAPES.get(name, (1, 2))


def flex_mask(fn, batch: int, heads: int, seq_q: int = SEQ, seq_k: int = SEQ) -> np.ndarray:
    return create_mask(fn, batch, heads, seq_q, seq_k, device="cpu").numpy()


def derived_mask(fn, batch: int, heads: int, seq_q: int = SEQ, seq_k: int = SEQ):
    """The token mask cusparseattn derives: the layout of `patterns.from_mask`, at token level."""
    lay = patterns.from_mask(fn, block=BLOCK_SIZE, batch=batch, heads=heads).layout(seq_q, seq_k)
    return lay, np.broadcast_to(lay.to_dense(batch, heads), (batch, heads, seq_q, seq_k))


def dense_attention(q, k, v, mask, scores=None):
    """Softmax of the (modified) scores where ``mask`` holds, in float64 torch; empty rows give 0."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5 if scores is None else scores
    s = s.masked_fill(~torch.as_tensor(mask), float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    total = p.sum(dim=-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", p / torch.where(total > 0, total, torch.ones_like(total)), v)


def inputs(seed: int, batch: int, heads: int, seq: int = SEQ, dim: int = 8, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, dim)
    return [torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad) for _ in "qkv"]


# ---- mask mods ----------------------------------------------------------------------------------------
def test_the_corpus_is_large_enough():
    assert len(MASK_MODS) >= 30 and len(SCORE_MODS) >= 8


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_matches_create_mask(name):
    fn = MASK_MODS[name]
    batch, heads = shape_of(name)
    lay, got = derived_mask(fn, batch, heads)
    assert lay.rule.c_expr is not None, f"{name} did not trace"
    want = flex_mask(fn, batch, heads)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{name}: {len(bad)} token pairs differ, first (b, h, q, kv) {tuple(bad[0])}"
    assert want.any() and not want.all(), f"{name}: a degenerate case"


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_attention_matches_dense(name):
    fn = MASK_MODS[name]
    batch, heads = shape_of(name)
    seed = sorted(MASK_MODS).index(name)
    q, k, v = inputs(seed, batch, heads)
    lay = patterns.from_mask(fn, block=BLOCK_SIZE, batch=batch, heads=heads).layout(SEQ)
    got = ca.attention(q.numpy(), k.numpy(), v.numpy(), lay, backend="reference")
    want = dense_attention(q, k, v, flex_mask(fn, batch, heads))
    np.testing.assert_allclose(got, want.numpy(), atol=1e-12, err_msg=f"{name} (seed {seed})")


# ---- score mods -------------------------------------------------------------------------------------
HEADS = 4
SOFTCAP = 5.0
# Float tables hold float32 values (the kernels read float32), in float64 tensors as a model's may be.
REL_BIAS = torch.randn(HEADS, 2 * SEQ - 1, generator=torch.Generator().manual_seed(3)).double()
BUCKETS = torch.tensor([0, 1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7])  # distance -> bucket
BUCKET_BIAS = torch.linspace(1.0, -1.0, 8)
POSITION_GATE = torch.linspace(-2.0, 2.0, SEQ)
HEAD_SCALE = torch.tensor([0.5, 1.0, 1.5, 2.0])


def alibi(score, b, h, q_idx, kv_idx):
    slope = torch.exp2(-8 * (h + 1) / HEADS)
    return score + slope * (kv_idx - q_idx)


def soft_cap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


SCORE_MODS = {
    "alibi": alibi,
    "softcap": soft_cap,
    "alibi_softcap": lambda score, b, h, q_idx, kv_idx: soft_cap(
        alibi(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx
    ),
    "relative_bias": lambda score, b, h, q_idx, kv_idx: score + REL_BIAS[h, q_idx - kv_idx + SEQ - 1],
    "relative_bias_rows": lambda score, b, h, q_idx, kv_idx: score + REL_BIAS[h][q_idx - kv_idx + SEQ - 1],
    "bucketed_bias": lambda score, b, h, q_idx, kv_idx: (
        score + BUCKET_BIAS[BUCKETS[(q_idx - kv_idx).abs().clamp(max=16)]]
    ),
    "causal_where": lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf")),
    "log2_distance": lambda score, b, h, q_idx, kv_idx: (
        score - torch.log2(1 + (q_idx - kv_idx).abs().float())
    ),
    "exp_decay": lambda score, b, h, q_idx, kv_idx: score * torch.exp(-(q_idx - kv_idx).abs() / 16.0),
    "sqrt_scale": lambda score, b, h, q_idx, kv_idx: score / torch.sqrt(1.0 + (q_idx - kv_idx).abs()),
    "sigmoid_gate": lambda score, b, h, q_idx, kv_idx: score + torch.sigmoid(POSITION_GATE[kv_idx]),
    "head_scale": lambda score, b, h, q_idx, kv_idx: score * HEAD_SCALE[h],
    "cosine": lambda score, b, h, q_idx, kv_idx: (
        score + 0.5 * torch.cos((q_idx - kv_idx) * 0.3) + 0.25 * torch.sin(score)
    ),
}


# Score mods that torch computes in float32 (a float32 table, .float()): as close as float32 allows.
FLOAT32_MODS = {"log2_distance", "sigmoid_gate"}


def vmapped_scores(score_mod, scores):
    """``score_mod`` on every score, as FlexAttention's eager path applies it: vmapped over b, h, q, kv."""
    batch, heads, sq, sk = scores.shape
    fn = score_mod  # in float64 where torch promotes integers to its default float dtype
    for dims in (
        (0, None, None, None, 0),
        (0, None, None, 0, None),
        (0, None, 0, None, None),
        (0, 0, None, None, None),
    ):
        fn = torch.vmap(fn, in_dims=dims)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return fn(scores, torch.arange(batch), torch.arange(heads), torch.arange(sq), torch.arange(sk))
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_attention_and_gradients_match_dense(name):
    score_mod = SCORE_MODS[name]
    seed = 100 + sorted(SCORE_MODS).index(name)
    q, k, v = inputs(seed, 2, HEADS, requires_grad=True)
    sm = ca.mods.score_mod(score_mod)
    assert sm.c_expr and sm.c_grad, name
    out = ca.attention(q, k, v, score_mod=score_mod, backend="reference")
    scores = vmapped_scores(score_mod, torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5)
    want = dense_attention(q, k, v, np.ones(scores.shape, bool), scores)
    tol = 1e-6 if name in FLOAT32_MODS else 1e-10
    torch.testing.assert_close(out, want, atol=tol, rtol=tol, msg=lambda m: f"{name} (seed {seed}): {m}")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, (q, k, v), dout)
    for label, a, b in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(
            a, b, atol=tol, rtol=tol, msg=lambda m, label=label: f"{name}: d{label} (seed {seed}): {m}"
        )


# ---- JAX spellings ----------------------------------------------------------------------------------------
JAX_IDS = jnp.asarray(DOC_IDS.numpy())

JAX_TWINS = {
    "sliding_window": lambda b, h, q_idx, kv_idx: jnp.abs(q_idx - kv_idx) <= WINDOW,
    "causal_where": lambda b, h, q_idx, kv_idx: jnp_where(q_idx >= kv_idx, True, False),
    "natten_1d": lambda b, h, q_idx, kv_idx: (
        jnp.abs(kv_idx - jnp.clip(q_idx, WINDOW // 2, 80 - 1 - WINDOW // 2)) <= WINDOW // 2
    ),
    "document_causal": lambda b, h, q_idx, kv_idx: jnp.logical_and(
        JAX_IDS[q_idx] == JAX_IDS[kv_idx], q_idx >= kv_idx
    ),
    "minimum_maximum": lambda b, h, q_idx, kv_idx: (
        jnp.minimum(q_idx, kv_idx) >= jnp.maximum(q_idx, kv_idx) - WINDOW
    ),
    "global_tokens": lambda b, h, q_idx, kv_idx: jnp.logical_or(
        jnp.logical_or(kv_idx < SINKS, q_idx < SINKS), jnp.abs(q_idx - kv_idx) <= WINDOW
    ),
}


@pytest.mark.parametrize("name", sorted(JAX_TWINS))
def test_jax_spellings_match_the_torch_rules(name):
    batch, heads = shape_of(name)
    lay, got = derived_mask(JAX_TWINS[name], batch, heads)
    assert lay.rule.c_expr is not None, f"{name} did not trace"
    assert np.array_equal(got, flex_mask(MASK_MODS[name], batch, heads)), name


def test_jax_score_mods_trace():
    alibi_jnp = lambda score, b, h, q_idx, kv_idx: score + jnp.exp2(-8 * (h + 1) / HEADS) * (kv_idx - q_idx)  # noqa: E731
    cap = lambda score, b, h, q_idx, kv_idx: SOFTCAP * jnp.tanh(score / SOFTCAP)  # noqa: E731
    for jax_fn, torch_fn in ((alibi_jnp, alibi), (cap, soft_cap)):
        assert ca.mods.score_mod(jax_fn).c_expr == ca.mods.score_mod(torch_fn).c_expr


# ---- the same C text as the rules that traced before -------------------------------------------------------
def test_flex_combinators_print_as_ours():
    ours = ca.mods.and_masks(ca.mods.causal_mask, ca.mods.sliding_window(WINDOW))
    theirs = and_masks(causal, lambda b, h, q_idx, kv_idx: (q_idx - kv_idx >= 0) & (q_idx - kv_idx < WINDOW))
    assert ca.mods.mask_rule(theirs).c_expr == ca.mods.mask_rule(ours).c_expr
    either = or_masks(causal, global_tokens)
    assert ca.mods.mask_rule(either).c_expr == "((q >= k) || ((k < P0) || (q < P0)))"
    assert ca.mods.mask_rule(MASK_MODS["causal_where"]).c_expr == "(q >= k)"
    assert "exp2f(" in ca.mods.score_mod(alibi).c_expr
    clamped = ca.mods.mask_rule(natten_1d).c_expr
    assert "min(max(q, P0), P1)" in clamped, clamped


# ---- Hypothesis: windows and lengths ----------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    window=st.integers(1, 40),
    seq_q=st.integers(1, 90),
    seq_k=st.integers(1, 90),
    kernel=st.sampled_from([1, 3, 5, 7]),
)
def test_windows_and_neighbourhoods_match_create_mask(window, seq_q, seq_k, kernel):
    length = max(seq_k, kernel)

    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx).abs() < window)

    def neighbourhood(b, h, q_idx, kv_idx):
        center = q_idx.clamp(kernel // 2, length - 1 - kernel // 2)
        return (kv_idx - center).abs() <= kernel // 2

    for fn in (window_mask, neighbourhood):
        _, got = derived_mask(fn, 1, 1, seq_q, seq_k)
        assert np.array_equal(got, flex_mask(fn, 1, 1, seq_q, seq_k)), (fn.__name__, window, seq_q, seq_k)


# ---- what cannot be traced --------------------------------------------------------------------------------
def python_if(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:  # the line the error names
        return True
    return False


def test_a_python_if_on_an_index_is_refused_naming_the_line():
    with pytest.raises(TraceError, match=r"truth value.*test_flex_corpus\.py:\d+") as info:
        patterns.from_mask(python_if, block=16)
    line = python_if.__code__.co_firstlineno + 1
    assert f"test_flex_corpus.py:{line}" in str(info.value)
    assert info.value.site.endswith(f"test_flex_corpus.py:{line}")


def test_a_python_if_on_a_captured_number_traces():
    causal_rule = True

    def maybe_causal(b, h, q_idx, kv_idx):
        if causal_rule:
            return q_idx >= kv_idx
        return (q_idx - kv_idx).abs() < WINDOW

    lay, got = derived_mask(maybe_causal, 1, 1)
    assert lay.rule.c_expr == "(q >= k)" and np.array_equal(got, flex_mask(maybe_causal, 1, 1))


def test_unknown_torch_functions_are_evaluated_as_flex_does():
    """torch.special.i0 has no traced form: the rule runs on torch index tensors, vmapped, never on NumPy
    arrays, and gives create_mask's mask (with bit masks for the kernels)."""

    def bessel_window(b, h, q_idx, kv_idx):
        return torch.logical_and(torch.special.i0((q_idx - kv_idx).float()) < 40.0, q_idx >= kv_idx)

    lay, got = derived_mask(bessel_window, 1, 2)
    assert lay.rule.c_expr is None and lay.rule.fn.framework == "torch"
    assert np.array_equal(got, flex_mask(bessel_window, 1, 2))
    q, k, v = inputs(5, 1, 2)
    out = ca.attention(q.numpy(), k.numpy(), v.numpy(), lay, backend="reference")
    want = dense_attention(q, k, v, flex_mask(bessel_window, 1, 2))
    np.testing.assert_allclose(out, want.numpy(), atol=1e-12)


def test_unknown_jax_functions_are_evaluated_as_flex_does():
    def jax_rule(b, h, q_idx, kv_idx):
        return jnp.logical_and(jnp.cbrt(q_idx - kv_idx) < 2.5, q_idx >= kv_idx)

    lay, got = derived_mask(jax_rule, 1, 1)
    assert lay.rule.c_expr is None and lay.rule.fn.framework == "jax"
    want = flex_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < 16) & (q_idx >= kv_idx), 1, 1)
    assert np.array_equal(got, want)


# ---- the CUDA kernels (bfloat16, torch CUDA tensors) ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_on_the_gpu(name):
    from kernel_cases import np_dtype
    from test_kernels_mods import assert_matches

    from cusparseattn import plan
    from cusparseattn.testing import random_qkv

    batch, heads = shape_of(name)
    layout = patterns.from_mask(MASK_MODS[name], block=64, batch=batch, heads=heads).layout(SEQ)
    assert plan.rule_mode(layout) == "expr", layout.rule
    rng = np.random.default_rng(sorted(MASK_MODS).index(name))
    q, k, v = random_qkv(rng, batch, heads, heads, SEQ, SEQ, 64, np_dtype("bfloat16"))
    assert_matches(q, k, v, layout, None, "bfloat16", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_on_the_gpu(name):
    from kernel_cases import np_dtype
    from test_kernels_mods import assert_matches

    from cusparseattn.testing import random_qkv

    rng = np.random.default_rng(100 + sorted(SCORE_MODS).index(name))
    layout = patterns.dense(block=64).layout(SEQ)
    q, k, v = random_qkv(rng, 2, HEADS, 2, SEQ, SEQ, 64, np_dtype("bfloat16"))
    assert_matches(q, k, v, layout, ca.mods.score_mod(SCORE_MODS[name]), "bfloat16", rng)
