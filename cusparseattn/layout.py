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
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

MIN_BLOCK, MAX_BLOCK = 16, 128
MAX_PARAMS, MAX_ARRAYS = 8, 4  # the P0..P7 and A0..A3 slots a rule's C expression may use
# What TokenRule.narrow lets through: names, numbers, and operators that neither multiply nor shift.
_NARROW_TOKENS = re.compile(r"[A-Za-z_]\w*|\d+|&&|\|\||<<|>>|[<>=!]=|[-+/%<>!?:()\[\]]")
_NARROW_NAME = re.compile(r"[bhqk]|P[0-7]|A[0-3]|true|false")


def _tokens(expr: str) -> list[str] | None:
    """`expr` as _NARROW_TOKENS's tokens; None where some of it is none of them."""
    tokens = _NARROW_TOKENS.findall(expr)
    return tokens if "".join(tokens) == re.sub(r"\s+", "", expr) else None


def narrowable(expr: str) -> bool:
    """Whether a rule's C expression only adds, subtracts, divides and compares its names, parameters, array
    elements and literals (no products, shifts, casts or calls): then its value is bounded by its terms', and
    the kernels compile it for 32-bit integers as well (TokenRule.narrow decides at run time)."""
    tokens = _tokens(expr)
    return tokens is not None and not any(
        t in ("<<", ">>") or t.isidentifier() and not _NARROW_NAME.fullmatch(t) for t in tokens
    )


_COMPARISONS = {"<=", "<", ">=", ">", "=="}
_FLIPPED = {"<=": ">=", "<": ">", ">=": "<=", ">": "<", "==": "=="}


def key_band(expr: str) -> tuple[str | None, str | None] | None:
    """The keys a rule's C expression lets each query see, where they are one run: ``(first, last)``, C
    expressions over ``b, h, q`` and its parameters for the first and last key that query ``q`` attends
    (``None`` where the rule sets no bound on that side), exactly ``first <= k <= last``; None for other
    rules. It knows conjunctions (``&&``) of comparisons of sums, `k` in one term, as causal and sliding
    windows write them: the kernels then mask a partial tile's row from two numbers.

    >>> key_band("q + P0 - k >= 0 && q + P0 - k < P1")
    ('q + P0 - P1 + 1', 'q + P0')
    >>> key_band("k <= q || k < P0") is None
    True
    """
    return _band(expr, "k")


def query_band(expr: str) -> tuple[str | None, str | None] | None:
    """As `key_band`, the queries that see each key: C expressions over ``b, h, k`` and the parameters for
    the first and last query that attends key ``k``, for the backward's tiles, whose rows are keys.

    >>> query_band("q + P0 - k >= 0 && q + P0 - k < P1")
    ('-P0 + k', '-P0 + k + P1 - 1')
    """
    return _band(expr, "q")


def _band(expr: str, var: str) -> tuple[str | None, str | None] | None:
    tokens = _tokens(expr)
    if tokens is None:
        return None
    firsts, lasts = [], []
    for conjunct in _conjuncts(tokens):
        bound = _bound(conjunct, var)
        if bound is None:
            return None
        first, last = bound
        firsts += [first] if first else []
        lasts += [last] if last else []
    if not firsts and not lasts:
        return None

    def tightest(bounds: list[str], pick: str) -> str | None:
        return functools.reduce(lambda a, b: f"{pick}({a}, {b})", bounds) if bounds else None

    return tightest(firsts, "max"), tightest(lasts, "min")


def _conjuncts(tokens: list[str]) -> list[list[str]]:
    tokens = _strip_parens(tokens)
    parts = _split_top(tokens, {"&&"})
    if len(parts) == 1:
        return [tokens]
    return [c for part in parts[::2] for c in _conjuncts(part)]


def _strip_parens(tokens: list[str]) -> list[str]:
    while len(tokens) >= 2 and tokens[0] == "(" and _closing(tokens, 0) == len(tokens) - 1:
        tokens = tokens[1:-1]
    return tokens


def _closing(tokens: list[str], start: int) -> int:
    depth = 0
    for i in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[i], 0)
        if depth == 0:
            return i
    return -1


