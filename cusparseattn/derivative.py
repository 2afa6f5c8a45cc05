"""The derivative of a traced score mod with respect to the score, symbolic and simplified (`Derivative`), for
the backward kernels' ``CSA_SCORE_GRAD``.
"""

from __future__ import annotations

from .graph import Graph
from .tensorlike import LN2
from .traced import Expr


# ---- the derivative with respect to the score --------------------------------------------------------------
class Derivative:
    """d(node)/d(score), symbolic, through smart constructors that simplify as they build.

    They fold literal arithmetic, drop ``x + 0`` and ``x * 1``, turn ``x * 0`` into 0, ``x + -y`` into
    ``x - y`` and ``where(c, x, x)`` into ``x``, and keep products as a coefficient times factors over
    factors, cancelling a factor that appears above and below the line (so ``cap * tanh(s / cap)`` has the
    derivative ``1 - tanh(s / cap)²``). Only float nodes depend on the score: integer and boolean values are
    piecewise constant in it.
    """

    def __init__(self, graph: Graph, score: Expr):
        self.graph, self.score = graph, score
        self._memo: dict[int, Expr] = {}
        self.zero, self.one = graph.literal(0.0, "float"), graph.literal(1.0, "float")

    def of(self, x: Expr) -> Expr:
        found = self._memo.get(id(x))
        if found is None:
            found = self._memo[id(x)] = self._rule(x)
        return found

    def _rule(self, x: Expr) -> Expr:
        if x is self.score:
            return self.one
        if x.kind != "float" or x.op in ("var", "param", "lit", "index", "cast"):
            return self.zero
        a = x.args
        da = [self.of(arg) for arg in a]
        if x.op == "add":
            return self.add(da[0], da[1])
        if x.op == "sub":
            return self.sub(da[0], da[1])
        if x.op == "mul":
            return self.add(self.mul(da[0], a[1]), self.mul(a[0], da[1]))
        if x.op == "truediv":
            if da[1] is self.zero:
                return self.div(da[0], a[1])
            top = self.sub(self.mul(da[0], a[1]), self.mul(a[0], da[1]))
            return self.div(top, self.mul(a[1], a[1]))
        if x.op == "floordiv":  # piecewise constant
            return self.zero
        if x.op == "mod":  # a - floor(a / b) * b
            return self.sub(da[0], self.mul(self.graph.node("floordiv", "float", a), da[1]))
        if x.op == "neg":
            return self.neg(da[0])
        if x.op == "abs":
            return self.where(self.compare("lt", a[0], self.zero), self.neg(da[0]), da[0])
        if x.op == "where":
            return self.where(a[0], da[1], da[2])
        if x.op in ("minimum", "maximum"):
            return self.where(self.compare("le" if x.op == "minimum" else "ge", a[0], a[1]), da[0], da[1])
        if x.op == "fmod":  # a - trunc(a / b) * b, trunc(a / b) = (a - fmod(a, b)) / b
            if da[1] is self.zero:
                return da[0]
            return self.sub(da[0], self.mul(self.div(self.sub(a[0], x), a[1]), da[1]))
        if x.op == "exp":
            return self.mul(x, da[0])
        if x.op == "exp2":
            return self.mul(self.mul(self.lit(LN2), x), da[0])
        if x.op == "log":
            return self.div(da[0], a[0])
        if x.op == "log2":
            return self.div(da[0], self.mul(self.lit(LN2), a[0]))
        if x.op == "sin":
            return self.mul(self.graph.node("cos", "float", a), da[0])
        if x.op == "cos":
            return self.neg(self.mul(self.graph.node("sin", "float", a), da[0]))
        if x.op == "tanh":
            return self.mul(self.sub(self.one, self.mul(x, x)), da[0])
        if x.op == "sqrt":
            return self.div(da[0], self.mul(self.graph.literal(2.0, "float"), x))
        raise AssertionError(f"no derivative rule for {x.op}")

    # ---- smart constructors (float nodes) ----
    def lit(self, value: float) -> Expr:
        return self.graph.literal(value, "float")

    def compare(self, op: str, a: Expr, b: Expr) -> Expr:
        return self.graph.node(op, "bool", (a, b))

    def add(self, a: Expr, b: Expr) -> Expr:
        if a.op == "lit" and b.op == "lit":
            return self.lit(a.data + b.data)
        if a is self.zero:
            return b
        if b is self.zero:
            return a
        if b.op == "neg":
            return self.sub(a, b.args[0])
        return self.graph.node("add", "float", (a, b))

    def sub(self, a: Expr, b: Expr) -> Expr:
        if a.op == "lit" and b.op == "lit":
            return self.lit(a.data - b.data)
        if b is self.zero:
            return a
        if a is self.zero:
            return self.neg(b)
        return self.graph.node("sub", "float", (a, b))

    def neg(self, a: Expr) -> Expr:
        if a.op == "lit":
            return self.lit(-a.data)
        if a.op == "neg":
            return a.args[0]
        return self.graph.node("neg", "float", (a,))

    def where(self, cond: Expr, a: Expr, b: Expr) -> Expr:
        if a is b:
            return a
        if cond.op == "lit":
            return a if cond.data else b
        return self.graph.node("where", "float", (cond, a, b))

    def mul(self, a: Expr, b: Expr) -> Expr:
        return self._product(self._factors(a), self._factors(b), divide=False)

    def div(self, a: Expr, b: Expr) -> Expr:
        return self._product(self._factors(a), self._factors(b), divide=True)

    def _factors(self, x: Expr) -> tuple[float, list[Expr], list[Expr]]:
        """``x`` as ``coefficient * prod(numerator) / prod(denominator)``."""
        if x.op == "lit":
            return x.data, [], []
        if x.op == "neg":
            c, num, den = self._factors(x.args[0])
            return -c, num, den
        if x.op in ("mul", "truediv") and x.kind == "float":
            c1, n1, d1 = self._factors(x.args[0])
            c2, n2, d2 = self._factors(x.args[1])
            if x.op == "mul":
                return c1 * c2, n1 + n2, d1 + d2
            if c2 != 0:
                return c1 / c2, n1 + d2, d1 + n2
        return 1.0, [x], []

    def _product(self, a, b, *, divide: bool) -> Expr:
        (ca, na, da), (cb, nb, db) = a, b
        if divide:
            if cb == 0:
                return self.graph.node("truediv", "float", (self._build(ca, na, da), self.zero))
            coefficient, num, den = ca / cb, na + db, da + nb
        else:
            coefficient, num, den = ca * cb, na + nb, da + db
        if coefficient == 0:
            return self.zero
        # Cancel x / x. Identity suffices, the graph interns equal nodes (and `==` would trace, not compare).
        kept = []
        for d in den:
            i = next((i for i, n in enumerate(num) if n is d), None)
            if i is None:
                kept.append(d)
            else:
                del num[i]
        return self._build(coefficient, num, kept)

    def _build(self, coefficient: float, num: list[Expr], den: list[Expr]) -> Expr:
        top = None
        for n in num:
            top = n if top is None else self.graph.node("mul", "float", (top, n))
        if den:
            bottom = den[0]
            for d in den[1:]:
                bottom = self.graph.node("mul", "float", (bottom, d))
            top = self.graph.node("truediv", "float", (self.one if top is None else top, bottom))
        if top is None:
            return self.lit(coefficient)
        if coefficient == 1:
            return top
        if coefficient == -1:
            return self.neg(top)
        return self.graph.node("mul", "float", (self.lit(coefficient), top))
