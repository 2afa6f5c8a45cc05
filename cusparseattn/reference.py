"""The reference: block-sparse attention forward and backward, the oracle of every test.

It computes the same function as the kernels: ``S = scale * q @ k^T``, modified by an optional score_mod
(`cusparseattn.mods`), masked by the layout (blocks, and the token rule inside partial blocks only), a
softmax in float32 (float64 on request), ``out = P @ v`` and the natural-log log-sum-exp of each row. The
backward is the flash-attention one: it recomputes ``P = exp(S - lse)`` and uses ``delta = rowsum(dout *
out)``.

It runs where its arrays are: it is written against the array API standard (through ``array_api_compat``),
so NumPy arrays run on the host and CuPy arrays on their GPU, with no copy of the arrays to the host. The
layout is host data: each band's token mask is described on the host (its blocks' masks, the rule evaluated
in partial blocks only), sent to the arrays' device (a copy of a few booleans towards the device only) and
built there.
A score mod runs on the scores where they are.

Memory stays bounded: query rows are processed in bands, and each band gathers only the key blocks that its
block rows set, so a sparse layout costs proportionally less and no ``Sq x Sk`` array is ever built. A
band's score tensor (``batch x heads x rows x gathered keys``) holds at most `CHUNK_BYTES` (on a GPU
`DEVICE_CHUNK_BYTES`); peak extra memory is a few times that, plus the inputs upcast to the working precision.

A query row that attends to nothing gets ``out = 0``, ``lse = -inf`` and zero gradients, never NaN.

>>> import numpy as np
>>> from cusparseattn.layout import BlockLayout
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 64, 16), dtype=np.float32)
>>> lay = BlockLayout(np.tril(np.ones((4, 4), bool)), block_size=16, seq_q=64)
>>> out, lse = forward(q, k, v, lay)
>>> out.dtype, lse.shape
(dtype('float32'), (1, 2, 64))
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import array_api_compat
import ml_dtypes
import numpy as np

from .dynamic import DynamicLayout
from .layout import BlockLayout
from .trace import ScoreMod

# Bytes of one band's score tensor in the working precision (the largest temporary; forward keeps about two
# of these alive, backward about three), on the host and on a GPU, where a band costs its launches whatever
# its size, so fewer larger ones run faster. Tests lower them to exercise the banding.
CHUNK_BYTES = 64 << 20
DEVICE_CHUNK_BYTES = 256 << 20

_PRECISIONS = {np.dtype(np.float32), np.dtype(np.float64)}


def forward(q, k, v, layout: BlockLayout, *, scale=None, precision=np.float32, score_mod=None):
    """Block-sparse attention: ``(out, lse)`` for ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]``.

    Arrays of any one array-API namespace (NumPy, CuPy, ...); the results are of that namespace, on the
    arrays' device. Query head ``h`` uses key/value head ``h // (Hq // Hkv)``. Inputs are upcast exactly to
    ``precision`` (float32 or float64), ``out`` is rounded once to the inputs' dtype; ``lse [B, Hq, Sq]`` has
    the dtype of ``precision``. Empty rows (every score masked, or modified to -inf) give ``out = 0`` and
    ``lse = -inf``.

    ``score_mod`` (a `cusparseattn.trace.ScoreMod` or a function to trace) replaces each scaled score ``s``
    by ``score_mod(s, b, h, q, k)`` before the mask (``h`` the query head, ``q, k`` global positions: the
    layout's ``origin`` added); the lse is over the modified scores.

    >>> import numpy as np
    >>> from cusparseattn.layout import BlockLayout
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 40, 8)).astype(np.float16)
    >>> k, v = rng.standard_normal((2, 2, 2, 50, 8)).astype(np.float16)
    >>> lay = BlockLayout(np.ones((3, 4), bool), block_size=16, seq_q=40, seq_k=50)
    >>> out, lse = forward(q, k, v, lay)
    >>> out.shape, out.dtype, lse.dtype
    ((2, 4, 40, 8), dtype('float16'), dtype('float32'))
    """
    xp, (q, k, v) = _arrays(q=q, k=k, v=v)
    _check_qkv(xp, q, k, v)
    layout = _host_layout(layout, q.shape, k.shape)
    _check_layout(layout, q.shape, k.shape)
    prec = _precision(precision)
    work = getattr(xp, prec.name)  # the working dtype in the arrays' namespace
    scale = _scale(scale, q.shape[-1])
    mod = _score_mod(score_mod)
    device = array_api_compat.device(q)
    qp, kp, vp = (xp.astype(x, work, copy=False) for x in (q, k, v))
    out = xp.zeros(q.shape, dtype=work, device=device)
    lse = xp.full(q.shape[:3], -math.inf, dtype=work, device=device)
    for c in _chunks(layout, q.shape, k.shape[1], prec.itemsize, _chunk_bytes(xp)):
        band = _Band(xp, c, device)
        s = _scores(xp, qp[c.rows], band.gather(kp), scale)
        if mod is not None:
            s = mod.evaluate(s, *band.positions(layout))
        s = band.masked(s)
        m = xp.max(s, axis=-1, keepdims=True)
        # An empty row has max -inf: shift it by 0 instead, so exp gives 0 and never exp(-inf - -inf) = NaN.
        m = xp.where(m == -math.inf, band.zero(work), m)
        s -= m
        p = xp.exp(s)
        del s
        denom = xp.sum(p, axis=-1)
        nonempty = denom > 0
        denom = xp.where(nonempty, denom, band.one(work))  # an empty row: 0 / 1, and no log(0)
        o = _grouped(xp, p, band.gather(vp))
        o /= xp.expand_dims(denom, axis=-1)
        out[c.rows] = o
        lse[c.rows] = xp.where(nonempty, m[..., 0] + xp.log(denom), band.minus_inf(work))
    return xp.astype(out, q.dtype), lse


def backward(
    dout, q, k, v, out, lse, layout: BlockLayout, *, scale=None, precision=np.float32, score_mod=None
):
    """Gradients ``(dq, dk, dv)`` of block-sparse attention, given the forward's ``out`` and ``lse``.

    Arrays of one namespace, as in `forward`. Flash-attention math: ``P = exp(S - lse)``, ``dV = P^T dO``,
    ``dP = dO V^T``, ``delta = rowsum(dO * O)`` (from ``out`` as given), ``dS = P * (dP - delta)``, ``dQ =
    scale * dS K``, ``dK = scale * dS^T Q``; with GQA, ``dk`` and ``dv`` sum over the query heads of each
    group. Rows with ``lse = -inf`` contribute nothing. Each gradient has the dtype of its input. With a
    ``score_mod`` (as in `forward`), ``S`` is the modified score and ``dS`` is multiplied by the mod's
    derivative at the raw scaled score (0 where ``P`` is 0, never NaN).

    >>> import numpy as np
    >>> from cusparseattn.layout import BlockLayout
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 1, 32, 8))
    >>> lay = BlockLayout(np.tril(np.ones((2, 2), bool)), block_size=16, seq_q=32)
    >>> out, lse = forward(q, k, v, lay, precision=np.float64)
    >>> dq, dk, dv = backward(np.ones_like(out), q, k, v, out, lse, lay, precision=np.float64)
    >>> bool(np.allclose(dv.sum(axis=2), 32))  # each query row's probabilities sum to 1
    True
    """
    xp, (dout, q, k, v, out, lse) = _arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    _check_qkv(xp, q, k, v)
    layout = _host_layout(layout, q.shape, k.shape)
    _check_layout(layout, q.shape, k.shape)
    for name, arr, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, q.shape[:3])):
        if arr.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (from q), got {arr.shape}")
    prec = _precision(precision)
    work = getattr(xp, prec.name)  # the working dtype in the arrays' namespace
    scale = _scale(scale, q.shape[-1])
    mod = _score_mod(score_mod)
    device = array_api_compat.device(q)
    qp, kp, vp, dop, outp, lsep = (xp.astype(x, work, copy=False) for x in (q, k, v, dout, out, lse))
    dq, dk, dv = (xp.zeros(x.shape, dtype=work, device=device) for x in (qp, kp, vp))
    for c in _chunks(layout, q.shape, k.shape[1], prec.itemsize, _chunk_bytes(xp)):
        band = _Band(xp, c, device)
        hkv = c.k1 - c.k0
        qc, doc, kc, vc = qp[c.rows], dop[c.rows], band.gather(kp), band.gather(vp)
        delta = xp.sum(doc * outp[c.rows], axis=-1, keepdims=True)
        # P = exp(S - lse): an lse of -inf (empty row) becomes +inf so that P is 0 even where S is -inf.
        row_lse = lsep[c.rows]
        row_lse = xp.where(row_lse == -math.inf, band.plus_inf(work), row_lse)
        s = _scores(xp, qc, kc, scale)
        if mod is not None:
            positions = band.positions(layout)
            slope = mod.grad(s, *positions)
            s = mod.evaluate(s, *positions)
        s = band.masked(s)
        s -= xp.expand_dims(row_lse, axis=-1)
        p = xp.exp(s)
        del s
        band.add(dv, _grouped_t(xp, p, doc, hkv))
        ds = _grouped(xp, doc, xp.matrix_transpose(vc))
        ds -= delta
        ds *= p
        if mod is not None:  # only where P > 0: the derivative may be inf or NaN where the pair is masked
            ds = xp.where(p > 0, ds * slope, ds)
        del p
        dq[c.rows] = scale * _grouped(xp, ds, kc)
        band.add(dk, scale * _grouped_t(xp, ds, qc, hkv))
    return xp.astype(dq, q.dtype), xp.astype(dk, k.dtype), xp.astype(dv, v.dtype)


def dense_forward(q, k, v, mask, *, scale=None, precision=np.float64, score_mod=None):
    """Plain masked softmax attention with a full token mask ``[B|1, H|1, Sq, Sk]``: the oracle of the oracle.

    Written as directly as possible (GQA by repeating k/v heads, the whole ``Sq x Sk`` score matrix), for
    tests at small sizes. Same contract as `forward`, except that ``score_mod`` is called as a plain function
    on NumPy arrays ``(scores, b, h, q, k)``, not traced.

    >>> import numpy as np
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 1, 8, 4))
    >>> out, lse = dense_forward(q, k, v, np.tril(np.ones((8, 8), bool)))
    >>> bool(np.allclose(out[0, 0, 0], v[0, 0, 0]))  # the first query sees only the first key
    True
    """
    prec = _precision(precision)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    _check_qkv(np, q, k, v)
    scale = _scale(scale, q.shape[-1])
    (b, hq, sq, _), (_, hkv, sk, _) = q.shape, k.shape
    mask = np.asarray(mask, dtype=bool)
    try:
        mask = np.broadcast_to(mask, (b, hq, sq, sk))
    except ValueError:
        raise ValueError(
            f"mask must broadcast to [B, Hq, Sq, Sk] = {[b, hq, sq, sk]}, got {mask.shape}"
        ) from None
    qp = q.astype(prec)
    kp, vp = (np.repeat(x.astype(prec), hq // hkv, axis=1) for x in (k, v))
    s = scale * (qp @ kp.swapaxes(-1, -2))
    if score_mod is not None:
        b_idx, h_idx = np.arange(b)[:, None, None, None], np.arange(hq)[None, :, None, None]
        s = np.asarray(score_mod(s, b_idx, h_idx, np.arange(sq)[:, None], np.arange(sk)[None, :]), dtype=prec)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = (p @ vp) / np.where(denom > 0, denom, 1)
    with np.errstate(divide="ignore"):
        lse = np.where(denom > 0, m + np.log(denom), -np.inf)[..., 0]
    return out.astype(q.dtype), lse.astype(prec)


# ---- validation --------------------------------------------------------------------------------------------


def _arrays(**arrays):
    """``(namespace, arrays)``: the array-API namespace that the arrays share and the arrays, anything else
    (lists, scalars) made a NumPy array first. Raises naming each argument's namespace when they differ."""
    arrays = {
        name: x if array_api_compat.is_array_api_obj(x) else np.asarray(x) for name, x in arrays.items()
    }
    spaces = {name: array_api_compat.array_namespace(x) for name, x in arrays.items()}
    if len(set(spaces.values())) > 1:
        got = ", ".join(f"{name} {space.__name__}" for name, space in spaces.items())
        raise TypeError(f"{', '.join(arrays)} must be arrays of one namespace, got {got}")
    return next(iter(spaces.values())), tuple(arrays.values())