def _split_top(tokens: list[str], separators: set[str]) -> list[list[str]]:
    """`tokens` split at the separators outside parentheses, each separator a part of its own between."""
    parts, depth, start = [], 0, 0
    for i, t in enumerate(tokens):
        depth += {"(": 1, ")": -1}.get(t, 0)
        if depth == 0 and t in separators:
            parts += [tokens[start:i], [t]]
            start = i + 1
    return parts + [tokens[start:]]


def _bound(tokens: list[str], var: str) -> tuple[str | None, str | None] | None:
    """A comparison ``L op R`` of sums whose `var` terms add up to +-var as var's (first, last), else None."""
    parts = _split_top(tokens, _COMPARISONS)
    if len(parts) != 3:
        return None
    left, (op,), right = parts
    terms = (_sum_terms(left, 1), _sum_terms(right, -1))
    if None in terms:
        return None
    terms = terms[0] + terms[1]  # L - R
    c = sum(sign for sign, atom in terms if atom == var)
    if c not in (1, -1):
        return None
    # c var + F op 0: var op -F, or var flipped(op) F.
    rest = [(sign * -c, atom) for sign, atom in terms if atom != var]
    op = op if c == 1 else _FLIPPED[op]
    shift = {"<=": 0, "<": -1, ">=": 0, ">": 1, "==": 0}[op]
    bound = _format_sum(rest, shift)
    return (bound if op in (">=", ">", "==") else None), (bound if op in ("<=", "<", "==") else None)


def _sum_terms(tokens: list[str], sign: int) -> list[tuple[int, str]] | None:
    """The signed atoms (names, parameters, literals) of a sum with parentheses, else None."""
    terms, i, current = [], 0, sign
    expect_atom = True
    while i < len(tokens):
        t = tokens[i]
        if expect_atom and t in ("+", "-"):
            current = -current if t == "-" else current
        elif expect_atom and t == "(":
            end = _closing(tokens, i)
            inner = _sum_terms(tokens[i + 1 : end], current) if end > 0 else None
            if inner is None:
                return None
            terms += inner
            i, expect_atom = end, False
        elif expect_atom and (t.isdigit() or re.fullmatch(r"[bhqk]|P[0-7]", t)):
            terms.append((current, t))
            expect_atom = False
        elif not expect_atom and t in ("+", "-"):
            current, expect_atom = (sign if t == "+" else -sign), True
        else:
            return None
        i += 1
    return None if expect_atom else terms


def _format_sum(terms: list[tuple[int, str]], constant: int) -> str:
    constant += sum(sign * int(atom) for sign, atom in terms if atom.isdigit())
    names = [(sign, atom) for sign, atom in terms if not atom.isdigit()]
    names += [(1 if constant > 0 else -1, str(abs(constant)))] if constant else []
    if not names:
        return "0"
    text = " ".join(f"{'-' if sign < 0 else '+'} {atom}" for sign, atom in names)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


