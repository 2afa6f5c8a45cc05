"""What the kernels learn from a traced rule's program before they compile it (`kernel_rule`): the C text of
the output they evaluate, the run of keys each query sees or of queries each key (`band`: the kernels then
mask a tile's row from its two ends), and whether the text computes in 32-bit integers (`narrowable`
structurally, and `largest`, the bound of its values that decides it at run time).

>>> from cusparseattn.trace import trace
>>> program = trace(lambda b, h, q, k: (q >= k) & (q - k < 256), "mask_mod")
>>> rule = kernel_rule(program, "value")
>>> rule.expr, rule.key_band, rule.query_band
('((q >= k) && ((q - k) < P0))', ('((q - P0) + 1)', 'q'), ('k', '((k + P0) - 1)'))
"""

from __future__ import annotations

from dataclasses import dataclass

from .program import MASK_NAMES, WIDE, Program, terms
from .traced import Expr

_FLIPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}
_SHIFT = {"le": 0, "lt": -1, "ge": 0, "gt": 1, "eq": 0}  # what turns a strict bound into an inclusive one


@dataclass(frozen=True)
class KernelRule:
    """A rule as the kernels compile it: its C expression over ``b, h, q, k``, the parameters ``P0..P7`` and
    arrays ``A0..A3`` (`cusparseattn.program.MASK_NAMES`), whether that text is exact in 32-bit integers
    where its values fit (``narrowable``), and its bands, C texts ``(first, last)`` (None on a side without
    a bound) for the keys a query ``q`` attends (``key_band``) and the queries that attend key ``k``
    (``query_band``), or None where the rule is no such run."""

    expr: str
    narrowable: bool = False
    key_band: tuple[str | None, str | None] | None = None
    query_band: tuple[str | None, str | None] | None = None


def kernel_rule(program: Program, output: str) -> KernelRule:
    """The `KernelRule` of one boolean output of a traced mask's program."""
    node = program.outputs[output]
    text, printed = program.c_form(node, MASK_NAMES)

    def texts(found):
        if found is None:
            return None
        return tuple(None if x is None else program.c_text_of(x, MASK_NAMES) for x in found)

    return KernelRule(text, not printed & WIDE, texts(band(node, "k")), texts(band(node, "q")))


def band(node: Expr, var: str) -> tuple[Expr | None, Expr | None] | None:
    """Where a boolean node says ``first <= var <= last`` exactly, ``(first, last)``: nodes free of `var`
    (None on a side without a bound), the largest of the lower bounds and the least of the upper ones;
    else None. It knows conjunctions of comparisons whose sides are sums in which `var` is one term, as
    causal rules and sliding windows are written; any term free of `var` (a block index, a table's value)
    may stand beside it.

    >>> from cusparseattn.trace import trace
    >>> program = trace(lambda b, h, q, k: (k <= q) & (q - k < 64), "mask_mod")
    >>> first, last = band(program.outputs["value"], "k")
    >>> program.c_text_of(first, MASK_NAMES), program.c_text_of(last, MASK_NAMES)
    ('((q - P0) + 1)', 'q')
    """
    firsts, lasts = [], []
    for term in terms(node, "and"):
        found = _bound(term, var)
        if found is None:
            return None
        first, last = found
        firsts += [first] if first is not None else []
        lasts += [last] if last is not None else []
    if not firsts and not lasts:
        return None

    def tightest(bounds: list[Expr], op: str) -> Expr | None:
        out = None
        for x in bounds:
            out = x if out is None else node.graph.node(op, "int", (out, x))
        return out

    return tightest(firsts, "maximum"), tightest(lasts, "minimum")


def _bound(term: Expr, var: str) -> tuple[Expr | None, Expr | None] | None:
    """A comparison whose sides' difference is ``+-var + rest``, rest free of `var`: var's bounds."""
    if term.op not in _SHIFT or term.args[0].kind != "int":
        return None
    left, right = term.args
    parts = _sum(left, 1) + _sum(right, -1)  # left - right
    c = sum(sign for sign, atom in parts if atom.op == "var" and atom.data == var)
    rest = [(sign, atom) for sign, atom in parts if not (atom.op == "var" and atom.data == var)]
    if c not in (1, -1) or any(_uses(atom, var) for _, atom in rest):
        return None
    op = term.op if c == 1 else _FLIPPED[term.op]
    # c var + rest op 0: var op -c rest.
    bound = _make_sum(term.graph, [(-c * sign, atom) for sign, atom in rest], _SHIFT[op])
    return (bound if op in ("ge", "gt", "eq") else None), (bound if op in ("le", "lt", "eq") else None)


def _sum(x: Expr, sign: int) -> list[tuple[int, Expr]]:
    """The signed terms of ``sign * x`` through its additions, subtractions and negations."""
    if x.op == "add":
        return _sum(x.args[0], sign) + _sum(x.args[1], sign)
    if x.op == "sub":
        return _sum(x.args[0], sign) + _sum(x.args[1], -sign)
    if x.op == "neg":
        return _sum(x.args[0], -sign)
    return [(sign, x)]


def _uses(x: Expr, var: str, memo: dict | None = None) -> bool:
    memo = {} if memo is None else memo
    found = memo.get(id(x))
    if found is None:
        found = memo[id(x)] = (x.op == "var" and x.data == var) or any(_uses(a, var, memo) for a in x.args)
    return found


def _make_sum(graph, parts: list[tuple[int, Expr]], constant: int) -> Expr:
    """``sum(sign * atom) + constant`` as nodes, literals folded into the constant."""
    constant += sum(sign * atom.data for sign, atom in parts if atom.op == "lit")
    out = None
    for sign, atom in parts:
        if atom.op == "lit":
            continue
        if out is None:
            out = atom if sign > 0 else graph.node("neg", "int", (atom,))
        else:
            out = graph.node("add" if sign > 0 else "sub", "int", (out, atom))
    if out is None:
        return graph.literal(constant, "int")
    if constant:
        out = graph.node("add" if constant > 0 else "sub", "int", (out, graph.literal(abs(constant), "int")))
    return out


def largest(node: Expr, positions: int, bands: tuple = ()) -> int:
    """A bound of the magnitude of every integer that a node's C text computes, for ``b, h, q, k`` below
    ``positions``, parameters at their values and arrays at their present values; each of ``bands`` (a
    band's bounds, nodes) also has a tile's first key or query subtracted and 1 added in the kernels.
    Where it is below 2^31 (and the text is `KernelRule.narrowable`) the kernels take 32-bit integers."""
    memo: dict[int, int] = {}
    values = [_magnitude(node, positions, memo)]
    values += [_magnitude(x, positions, memo) + positions + 1 for x in bands if x is not None]
    return max([*values, *memo.values()])


def _magnitude(x: Expr, n: int, memo: dict) -> int:
    found = memo.get(id(x))
    if found is not None:
        return found
    a = [_magnitude(arg, n, memo) for arg in x.args]
    op = x.op
    if x.kind == "bool":
        out = 1
    elif op == "var":
        out = n
    elif op in ("lit", "param"):
        out = abs(int(x.data if op == "lit" else x.data.value))
    elif op == "index":
        out = int(abs(x.data.array.data).max(initial=0))
    elif op in ("add", "sub"):
        out = a[0] + a[1]
    elif op == "mul":
        out = a[0] * a[1]
    elif op in ("mod", "fmod"):  # floor's remainder lies within the divisor; C's within both
        out = min(a) if op == "fmod" else a[1]
    else:  # neg, abs, floordiv, minimum, maximum, where, casts: no larger than their operands
        out = max(a, default=0)
    memo[id(x)] = out
    return out
