"""Rules of layouts that combine (``|``, ``&``: `combined_rule`) or that are seen from a window of another
(`shifted_rule`): traced rules give traced rules, their programs replayed into one
(`cusparseattn.program.Program.replay`), so the kernels keep compiling them and their analyses.
"""

from __future__ import annotations

import numpy as np

from .graph import Graph
from .mods import mask_rule
from .program import Program
from .rules import TokenRule, is_torch
from .traced import Expr, NotCompilable


def combined_rule(a, b, op: str) -> tuple[TokenRule | None, bool]:
    """The rule of layouts ``a op b``, and whether it is exact (equal to the token mask everywhere in
    range)."""
    ra, rb = a.rule, b.rule
    if ra is None and rb is None:
        return None, False
    # An operand that is full everywhere decides alone (|) or leaves everything to the other (&).
    for x, y in ((a, b), (b, a)):
        if x.full.all():
            keep = x if op == "|" else y
            return keep.rule, keep._exact_rule
    if a._exact_rule and b._exact_rule and ra.program is not None and rb.program is not None:
        try:
            return mask_rule(_RuleOp(op, ra.fn, rb.fn), name=f"({ra.name} {op} {rb.name})"), True
        except NotCompilable:  # more parameters or arrays than the kernels take: the token masks below
            pass
    if op == "&":
        # Where one operand has no partial block under the other's blocks, the other's rule is the whole
        # answer: the result's partial blocks are partial in the other operand, its full blocks full there.
        for x, y in ((a, b), (b, a)):
            if not (x.partial & y.blocks).any():
                return y.rule, False
    na, nb = ("blocks" if lay.rule is None else lay.rule.name for lay in (a, b))
    return TokenRule(f"({na} {op} {nb})", _MaskOp(op, a, b)), True


def shifted_rule(rule: TokenRule, db: int = 0, dh: int = 0, dq: int = 0, dk: int = 0) -> TokenRule:
    """`rule` seen from a sub-layout whose batch, head, query and key 0 are the original's db, dh, dq, dk: its
    program replayed with one parameter more per nonzero shift (past the kernels' parameters, a rule
    without a program: bits)."""
    shifts = {"b": db, "h": dh, "q": dq, "k": dk}
    moved = ", ".join(f"{var}+{s}" for var, s in shifts.items() if s)
    name, fn = f"{rule.name}[{moved}]", _Shifted(rule.fn, (db, dh, dq, dk))
    if rule.program is None:
        return TokenRule(name, fn)
    graph = Graph()
    values = {}
    for var, shift in shifts.items():
        index = graph.var(var, "int")
        values[var] = graph.apply("add", index, graph.param(shift)) if shift else index
    outputs = {out: rule.program.replay(out, values) for out in rule.program.outputs}
    try:
        program = Program(outputs, "mask_mod", name).check_compilable()
    except NotCompilable:
        return TokenRule(name, fn)
    return TokenRule(name, fn, program)


class _RuleOp:
    """``fa op fb`` for two rule functions, on NumPy, torch or traced indices."""

    def __init__(self, op: str, fa, fb):
        self.op, self.fa, self.fb = op, fa, fb

    def __call__(self, b, h, q, k):
        x, y = self.fa(b, h, q, k), self.fb(b, h, q, k)
        if not any(is_torch(v) or isinstance(v, Expr) for v in (x, y)):
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