@dataclass(frozen=True, eq=False)
class TokenRule:
    """A token-level attention rule, vectorised: ``fn(b, h, q, k) -> bool array``.

    ``b, h, q, k`` are integer arrays that broadcast against each other (absolute batch, query-head, query and
    key indices). ``c_expr`` is the same rule as a C expression over ``b, h, q, k`` (``long long``, or ``int``
    where `narrow` allows), the run-time integer parameters ``P0..P7`` (values in ``params``) and the captured
    ``const int*`` arrays ``A0..A3`` (values in ``arrays``): kernels compile the expression, so new parameter
    values never recompile. A rule with no ``c_expr`` reaches the kernels as a bit mask per partial tile.

    ``c_partial``, where given, is a cheaper expression with the same parameters that is exact only inside
    the partial blocks of the layout built with the rule (and of its windows and sub-layouts): kernels
    evaluate the rule nowhere else, so they compile it in place of ``c_expr``.

    >>> r = TokenRule("causal", lambda b, h, q, k: k <= q, c_expr="k <= q")
    >>> bool(r(0, 0, 5, 3))
    True
    """

    name: str
    fn: Callable[..., np.ndarray]
    c_expr: str | None = None
    params: tuple[int, ...] = ()
    arrays: tuple[np.ndarray, ...] = field(default=())
    c_partial: str | None = None

    def __call__(self, b, h, q, k) -> np.ndarray:
        return np.asarray(self.fn(b, h, q, k), dtype=bool)

    @property
    def kernel_expr(self) -> str | None:
        """The C expression that the attention kernels compile."""
        return self.c_partial or self.c_expr

    def narrow(self, positions: int) -> bool:
        """Whether `kernel_expr` stays exact in 32-bit integers (the kernels then use them: half the
        instructions) for positions below `positions`: it is `narrowable`, and as many terms as it names, each
        at most the largest position, parameter, literal or array value, add up to less than 2^31 (two more
        where it is a band, `key_band` or `query_band`: the kernels subtract a tile's first key or query from
        its bounds and add 1)."""
        expr = self.kernel_expr
        if expr is None or not narrowable(expr):
            return False
        terms = [t for t in _NARROW_TOKENS.findall(expr) if t[0].isalnum()]
        terms += ["k0", "1"] if key_band(expr) or query_band(expr) else []
        largest = max(
            [positions, *(abs(int(x)) for x in self.params)]
            + [int(t) for t in terms if t.isdigit()]
            + [int(np.abs(a).max(initial=0)) for a in self.arrays]
        )
        return len(terms) * largest < 2**31

    @property
    def structure(self) -> tuple:
        """What changes compiled code: the expressions and the number of parameters, never their values."""
        return (self.c_expr, self.c_partial, len(self.params), tuple(a.dtype.str for a in self.arrays))

    def __repr__(self) -> str:
        return f"TokenRule({self.name!r})"


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
        rule = self.rule if self.rule is None or (b0, h0) == (0, 0) else _shifted_rule(self.rule, b0, h0)
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
            rule = _shifted_rule(rule, dq=q_start, dk=k_start)
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
        groups = _distinct_grids(self)
        step = _pool_step(self.num_blocks, max_width)
        lines = [repr(self)]
        if step > 1:
            lines.append(f"(one character = {step}x{step} blocks)")
        for members in groups[:_MAX_PICTURES]:
            b, h = members[0]
            lines.append(_describe(members, self.batch, self.heads) + ":")
            codes = _pooled_codes(self.blocks[b, h], self.full[b, h], step)
            lines.extend("".join(_GLYPHS[c] for c in row) for row in codes)
        if len(groups) > _MAX_PICTURES:
            lines.append(f"... and {len(groups) - _MAX_PICTURES} more distinct (batch, head) layouts")
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
        groups = _distinct_grids(self)[:_MAX_PANELS]
        step = _pool_step(self.num_blocks, max_pixels)
        panels = []
        for members in groups:
            b, h = members[0]
            codes = _pooled_codes(self.blocks[b, h], self.full[b, h], step)
            scale = max(1, min(max_pixels, _PNG_MIN_PANEL) // max(codes.shape))
            pixels = _PNG_COLOURS[codes].repeat(scale, axis=0).repeat(scale, axis=1)
            if scale >= 6:  # grid lines between blocks once they are large enough to read
                pixels[scale - 1 :: scale, :] = _PNG_LINE
                pixels[:, scale - 1 :: scale] = _PNG_LINE
            panels.append((_describe(members, self.batch, self.heads), pixels))
        width, height, spots = _png_geometry([p.shape[:2] for _, p in panels])
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        draw.text((_PNG_PAD, 4), _png_title(self, step), fill=(0, 0, 0))
        x = _PNG_PAD
        for name, colour in (("full", 1), ("partial", 2), ("empty", 0)):
            draw.rectangle(
                (x, 22, x + 10, 32), fill=tuple(int(c) for c in _PNG_COLOURS[colour]), outline=(0, 0, 0)
            )
            draw.text((x + 14, 22), name, fill=(0, 0, 0))
            x += 80
        for (label, pixels), (px, py) in zip(panels, spots, strict=True):
            draw.text((px, py - _PNG_LABEL), label, fill=(0, 0, 0))
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
        partial = _from_kv_lists(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = np.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _from_kv_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        if partial.shape[2] < n_q or partial.shape[3] < n_k:
            raise ValueError(
                f"block_mask has {partial.shape[2:]} blocks of {(bq, bk)}, too few for seq_q={sq}, seq_k={sk}"
            )
        partial, full = partial[:, :, :n_q, :n_k], full[:, :, :n_q, :n_k]
        rule = None
        if partial.any():
            mask_mod = block_mask.mask_mod
            rule = TokenRule(f"flex:{getattr(mask_mod, '__name__', 'mask_mod')}", _FlexRule(mask_mod))
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
        mask_mod = _flex_mask_mod(self)
        _probe_torch_rule(self, mask_mod, device)
        kv_num, kv_idx = _kv_lists(self.partial)
        full_num, full_idx = _kv_lists(self.full)
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
_REF = re.compile(r"\b([PA])(\d+)\b")


def is_torch(x) -> bool:
    """Whether ``x`` is a torch object (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


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
    rule, exact = _combined_rule(a, b, op)
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


def _combined_rule(a: BlockLayout, b: BlockLayout, op: str) -> tuple[TokenRule | None, bool]:
    """The rule of ``a op b`` and whether it is exact (equal to the token mask everywhere in range)."""
    ra, rb = a.rule, b.rule
    if ra is None and rb is None:
        return None, False
    # An operand that is full everywhere decides alone (|) or leaves everything to the other (&).
    for x, y in ((a, b), (b, a)):
        if x.full.all():
            keep = x if op == "|" else y
            return keep.rule, keep._exact_rule
    if a._exact_rule and b._exact_rule and ra.c_expr is not None and rb.c_expr is not None:
        if len(ra.params) + len(rb.params) <= MAX_PARAMS and len(ra.arrays) + len(rb.arrays) <= MAX_ARRAYS:
            expr_b = _REF.sub(
                lambda m: f"{m[1]}{int(m[2]) + (len(ra.params) if m[1] == 'P' else len(ra.arrays))}",
                rb.c_expr,
            )
            joint = "&&" if op == "&" else "||"
            rule = TokenRule(
                f"({ra.name} {op} {rb.name})",
                _RuleOp(op, ra.fn, rb.fn),
                c_expr=f"({ra.c_expr}) {joint} ({expr_b})",
                params=ra.params + rb.params,
                arrays=ra.arrays + rb.arrays,
            )
            return rule, True
    if op == "&":
        # Where one operand has no partial block under the other's blocks, the other's rule is the whole
        # answer: the result's partial blocks are partial in the other operand, its full blocks full there.
        for x, y in ((a, b), (b, a)):
            if not (x.partial & y.blocks).any():
                return y.rule, False
    na, nb = ("blocks" if lay.rule is None else lay.rule.name for lay in (a, b))
    return TokenRule(f"({na} {op} {nb})", _MaskOp(op, a, b)), True


class _RuleOp:
    """``fa op fb`` for two rule functions, on NumPy or torch indices."""

    def __init__(self, op: str, fa, fb):
        self.op, self.fa, self.fb = op, fa, fb

    def __call__(self, b, h, q, k):
        x, y = self.fa(b, h, q, k), self.fb(b, h, q, k)
        if not (is_torch(x) or is_torch(y)):
            x, y = np.asarray(x, dtype=bool), np.asarray(y, dtype=bool)
        return (x & y) if self.op == "&" else (x | y)


class _MaskOp:
    """The token masks of two layouts joined by ``op``, on NumPy or torch indices."""

    def __init__(self, op: str, a: BlockLayout, b: BlockLayout):
        self.op, self.a, self.b = op, a, b

    def __call__(self, b, h, q, k):
        if any(is_torch(x) for x in (b, h, q, k)):
            x, y = self.a._torch_token_mask(b, h, q, k), self.b._torch_token_mask(b, h, q, k)
        else:
            x, y = self.a.token_mask(b, h, q, k), self.b.token_mask(b, h, q, k)
        return (x & y) if self.op == "&" else (x | y)


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


class _Shifted:
    """A rule function seen from a sub-layout: its index 0 on each axis is the original's ``shifts``."""

    def __init__(self, fn, shifts: tuple[int, int, int, int]):
        self.fn, self.shifts = fn, shifts

    def __call__(self, b, h, q, k):
        db, dh, dq, dk = self.shifts
        return self.fn(b + db, h + dh, q + dq, k + dk)


def _shifted_rule(rule: TokenRule, db: int = 0, dh: int = 0, dq: int = 0, dk: int = 0) -> TokenRule:
    """`rule` seen from a sub-layout whose batch, head, query and key 0 are the original's db, dh, dq, dk: the
    C expression gains one parameter per nonzero shift (or, past the parameter slots, falls back to bits)."""
    shifts = {"b": db, "h": dh, "q": dq, "k": dk}
    exprs, params = [rule.c_expr, rule.c_partial], list(rule.params)
    if rule.c_expr is None or len(params) + sum(s != 0 for s in shifts.values()) > MAX_PARAMS:
        exprs = [None, None]
    for var, shift in shifts.items():
        if exprs[0] is not None and shift:
            exprs = [e and re.sub(rf"\b{var}\b", f"({var} + P{len(params)})", e) for e in exprs]
            params.append(shift)
    moved = ", ".join(f"{var}+{s}" for var, s in shifts.items() if s)
    return TokenRule(
        f"{rule.name}[{moved}]",
        _Shifted(rule.fn, (db, dh, dq, dk)),
        c_expr=exprs[0],
        params=tuple(params) if exprs[0] is not None else (),
        arrays=rule.arrays if exprs[0] is not None else (),
        c_partial=exprs[1],
    )


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


# ---- pictures ----------------------------------------------------------------------------------------------
_GLYPHS = ("\u00b7", "\u2588", "\u2592")  # codes: 0 empty, 1 full, 2 partial
_MAX_PICTURES, _MAX_PANELS = 8, 16
_PNG_COLOURS = np.array([[236, 236, 236], [31, 96, 180], [245, 150, 40]], dtype=np.uint8)
_PNG_LINE = np.array([255, 255, 255], dtype=np.uint8)
_PNG_PAD, _PNG_LABEL, _PNG_HEADER, _PNG_COLUMNS, _PNG_MIN_WIDTH, _PNG_MIN_PANEL = 10, 14, 40, 4, 300, 256


def _distinct_grids(layout: BlockLayout) -> list[list[tuple[int, int]]]:
    """The (batch, head) pairs grouped by identical blocks and partial flags, in order of first appearance."""
    nb, nh = layout.batch, layout.heads
    flat = np.concatenate([layout.blocks.reshape(nb * nh, -1), layout.partial.reshape(nb * nh, -1)], axis=1)
    groups: dict[bytes, list[tuple[int, int]]] = {}
    for i, row in enumerate(np.packbits(flat, axis=1)):  # one row per (batch, head), each hashed whole
        groups.setdefault(row.tobytes(), []).append(divmod(i, nh))
    return list(groups.values())


def _ranges(values: list[int]) -> str:
    parts, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None], strict=True):
        if cur != prev + 1 if cur is not None else True:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def _describe(members: list[tuple[int, int]], n_batch: int, n_heads: int) -> str:
    bs, hs = sorted({b for b, _ in members}), sorted({h for _, h in members})
    if len(members) != len(bs) * len(hs):
        shown = ", ".join(f"({b}, {h})" for b, h in members[:8])
        return f"(batch, head) in {shown}{', ...' if len(members) > 8 else ''}"
    bdesc = "* (shared by all batch elements)" if n_batch == 1 else _ranges(bs)
    hdesc = "* (shared by all heads)" if n_heads == 1 else _ranges(hs)
    if n_heads > 1 and len(hs) == n_heads:
        hdesc += " (shared by all heads)"
    return f"batch {bdesc}, head {hdesc}"