def _precision(precision) -> np.dtype:
    try:
        prec = np.dtype(precision)
    except TypeError:
        prec = None
    if prec not in _PRECISIONS:
        raise ValueError(f"precision must be float32 or float64, got {precision!r}")
    return prec


def _dtype_name(xp, dtype) -> str | None:
    """The name of ``dtype`` of namespace ``xp`` if it is float16, bfloat16 (ml_dtypes' NumPy dtype: NumPy
    alone has it), float32 or float64; else None."""
    for name in ("float16", "float32", "float64"):
        if dtype == getattr(xp, name, None):
            return name
    return "bfloat16" if isinstance(dtype, np.dtype) and dtype == ml_dtypes.bfloat16 else None


def _check_qkv(xp, q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions [batch, heads, seq, head_dim], got shape {x.shape}"
            )
        if _dtype_name(xp, x.dtype) is None:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"k has batch {bk}, expected q's batch {b}")
    if dk != d:
        raise ValueError(f"k has head_dim {dk}, expected q's head_dim {d}")
    if hq % hkv:
        raise ValueError(f"k has {hkv} heads, and q's {hq} heads are not a multiple of it")


def _host_layout(layout, q_shape, k_shape):
    """A `cusparseattn.dynamic.DynamicLayout` as the `BlockLayout` of its selection (its indices read on the
    host, ignored entries ignored: the kernels' rule, without the call's checks), anything else as it is."""
    if not isinstance(layout, DynamicLayout):
        return layout
    (_, hq, sq, _), (_, hkv, sk, _) = q_shape, k_shape
    rows = -(-sq // layout.block_size[0]) if layout.per == "block" else sq
    if layout.rows != rows or layout.heads not in (1, hq, hkv) or layout.batch not in (1, q_shape[0]):
        raise ValueError(
            f"layout's indices {tuple(layout.indices.shape)} do not fit q {q_shape} and k {k_shape}: "
            "expected "
            f"[1 or {q_shape[0]}, 1 or {hq} or {hkv}, {rows}, k]"
        )
    return layout.to_layout(sq, sk, hq, hkv)


def _check_layout(layout, q_shape, k_shape) -> None:
    (b, hq, sq, _), sk = q_shape, k_shape[2]
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout or a DynamicLayout, got {type(layout).__name__}")
    if (layout.seq_q, layout.seq_k) != (sq, sk):
        raise ValueError(
            f"layout is for seq_q={layout.seq_q}, seq_k={layout.seq_k}, but q has {sq} tokens and k has {sk}"
        )
    if layout.batch not in (1, b):
        raise ValueError(f"layout has batch {layout.batch}, expected 1 or q's batch {b}")
    if layout.heads not in (1, hq):
        raise ValueError(f"layout has {layout.heads} heads, expected 1 or q's {hq} heads")


def _scale(scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _score_mod(score_mod) -> ScoreMod | None:
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    return ScoreMod.trace(score_mod)


# ---- the banded walk ---------------------------------------------------------------------------------------


class _Chunk(NamedTuple):
    """Query rows ``r0:r1`` of batches ``b0:b1``, query heads ``h0:h1`` (key/value heads ``k0:k1``), against
    the key tokens ``cols`` (sorted), which are the ``runs`` of consecutive tokens ``(start, stop)``;
    ``mask`` builds the booleans that broadcast against the scores ``[b, h, rows, cols]``, None where every
    pair attends."""

    b0: int
    b1: int
    h0: int
    h1: int
    k0: int
    k1: int
    r0: int
    r1: int
    cols: np.ndarray
    runs: tuple[tuple[int, int], ...]
    mask: _BandMask | None

    @property
    def rows(self) -> tuple:
        """Index of the band's query rows in ``q``, ``out``, ``lse``: ``[b, h, rows]``."""
        return slice(self.b0, self.b1), slice(self.h0, self.h1), slice(self.r0, self.r1), ...


def _chunk_bytes(xp) -> int:
    return DEVICE_CHUNK_BYTES if array_api_compat.is_cupy_namespace(xp) else CHUNK_BYTES


def _chunks(layout: BlockLayout, q_shape, hkv: int, itemsize: int, budget: int) -> Iterator[_Chunk]:
    """Walk the layout's (batch, head) slices, and in each, bands of query rows with the key blocks they set.

    Batch elements and heads that share a block mask are processed together; a band grows block row by block
    row while its score tensor stays under ``budget`` bytes (and is cut into fewer rows when even one block
    row is too large). Block rows with no block set are skipped: their output stays 0 and their lse -inf.
    """
    nb, hq, sq, _ = q_shape
    group = hq // hkv
    bq, bk = layout.block_size
    for bl in range(layout.batch):
        b0, b1 = (bl, bl + 1) if layout.batch > 1 else (0, nb)
        for hl in range(layout.heads):
            if layout.heads > 1:
                h0, h1, k0, k1 = hl, hl + 1, hl // group, hl // group + 1
            else:
                h0, h1, k0, k1 = 0, hq, 0, hkv
            blocks = layout.blocks[bl, hl]
            partial = layout.partial[bl, hl]
            row_bytes = (b1 - b0) * (h1 - h0) * itemsize
            b_idx, h_idx = np.arange(b0, b1), np.arange(h0, h1)
            for r0, r1, cols, runs in _bands(blocks, bq, bk, sq, layout.seq_k, row_bytes, budget):
                mask = _band_mask(layout, blocks, partial, b_idx, h_idx, np.arange(r0, r1), cols)
                yield _Chunk(b0, b1, h0, h1, k0, k1, r0, r1, cols, runs, mask)


def _bands(blocks: np.ndarray, bq: int, bk: int, seq_q: int, seq_k: int, row_bytes: int, budget: int):
    """Yield ``(r0, r1, cols, runs)``: query rows, the sorted key tokens of the blocks that those rows set,
    and those tokens as runs of consecutive ones."""
    nq = blocks.shape[0]
    nonempty = blocks.any(axis=1)
    start = 0
    while start < nq:
        if not nonempty[start]:
            start += 1
            continue
        union, end = blocks[start].copy(), start + 1
        while end < nq and nonempty[end]:
            grown = union | blocks[end]
            if (end + 1 - start) * bq * np.count_nonzero(grown) * bk * row_bytes > budget:
                break
            union, end = grown, end + 1
        cols = (np.flatnonzero(union)[:, None] * bk + np.arange(bk)).ravel()
        cols = cols[cols < seq_k]
        runs = _runs(union, bk, seq_k)
        r0, r1 = start * bq, min(end * bq, seq_q)
        step = max(1, budget // (cols.size * row_bytes))
        for r in range(r0, r1, step):
            yield r, min(r + step, r1), cols, runs
        start = end


def _runs(union: np.ndarray, bk: int, seq_k: int) -> tuple[tuple[int, int], ...]:
    """The key tokens of the set blocks as runs ``(start, stop)`` of consecutive blocks, cut at ``seq_k``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], union, [False])).astype(np.int8)))
    return tuple((int(a) * bk, min(int(b) * bk, seq_k)) for a, b in zip(edges[::2], edges[1::2], strict=True))


class _BandMask(NamedTuple):
    """One band's token mask in the few bytes that make it, sent to the arrays' device and built there: its
    tiles (``[.., n, bq, bk]`` booleans: all False, all True, then the rule's values in each partial block)
    and which tile each of its blocks takes (``[nqb, nkb]``, block rows by block columns); the band is rows
    ``first : first + rows`` and the first ``cols`` columns of those blocks' tokens."""

    tiles: np.ndarray
    pick: np.ndarray
    first: int
    rows: int
    cols: int

    def build(self, xp, device):
        """The mask, ``[rows, cols]`` or ``[b|1, h|1, rows, cols]``, on ``device``."""
        lead = self.tiles.shape[:-3]
        (bq, bk), (nqb, nkb) = self.tiles.shape[-2:], self.pick.shape
        tiles = xp.asarray(self.tiles, device=device)
        mask = xp.take(tiles, xp.asarray(self.pick.ravel(), device=device), axis=len(lead))
        mask = xp.reshape(mask, (*lead, nqb, nkb, bq, bk))
        axes = tuple(range(len(lead)))
        mask = xp.reshape(
            xp.permute_dims(mask, (*axes, *(a + len(lead) for a in (0, 2, 1, 3)))),
            (*lead, nqb * bq, nkb * bk),
        )
        return mask[..., self.first : self.first + self.rows, : self.cols]


def _band_mask(layout, blocks, partial, b_idx, h_idx, rows, cols) -> _BandMask | None:
    """The token mask of one band: a block lookup, with the rule evaluated only in the partial blocks (at
    positions past the sequences clamped, then cut); None where every pair of the band attends.

    Same values as ``layout.token_mask`` (the rule gets absolute batch and query-head indices). The mask is
    ``[rows, cols]`` unless the rule depends on the batch or head, then ``[b|1, h|1, rows, cols]``. ``rows``
    are consecutive, ``cols`` the tokens of whole key blocks, the last cut at the sequence's end.
    """
    bq, bk = layout.block_size
    qb = np.arange(rows[0] // bq, rows[-1] // bq + 1)
    kb = np.unique(cols // bk)
    pick = blocks[np.ix_(qb, kb)].astype(np.intp)  # tile 0: no pair attends; 1: every pair
    pi, pj = np.nonzero(partial[np.ix_(qb, kb)]) if layout.rule is not None else ((), ())
    if len(pi) == 0 and pick.all():
        return None
    tiles = np.stack([np.zeros((bq, bk), bool), np.ones((bq, bk), bool)])
    if len(pi):
        q = np.minimum((qb[pi] * bq)[:, None, None] + np.arange(bq)[:, None], layout.seq_q - 1)
        k = np.minimum((kb[pj] * bk)[:, None, None] + np.arange(bk), layout.seq_k - 1)
        vals = layout.rule(b_idx[:, None, None, None, None], h_idx[None, :, None, None, None], q, k)
        vals = np.broadcast_to(vals, np.broadcast_shapes(np.shape(vals), (len(pi), bq, bk)))
        tiles = np.concatenate([np.broadcast_to(tiles, vals.shape[:-3] + tiles.shape), vals], axis=-3)
        pick[pi, pj] = 2 + np.arange(len(pi))
    return _BandMask(tiles.astype(bool), pick, int(rows[0] - qb[0] * bq), rows.size, cols.size)


class _Band:
    """One chunk on the arrays' side: its key tokens gathered from and added into arrays of namespace ``xp``
    by slices of its runs, its mask and positions sent to the arrays' device."""

    def __init__(self, xp, chunk: _Chunk, device):
        self.xp, self.chunk, self.device = xp, chunk, device

    def _keys(self, a: int, b: int) -> tuple:
        c = self.chunk
        return slice(c.b0, c.b1), slice(c.k0, c.k1), slice(a, b), ...

    def gather(self, x):
        """The band's key tokens of ``x [B, Hkv, Sk, D]``: ``[b, hkv, cols, D]``, a copy. Never a view: where
        q and k are one array, NumPy computes ``q @ k^T`` on views of it as a symmetric product, which rounds
        differently, and the reference gives the same bits whichever buffers it is handed."""
        return self.xp.concat([x[self._keys(a, b)] for a, b in self.chunk.runs], axis=2)

    def add(self, target, grads) -> None:
        """``target`` (like the keys) += ``grads`` (like `gather`'s result), at the band's key tokens."""
        at = 0
        for a, b in self.chunk.runs:
            target[self._keys(a, b)] += grads[:, :, at : at + b - a, :]
            at += b - a

    def masked(self, s):
        """The scores with the masked pairs set to -inf."""
        if self.chunk.mask is None:
            return s
        mask = self.chunk.mask.build(self.xp, self.device)
        return self.xp.where(mask, s, self.minus_inf(s.dtype))

    def positions(self, layout: BlockLayout) -> tuple:
        """The band's batch, query-head, global query and global key indices, broadcasting against its
        scores."""
        xp, c, device = self.xp, self.chunk, self.device
        q0, k0 = getattr(layout, "origin", (0, 0))
        return (
            xp.reshape(xp.arange(c.b0, c.b1, device=device), (-1, 1, 1, 1)),
            xp.reshape(xp.arange(c.h0, c.h1, device=device), (1, -1, 1, 1)),
            xp.reshape(xp.arange(c.r0 + q0, c.r1 + q0, device=device), (-1, 1)),
            xp.reshape(xp.asarray(c.cols + k0, device=device), (1, -1)),
        )

    # 0-d constants on the device, for `where`: not every namespace takes Python scalars there.
    def zero(self, dtype):
        return self.xp.asarray(0.0, dtype=dtype, device=self.device)

    def one(self, dtype):
        return self.xp.asarray(1.0, dtype=dtype, device=self.device)

    def minus_inf(self, dtype):
        return self.xp.asarray(-math.inf, dtype=dtype, device=self.device)

    def plus_inf(self, dtype):
        return self.xp.asarray(math.inf, dtype=dtype, device=self.device)


# ---- tile algebra ------------------------------------------------------------------------------------------


def _scores(xp, qc, kc, scale: float):
    """``scale * q @ k^T`` with GQA (a fresh array the caller may overwrite)."""
    s = _grouped(xp, qc, xp.matrix_transpose(kc))
    s *= scale
    return s


def _grouped(xp, a, b):
    """``a @ b`` where ``a [n, Hq, r, x]`` has query heads and ``b [n, Hkv, x, c]`` key/value heads (GQA)."""
    n, hq, r, x = a.shape
    hkv = b.shape[1]
    grouped = xp.matmul(xp.reshape(a, (n, hkv, hq // hkv, r, x)), xp.expand_dims(b, axis=2))
    return xp.reshape(grouped, (n, hq, r, b.shape[-1]))


def _grouped_t(xp, a, b, hkv: int):
    """``a^T @ b`` summed over each group's query heads: ``[n, Hq, r, c], [n, Hq, r, x] -> [n, Hkv, c, x]``.

    The group's heads are folded into the contraction, so the sum is one matmul, not a ``[.., Hq, c, x]``
    temporary.
    """
    n, hq, r, c = a.shape
    g = hq // hkv
    at = xp.permute_dims(xp.reshape(a, (n, hkv, g, r, c)), (0, 1, 4, 2, 3))
    return xp.matmul(xp.reshape(at, (n, hkv, c, g * r)), xp.reshape(b, (n, hkv, g * r, b.shape[-1])))
