"""Selectors: the indices of a dynamic layout (`cusparseattn.dynamic`), computed from q and k in the caller's
framework and on its device (PyTorch, CuPy, NumPy, JAX: written against the array API standard), in bounded
memory: the scores of query rows against pooled keys, one band of rows at a time, never ``[Sq, Sk]``.

- `moba`: MoBA's gate (arXiv 2502.13189): each key block's mean key, scored against each query
  (``per="token"``, the paper's gate) or each query block's mean query (``per="block"``: the mean of the
  block's per-token scores, as the gate is linear), top-k per row, the block of the row's own (last) query
  always in and later blocks out when causal.
- `nsa`: NSA's selection (arXiv 2502.11089): per query token, a softmax of its scores against one pooled
  (compressed) key per block, summed over the query heads of each KV group, so the group shares one
  selection; top-k per token with the first blocks and the local blocks (the last ones up to the query)
  always in, later blocks out.

On PyTorch and CuPy GPU arrays `moba` runs as one CUDA kernel (`cusparseattn.moba_kernel`), with the same
result. Both give int32 indices ``[B, H, rows, k]``, ascending in each row with ``-1`` padding at its end
(rows with fewer candidates than ``k``). Ties go to the smaller block index (a stable descending sort), so
the set chosen is `torch.topk`'s on the same scores wherever no tie straddles the k-th place, and the same
on every framework and device. The attention on the selection is causal inside the chosen blocks when the
caller says so: ``ca.attention(q, k, v, ca.dynamic.block_indices(idx, block=b), causal=True)``.

>>> import numpy as np
>>> import cusparseattn as ca
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 2, 256, 16), dtype=np.float32)
>>> idx = moba(q, k, block=32, topk=2)  # [1, 2, 8, 3]: own block plus the 2 best earlier ones
>>> idx[0, 0, :3].tolist()
[[0, -1, -1], [0, 1, -1], [0, 1, 2]]
>>> out = ca.attention(q, k, v, ca.dynamic.block_indices(idx, block=32), causal=True)
"""

from __future__ import annotations

import math

import array_api_compat

from . import moba_kernel
from .arrays import wrap
from .layout import check_block

#: Bytes of one band's score tensor (float32); a selector keeps a few of these alive at once.
BAND_BYTES = 64 << 20


