"""Dynamic layouts: the key blocks that each query block (MoBA; FlexAttention's ``BlockMask.from_kv_blocks``)
or each query token (NSA) attends, given as integer arrays that the caller's code makes at every step, where
its arrays are.

`block_indices` takes ``indices [B|1, H|1, nQ, k]``, the key blocks of each query block; `token_indices`
takes ``indices [B|1, H|1, Sq, k]``, those of each query token. Both are int32 arrays of q's framework and
device; an entry is a key block index, and ``-1`` pads a row. ``counts [B|1, H|1, rows]`` (int32), where
given, says how many entries of each row count: the ones from ``counts`` on are padding whatever they hold.
The head axis is 1 (one selection for all heads), q's heads (one per query head) or k's heads (one per KV
head: the query heads of a group share it, as NSA's selection does).

What a query attends is ``(chosen & within) | plus``: the key tokens of its chosen blocks, intersected with a
static layout or Pattern ``within`` (``dyn & patterns.causal()``: causal inside the chosen blocks; the call's
``causal=True`` does the same), joined with a static ``plus`` (``dyn | patterns.local(512)``: an always-on
window; ``dyn | patterns.streaming(...)``: sinks). ``&`` and ``|`` with static layouts or Patterns keep that
form (``(d | a) & b`` is ``(d & b) | (a & b)``), so any mix of them is one `DynamicLayout`. The static parts
have the dynamic layout's block size.

Bad values have a defined meaning everywhere: an entry that is negative or not below the number of key blocks
is ignored (as padding), a block listed twice counts once, counts are clamped to ``[0, k]``. Where the arrays
are on the host, reading them is free, so the call checks them there and raises on an index below -1 or past
the last key block and on counts outside ``[0, k]``; on a GPU nothing is read back and the rule above holds.

On a GPU the CUDA kernels run per-block layouts, forward and backward, on both kernel paths: their tile
tables are built on the device at every call from the index arrays (`cusparseattn.dynamic_tables`), so a
step reads nothing back on the host and replays in a CUDA graph with the indices refilled in place. They take
one static part with partial blocks (``within`` or ``plus``: the other block-granular). A per-token layout
whose KV group of 16 to 128 query heads (a power of two) shares the selection, as NSA's does, reaches them
as a per-block layout over grouped rows (`cusparseattn.token_groups`); `backends.why_not` says what else
they refuse, and the reference runs those, reading the indices once per pass (one small copy to the host on
a GPU: `DynamicLayout.to_layout`). A new
`DynamicLayout` object makes a new plan (its tables and kernels are kept by the indices' shape) and
``torch.compile`` takes it as a constant; under ``jax.jit`` the index arrays may be traced (they are operands
of the XLA call that runs the reference, so a jitted step takes new indices without tracing again).

>>> import numpy as np
>>> import cusparseattn as ca
>>> idx = np.array([[[[0, -1], [0, 1], [0, -1], [1, 3]]]], np.int32)  # [B, H, nQ, k], blocks of 16
>>> lay = ca.dynamic.block_indices(idx, block=16) & ca.patterns.causal(block=16)
>>> lay  # doctest: +ELLIPSIS
DynamicLayout(per='block', batch=1, heads=1, rows=4, k=2, ..., numpy int32, cpu, within=causal(block=16))
>>> print(lay.to_layout(64, 64).to_string().split(":", 1)[1])
<BLANKLINE>
▒···
█▒··
█···
·█·▒
"""

from __future__ import annotations

import numpy as np

from .arrays import Tensor, device_name, signature, wrap
from .layout import BlockLayout, check_block
from .pattern import Pattern
from .recent import Recent
from .rules import TokenRule

PER = ("block", "token")
INDEX_DTYPE = "int32"
# Entries of a selection compared at once when a per-token layout's rule is evaluated (bounds its memory).
_LOOKUP_CHUNK = 1 << 20


def block_indices(indices, counts=None, *, block=128) -> DynamicLayout:
    """A dynamic layout from the key blocks of each query block: ``indices [B|1, H|1, nQ, k]`` int32.

    ``nQ`` is the number of query blocks, ``ceil(Sq / block)``; entries ``-1`` (or from ``counts`` on) pad.
    ``block`` is the block size of queries and keys (a pair for different ones), a power of two from 16 to
    128. Combine with ``&`` / ``|`` and static layouts or Patterns (module docstring).

    >>> import numpy as np
    >>> lay = block_indices(np.zeros((1, 1, 4, 2), np.int32), np.ones((1, 1, 4), np.int32), block=32)
    >>> lay.per, lay.rows, lay.width, lay.block_size
    ('block', 4, 2, (32, 32))
    """
    return DynamicLayout(indices, counts, per="block", block_size=block)


