"""Token rules: the predicate over (b, h, q, k) that a layout's partial blocks defer to (`TokenRule`), what
its C expression tells (bands of keys or queries, whether 32-bit arithmetic is exact), and how rules
combine when layouts do (``|``, ``&``, shifts for indexing).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

MAX_PARAMS, MAX_ARRAYS = 8, 4  # the P0..P7 and A0..A3 slots a rule's C expression may use
_NARROW_TOKENS = re.compile(r"[A-Za-z_]\w*|\d+|&&|\|\||<<|>>|[<>=!]=|[-+/%<>!?:(),\[\]]")
_NARROW_NAME = re.compile(r"[bhqk]|P[0-7]|A[0-3]|true|false|RuleInt|min|max")
_NOT_VALUES = {"RuleInt", "min", "max", "true", "false"}  # names in a rule that are no term of its sums


def _tokens(expr: str) -> list[str] | None:
    """`expr` as _NARROW_TOKENS's tokens; None where some of it is none of them."""
    tokens = _NARROW_TOKENS.findall(expr)
    return tokens if "".join(tokens) == re.sub(r"\s+", "", expr) else None


def narrowable(expr: str) -> bool:
    """Whether a rule's C expression only adds, subtracts, divides, compares and takes the least or largest
    of its names, parameters, array elements and literals (no products, shifts or other calls; casts to the
    kernels' RuleInt alone): then its value is bounded by its terms', and the kernels compile it for 32-bit
    integers as well (TokenRule.narrow decides at run time)."""
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
        terms = [t for t in _NARROW_TOKENS.findall(expr) if t[0].isalnum() and t not in _NOT_VALUES]
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


_REF = re.compile(r"\b([PA])(\d+)\b")


def is_torch(x) -> bool:
    """Whether ``x`` is a torch object (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def combined_rule(a, b, op: str) -> tuple[TokenRule | None, bool]:
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

    def __init__(self, op: str, a, b):
        self.op, self.a, self.b = op, a, b

    def __call__(self, b, h, q, k):
        if any(is_torch(x) for x in (b, h, q, k)):
            x, y = self.a._torch_token_mask(b, h, q, k), self.b._torch_token_mask(b, h, q, k)
        else:
            x, y = self.a.token_mask(b, h, q, k), self.b.token_mask(b, h, q, k)
        return (x & y) if self.op == "&" else (x | y)


class _Shifted:
    """A rule function seen from a sub-layout: its index 0 on each axis is the original's ``shifts``."""

    def __init__(self, fn, shifts: tuple[int, int, int, int]):
        self.fn, self.shifts = fn, shifts

    def __call__(self, b, h, q, k):
        db, dh, dq, dk = self.shifts
        return self.fn(b + db, h + dh, q + dq, k + dk)


def shifted_rule(rule: TokenRule, db: int = 0, dh: int = 0, dq: int = 0, dk: int = 0) -> TokenRule:
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
