"""Block layouts: which (query block, key block) pairs attend, and the token rule inside partial blocks.

A `BlockLayout` is a boolean block mask ``[B, H, nQ, nK]`` (a size of 1 in B or H is shared by all batch
elements or heads) for one pair of sequence lengths, plus a `TokenRule` that decides token by token inside the
blocks marked *partial*. Blocks that are set and not partial are *full*: every token pair inside them attends.

The rule decides only inside partial blocks (the reference and the kernels both apply it there alone).
Patterns also keep the rule True inside their full blocks, so a full block means "no token test needed" either
way.

Layouts combine with ``|`` and ``&`` (the result's rule evaluates both operands, or joins their C
expressions when both rules are the whole pattern), compare with ``==`` (same token mask), index as
``layout[b, h]``, print as a text grid (``str``) or a PNG (``save_png``), and convert to and from
FlexAttention's ``BlockMask`` (``to_flex``, ``from_flex``) and DeepSpeed's ``[H, nb, nb]`` layouts
(``from_deepspeed``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import flex_layouts, pictures
from .rule_algebra import combined_rule, shifted_rule
from .rules import TokenRule

MIN_BLOCK, MAX_BLOCK = 16, 128


class Compressed(NamedTuple):
    """One compressed form of a layout, flattened over (b, h, row): the CSR rows or the CSC columns.

    Entry ``indptr[(b * H + h) * n + i]`` .. ``indptr[... + 1]`` of ``indices`` lists the blocks of line ``i``
    of batch ``b``, head ``h``; ``partial`` marks the entries that need the token rule.
    """

    indptr: np.ndarray  # int32 [B * H * n + 1]
    indices: np.ndarray  # int32 [nnz]
    partial: np.ndarray  # bool [nnz]


def check_block(name: str, value: int) -> int:
    """``value`` as an int when it is a block size (a power of two from MIN_BLOCK to MAX_BLOCK); else a
    ValueError naming ``name``."""
    if (
        not isinstance(value, (int, np.integer))
        or value < MIN_BLOCK
        or value > MAX_BLOCK
        or value & (value - 1)
    ):
        raise ValueError(f"{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {value!r}")
    return int(value)


def _as_4d(name: str, mask) -> np.ndarray:
    arr = np.asarray(mask)
    if arr.dtype != bool:
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must be a boolean or 0/1 integer array, got dtype {arr.dtype}")
        arr = arr != 0
    if arr.ndim not in (2, 3, 4):
        raise ValueError(f"{name} must have shape [nQ, nK], [H, nQ, nK] or [B, H, nQ, nK], got {arr.shape}")
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape)


class BlockLayout:
    """A block-sparse attention layout for one pair of sequence lengths.

    >>> import numpy as np
    >>> lay = BlockLayout(np.tril(np.ones((4, 4), bool)), block_size=64, seq_q=256)
    >>> lay.nnz, round(lay.density, 3)
    (10, 0.625)
    """

    def __init__(
        self,
        blocks,
        *,
        block_size: int | tuple[int, int],
        seq_q: int,
        seq_k: int | None = None,
        partial=None,
        rule: TokenRule | None = None,
        origin: tuple[int, int] = (0, 0),
    ):
        bq, bk = (block_size, block_size) if np.isscalar(block_size) else tuple(block_size)
        self.block_size = (check_block("block_size (query)", bq), check_block("block_size (key)", bk))
        seq_k = seq_q if seq_k is None else seq_k
        for name, s in (("seq_q", seq_q), ("seq_k", seq_k)):
            if not isinstance(s, (int, np.integer)) or s < 1:
                raise ValueError(f"{name} must be a positive integer, got {s!r}")
        self.seq_q, self.seq_k = int(seq_q), int(seq_k)
        blocks = _as_4d("blocks", blocks)
        want = (-(-self.seq_q // self.block_size[0]), -(-self.seq_k // self.block_size[1]))
        if blocks.shape[2:] != want:
            raise ValueError(
                f"blocks has {blocks.shape[2:]} blocks, expected {want} for seq_q={self.seq_q}, "
                f"seq_k={self.seq_k} and block_size={self.block_size}"
            )
        if partial is None:
            partial = blocks if rule is not None else np.zeros_like(blocks)
        partial = np.broadcast_to(_as_4d("partial", partial), blocks.shape) & blocks
        if rule is None and partial.any():
            raise ValueError("partial blocks need a rule: pass rule=TokenRule(...) or no partial mask")
        blocks.setflags(write=False)
        partial = np.ascontiguousarray(partial)
        partial.setflags(write=False)
        self.blocks, self.partial, self.rule = blocks, partial, rule
        if len(origin) != 2 or any(not isinstance(o, (int, np.integer)) or o < 0 for o in origin):
            raise ValueError(f"origin must be two non-negative integers (query, key), got {origin!r}")
        # Where this layout sits in a longer sequence (a window of it, `window`): score mods see global
        # positions. The rule has been shifted already, so the token mask ignores it.
        self.origin = (int(origin[0]), int(origin[1]))
        self._torch_cache = {}  # device -> the block and partial tables as flat torch tensors

    # ---- shape and counts ----------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.blocks.shape[0]

    @property
    def heads(self) -> int:
        return self.blocks.shape[1]

    @property
    def num_blocks(self) -> tuple[int, int]:
        return self.blocks.shape[2], self.blocks.shape[3]

    @property
    def full(self) -> np.ndarray:
        return self.blocks & ~self.partial

    @property
    def nnz(self) -> int:
        return int(np.count_nonzero(self.blocks))

    @property
    def density(self) -> float:
        """Fraction of blocks that are visited (full or partial), over every batch element and head."""
        return self.nnz / self.blocks.size

    # ---- compressed forms for the kernels ------------------------------------------------------------------
    @functools.cached_property
    def _csr(self) -> Compressed:
        return _compress(self.blocks, self.partial)

    @functools.cached_property
    def _csc(self) -> Compressed:
        return _compress(self.blocks.swapaxes(2, 3), self.partial.swapaxes(2, 3))

    def csr(self) -> Compressed:
        """Per query-block row, its key blocks (the forward and dQ walk these)."""
        return self._csr

    def csc(self) -> Compressed:
        """Per key-block column, its query blocks (dK and dV walk these)."""
        return self._csc

    # ---- token level ---------------------------------------------------------------------------------------
    def token_mask(self, b, h, q, k) -> np.ndarray:
        """Whether query token ``q`` attends key token ``k`` (vectorised, broadcasting integer arrays)."""
        b, h, q, k = (np.asarray(x, dtype=np.int64) for x in (b, h, q, k))
        bb = b if self.batch > 1 else np.zeros_like(b)
        hh = h if self.heads > 1 else np.zeros_like(h)
        qb, kb = q // self.block_size[0], k // self.block_size[1]
        inside = (q >= 0) & (q < self.seq_q) & (k >= 0) & (k < self.seq_k)
        qb, kb = np.where(inside, qb, 0), np.where(inside, kb, 0)
        mask = self.blocks[bb, hh, qb, kb] & inside
        if self.rule is not None:
            part = self.partial[bb, hh, qb, kb]
            # Pairs past a sequence's end are masked out already; clamped, they keep rules that index
            # per-token tables (document ids) in bounds when callers evaluate whole kernel tiles.
            qc, kc = np.clip(q, 0, self.seq_q - 1), np.clip(k, 0, self.seq_k - 1)
            mask = mask & (~part | self.rule(b, h, qc, kc))
        return mask

    def to_dense(self, batch: int | None = None, heads: int | None = None) -> np.ndarray:
        """The token-level mask ``[B, H, seq_q, seq_k]`` (for tests and small sizes)."""
        nb, nh = batch or self.batch, heads or self.heads
        b = np.arange(nb)[:, None, None, None]
        h = np.arange(nh)[None, :, None, None]
        q = np.arange(self.seq_q)[None, None, :, None]
        k = np.arange(self.seq_k)[None, None, None, :]
        return self.token_mask(b, h, q, k)

    # ---- set algebra, equality, indexing -------------------------------------------------------------------
    # True when the rule alone equals the token mask for every in-range pair (not only inside partial
    # blocks): patterns set it, and the algebra then joins two rules' C expressions, not bit masks.
    _exact_rule = False

    def __hash__(self) -> int:
        """A hash that agrees with `==`: lengths, block size, origin and which blocks any batch element or
        head visits (equal layouts visit the same ones, whatever their broadcast axes). Read once: layouts
        are immutable. The per-device caches (index tables, tile plans) key layouts by identity, not by it."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            visited = np.packbits(self.blocks.any(axis=(0, 1))).tobytes()
            cached = hash((self.seq_q, self.seq_k, self.block_size, self.origin, visited))
            self.__dict__["_hash"] = cached
        return cached

    def __or__(self, other: BlockLayout) -> BlockLayout:
        """Union: a token pair attends when it attends in either layout.

        >>> import numpy as np
        >>> a = BlockLayout(np.eye(2, dtype=bool), block_size=16, seq_q=32)
        >>> (a | BlockLayout(np.ones((2, 2), bool), block_size=16, seq_q=32)).nnz
        4
        """
        return _combine(self, other, "|")

    def __and__(self, other: BlockLayout) -> BlockLayout:
        """Intersection: a token pair attends when it attends in both layouts.

        >>> import numpy as np
        >>> a = BlockLayout(np.eye(2, dtype=bool), block_size=16, seq_q=32)
        >>> (a & BlockLayout(np.ones((2, 2), bool), block_size=16, seq_q=32)).nnz
        2
        """
        return _combine(self, other, "&")

    def __eq__(self, other) -> bool:
        """Same lengths, block size, blocks (a shared batch or head axis broadcasts) and token mask.

        The token masks are compared by evaluating both layouts inside every block that is partial in either
        of them, so two layouts with different rule objects but the same mask are equal.
        """
        if other is self:  # the weak-keyed caches compare a layout with itself on every lookup
            return True
        if not isinstance(other, BlockLayout):
            return NotImplemented
        if (self.seq_q, self.seq_k, self.block_size, self.origin) != (
            other.seq_q,
            other.seq_k,
            other.block_size,
            other.origin,
        ):
            return False
        try:
            shape = _broadcast_shape(self, other)
        except ValueError:
            return False
        if not np.array_equal(np.broadcast_to(self.blocks, shape), np.broadcast_to(other.blocks, shape)):
            return False
        check = np.broadcast_to(self.partial, shape) | np.broadcast_to(other.partial, shape)
        return all(
            np.array_equal(self.token_mask(*idx), other.token_mask(*idx))
            for idx in _block_tokens(self, np.nonzero(check))
        )

    def __getitem__(self, index) -> BlockLayout:
        """``layout[b]`` or ``layout[b, h]``: one batch element (and head) as a layout of batch (and heads) 1.

        The rule keeps seeing the original batch and head indices. A layout shared by all batch elements (or
        heads) accepts any index >= 0 on that axis.

        >>> import numpy as np
        >>> lay = BlockLayout(np.ones((3, 2, 2), bool), block_size=16, seq_q=32)
        >>> lay[0, 2].heads
        1
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) not in (1, 2):
            raise IndexError(f"a layout takes [batch] or [batch, head], got {len(index)} indices")
        b0 = _axis_index("batch", index[0], self.batch)
        h0 = _axis_index("head", index[1], self.heads) if len(index) == 2 else 0
        rows = [b0 if self.batch > 1 else 0]
        cols = slice(None) if len(index) == 1 else [h0 if self.heads > 1 else 0]
        rule = self.rule if self.rule is None or (b0, h0) == (0, 0) else shifted_rule(self.rule, b0, h0)
        out = BlockLayout(
            self.blocks[rows][:, cols],
            block_size=self.block_size,
            seq_q=self.seq_q,
            seq_k=self.seq_k,
            partial=self.partial[rows][:, cols],
            rule=rule,
            origin=self.origin,
        )
        out._exact_rule = self._exact_rule
        return out

    def window(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> BlockLayout:
        """The layout of queries ``[q_start, q_stop)`` against keys ``[k_start, k_stop)`` (token positions),
        for a kernel call on those slices of q and k/v (context parallelism runs one per pair of shards).

        Starts are multiples of the block size, stops too or the sequence's end. The rule and score mods keep
        seeing the positions of the whole sequence (``origin`` says where the window starts).

        >>> import numpy as np
        >>> lay = BlockLayout(np.tril(np.ones((4, 4), bool)), block_size=16, seq_q=64)
        >>> w = lay.window(32, 64, 0, 32)
        >>> w.nnz, w.origin, lay.window(0, 32, 32, 64).nnz
        (4, (32, 0), 0)
        """
        bq, bk = self.block_size
        spans = (("q", q_start, q_stop, self.seq_q, bq), ("k", k_start, k_stop, self.seq_k, bk))
        for axis, start, stop, seq, block in spans:
            for name, value in ((f"{axis}_start", start), (f"{axis}_stop", stop)):
                if not isinstance(value, (int, np.integer)):
                    raise TypeError(f"{name} must be an integer, got {value!r}")
            if not 0 <= start < stop <= seq:
                raise ValueError(
                    f"{axis}_start, {axis}_stop must satisfy 0 <= start < stop <= {seq}, got {start}, {stop}"
                )
            if start % block or (stop % block and stop != seq):
                raise ValueError(
                    f"{axis}_start and {axis}_stop must be multiples of the block size {block} "
                    f"(or the stop the sequence end {seq}), got {start}, {stop}"
                )
        rows = slice(q_start // bq, -(-q_stop // bq))
        cols = slice(k_start // bk, -(-k_stop // bk))
        rule = self.rule
        if rule is not None and (q_start or k_start):
            rule = shifted_rule(rule, dq=q_start, dk=k_start)
        out = BlockLayout(
            self.blocks[:, :, rows, cols],
            block_size=self.block_size,
            seq_q=q_stop - q_start,
            seq_k=k_stop - k_start,
            partial=self.partial[:, :, rows, cols],
            rule=rule,
            origin=(self.origin[0] + q_start, self.origin[1] + k_start),
        )
        out._exact_rule = self._exact_rule
        return out

    # ---- pictures ------------------------------------------------------------------------------------------
    def to_string(self, max_width: int = 64) -> str:
        """A text picture: one grid per distinct (batch, head) layout, █ full, ▒ partial, · empty.

        Grids wider than ``max_width`` blocks are downsampled: a character stands for a square of blocks and
        shows full if all of them are full, empty if all are empty, partial otherwise.

        >>> import numpy as np
        >>> text = BlockLayout(np.tril(np.ones((2, 2), bool)), block_size=16, seq_q=32).to_string()
        >>> for line in text.splitlines()[1:]:
        ...     print(line)
        batch * (shared by all batch elements), head * (shared by all heads):
        █·
        ██
        """
        groups = pictures.distinct_grids(self)
        step = pictures.pool_step(self.num_blocks, max_width)
        lines = [repr(self)]
        if step > 1:
            lines.append(f"(one character = {step}x{step} blocks)")
        for members in groups[: pictures.MAX_PICTURES]:
            b, h = members[0]
            lines.append(pictures.describe(members, self.batch, self.heads) + ":")
            codes = pictures.pooled_codes(self.blocks[b, h], self.full[b, h], step)
            lines.extend("".join(pictures.GLYPHS[c] for c in row) for row in codes)
        if len(groups) > pictures.MAX_PICTURES:
            lines.append(f"... and {len(groups) - pictures.MAX_PICTURES} more distinct (batch, head) layouts")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()

    def save_png(self, path, *, max_pixels: int = 1024):
        """Write a PNG picture of the layout and return ``path`` (needs Pillow: ``cusparseattn[plot]``).

        One panel per distinct (batch, head) layout (up to 16), each at most ``max_pixels`` on a side: larger
        grids are max-pooled (a pixel is full if all its blocks are, empty if none is set, partial otherwise),
        small ones are enlarged. Colours: full blue, partial orange, empty light grey.
        """
        try:
            from PIL import Image, ImageDraw
        except ImportError as exc:
            raise ImportError(
                "BlockLayout.save_png needs Pillow: pip install 'cusparseattn[plot]' (or pip install pillow)"
            ) from exc
        if not isinstance(max_pixels, int) or max_pixels < 16:
            raise ValueError(f"max_pixels must be an integer >= 16, got {max_pixels!r}")
        groups = pictures.distinct_grids(self)[: pictures.MAX_PANELS]
        step = pictures.pool_step(self.num_blocks, max_pixels)
        panels = []
        for members in groups:
            b, h = members[0]
            codes = pictures.pooled_codes(self.blocks[b, h], self.full[b, h], step)
            scale = max(1, min(max_pixels, pictures.PNG_MIN_PANEL) // max(codes.shape))
            pixels = pictures.PNG_COLOURS[codes].repeat(scale, axis=0).repeat(scale, axis=1)
            if scale >= 6:  # grid lines between blocks once they are large enough to read
                pixels[scale - 1 :: scale, :] = pictures.PNG_LINE
                pixels[:, scale - 1 :: scale] = pictures.PNG_LINE
            panels.append((pictures.describe(members, self.batch, self.heads), pixels))
        width, height, spots = pictures.png_geometry([p.shape[:2] for _, p in panels])
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        draw.text((pictures.PNG_PAD, 4), pictures.png_title(self, step), fill=(0, 0, 0))
        x = pictures.PNG_PAD
        for name, colour in (("full", 1), ("partial", 2), ("empty", 0)):
            draw.rectangle(
                (x, 22, x + 10, 32),
                fill=tuple(int(c) for c in pictures.PNG_COLOURS[colour]),
                outline=(0, 0, 0),
            )
            draw.text((x + 14, 22), name, fill=(0, 0, 0))
            x += 80
        for (label, pixels), (px, py) in zip(panels, spots, strict=True):
            draw.text((px, py - pictures.PNG_LABEL), label, fill=(0, 0, 0))
            image.paste(Image.fromarray(pixels, "RGB"), (px, py))
        image.save(path, format="PNG")
        return path

    # ---- interchange ---------------------------------------------------------------------------------------
    @classmethod
    def from_flex(cls, block_mask, seq_q: int | None = None, seq_k: int | None = None) -> BlockLayout:
        """A layout from PyTorch FlexAttention's ``BlockMask``: its full blocks stay full, its other blocks
        are partial, with the block mask's ``mask_mod`` as rule (evaluated through torch).

        >>> import torch
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = lambda b, h, q, k: q >= k
        >>> bm = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
        >>> lay = BlockLayout.from_flex(bm)
        >>> lay.nnz, int(lay.partial.sum())
        (10, 4)
        """
        sq, sk = (int(x) for x in block_mask.seq_lengths)
        sq, sk = seq_q or sq, seq_k or sk
        bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
        n_q, n_k = -(-sq // bq), -(-sk // bk)
        partial = flex_layouts.from_kv_lists(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = np.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = flex_layouts.from_kv_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        if partial.shape[2] < n_q or partial.shape[3] < n_k:
            raise ValueError(
                f"block_mask has {partial.shape[2:]} blocks of {(bq, bk)}, too few for seq_q={sq}, seq_k={sk}"
            )
        partial, full = partial[:, :, :n_q, :n_k], full[:, :, :n_q, :n_k]
        rule = None
        if partial.any():
            mask_mod = block_mask.mask_mod
            rule = TokenRule(
                f"flex:{getattr(mask_mod, '__name__', 'mask_mod')}", flex_layouts.FlexRule(mask_mod)
            )
        return cls(partial | full, block_size=(bq, bk), seq_q=sq, seq_k=sk, partial=partial, rule=rule)

    def to_flex(self, device=None):
        """This layout as a FlexAttention ``BlockMask`` on ``device`` (the CPU by default), the device of the
        queries it will mask.

        Full blocks become FlexAttention's full blocks; partial blocks its masked blocks, with a ``mask_mod``
        that looks the block up and applies the rule with torch ops. That needs a rule written with Python
        operators and indexing only (every rule of `cusparseattn.patterns`, their set algebra and indexing,
        and rules from ``from_flex``); another rule raises a ValueError here. The lookup tables live on
        ``device``: a mask moved elsewhere with ``.to`` fails FlexAttention's tracing with a RuntimeError that
        says so.

        >>> import numpy as np
        >>> bm = BlockLayout(np.tril(np.ones((4, 4), bool)), block_size=64, seq_q=256).to_flex()
        >>> bm.BLOCK_SIZE
        (64, 64)
        """
        import torch
        from torch.nn.attention.flex_attention import BlockMask

        device = torch.device("cpu" if device is None else device)
        mask_mod = flex_layouts.flex_mask_mod(self)
        flex_layouts.probe_torch_rule(self, mask_mod, device)
        kv_num, kv_idx = flex_layouts.kv_lists(self.partial)
        full_num, full_idx = flex_layouts.kv_lists(self.full)
        return BlockMask.from_kv_blocks(
            *(torch.from_numpy(t).to(device) for t in (kv_num, kv_idx, full_num, full_idx)),
            BLOCK_SIZE=self.block_size,
            mask_mod=mask_mod,
            seq_lengths=(self.seq_q, self.seq_k),
        )

    @classmethod
    def from_deepspeed(cls, layout, block: int, seq_len: int) -> BlockLayout:
        """A layout from a DeepSpeed sparsity config's ``make_layout(seq_len)``: ``[H, nb, nb]`` 0/1 blocks.

        >>> import numpy as np
        >>> BlockLayout.from_deepspeed(np.ones((2, 4, 4), np.int64), 16, 64).heads
        2
        """
        if hasattr(layout, "detach"):  # a torch tensor, maybe on a GPU
            layout = layout.detach().cpu().numpy()
        arr = np.asarray(layout)
        if arr.ndim != 3:
            raise ValueError(
                f"layout must be a DeepSpeed layout [num_heads, num_blocks, num_blocks], got {arr.shape}"
            )
        return cls(arr[None], block_size=block, seq_q=seq_len)

    def _torch_token_mask(self, b, h, q, k):
        """`token_mask` with torch ops on torch index tensors (FlexAttention calls it under ``vmap``)."""
        import torch

        blocks, partial = self._torch_tables(q.device)
        n_q, n_k = self.num_blocks
        bb = b if self.batch > 1 else b * 0
        hh = h if self.heads > 1 else h * 0
        inside = (q >= 0) & (q < self.seq_q) & (k >= 0) & (k < self.seq_k)
        qb = torch.clamp(q // self.block_size[0], 0, n_q - 1)
        kb = torch.clamp(k // self.block_size[1], 0, n_k - 1)
        flat = ((bb * self.heads + hh) * n_q + qb) * n_k + kb
        mask = blocks[flat] & inside
        if self.rule is not None:
            qc, kc = torch.clamp(q, 0, self.seq_q - 1), torch.clamp(k, 0, self.seq_k - 1)
            mask = mask & (~partial[flat] | self.rule.fn(b, h, qc, kc))
        return mask

    def _torch_tables(self, device):
        import torch

        key = str(device)
        tables = self._torch_cache.get(key)
        if tables is None:
            # FlexAttention traces its mask_mod with Dynamo, which cannot make these tensors (torch 2.11's
            # cannot even call __dict__.setdefault): to_flex makes them first, eagerly.
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"this layout's FlexAttention mask has no lookup tables on {key}: make the BlockMask "
                    f"for that device with layout.to_flex(device={key!r}) rather than moving it with .to()"
                )
            # copies: the layout's arrays are read-only, torch tensors are not
            tables = tuple(
                torch.from_numpy(np.array(a).reshape(-1)).to(device) for a in (self.blocks, self.partial)
            )
            self._torch_cache[key] = tables
        return tables

    def __repr__(self) -> str:
        kinds = "none" if self.rule is None else self.rule.name
        return (
            f"BlockLayout(batch={self.batch}, heads={self.heads}, seq_q={self.seq_q}, seq_k={self.seq_k}, "
            f"block_size={self.block_size}, blocks={self.num_blocks}, nnz={self.nnz}, "
            f"partial={int(np.count_nonzero(self.partial))}, density={self.density:.4f}, rule={kinds}"
            + (f", origin={self.origin})" if self.origin != (0, 0) else ")")
        )


def _compress(blocks: np.ndarray, partial: np.ndarray) -> Compressed:
    nb, nh, n, _ = blocks.shape
    counts = np.count_nonzero(blocks, axis=3).reshape(-1)
    indptr = np.zeros(nb * nh * n + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    if indptr[-1] >= 2**31:
        raise ValueError(f"layout has {indptr[-1]} blocks, more than a 32-bit index table holds")
    flat = blocks.reshape(-1, blocks.shape[3])
    rows, cols = np.nonzero(flat)
    return Compressed(
        indptr.astype(np.int32),
        cols.astype(np.int32),
        np.ascontiguousarray(partial.reshape(flat.shape)[rows, cols]),
    )


# ---- set algebra -------------------------------------------------------------------------------------------


def _broadcast_shape(a: BlockLayout, b: BlockLayout) -> tuple[int, int, int, int]:
    out = []
    for name, x, y in (("batch elements", a.batch, b.batch), ("heads", a.heads, b.heads)):
        if x != y and 1 not in (x, y):
            raise ValueError(
                f"layouts with {x} and {y} {name} do not match: each must be 1 (shared) or the same"
            )
        out.append(max(x, y))
    return (*out, *a.num_blocks)


def _combine(a: BlockLayout, b, op: str) -> BlockLayout:
    if not isinstance(b, BlockLayout):
        return NotImplemented
    if (a.seq_q, a.seq_k, a.block_size) != (b.seq_q, b.seq_k, b.block_size):
        raise ValueError(
            "layouts of different lengths or block sizes cannot be combined: "
            f"seq_q={a.seq_q}, seq_k={a.seq_k}, block_size={a.block_size} and "
            f"seq_q={b.seq_q}, seq_k={b.seq_k}, block_size={b.block_size}; "
            "build both for the same lengths and block size (a Pattern's .layout(seq_q, seq_k))"
        )
    if a.origin != b.origin:
        raise ValueError(f"layouts at different origins cannot be combined: {a.origin} and {b.origin}")
    _broadcast_shape(a, b)
    if op == "|":
        blocks, full = a.blocks | b.blocks, a.full | b.full
    else:
        blocks, full = a.blocks & b.blocks, a.full & b.full
    rule, exact = combined_rule(a, b, op)
    out = BlockLayout(
        blocks,
        block_size=a.block_size,
        seq_q=a.seq_q,
        seq_k=a.seq_k,
        partial=blocks & ~full,
        rule=rule,
        origin=a.origin,
    )
    out._exact_rule = exact
    return out


# ---- indexing ----------------------------------------------------------------------------------------------
def _axis_index(name: str, i, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"a layout's {name} index must be an integer, got {type(i).__name__}")
    i = int(i)
    if n == 1:
        if i < 0:
            raise IndexError(f"{name} index {i}: a layout shared by every {name} takes any index >= 0")
        return i
    if not -n <= i < n:
        raise IndexError(f"{name} index {i} is out of range for a layout with {n} along that axis")
    return i % n


def _block_tokens(layout: BlockLayout, where, budget: int = 1 << 22):
    """Index arrays ``(b, h, q, k)`` covering the tokens of the blocks ``where`` (nonzero of a [B, H, nQ, nK]
    mask), in chunks of at most ``budget`` pairs; indices past a sequence's end repeat its last token."""
    bi, hi, qi, ki = where
    bq, bk = layout.block_size
    rq, rk = np.arange(bq)[None, :, None], np.arange(bk)[None, None, :]
    step = max(1, budget // (bq * bk))
    for s in range(0, bi.size, step):
        sl = slice(s, s + step)
        q = np.minimum(qi[sl, None, None] * bq + rq, layout.seq_q - 1)
        k = np.minimum(ki[sl, None, None] * bk + rk, layout.seq_k - 1)
        yield bi[sl, None, None], hi[sl, None, None], q, k