def moba(q, k, *, block: int = 128, topk: int = 8, causal: bool = True, per: str = "block"):
    """MoBA's gate: the key blocks of each query block (``per="block"``) or query token (``per="token"``).

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]`` (Hq a multiple of Hkv), arrays of one framework.
        block: the block size of keys (and of queries, for ``per="block"``).
        topk: blocks chosen by score besides the own block.
        causal: the own block (the one holding the row's last query, aligned bottom-right when
            ``Sq != Sk``) always in, later blocks never; else a plain top-k of all blocks.
        per: ``"block"`` (indices for `cusparseattn.dynamic.block_indices`) or ``"token"`` (for
            `cusparseattn.dynamic.token_indices`).

    Returns:
        int32 indices ``[B, Hq, rows, topk + 1]`` (``topk`` when not causal), in q's framework and device.

    >>> import numpy as np
    >>> q, k = np.random.default_rng(1).standard_normal((2, 1, 1, 64, 8))
    >>> moba(q, k, block=16, topk=1, per="token").shape
    (1, 1, 64, 2)
    """
    xp = _namespace(q, k)
    q, k = _detached(q), _detached(k)
    bk = check_block("block", block)
    _check_count("topk", topk, 1)
    if per not in ("block", "token"):
        raise ValueError(f"per must be 'block' or 'token', got {per!r}")
    (nb, hq, sq, _), (_, hkv, sk, _) = _shapes(q, k)
    n_k = -(-sk // bk)
    held = wrap(q, "q"), wrap(k, "k")
    if not moba_kernel.reasons(*held, n_k):
        return moba_kernel.select(*held, block=bk, topk=topk, causal=causal, per=per, n_k=n_k)
    work = _work(xp, q)
    means = _pooled(xp, k, bk, work)  # [B, Hkv, nK, D]
    queries = _pooled(xp, q, bk, work) if per == "block" else xp.astype(q, work)
    rows_total = queries.shape[2]
    width = topk + 1 if causal else topk
    step = _band_rows(nb * hq * n_k)
    device = array_api_compat.device(q)
    out = []
    for r0 in range(0, rows_total, step):
        r1 = min(r0 + step, rows_total)
        s = _grouped(xp, queries[:, :, r0:r1], xp.matrix_transpose(means))  # [B, Hq, rows, nK]
        if causal:
            own = _own_block(xp, r0, r1, per, bk, sq, sk, device)  # [rows, 1]
            cols = xp.reshape(xp.arange(n_k, device=device), (1, -1))
            s = xp.where(cols == own, _const(xp, math.inf, work, device), s)
            s = xp.where(cols > own, _const(xp, -math.inf, work, device), s)
        out.append(_top(xp, s, width))
    return xp.concat(out, axis=2)


def nsa(
    q,
    k,
    *,
    block: int = 64,
    topk: int = 16,
    init_blocks: int = 1,
    local_blocks: int = 2,
    k_cmp=None,
    scale=None,
):
    """NSA's selection: per query token, the key blocks its KV group attends (``[B, Hkv, Sq, topk]``).

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]`` (Hq a multiple of Hkv), arrays of one framework.
        block: the key block size (NSA's selection block, 64).
        topk: blocks per token, the forced ones included (NSA's n = 16).
        init_blocks: the first blocks, always in (NSA: 1).
        local_blocks: the blocks up to the query's own, always in (NSA: 2; the own block, which is not
            wholly in the past, has no compressed score and is in only through these).
        k_cmp: the compressed keys ``[B, Hkv, nK, D]``, one per block (NSA's learned compression); by default
            each block's mean key.
        scale: the factor of the compressed scores, ``1 / sqrt(D)`` by default.

    Causal, aligned bottom-right when ``Sq != Sk``: a block is scored when it is wholly at or before the
    query, and never chosen when it starts after it.

    >>> import numpy as np
    >>> q = np.random.default_rng(2).standard_normal((1, 4, 256, 16))
    >>> k = np.random.default_rng(3).standard_normal((1, 2, 256, 16))
    >>> idx = nsa(q, k, block=16, topk=4)
    >>> idx.shape, idx[0, 0, 40].tolist()  # token 40: block 0, its own (2) and the one before (1)
    ((1, 2, 256, 4), [0, 1, 2, -1])
    """
    xp = _namespace(q, k)
    q, k = _detached(q), _detached(k)
    bk = check_block("block", block)
    _check_count("topk", topk, 1)
    _check_count("init_blocks", init_blocks, 0)
    _check_count("local_blocks", local_blocks, 0)
    if init_blocks + local_blocks > topk:
        raise ValueError(
            f"init_blocks + local_blocks = {init_blocks + local_blocks} blocks are always in, more than "
            f"topk = {topk}: raise topk or force fewer blocks"
        )
    (nb, hq, sq, d), (_, hkv, sk, _) = _shapes(q, k)
    work = _work(xp, q)
    n_k = -(-sk // bk)
    if k_cmp is None:
        k_cmp = _pooled(xp, k, bk, work)
    else:
        if tuple(k_cmp.shape) != (nb, hkv, n_k, d):
            raise ValueError(
                f"k_cmp must have shape [B, Hkv, nK, D] = {[nb, hkv, n_k, d]}, got {k_cmp.shape}"
            )
        k_cmp = xp.astype(_detached(k_cmp), work)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    device = array_api_compat.device(q)
    minus_inf, plus_inf = (_const(xp, x, work, device) for x in (-math.inf, math.inf))
    cols = xp.reshape(xp.arange(n_k, device=device), (1, -1))
    group = hq // hkv
    out = []
    step = _band_rows(nb * hq * n_k)
    for r0 in range(0, sq, step):
        r1 = min(r0 + step, sq)
        s = _grouped(xp, xp.astype(q[:, :, r0:r1], work), xp.matrix_transpose(k_cmp))
        s *= scale
        own = _own_block(xp, r0, r1, "token", bk, sq, sk, device)  # [rows, 1]
        # Whole blocks at or before the query: ends (j + 1) * bk - 1 <= its aligned position.
        last = xp.reshape(xp.arange(r0, r1, device=device), (-1, 1)) + (sk - sq)
        visible = (cols + 1) * bk - 1 <= last
        s = xp.where(visible, s, minus_inf)
        m = xp.max(s, axis=-1, keepdims=True)
        m = xp.where(m == -math.inf, _const(xp, 0.0, work, device), m)  # no visible block: p = 0, no NaN
        p = xp.exp(s - m)
        total = xp.sum(p, axis=-1, keepdims=True)
        p = p / xp.where(total > 0, total, _const(xp, 1.0, work, device))
        shape = (nb, hkv, group, r1 - r0, n_k)
        score = xp.sum(xp.reshape(p, shape), axis=2)  # summed over the group's query heads
        forced = ((cols < init_blocks) | (cols > own - local_blocks)) & (cols <= own)
        score = xp.where(visible, score, minus_inf)
        score = xp.where(forced, plus_inf, score)
        out.append(_top(xp, score, topk))
    return xp.concat(out, axis=2)


# ---- pieces ------------------------------------------------------------------------------------------------


def _namespace(q, k):
    for name, x in (("q", q), ("k", k)):
        if not array_api_compat.is_array_api_obj(x):
            raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch or JAX array, got {type(x).__qualname__}")
    try:
        return array_api_compat.array_namespace(q, k)
    except TypeError:
        raise TypeError(
            f"q and k must be arrays of one framework, got {type(q).__module__} and {type(k).__module__}"
        ) from None


def _detached(x):
    """Selection is not differentiable: torch tensors leave autograd's graph."""
    return x.detach() if hasattr(x, "detach") and hasattr(x, "requires_grad") else x


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _shapes(q, k):
    qs, ks = tuple(q.shape), tuple(k.shape)
    for name, shape in (("q", qs), ("k", ks)):
        if len(shape) != 4 or 0 in shape:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {shape}")
    if ks[0] != qs[0] or ks[3] != qs[3]:
        raise ValueError(f"k must have q's batch and head dim ({qs[0]}, {qs[3]}), got shape {ks}")
    if qs[1] % ks[1]:
        raise ValueError(f"k has {ks[1]} heads, and q's {qs[1]} heads are not a multiple of it")
    return qs, ks


def _work(xp, x):
    return xp.float64 if x.dtype == xp.float64 else xp.float32


def _const(xp, value: float, dtype, device):
    return xp.asarray(value, dtype=dtype, device=device)


def _band_rows(per_row: int) -> int:
    return max(1, BAND_BYTES // (4 * per_row))


def _pooled(xp, x, block: int, work):
    """The mean of each block of ``block`` tokens of ``x [B, H, S, D]``: ``[B, H, ceil(S / block), D]`` (the
    last block's mean over the tokens it has)."""
    nb, h, s, d = x.shape
    full = s // block
    parts = []
    if full:
        blocks = xp.reshape(x[:, :, : full * block], (nb, h, full, block, d))
        parts.append(xp.sum(blocks, axis=3, dtype=work) / block)
    if s % block:
        parts.append(xp.sum(x[:, :, full * block :], axis=2, keepdims=True, dtype=work) / (s % block))
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=2)


def _own_block(xp, r0: int, r1: int, per: str, block: int, sq: int, sk: int, device):
    """``[rows, 1]``: the key block holding each row's last query, aligned bottom-right (negative: no key)."""
    rows = xp.arange(r0, r1, device=device)
    last = xp.minimum((rows + 1) * block, sq) - 1 if per == "block" else rows
    aligned = last + (sk - sq)
    return xp.reshape(xp.where(aligned >= 0, aligned // block, -1), (-1, 1))


def _grouped(xp, a, b):
    """``a @ b`` with ``a [n, Hq, r, x]`` per query head and ``b [n, Hkv, x, c]`` per KV head (GQA)."""
    n, hq, r, x = a.shape
    hkv = b.shape[1]
    out = xp.matmul(xp.reshape(a, (n, hkv, hq // hkv, r, x)), xp.expand_dims(b, axis=2))
    return xp.reshape(out, (n, hq, r, b.shape[-1]))


def _top(xp, scores, width: int):
    """The ``width`` best columns of each row (ties: the smaller index), ascending, -1 for a pick of -inf
    (excluded) and for the places past the row's columns: int32 ``[..., width]``."""
    n = scores.shape[-1]
    order = xp.argsort(scores, axis=-1, descending=True, stable=True)[..., :width]
    picked = xp.take_along_axis(scores, order, axis=-1)
    order = xp.where(picked == -math.inf, n, order)  # n sorts after every block, then becomes -1
    order = xp.sort(order, axis=-1)
    order = xp.astype(xp.where(order == n, -1, order), xp.int32)
    if width > n:
        pad = xp.full(
            (*order.shape[:-1], width - n), -1, dtype=xp.int32, device=array_api_compat.device(order)
        )
        order = xp.concat([order, pad], axis=-1)
    return order
