"""OpenAI's sparse_attention API: block layouts against the original's rules, and blocksparse == dense."""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import openai
from cusparseattn.layout import BlockLayout
from cusparseattn.testing import check_close


# ---- the original's layouts and callbacks, stated again block by block (small sizes only) ------------------
def original_blocks(n_ctx, n_heads, mode, blocksize, ctx, num_verts=4, vertsize=1) -> np.ndarray:
    """[H, nb, nb] block mask, one block pair at a time, as the original's get_blocksparse_obj builds it."""
    nb = n_ctx // blocksize
    heads = n_heads if mode == "fixed" and num_verts > 1 else 1
    out = np.zeros((heads, nb, nb), bool)
    for h in range(heads):
        for qb in range(nb):
            for kb in range(qb + 1):  # never above the diagonal
                if mode == "all":
                    keep = True
                elif mode == "local":
                    keep = qb - kb <= ctx // blocksize
                elif mode == "strided":
                    chunk = (n_ctx // ctx) // blocksize
                    keep = qb // chunk == kb // chunk
                else:
                    stride = ctx // blocksize
                    summary = list(range(stride - 1, -1, -1))[vertsize * (h % num_verts) :][:vertsize]
                    keep = kb // stride == qb // stride or kb % stride in summary
                out[h, qb, kb] = keep
    return out


def original_token_mask(blocks, mode, blocksize, ctx) -> np.ndarray:
    """[H, n, n] token mask: the set blocks, with the original's callback applied inside each of them."""
    heads, nb, _ = blocks.shape
    n = nb * blocksize
    out = np.zeros((heads, n, n), bool)
    for h, qb, kb in zip(*np.nonzero(blocks), strict=True):
        for i in range(blocksize):
            for j in range(blocksize):
                q, k = qb * blocksize + i, kb * blocksize + j
                keep = not (qb == kb and j > i)
                if mode == "local":
                    keep = k <= q and q - k < ctx
                out[h, q, k] = keep
    return out


def softmax_attention(q, k, v, heads, mask) -> np.ndarray:
    """Dense float64 attention of [batch, n_ctx, n_embd] arrays under a [H|1, n, n] boolean mask."""
    qh, kh, vh = (np.asarray(openai.split_heads(x, heads), np.float64) for x in (q, k, v))
    w = qh @ kh.swapaxes(-1, -2) / math.sqrt(qh.shape[-1])
    w = np.where(mask, w, -np.inf)
    p = np.exp(w - w.max(-1, keepdims=True))
    return openai.merge_heads(p / p.sum(-1, keepdims=True) @ vh)


def randn(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---- layouts -----------------------------------------------------------------------------------------------
LAYOUT_CASES = [
    (256, 2, "all", 16, None, 4, 1),
    (512, 2, "all", 32, None, 4, 1),
    (256, 2, "local", 16, 16, 4, 1),
    (512, 4, "local", 32, 96, 4, 1),
    (256, 2, "strided", 16, 16, 4, 1),
    (1024, 2, "strided", 32, 16, 4, 1),
    (512, 4, "fixed", 16, 128, 4, 1),
    (512, 4, "fixed", 16, 128, 1, 2),
    (512, 6, "fixed", 32, 128, 2, 2),
]


@pytest.mark.parametrize("args", LAYOUT_CASES, ids=lambda a: f"{a[2]}-n{a[0]}-b{a[3]}-c{a[4]}-v{a[5]}x{a[6]}")
def test_layout_matches_the_original(args):
    n_ctx, heads, mode, bs, ctx, num_verts, vertsize = args
    lay = openai.get_blocksparse_obj(n_ctx, heads, mode, bs, ctx, num_verts, vertsize)
    want = original_blocks(n_ctx, heads, mode, bs, ctx, num_verts, vertsize)
    assert isinstance(lay, BlockLayout)
    assert lay.block_size == (bs, bs) and lay.seq_q == lay.seq_k == n_ctx and lay.batch == 1
    np.testing.assert_array_equal(lay.blocks[0], want)
    np.testing.assert_array_equal(lay.to_dense()[0], original_token_mask(want, mode, bs, ctx))
    # The kernels' invariant: the rule holds on every token pair of a full block.
    full = np.repeat(np.repeat(lay.full[0], bs, axis=1), bs, axis=2)
    h, q, k = np.nonzero(full)
    assert lay.rule(0, h, q, k).all()


@pytest.mark.parametrize(
    ("mode", "ctx", "bs"), [("all", None, 16), ("local", 32, 16), ("local", 64, 32), ("strided", 8, 16)]
)
def test_layout_is_the_dense_mask(mode, ctx, bs):
    n = 512
    lay = openai.get_blocksparse_obj(n, 2, mode, bs, ctx)
    mask = openai.get_attn_mask(n, mode, ctx)[0, 0].astype(bool)
    if mode == "strided":
        # The layout lives on the strided-transposed sequence: take the dense mask there.
        order = openai.strided_transpose(np.arange(n).reshape(1, n, 1), n, ctx, bs)[0, :, 0]
        mask = mask[np.ix_(order, order)]
    np.testing.assert_array_equal(lay.to_dense()[0, 0], mask)


def test_fixed_heads_and_sharing():
    assert openai.get_blocksparse_obj(512, 4, "fixed", 32, 128, num_verts=4).heads == 4
    assert openai.get_blocksparse_obj(512, 4, "fixed", 32, 128, num_verts=1).heads == 1
    lay = openai.get_blocksparse_obj(512, 4, "fixed", 32, 128, num_verts=2)
    np.testing.assert_array_equal(lay.blocks[0, 0], lay.blocks[0, 2])
    assert not np.array_equal(lay.blocks[0, 0], lay.blocks[0, 1])


def test_layouts_are_cached():
    a = openai.get_blocksparse_obj(256, 2, "local", 16, 32)
    assert openai.get_blocksparse_obj(256, 2, "local", blocksize=16, local_attn_ctx=32) is a
    assert openai.get_blocksparse_obj(256, 2, "local", 16, 48) is not a


def test_get_attn_mask():
    n, idx = 40, np.arange(40)
    q, k = idx[:, None], idx[None, :]
    cases = {
        ("all", None): k <= q,
        ("local", 7): (k <= q) & (q - k <= 6),
        ("local", 100): k <= q,  # the band is clipped to the sequence
        ("strided", 5): (k <= q) & ((q - k) % 5 == 0),
    }
    for (mode, ctx), want in cases.items():
        got = openai.get_attn_mask(n, mode, ctx)
        assert got.shape == (1, 1, n, n) and got.dtype == np.float32
        np.testing.assert_array_equal(got[0, 0], want.astype(np.float32))


# ---- reshapes ----------------------------------------------------------------------------------------------
def test_split_merge_heads_round_trip():
    x = randn((2, 24, 48))
    heads = openai.split_heads(x, 4)
    assert heads.shape == (2, 4, 24, 12) and np.shares_memory(heads, x)
    np.testing.assert_array_equal(heads[1, 2, 5], x[1, 5, 24:36])
    np.testing.assert_array_equal(openai.merge_heads(heads), x)
    t = torch.from_numpy(x)
    np.testing.assert_array_equal(openai.merge_heads(openai.split_heads(t, 4)).numpy(), x)


def test_strided_transpose():
    n, stride, bs = 512, 16, 16
    pos = np.arange(n).reshape(1, n, 1)
    got = openai.strided_transpose(pos, n, stride, bs)[0, :, 0]
    # Position i * stride + j moves to j * (n // stride) + i: each residue class becomes one chunk.
    want = np.arange(n).reshape(n // stride, stride).T
    np.testing.assert_array_equal(got.reshape(stride, n // stride), want)
    x = randn((2, n, 8))
    for arr in (x, torch.from_numpy(x)):
        y = openai.strided_transpose(arr, n, stride, bs)
        back = openai._strided_untranspose(y, n, stride)
        np.testing.assert_array_equal(np.asarray(back), x)


# ---- blocksparse == dense ----------------------------------------------------------------------------------
MODES = [("all", None, 16), ("all", None, 32), ("local", 32, 16), ("local", 64, 32), ("strided", 16, 16)]


@pytest.mark.parametrize(("mode", "ctx", "bs"), MODES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_blocksparse_equals_attention_impl(mode, ctx, bs, dtype):
    q, k, v = (randn((2, 512, 64), dtype, seed) for seed in range(3))
    sparse = openai.blocksparse_attention_impl(q, k, v, 4, mode, ctx, blocksize=bs)
    dense = openai.attention_impl(q, k, v, 4, mode, ctx)
    assert sparse.shape == dense.shape == q.shape and sparse.dtype == dense.dtype == dtype
    atol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(sparse, dense, rtol=0, atol=atol)
    mask = openai.get_attn_mask(512, mode, ctx)[0] > 0
    np.testing.assert_allclose(dense, softmax_attention(q, k, v, 4, mask), rtol=0, atol=atol)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16]),
    bs=st.sampled_from([16, 32]),
    chunks=st.integers(1, 3),
    stride=st.sampled_from([1, 2, 4, 8]),
    mode=st.sampled_from(["all", "local", "strided"]),
    extra=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_blocksparse_equals_dense_random(batch, heads, head_dim, bs, chunks, stride, mode, extra, seed):
    n_ctx = stride * bs * chunks if mode == "strided" else bs * chunks * 4
    ctx = {"all": None, "local": extra * bs, "strided": stride}[mode]
    q, k, v = (randn((batch, n_ctx, heads * head_dim), np.float64, seed + i) for i in range(3))
    sparse = openai.blocksparse_attention_impl(q, k, v, heads, mode, ctx, blocksize=bs)
    np.testing.assert_allclose(sparse, openai.attention_impl(q, k, v, heads, mode, ctx), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("num_verts", "vertsize", "heads"), [(4, 1, 4), (1, 1, 2), (2, 2, 4)])
def test_fixed_equals_its_dense_mask(num_verts, vertsize, heads):
    q, k, v = (randn((2, 512, 16 * heads), np.float64, seed) for seed in range(3))
    kw = dict(local_attn_ctx=128, num_verts=num_verts, vertsize=vertsize)
    got = openai.blocksparse_attention_impl(q, k, v, heads, "fixed", blocksize=32, **kw)
    mask = openai.get_blocksparse_obj(512, heads, "fixed", 32, **kw).to_dense()[0]
    np.testing.assert_allclose(got, softmax_attention(q, k, v, heads, mask), rtol=0, atol=1e-12)


def test_fixed_defaults_match_get_blocksparse_obj():
    q, k, v = (randn((1, 256, 64), np.float64, seed) for seed in range(3))
    a = openai.blocksparse_attention_impl(q, k, v, 4, "fixed", 64, blocksize=16)
    b = openai.blocksparse_attention_impl(q, k, v, 4, "fixed", 64, blocksize=16, num_verts=4, vertsize=1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_low_precision_against_float64(dtype):
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    q, k, v = (randn((1, 256, 64), np.float64, seed).astype(dtype) for seed in range(3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for mode, ctx in (("local", 32), ("strided", 16)):
        got = openai.blocksparse_attention_impl(q, k, v, 2, mode, ctx, blocksize=16)
        assert got.dtype == dtype
        check_close(
            mode,
            got,
            openai.attention_impl(q64, k64, v64, 2, mode, ctx),
            openai.attention_impl(q, k, v, 2, mode, ctx),
            dtype=dtype,
        )


# ---- other frameworks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all", "local", "strided"])
def test_torch_inputs_and_gradients(mode):
    ctx = {"all": None, "local": 32, "strided": 16}[mode]
    q, k, v = (torch.from_numpy(randn((2, 256, 32), np.float64, seed)).requires_grad_() for seed in range(3))
    sparse = openai.blocksparse_attention_impl(q, k, v, 2, mode, ctx, blocksize=16)
    dense = openai.attention_impl(q, k, v, 2, mode, ctx)
    assert isinstance(sparse, torch.Tensor) and sparse.dtype == torch.float64 and sparse.shape == q.shape
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-12)
    grad = torch.from_numpy(randn((2, 256, 32), np.float64, 7))
    sparse_grads = torch.autograd.grad(sparse, (q, k, v), grad)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad)
    for name, a, b in zip("qkv", sparse_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_attention_impl_recompute_gives_the_same_gradients():
    q, k, v = (torch.from_numpy(randn((1, 64, 16), np.float32, seed)).requires_grad_() for seed in range(3))
    grads = []
    for recompute in (False, True):
        out = openai.attention_impl(q, k, v, 2, "local", 16, recompute=recompute)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_blocksparse_recompute_gives_the_same_result_and_gradients():
    q, k, v = (torch.from_numpy(randn((1, 256, 64), np.float32, seed)).requires_grad_() for seed in range(3))
    runs = []
    for recompute in (False, True):
        out = openai.blocksparse_attention_impl(q, k, v, 4, "strided", 16, blocksize=16, recompute=recompute)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    dense = openai.attention_impl(q, k, v, 4, "strided", 16)
    torch.testing.assert_close(runs[0][0], dense, rtol=0, atol=1e-5)


def test_jax_inputs():
    jnp = pytest.importorskip("jax.numpy")
    q, k, v = (jnp.asarray(randn((1, 256, 32), np.float32, seed)) for seed in range(3))
    a = openai.blocksparse_attention_impl(q, k, v, 2, "local", 32, blocksize=16)
    b = openai.attention_impl(q, k, v, 2, "local", 32)
    assert type(a).__module__.split(".")[0] in ("jax", "jaxlib")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


# ---- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: openai.get_blocksparse_obj(256, 2, "dilated"), "attn_mode must be one of"),
        (lambda: openai.get_blocksparse_obj(250, 2, "all", 16), "n_ctx=250 must be a multiple of blocksize"),
        (lambda: openai.get_blocksparse_obj(256, 2, "local", 16), "local_attn_ctx"),
        (lambda: openai.get_blocksparse_obj(256, 2, "local", 16, 24), "multiple of blocksize=16"),
        (lambda: openai.get_blocksparse_obj(256, 2, "strided", 16, 32), "256 // 32 = 8 must be a multiple"),
        (lambda: openai.get_blocksparse_obj(256, 2, "strided", 16, 48), "multiple of local_attn_ctx=48"),
        (lambda: openai.get_blocksparse_obj(256, 6, "fixed", 16, 64, 4), "n_heads=6 must be a multiple"),
        (lambda: openai.get_blocksparse_obj(256, 4, "fixed", 16, 48, 1, 2), "vertsize=2 must divide"),
        (lambda: openai.get_blocksparse_obj(256, 4, "fixed", 16, 32, 4, 1), "num_verts=4 is more than the 2"),
        (lambda: openai.get_blocksparse_obj(256, 2, "all", 8), "blocksize must be one of 16, 32, 64, 128"),
        (lambda: openai.get_attn_mask(16, "fixed"), "attn_mode must be one of 'all', 'local', 'strided'"),
        (lambda: openai.split_heads(np.zeros((1, 4, 10)), 3), "n_embd=10 is not a multiple of n=3"),
        (lambda: openai.split_heads(np.zeros((1, 2, 4, 10)), 2), "x must be [batch, n_ctx, n_embd] (3 dim"),
        (
            lambda: openai.merge_heads(np.zeros((2, 5, 12))),
            "x must be [batch, heads, n_ctx, head_dim] (4 dim",
        ),
    ],
)
def test_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_input_shapes_are_checked_before_work():
    q = randn((1, 64, 16))
    with pytest.raises(ValueError, match=r"k has shape \(1, 32, 16\), expected q's shape"):
        openai.blocksparse_attention_impl(q, q[:, :32], q, 2, "all", blocksize=16)
    with pytest.raises(ValueError, match="n_embd=16 is not a multiple of heads=3"):
        openai.attention_impl(q, q, q, 3, "all")
    with pytest.raises(ValueError, match=r"q must have shape \[batch, n_ctx, n_embd\]"):
        openai.attention_impl(q[0], q[0], q[0], 2, "all")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("mode", "ctx"), [("all", None), ("local", 128), ("strided", 32)])
def test_cuda_kernels_match_the_dense_original(mode, ctx, dtype):
    from cusparseattn import backends

    q, k, v = (torch.from_numpy(randn((2, 2048, 256), np.float32, i)).to("cuda", dtype) for i in range(3))
    layout = openai.get_blocksparse_obj(2048, 4, mode, 32, ctx)
    # The kernels, not the reference, must run these (head dim 64, heads as strided views).
    assert backends.why_not(*(openai.split_heads(x, 4) for x in (q, k, v)), layout)["cuda"] == []
    got = openai.blocksparse_attention_impl(q, k, v, 4, mode, ctx, blocksize=32)
    assert got.device == q.device and got.dtype == dtype
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    name = str(dtype).removeprefix("torch.")
    check_close(
        f"{mode} {name}",
        got.float().cpu().numpy(),
        openai.attention_impl(q64, k64, v64, 4, mode, ctx).numpy(),
        openai.attention_impl(q.cpu(), k.cpu(), v.cpu(), 4, mode, ctx).float().numpy(),
        dtype=name,
    )