def token_indices(indices, counts=None, *, block=64) -> DynamicLayout:
    """A dynamic layout from the key blocks of each query token: ``indices [B|1, H|1, Sq, k]`` int32 (NSA's
    selection, per KV head when ``H`` is k's heads). ``block`` is the key block size; the static parts of the
    layout have blocks of ``block`` (queries and keys).

    >>> import numpy as np
    >>> idx = np.array([[[[0, -1], [0, -1], [1, 0], [1, -1]]]], np.int32)  # 4 queries, blocks of 16 keys
    >>> lay = token_indices(idx, block=16)
    >>> lay.to_dense(4, 32)[0, 0].astype(int).sum(axis=1).tolist()  # keys each query attends
    [16, 16, 32, 16]
    """
    return DynamicLayout(indices, counts, per="token", block_size=block)


def _index_holder(x, name: str) -> Tensor:
    h = wrap(x, name)
    want = "[B|1, H|1, rows, k]" if name == "indices" else "[B|1, H|1, rows]"
    if h.ndim != len(want.split(",")):
        raise ValueError(f"{name} must be {len(want.split(','))}-D {want}, got shape {h.shape}")
    if 0 in h.shape:
        raise ValueError(f"{name} has an empty dimension: shape {h.shape}")
    if h.dtype != INDEX_DTYPE:
        raise TypeError(
            f"{name} must be int32 (key block indices, -1 for padding), got {h.dtype}; "
            "convert it (torch: x.to(torch.int32), NumPy: x.astype(np.int32))"
        )
    return h


def _static(x, what: str):
    if x is None or isinstance(x, (Pattern, BlockLayout)):
        return x
    raise TypeError(f"{what} must be a Pattern or a BlockLayout, got {type(x).__qualname__}")


# The last joins of static parts, by the parts' identities (held in the value, so the ids stay theirs): a
# step that combines the same parts gets the same object, which plans and device tables are keyed by.
_joins = Recent(64)


