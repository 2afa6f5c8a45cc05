"""OpenAI's ``sparse_attention`` (github.com/openai/sparse_attention, ``attention.py``) for any framework.

Same function names, arguments and semantics as the original, on ``[batch, n_ctx, n_embd]`` arrays of NumPy,
CuPy, PyTorch or JAX (the result comes back in the caller's framework):

- ``attention_impl``: the dense masked attention of the original (the reference it checks itself against),
  computed with the caller's own framework, so it is differentiable in PyTorch and JAX;
- ``blocksparse_attention_impl``: the same function through ``cusparseattn.attention`` on the block layout of
  ``get_blocksparse_obj``; ``strided`` runs on the strided-transposed sequence, as the original does.

The attention modes, on absolute positions ``q`` (query) and ``k`` (key), heads of size ``n_embd // heads``:

- ``all``: causal, ``k <= q`` (the original's ``all`` is causal);
- ``local``: ``k <= q < k + local_attn_ctx``;
- ``strided``: ``k <= q`` and ``(q - k) % local_attn_ctx == 0``;
- ``fixed`` (block sparse only): at block level, each query block sees the earlier blocks of its own group
  of ``local_attn_ctx // blocksize`` blocks and ``vertsize`` summary block columns per group, which head ``h``
  takes from the group's end (``num_verts`` choices, cycling over heads); diagonal blocks are causal.

Differences from the original: ``blocksize`` must be a power of two from 16 to 128 (the original also took 8);
``get_attn_mask`` returns a NumPy float32 array; ``num_verts`` / ``vertsize`` left as None take
``get_blocksparse_obj``'s defaults (4 and 1); ``recompute`` is accepted everywhere (see each function).

>>> import numpy as np
>>> from cusparseattn import openai
>>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 256, 64), dtype=np.float32)
>>> kw = dict(heads=2, attn_mode="strided", local_attn_ctx=8)
>>> a = openai.blocksparse_attention_impl(q, k, v, blocksize=16, **kw)
>>> b = openai.attention_impl(q, k, v, **kw)
>>> a.shape, bool(np.abs(a - b).max() < 1e-5)
((2, 256, 64), True)
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import api, arrays
from .layout import MAX_BLOCK, MIN_BLOCK, BlockLayout
from .mods import mask_rule

MODES = ("all", "local", "strided", "fixed")
_BLOCKSIZES = tuple(2**i for i in range(MIN_BLOCK.bit_length() - 1, MAX_BLOCK.bit_length()))
_MASKED = -1e9  # the original's additive mask: every row keeps its diagonal, so no row is fully masked

_CAUSAL = mask_rule(lambda b, h, q, k: k <= q, name="causal")


# ---- the caller's framework --------------------------------------------------------------------------------
def _framework(x) -> str:
    return arrays.wrap(x).framework


def _permute(x, axes: tuple[int, ...]):
    return x.permute(*axes) if _framework(x) == "torch" else x.transpose(axes)


def _dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _cast(x, dtype):
    return x.to(dtype) if _framework(x) == "torch" else x.astype(dtype)


def _matmul(a, b):
    if _framework(a) == "jax":
        import jax

        # JAX's default float32 matmul on a GPU rounds its inputs (TF32, bf16 passes): a reference must not.
        return jax.numpy.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    return a @ b


def _softmax(w):
    fw = _framework(w)
    if fw == "torch":
        return w.softmax(dim=-1)
    if fw == "jax":
        import jax

        return jax.nn.softmax(w, axis=-1)
    xp = np
    if fw == "cupy":
        import cupy as xp
    e = xp.exp(w - w.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- checks ------------------------------------------------------------------------------------------------
def _positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _mode(attn_mode: str, allowed: tuple[str, ...] = MODES) -> str:
    if attn_mode not in allowed:
        raise ValueError(f"attn_mode must be one of {', '.join(map(repr, allowed))}, got {attn_mode!r}")
    return attn_mode


def _check_strided(n_ctx: int, local_attn_ctx, blocksize: int) -> int:
    local_attn_ctx = _positive("local_attn_ctx (the stride)", local_attn_ctx)
    if n_ctx % local_attn_ctx:
        raise ValueError(f"n_ctx={n_ctx} must be a multiple of local_attn_ctx={local_attn_ctx} for 'strided'")
    bt_ctx = n_ctx // local_attn_ctx
    if bt_ctx % blocksize:
        raise ValueError(
            f"n_ctx // local_attn_ctx = {n_ctx} // {local_attn_ctx} = {bt_ctx} must be a multiple of "
            f"blocksize={blocksize} for 'strided'"
        )
    return bt_ctx


def _check_inputs(q, k, v, heads: int) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must have shape [batch, n_ctx, n_embd], got {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected q's shape {tuple(q.shape)}")
    if q.shape[2] % heads:
        raise ValueError(f"q's n_embd={q.shape[2]} is not a multiple of heads={heads}")


# ---- the original's functions ------------------------------------------------------------------------------
def get_attn_mask(n: int, attn_mode: str, local_attn_ctx: int | None = None) -> np.ndarray:
    """The dense token mask of ``attention_impl``: float32 ``[1, 1, n, n]``, 1 where query q sees key k.

    >>> get_attn_mask(4, "strided", local_attn_ctx=2)[0, 0]
    array([[1., 0., 0., 0.],
           [0., 1., 0., 0.],
           [1., 0., 1., 0.],
           [0., 1., 0., 1.]], dtype=float32)
    """
    n = _positive("n", n)
    _mode(attn_mode, ("all", "local", "strided"))
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = k <= q
    if attn_mode == "local":
        mask &= q - k < _positive("local_attn_ctx (the bandwidth)", local_attn_ctx)
    elif attn_mode == "strided":
        mask &= (q - k) % _positive("local_attn_ctx (the stride)", local_attn_ctx) == 0
    return mask.astype(np.float32).reshape(1, 1, n, n)


def strided_transpose(x, n_ctx: int, local_attn_ctx: int, blocksize: int):
    """Reorders ``[batch, n_ctx, embd]`` so tokens ``local_attn_ctx`` apart become neighbours.

    Position ``i * local_attn_ctx + j`` moves to ``j * (n_ctx // local_attn_ctx) + i``: each residue class
    modulo the stride becomes one contiguous chunk, where ``strided`` attention is plain causal attention.

    >>> import numpy as np
    >>> strided_transpose(np.arange(8).reshape(1, 8, 1), 8, 2, 1)[0, :, 0]
    array([0, 2, 4, 6, 1, 3, 5, 7])
    """
    bt_ctx = _check_strided(n_ctx, local_attn_ctx, blocksize)
    n, t, embd = x.shape
    x = _permute(x.reshape((n, bt_ctx, local_attn_ctx, embd)), (0, 2, 1, 3))
    return x.reshape((n, t, embd))


def _strided_untranspose(x, n_ctx: int, local_attn_ctx: int):
    n, t, embd = x.shape
    x = _permute(x.reshape((n, local_attn_ctx, n_ctx // local_attn_ctx, embd)), (0, 2, 1, 3))
    return x.reshape((n, t, embd))


def split_heads(x, n: int):
    """``[batch, n_ctx, n_embd]`` to ``[batch, n, n_ctx, n_embd // n]``, as a view (no copy).

    >>> import numpy as np
    >>> split_heads(np.zeros((2, 5, 12)), 3).shape
    (2, 3, 5, 4)
    """
    if len(x.shape) != 3:
        raise ValueError(f"x must be [batch, n_ctx, n_embd] (3 dimensions), got shape {tuple(x.shape)}")
    batch, t, m = x.shape
    if m % _positive("n (heads)", n):
        raise ValueError(f"n_embd={m} is not a multiple of n={n} heads")
    return _permute(x.reshape((batch, t, n, m // n)), (0, 2, 1, 3))


def merge_heads(x):
    """``[batch, heads, n_ctx, head_dim]`` to ``[batch, n_ctx, heads * head_dim]``, undoing split_heads.

    >>> import numpy as np
    >>> merge_heads(np.zeros((2, 3, 5, 4))).shape
    (2, 5, 12)
    >>> merge_heads(np.zeros((2, 5, 12)))
    Traceback (most recent call last):
    ValueError: x must be [batch, heads, n_ctx, head_dim] (4 dimensions), got shape (2, 5, 12)
    """
    if len(x.shape) != 4:
        raise ValueError(
            f"x must be [batch, heads, n_ctx, head_dim] (4 dimensions), got shape {tuple(x.shape)}"
        )
    batch, heads, t, d = x.shape
    return _permute(x, (0, 2, 1, 3)).reshape((batch, t, heads * d))


def _checkpointed(fn, q, k, v, recompute: bool):
    """``fn(q, k, v)``; with ``recompute``, PyTorch and JAX keep only q, k, v and recompute fn backward."""
    if recompute and _framework(q) == "torch" and any(x.requires_grad for x in (q, k, v)):
        import torch.utils.checkpoint

        return torch.utils.checkpoint.checkpoint(fn, q, k, v, use_reentrant=False)
    if recompute and _framework(q) == "jax":
        import jax

        return jax.checkpoint(fn)(q, k, v)
    return fn(q, k, v)


def attention_impl(q, k, v, heads: int, attn_mode: str, local_attn_ctx: int | None = None, recompute=False):
    """Dense masked attention, the original's reference: ``[batch, n_ctx, n_embd]`` in and out.

    Scores ``q k^T / sqrt(n_embd // heads)`` per head, masked with ``get_attn_mask`` (``-1e9`` where masked),
    softmax, times ``v``. Computed with the caller's framework (differentiable in PyTorch and JAX); float16
    and bfloat16 are computed in float32 and the result rounded to the input dtype. ``recompute=True`` keeps
    only q, k, v for the backward pass in PyTorch (``torch.utils.checkpoint``) and JAX (``jax.checkpoint``).

    >>> import numpy as np
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 64, 32), dtype=np.float32)
    >>> attention_impl(q, k, v, heads=2, attn_mode="local", local_attn_ctx=16).shape
    (1, 64, 32)
    """
    _check_inputs(q, k, v, _positive("heads", heads))
    mask = get_attn_mask(k.shape[1], attn_mode, local_attn_ctx)

    def dense(q, k, v):
        wide = np.float64 if _dtype_name(q) == "float64" else np.float32
        if _framework(q) == "torch":
            import torch

            wide = torch.float64 if wide is np.float64 else torch.float32
        qh, kh, vh = (_cast(split_heads(x, heads), wide) for x in (q, k, v))
        m = _cast(arrays.wrap(q).from_numpy(mask).native, wide)
        w = _matmul(qh, _permute(kh, (0, 1, 3, 2))) * (1.0 / math.sqrt(qh.shape[-1]))
        w = w * m + _MASKED * (1 - m)
        return merge_heads(_cast(_matmul(_softmax(w), vh), q.dtype))

    return _checkpointed(dense, q, k, v, recompute)


def blocksparse_attention_impl(
    q,
    k,
    v,
    heads: int,
    attn_mode: str,
    local_attn_ctx: int | None = None,
    blocksize: int = 32,
    num_verts: int | None = None,
    vertsize: int | None = None,
    recompute=False,
):
    """Block-sparse attention through ``cusparseattn.attention``: ``[batch, n_ctx, n_embd]`` in and out.

    Equals ``attention_impl`` for ``all``, ``local`` and ``strided``; ``fixed`` follows the layout of
    ``get_blocksparse_obj``. ``strided`` transposes q, k, v with ``strided_transpose``, attends causally
    within each chunk, and transposes back, as the original does. The heads are strided views of q, k, v (no
    copy); the backend (CUDA kernels or the NumPy reference) is ``cusparseattn.attention``'s choice.
    The weights ``[heads, n_ctx, n_ctx]``, which the original's ``recompute`` avoided keeping, are never
    stored: the backward pass recomputes them from q, k, v, the output and its log-sum-exp. With PyTorch,
    ``recompute=True`` also drops the output and log-sum-exp and recomputes them in the backward
    (`cusparseattn.torch.attention`'s option); for other frameworks it changes nothing.

    >>> import numpy as np
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 256, 64), dtype=np.float32)
    >>> blocksparse_attention_impl(q, k, v, heads=4, attn_mode="local", local_attn_ctx=64).shape
    (1, 256, 64)
    """
    _check_inputs(q, k, v, _positive("heads", heads))
    n_ctx = q.shape[1]
    layout = get_blocksparse_obj(
        n_ctx,
        heads,
        attn_mode,
        blocksize,
        local_attn_ctx,
        4 if num_verts is None else num_verts,
        1 if vertsize is None else vertsize,
    )
    if attn_mode == "strided":
        q, k, v = (strided_transpose(x, n_ctx, local_attn_ctx, blocksize) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[2] // heads)
    qh, kh, vh = (split_heads(x, heads) for x in (q, k, v))
    if _framework(q) == "torch":
        from . import torch as adapter

        out = adapter.attention(qh, kh, vh, layout, scale=scale, recompute=bool(recompute))
    else:
        out = api.attention(qh, kh, vh, layout, scale=scale)
    a = merge_heads(out)
    if attn_mode == "strided":
        a = _strided_untranspose(a, n_ctx, local_attn_ctx)
    return a


def get_blocksparse_obj(
    n_ctx: int,
    n_heads: int,
    attn_mode: str,
    blocksize: int = 32,
    local_attn_ctx: int | None = None,
    num_verts: int = 4,
    vertsize: int = 1,
) -> BlockLayout:
    """The block layout of ``blocksparse_attention_impl``, with the original's ``get_callback`` as token rule.

    Blocks are ``[1, 1 or n_heads, n_ctx // blocksize, n_ctx // blocksize]``: per head only for ``fixed``
    with ``num_verts > 1``. The rule is the original callback: causal inside the diagonal blocks, and for
    ``local`` also the band ``q - k < local_attn_ctx`` (only the diagonal and the farthest blocks are
    partial). For ``strided`` the layout is over the strided-transposed sequence (see ``strided_transpose``).
    Layouts are cached per arguments, so repeated calls reuse the kernels' device tables.

    >>> lay = get_blocksparse_obj(1024, 4, "local", blocksize=32, local_attn_ctx=128)
    >>> lay.num_blocks, lay.nnz
    ((32, 32), 150)
    """
    if blocksize not in _BLOCKSIZES:
        raise ValueError(
            f"blocksize must be one of {', '.join(map(str, _BLOCKSIZES))} (the original also took 8), "
            f"got {blocksize!r}"
        )
    return _blocksparse_layout(
        _positive("n_ctx", n_ctx),
        _positive("n_heads", n_heads),
        _mode(attn_mode),
        int(blocksize),
        local_attn_ctx,
        num_verts,
        vertsize,
    )


@functools.lru_cache(maxsize=64)
def _blocksparse_layout(
    n_ctx, n_heads, attn_mode, blocksize, local_attn_ctx, num_verts, vertsize
) -> BlockLayout:
    if n_ctx % blocksize:
        raise ValueError(f"n_ctx={n_ctx} must be a multiple of blocksize={blocksize}")
    nb = n_ctx // blocksize
    i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
    causal = j <= i
    diagonal = np.broadcast_to(i == j, (nb, nb))
    rule = _CAUSAL
    if attn_mode == "all":
        blocks, partial = causal, diagonal
    elif attn_mode == "local":
        bandwidth = _positive("local_attn_ctx (the bandwidth)", local_attn_ctx)
        if bandwidth % blocksize:
            raise ValueError(
                f"local_attn_ctx={bandwidth} must be a multiple of blocksize={blocksize} for 'local'"
            )
        extra = bandwidth // blocksize
        blocks = causal & (i - j <= extra)
        # Blocks 1 .. extra-1 below the diagonal lie wholly inside the band: only the two edges need the rule.
        partial = blocks & ((i == j) | (i - j == extra))
        rule = mask_rule(lambda b, h, q, k: (k <= q) & (q - k < bandwidth), name=f"openai_local({bandwidth})")
    elif attn_mode == "strided":
        chunks = _check_strided(n_ctx, local_attn_ctx, blocksize) // blocksize
        blocks, partial = causal & (i // chunks == j // chunks), diagonal
    else:
        blocks, partial = _fixed_blocks(nb, n_heads, blocksize, local_attn_ctx, num_verts, vertsize), diagonal
    return BlockLayout(blocks, block_size=blocksize, seq_q=n_ctx, partial=partial, rule=rule)


def _fixed_blocks(nb, n_heads, blocksize, local_attn_ctx, num_verts, vertsize) -> np.ndarray:
    """The original's ``fixed`` layout, [nb, nb] for one vertical choice, else [n_heads, nb, nb]."""
    local_attn_ctx = _positive("local_attn_ctx", local_attn_ctx)
    num_verts, vertsize = _positive("num_verts", num_verts), _positive("vertsize", vertsize)
    stride = local_attn_ctx // blocksize
    if stride < 1:
        raise ValueError(
            f"local_attn_ctx={local_attn_ctx} must be at least blocksize={blocksize} for 'fixed'"
        )
    if stride % vertsize:
        raise ValueError(
            f"vertsize={vertsize} must divide local_attn_ctx // blocksize = {stride} for 'fixed'"
        )
    if n_heads % num_verts:
        raise ValueError(f"n_heads={n_heads} must be a multiple of num_verts={num_verts} for 'fixed'")
    choices = np.arange(stride - 1, -1, -1).reshape(-1, vertsize)
    if num_verts > len(choices):
        raise ValueError(
            f"num_verts={num_verts} is more than the {len(choices)} groups of vertsize={vertsize} summary "
            f"blocks in a stride of {stride} blocks"
        )
    verts = choices[np.arange(n_heads if num_verts > 1 else 1) % num_verts]  # [heads, vertsize]
    i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
    vertical = ((j % stride)[None, :, :, None] == verts[:, None, None, :]).any(axis=-1)
    return (vertical | (i // stride == j // stride)) & (j <= i)