def _pool_step(num_blocks: tuple[int, int], max_side: int) -> int:
    return max(1, -(-max(num_blocks) // max_side))


def _pooled_codes(blocks: np.ndarray, full: np.ndarray, step: int) -> np.ndarray:
    """Codes (0 empty, 1 full, 2 partial) of squares of ``step`` x ``step`` blocks: full if all are full,
    empty if none is set, partial otherwise."""
    if step == 1:
        return np.where(full, 1, np.where(blocks, 2, 0)).astype(np.uint8)
    nq, nk = blocks.shape
    rq, rk = -(-nq // step), -(-nk // step)
    pad = ((0, rq * step - nq), (0, rk * step - nk))
    any_set = np.pad(blocks, pad).reshape(rq, step, rk, step).any(axis=(1, 3))
    all_full = np.pad(full, pad, constant_values=True).reshape(rq, step, rk, step).all(axis=(1, 3))
    return np.where(all_full, 1, np.where(any_set, 2, 0)).astype(np.uint8)


def _png_geometry(shapes: list[tuple[int, int]]) -> tuple[int, int, list[tuple[int, int]]]:
    """Image size and each panel's top-left corner: panels on a grid of at most 4 columns under a header."""
    ph, pw = max(s[0] for s in shapes), max(s[1] for s in shapes)
    cols = min(len(shapes), _PNG_COLUMNS)
    rows = -(-len(shapes) // cols)
    cell_w, cell_h = pw + _PNG_PAD, _PNG_LABEL + ph + _PNG_PAD
    spots = [
        (_PNG_PAD + (i % cols) * cell_w, _PNG_HEADER + (i // cols) * cell_h + _PNG_LABEL)
        for i in range(len(shapes))
    ]
    return max(_PNG_MIN_WIDTH, _PNG_PAD + cols * cell_w), _PNG_HEADER + rows * cell_h, spots


def _png_title(layout: BlockLayout, step: int) -> str:
    title = (
        f"seq {layout.seq_q}x{layout.seq_k}, block {layout.block_size[0]}x{layout.block_size[1]}, "
        f"{layout.num_blocks[0]}x{layout.num_blocks[1]} blocks, density {layout.density:.4f}"
    )
    return title + (f", 1 px = {step}x{step} blocks" if step > 1 else "")


# ---- FlexAttention -----------------------------------------------------------------------------------------
def _kv_lists(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FlexAttention's per-row block lists: counts [B, H, nQ], indices [B, H, nQ, nK] (set columns first)."""
    counts = np.count_nonzero(mask, axis=-1).astype(np.int32)
    order = np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)
    return counts, order


def _from_kv_lists(counts, indices) -> np.ndarray:
    counts, indices = (np.asarray(t.detach().cpu().numpy()) for t in (counts, indices))
    valid = np.arange(indices.shape[-1]) < counts[..., None]
    out = np.zeros(indices.shape, dtype=bool)
    b, h, q, j = np.nonzero(valid)
    out[b, h, q, indices[b, h, q, j]] = True
    return out


def _getitem_to_index():
    """FlexAttention's context that lets ``tensor[index]`` run under ``vmap`` with a batched index."""
    import contextlib

    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # older or newer torch without it: plain indexing works under vmap there
        return contextlib.nullcontext()
    return TransformGetItemToIndex()


class _FlexRule:
    """A FlexAttention ``mask_mod`` as a rule function: called directly on torch indices, and through
    ``torch.vmap`` on NumPy ones (one flat batch of pairs)."""

    def __init__(self, mask_mod):
        self.mask_mod = mask_mod

    def __call__(self, b, h, q, k):
        if any(is_torch(x) for x in (b, h, q, k)):
            return self.mask_mod(b, h, q, k)
        import torch

        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (b, h, q, k)))
        if arrays[0].size == 0:
            return np.zeros(arrays[0].shape, dtype=bool)
        flat = [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
        with _getitem_to_index():
            out = torch.vmap(self.mask_mod)(*flat)
        return out.numpy().astype(bool).reshape(arrays[0].shape)


def _flex_mask_mod(layout: BlockLayout):
    def layout_mask(b, h, q_idx, kv_idx):
        return layout._torch_token_mask(b, h, q_idx, kv_idx)

    return layout_mask


def _probe_torch_rule(layout: BlockLayout, mask_mod, device) -> None:
    """Runs ``mask_mod`` once, eagerly on ``device``: that checks that the rule runs on torch ops, and makes
    the lookup tables of the layout (and of the layouts its rule is made of) that the mask reads there."""
    import torch

    idx = torch.arange(4, device=device)
    try:
        with _getitem_to_index():
            out = torch.vmap(mask_mod)(idx * 0, idx * 0, idx % layout.seq_q, idx % layout.seq_k)
        if not is_torch(out) or out.dtype != torch.bool or tuple(out.shape) != (4,):
            raise TypeError(
                f"it gave {type(out).__name__} {getattr(out, 'dtype', '')}, not a torch bool tensor"
            )
    except Exception as exc:
        if layout.rule is None:  # the mask is this module's own torch code: a failure here is a bug
            raise
        raise ValueError(
            f"the layout's rule {layout.rule.name!r} cannot be evaluated with torch ops, so FlexAttention "
            f"cannot apply it ({type(exc).__name__}: {exc}); to_flex supports rules written with Python "
            "operators and indexing only, as every pattern of cusparseattn.patterns is"
        ) from exc