def _join(a, b, op: str):
    """``a op b`` of two static parts (None: everything for ``&``'s within, nothing for ``|``'s plus)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, Pattern) != isinstance(b, Pattern):
        raise TypeError(
            "a dynamic layout combines Patterns with Patterns and BlockLayouts with BlockLayouts; "
            f"got {type(a).__name__} and {type(b).__name__}: build the Pattern's layout (pattern.layout(S))"
        )
    key = (id(a), id(b), op)
    kept = _joins.get(key)
    if kept is None:
        kept = _joins.put(key, (a, b, a | b if op == "|" else a & b))
    return kept[2]


class DynamicLayout:
    """Key blocks chosen per query block or per query token, as index arrays of the caller's framework,
    combined with static layouts: ``(chosen & within) | plus`` (module docstring). Made by `block_indices`
    and `token_indices`; immutable, but the arrays it holds are the caller's, read at each pass (refill them
    in place and the next call sees the new selection).

    >>> import numpy as np
    >>> from cusparseattn import patterns
    >>> dyn = token_indices(np.zeros((1, 4, 256, 2), np.int32), block=64)
    >>> (dyn & patterns.causal(block=64) | patterns.local(128, block=64)).within.name
    'causal(block=64)'
    """

    def __init__(self, indices, counts=None, *, per: str, block_size, within=None, plus=None):
        if per not in PER:
            raise ValueError(f"per must be 'block' or 'token', got {per!r}")
        bq, bk = (block_size, block_size) if np.isscalar(block_size) else tuple(block_size)
        if per == "token" and bq != bk:
            raise ValueError(f"a per-token layout takes one block size (its keys'), got {block_size!r}")
        self.block_size = (check_block("block (query)", bq), check_block("block (key)", bk))
        self.per = per
        self._indices = _index_holder(indices, "indices")
        self._counts = None if counts is None else _index_holder(counts, "counts")
        if self._counts is not None:
            c, i = self._counts, self._indices
            if c.framework != i.framework or device_name(c.device) != device_name(i.device):
                raise ValueError(
                    f"counts must be an array of indices' framework and device ({i.framework}, "
                    f"{device_name(i.device)}), got {c.framework}, {device_name(c.device)}"
                )
            if c.shape != i.shape[:3]:
                raise ValueError(f"counts must have shape indices.shape[:3] = {i.shape[:3]}, got {c.shape}")
        self._set_parts(within, plus)

    def _set_parts(self, within, plus) -> None:
        for name, part in (("within", within), ("plus", plus)):
            if _static(part, name) is not None and tuple(part.block_size) != self.block_size:
                raise ValueError(
                    f"{name} has blocks of {tuple(part.block_size)}, expected the dynamic layout's "
                    f"{self.block_size}: build it with block={self.block_size[1]}"
                )
        self.within, self.plus = within, plus

    # ---- what it holds -----------------------------------------------------------------------------------
    @property
    def indices(self):
        """The index array as the caller gave it."""
        return self._indices.native

    @property
    def counts(self):
        return None if self._counts is None else self._counts.native

    @property
    def batch(self) -> int:
        return self._indices.shape[0]

    @property
    def heads(self) -> int:
        return self._indices.shape[1]

    @property
    def rows(self) -> int:
        """Query blocks (``per='block'``) or query tokens (``per='token'``)."""
        return self._indices.shape[2]

    @property
    def width(self) -> int:
        """``k``: entries per row."""
        return self._indices.shape[3]

    @property
    def framework(self) -> str:
        return self._indices.framework

    @property
    def device(self):
        return self._indices.device

    def holders(self) -> list[Tensor]:
        return [h for h in (self._indices, self._counts) if h is not None]

    def plan_key(self) -> tuple | None:
        """What a plan of this layout depends on, for GPU arrays: ``per``, the block size, the static parts
        by identity and the index arrays' signatures (`cusparseattn.arrays.signature`), never their values;
        None on the host or inside ``jax.jit`` (those are keyed by the layout's identity)."""
        if self.traced or self.device[0] == "cpu":
            return None
        described = tuple(signature(h.native) for h in self.holders())
        return None if None in described else self._key(described)

    def signature(self) -> tuple:
        """What its passes depend on but the index values: ``per``, the block size, the static parts by
        identity, the index arrays' shapes and dtypes (the key of an XLA call, whose index buffers come with
        each call)."""
        return self._key(tuple((h.shape, h.dtype) for h in self.holders()))

    def _key(self, arrays: tuple) -> tuple:
        return (self.per, self.block_size, id(self.within), id(self.plus), arrays)

    @property
    def traced(self) -> bool:
        """Whether its arrays are traced inside ``jax.jit`` (no values yet)."""
        return any(getattr(h, "traced", False) for h in self.holders())

    def _with(self, within, plus) -> DynamicLayout:
        out = DynamicLayout.__new__(DynamicLayout)
        out.__dict__.update(self.__dict__)
        out._set_parts(within, plus)
        return out

    def with_arrays(self, indices, counts=None) -> DynamicLayout:
        """The same layout (per, block size, static parts) over other index arrays (another step's)."""
        return DynamicLayout(
            indices, counts, per=self.per, block_size=self.block_size, within=self.within, plus=self.plus
        )

    # ---- algebra with static layouts ---------------------------------------------------------------------
    def __and__(self, other) -> DynamicLayout:
        """``(chosen & within & other) | (plus & other)``."""
        other = _static(other, "the layout combined with a DynamicLayout")
        plus = None if self.plus is None else _join(self.plus, other, "&")
        return self._with(_join(self.within, other, "&"), plus)

    def __or__(self, other) -> DynamicLayout:
        """``(chosen & within) | plus | other``."""
        other = _static(other, "the layout combined with a DynamicLayout")
        return self._with(self.within, _join(self.plus, other, "|"))

    __rand__, __ror__ = __and__, __or__

    # ---- fitting a call ----------------------------------------------------------------------------------
    def fit(self, sizes, causal=None) -> DynamicLayout:
        """This layout for a call of `cusparseattn.call.Sizes` ``sizes``: checked (framework, device, rows,
        batch, heads; on the host also the values), its static parts built for the call's lengths, a causal
        layout for them intersected where ``causal`` (a BlockLayout) is given. Raises naming what does not
        fit."""
        i = self._indices
        if i.framework != sizes.framework or device_name(i.device) != device_name(sizes.device):
            raise ValueError(
                f"indices must be an array of q's framework and device ({sizes.framework}, "
                f"{device_name(sizes.device)}), got {i.framework}, {device_name(i.device)}"
            )
        bq, bk = self.block_size
        rows = -(-sizes.seq_q // bq) if self.per == "block" else sizes.seq_q
        what = f"{rows} query blocks of {bq}" if self.per == "block" else f"{rows} query tokens"
        if self.rows != rows:
            raise ValueError(f"indices has {self.rows} rows, expected one per query: q has {what}")
        if self.batch not in (1, sizes.batch):
            raise ValueError(
                f"indices has batch {self.batch}, expected 1 (shared) or q's batch {sizes.batch}"
            )
        if self.heads not in (1, sizes.heads_q, sizes.heads_kv):
            raise ValueError(
                f"indices has {self.heads} heads, expected 1 (shared), q's {sizes.heads_q} heads or k's "
                f"{sizes.heads_kv} heads (one selection per KV group)"
            )
        out = self
        # Traced arrays (inside jax.jit) have no values yet: cusparseattn.jax hands them to its XLA call,
        # which runs on them as on a GPU's (nothing checked, out-of-range entries ignored).
        traced = self.traced
        if i.framework == "jax" and not traced:  # read here, outside XLA's callbacks (they must not wait)
            out = out.with_arrays(*(h.numpy() for h in self.holders()))
        if i.device[0] == "cpu" and not traced:
            out._check_values(-(-sizes.seq_k // bk))
        parts = [_resolved(p, sizes) for p in (out.within, out.plus)]
        out = out._with(*parts)
        return out if causal is None else out & causal

    def _check_values(self, n_k: int) -> None:
        idx = self._indices.numpy()
        bad = np.argwhere((idx < -1) | (idx >= n_k))
        if bad.size:
            at = tuple(int(x) for x in bad[0])
            raise ValueError(
                f"indices[{', '.join(map(str, at))}] is {int(idx[at])}, expected a key block 0..{n_k - 1} or "
                f"-1 (padding); there are {n_k} key blocks of {self.block_size[1]}"
            )
        if self._counts is not None:
            c = self._counts.numpy()
            bad = np.argwhere((c < 0) | (c > self.width))
            if bad.size:
                at = tuple(int(x) for x in bad[0])
                raise ValueError(
                    f"counts[{', '.join(map(str, at))}] is {int(c[at])}, expected 0..{self.width}"
                )

    # ---- on the host -------------------------------------------------------------------------------------
    def selection(self, n_k: int) -> np.ndarray:
        """The indices on the host (a copy from a GPU) with every ignored entry (padding, past ``counts``,
        out of range) set to -1: int32 ``[B|1, H|1, rows, k]``."""
        idx = np.array(self._indices.numpy(), dtype=np.int32)
        valid = (idx >= 0) & (idx < n_k)
        if self._counts is not None:
            counts = np.clip(self._counts.numpy(), 0, self.width)
            valid &= np.arange(self.width) < counts[..., None]
        idx[~valid] = -1
        return idx

    def to_layout(self, seq_q: int, seq_k: int, heads_q: int | None = None, heads_kv: int | None = None):
        """The `BlockLayout` of this selection for these lengths (the indices read on the host), its static
        parts applied: what the reference runs. ``heads_q`` and ``heads_kv`` (default: the indices' heads)
        say what the head axis counts; a per-KV-head selection is repeated for each query head of the group.
        """
        heads_q = self.heads if heads_q is None else heads_q
        heads_kv = heads_q if heads_kv is None else heads_kv
        bq, bk = self.block_size
        n_q, n_k = -(-seq_q // bq), -(-seq_k // bk)
        sel = self.selection(n_k)
        group = heads_q // heads_kv if self.heads == heads_kv != heads_q else 1
        if self.per == "block":
            chosen = _blocks(sel, n_k)
            if group > 1:
                chosen = np.repeat(chosen, group, axis=1)
            layout = BlockLayout(chosen, block_size=self.block_size, seq_q=seq_q, seq_k=seq_k)
        else:
            any_, all_ = _token_blocks(sel, n_q, n_k, bq)
            if group > 1:
                any_, all_ = (np.repeat(x, group, axis=1) for x in (any_, all_))
            rule = TokenRule("dynamic tokens", _TokenLookup(sel, group, bk))
            layout = BlockLayout(
                any_, block_size=self.block_size, seq_q=seq_q, seq_k=seq_k, partial=any_ & ~all_, rule=rule
            )
        sizes = _Lengths(seq_q, seq_k)
        if self.within is not None:
            layout = layout & _resolved(self.within, sizes)
        if self.plus is not None:
            layout = layout | _resolved(self.plus, sizes)
        return layout

    def to_dense(self, seq_q: int, seq_k: int, heads_q: int | None = None, heads_kv: int | None = None):
        """The token mask ``[B|1, H, seq_q, seq_k]`` (for tests and small sizes)."""
        lay = self.to_layout(seq_q, seq_k, heads_q, heads_kv)
        return lay.to_dense()

    def __repr__(self) -> str:
        parts = [
            f"per={self.per!r}, batch={self.batch}, heads={self.heads}, rows={self.rows}, k={self.width}",
            f"block_size={self.block_size}",
            f"{self.framework} int32" + (" with counts" if self._counts is not None else ""),
            device_name(self.device),
        ]
        for name, part in (("within", self.within), ("plus", self.plus)):
            if part is not None:
                parts.append(f"{name}={getattr(part, 'name', None) or _layout_name(part)}")
        return f"DynamicLayout({', '.join(parts)})"


def _layout_name(layout: BlockLayout) -> str:
    return "blocks" if layout.rule is None else layout.rule.name


class _Lengths:
    def __init__(self, seq_q: int, seq_k: int):
        self.seq_q, self.seq_k = seq_q, seq_k


def _resolved(part, sizes):
    """A static part for the call's lengths: a Pattern built, a BlockLayout checked."""
    if (
        part is None
        or isinstance(part, BlockLayout)
        and (part.seq_q, part.seq_k) == (sizes.seq_q, sizes.seq_k)
    ):
        return part
    if isinstance(part, BlockLayout):
        raise ValueError(
            f"a static part of the dynamic layout was built for seq_q={part.seq_q}, seq_k={part.seq_k}, but "
            f"q has {sizes.seq_q} tokens and k has {sizes.seq_k}: pass the Pattern instead"
        )
    return part.layout(sizes.seq_q, sizes.seq_k)


def _blocks(sel: np.ndarray, n_k: int) -> np.ndarray:
    """The block mask ``[B, H, rows, n_k]`` of a cleaned selection (-1 ignored)."""
    out = np.zeros((*sel.shape[:3], n_k + 1), dtype=bool)
    np.put_along_axis(out, np.where(sel < 0, n_k, sel), True, axis=-1)
    return out[..., :n_k]


def _token_blocks(sel: np.ndarray, n_q: int, n_k: int, bq: int) -> tuple[np.ndarray, np.ndarray]:
    """For a per-token selection: which key blocks any / every token of each query block chose, in chunks of
    query blocks so that the per-token table stays small."""
    nb, nh, seq_q, _ = sel.shape
    any_ = np.zeros((nb, nh, n_q, n_k), dtype=bool)
    all_ = np.zeros_like(any_)
    step = max(1, (1 << 24) // max(1, nb * nh * bq * (n_k + 1)))
    for r0 in range(0, n_q, step):
        r1 = min(r0 + step, n_q)
        tokens = _blocks(sel[:, :, r0 * bq : min(r1 * bq, seq_q)], n_k)
        for r in range(r0, r1):
            rows = tokens[:, :, (r - r0) * bq : (r - r0 + 1) * bq]
            any_[:, :, r], all_[:, :, r] = rows.any(axis=2), rows.all(axis=2)
    return any_, all_


class _TokenLookup:
    """A per-token selection as a rule: query ``q`` attends key ``k`` when ``k``'s block is among ``q``'s
    entries (``sel``, cleaned: -1 never matches). ``h`` is a query head; ``group`` query heads share one
    selection head when the selection is per KV head."""

    def __init__(self, sel: np.ndarray, group: int, block: int):
        self.sel, self.group, self.block = sel, group, block

    def __call__(self, b, h, q, k):
        sel = self.sel
        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (b, h, q, k)))
        b, h, q, k = (a.reshape(-1) for a in arrays)
        b = b if sel.shape[0] > 1 else np.zeros_like(b)
        h = h // self.group if sel.shape[1] > 1 else np.zeros_like(h)
        q = np.clip(q, 0, sel.shape[2] - 1)
        out = np.empty(b.shape, dtype=bool)
        step = max(1, _LOOKUP_CHUNK // sel.shape[3])
        for s in range(0, b.size, step):
            c = slice(s, s + step)
            out[c] = (sel[b[c], h[c], q[c]] == (k[c] // self.block)[:, None]).any(axis=1)
        return out.reshape(arrays[0].shape)
