"""A finished trace (`Program`): its output as one C expression for the kernels (`c_text`, with the names a
mask or a score mod prints as: `MASK_NAMES`, `SCORE_NAMES`), evaluated on NumPy or CuPy index arrays for
the reference (`evaluate`), its parameters and captured arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .traced import (
    MAX_ARRAYS,
    MAX_FLOAT_PARAMS,
    MAX_INT_PARAMS,
    ArrayRef,
    Expr,
    NotCompilable,
    clamp_index,
    type_root,
)


# ---- the finished program ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CNames:
    """How a program's parameters and arrays are spelled in C, for one kernel interface."""

    int_param: str  # prefix of the integer parameters
    float_param: str | None  # prefix of the float parameters (None: floats are not allowed)
    array_int: str  # format of an int array's element: {slot}, {index}
    array_float: str | None
    int_type: str  # the integers' C type, of casts; literals take it from the names beside them
    int_suffix: str  # of integer literals

    def typed(self, value: int) -> str:
        """An integer literal of `int_type`, for min and max, whose overloads take no mixed types."""
        text = _c_literal(value, "int", self.int_suffix)
        return text if self.int_suffix else f"(({self.int_type}){text})"


# A mask's integers are the kernels' RuleInt (long long, or int where the rule's values allow:
# cusparseattn.analyses), a score mod's long long.
MASK_NAMES = CNames("P", None, "((RuleInt)A{slot}[{index}])", None, "RuleInt", "")
SCORE_NAMES = CNames(
    "SI",
    "SF",
    "((long long)((const int*)SA{slot})[{index}])",
    "(((const float*)SA{slot})[{index}])",
    "long long",
    "LL",
)

_C_BINARY = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
}  # fmt: skip
_C_LOGICAL = {"and": ("&&", "&"), "or": ("||", "|"), "xor": ("!=", "^")}  # (booleans, integers)
_C_FLOAT_FUNCTIONS = {
    "exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "tanh": "tanhf", "sqrt": "sqrtf",
    "abs": "fabsf", "sin": "sinf", "cos": "cosf",
}  # fmt: skip
_C_SHIFTS = {"lshift": "<<", "rshift": ">>"}
# What a C text computes in 64-bit integers only (or in floats), by the node that prints it: `Program.c_form`.
WIDE = frozenset({"csa::floordiv", "csa::floormod", "shifts", "bitwise", "float"})
_WIDE_OPS = {
    "lshift": "shifts", "rshift": "shifts", "and": "bitwise", "or": "bitwise", "xor": "bitwise",
    "invert": "bitwise",
}  # fmt: skip
_PRINTED = ("printed",)  # the printer's memo key of what it printed (one set, shared by the memo's copies)


class Program:
    """A finished trace: named output nodes with their parameters and arrays numbered in a fixed order.

    Slots are numbered by a depth-first walk of the outputs, so the same structure always gets the same
    numbering (and the same C text), whatever the values.
    """

    def __init__(self, outputs: dict[str, Expr], role: str, name: str):
        self.outputs, self.role, self.name = outputs, role, name
        self._slots: dict[int, int] = {}  # id(Param) or id(ArrayRef) -> slot
        ints: list[int] = []
        floats: list[float] = []
        arrays: list[ArrayRef] = []
        self.variables: set[str] = set()
        self.kinds: set[str] = set()
        seen: set[int] = set()

        def number(param: Expr) -> None:
            if id(param.data) not in self._slots:
                values = ints if param.kind == "int" else floats
                self._slots[id(param.data)] = len(values)
                values.append(param.data.value)

        def walk(x: Expr) -> None:
            if id(x) in seen:
                return
            seen.add(id(x))
            self.kinds.add(x.kind)
            for a in x.args[:1] if _constant_divisor(x) else x.args:
                walk(a)
            if x.op == "var":
                self.variables.add(x.data)
            elif x.op == "param":
                number(x)
            elif x.op == "index" and id(x.data) not in self._slots:
                self._slots[id(x.data)] = len(arrays)
                arrays.append(x.data)
                for dim in x.data.shape:
                    number(dim)

        for out in outputs.values():
            walk(out)
        self.int_params, self.float_params = tuple(ints), tuple(floats)
        self._arrays = tuple(arrays)
        self.arrays = tuple(ref.array.data.reshape(-1) for ref in arrays)

    def check_compilable(self) -> Program:
        """Raise `NotCompilable` unless the kernels can take this program; return it."""
        what = f"{self.role} {self.name!r}"
        if self.role == "mask_mod" and "float" in self.kinds:
            raise NotCompilable(
                f"mask_mod takes integers only, but {what} computes with floats (a float constant, a float "
                "array, or / division): use // for integer division and integer constants"
            )
        integer_noun = (
            "integer parameters (each integer constant and each dimension of a captured array is one)"
        )
        for count, limit, noun in (
            (len(self.int_params), MAX_INT_PARAMS, integer_noun),
            (len(self.float_params), MAX_FLOAT_PARAMS, "float parameters (each float constant is one)"),
            (len(self.arrays), MAX_ARRAYS, "captured arrays"),
        ):
            if count > limit:
                raise NotCompilable(
                    f"{what} needs {count} {noun}; the kernels take at most {limit}. Capture numbers in "
                    "variables (one parameter each, however often used) or merge arrays"
                )
        return self

    @property
    def structure(self) -> tuple:
        """What changes compiled code: the C text, counts of parameters and arrays' dtypes and ranks."""
        names = SCORE_NAMES if self.role == "score_mod" else MASK_NAMES
        texts = tuple(self.c_text(n, names) for n in self.outputs)
        ranks = tuple((ref.array.data.dtype.str, ref.array.ndim) for ref in self._arrays)
        return (self.role, texts, len(self.int_params), len(self.float_params), ranks)

    # ---- C ----
    def c_text(self, output: str, names: CNames) -> str:
        """The output as one fully parenthesised C expression over ``s, b, h, q, k`` and the slots."""
        return self.c_text_of(self.outputs[output], names)

    def c_text_of(self, node: Expr, names: CNames) -> str:
        """A node of this program's graph as C, its parameters and arrays in this program's slots."""
        return self.c_form(node, names)[0]

    def c_form(self, node: Expr, names: CNames) -> tuple[str, frozenset[str]]:
        """`c_text_of`, and what of its text computes in 64-bit integers only (`WIDE`: ``csa::floordiv``
        and ``floormod``, shifts, bitwise operations, floats): with none of them, the text is exact in
        32-bit integers wherever its values fit (`cusparseattn.analyses.largest`)."""
        printed: set[str] = set()
        text = self._c(node, names, {_PRINTED: printed})
        return text, frozenset(printed)

    def replay(self, output: str, values: dict) -> Expr:
        """The output rebuilt over other values of ``b, h, q, k`` (`Expr` of another trace's graph, or
        numbers): how a trace that calls a traced rule sees it. Parameters become parameters of that graph
        with the same values, captured arrays are indexed there."""
        graph = next(v.graph for v in values.values() if isinstance(v, Expr))
        memo: dict[int, Expr] = {}

        def build(x: Expr) -> Expr:
            found = memo.get(id(x))
            if found is not None:
                return found
            if x.op == "var":
                out = graph.operand(values[x.data])
            elif x.op == "param":
                out = graph.param(x.data.value)
            elif x.op == "index":
                out = graph.index(x.data.array, tuple(build(a) for a in x.args))
            else:
                out = graph.node(x.op, x.kind, tuple(build(a) for a in x.args), x.data)
            memo[id(x)] = out
            return out

        return build(self.outputs[output])

    def partial_output(self, block_size: tuple[int, int]) -> Expr | None:
        """What a mask decides inside the partial blocks of its layout of `block_size` blocks, where that is
        less than the whole mask (else None): the terms of its top-level ``&&`` (or ``||``) that have one
        value over every block are left out. Such a term reads q and k only as ``q // c`` and ``k // c``, c a
        multiple of the block's side at the parameters' values (b, h, parameters and captured arrays read
        at such indices are constant too); in a partial block each such conjunct is true, or the block would
        be empty, and each such disjunct false, or the block would be full. The layout's classification of
        blocks is exact (it evaluates the whole mask), so the kernels need only the rest there (the
        ``"partial"`` output of `cusparseattn.mods.mask_rule`'s program)."""
        out = self.outputs["value"]
        if out.kind != "bool" or out.op not in ("and", "or"):
            return None
        parts, memo = terms(out, out.op), {}
        kept = [t for t in parts if not _per_block(t, block_size, memo)]
        if not kept or len(kept) == len(parts):
            return None
        joined = kept[0]
        for term in kept[1:]:
            joined = out.graph.node(out.op, "bool", (joined, term))
        return joined

    def _c(self, x: Expr, names: CNames, memo: dict) -> str:
        found = memo.get(id(x))
        if found is not None:
            return found
        if x.kind == "float" or (x.op in _WIDE_OPS and x.kind == "int"):
            memo[_PRINTED].add(_WIDE_OPS.get(x.op, "float"))
        if x.op == "and" and x.kind == "bool":
            # Each operand's value counts only where the other one holds: the other's facts hold there (C's
            # / and % give some value elsewhere, and && drops it).
            left, right = _lookups_first(x.args, memo)
            a = [self._c(left, names, _assuming(right, memo)), self._c(right, names, _assuming(left, memo))]
        elif x.op == "or" and x.kind == "bool":
            a = [self._c(arg, names, memo) for arg in _lookups_first(x.args, memo)]
        elif x.op == "where":  # the first choice counts only where the condition holds
            cond, first, second = x.args
            a = [self._c(cond, names, memo), self._c(first, names, _assuming(cond, memo))]
            a.append(self._c(second, names, memo))
        elif _constant_divisor(x):
            a = [self._c(x.args[0], names, memo), str(_value(x.args[1]))]
        else:
            a = [self._c(arg, names, memo) for arg in x.args]
        op, kind = x.op, x.kind
        if op == "var":
            text = x.data
        elif op == "lit":
            text = _c_literal(x.data, kind, names.int_suffix)
        elif op == "param":
            prefix = names.int_param if kind == "int" else names.float_param
            text = f"{prefix}{self._slots[id(x.data)]}"
        elif op == "index":
            ref = x.data
            shape = [self._c(d, names, memo) for d in ref.shape]
            flat = None
            for i, n, index, d in zip(a, shape, x.args, ref.shape, strict=True):
                i = names.typed(index.data) if index.op == "lit" else i
                low = i if _sign(index, memo) else f"max({i}, {names.typed(0)})"  # known >= 0: no floor
                one = _c_literal(1, "int", names.int_suffix)
                last = names.typed(d.data - 1) if d.op == "lit" else f"({n} - {one})"
                clamped = f"min({low}, {last})"
                flat = clamped if flat is None else f"(({flat} * {n}) + {clamped})"
            form = names.array_int if kind == "int" else names.array_float
            text = form.format(slot=self._slots[id(ref)], index=flat)
        elif op == "cast":
            text = f"((float)({a[0]}))" if kind == "float" else f"(({names.int_type})({a[0]}))"
        elif op in _C_BINARY:
            text = f"({a[0]} {_C_BINARY[op]} {a[1]})"
        elif op in _C_LOGICAL:
            text = f"({a[0]} {_C_LOGICAL[op][kind != 'bool']} {a[1]})"
        elif op == "invert":
            text = f"(!{a[0]})" if kind == "bool" else f"(~{a[0]})"
        elif op == "neg":
            text = f"(-{a[0]})"
        elif op in ("floordiv", "mod") and kind == "int" and _non_negative_by_positive(x.args, memo):
            # C's own division on a value >= 0 and a divisor > 0: floor's answer, and narrowable to 32 bits
            text = f"({a[0]} {'/' if op == 'floordiv' else '%'} {a[1]})"
        elif op == "floordiv":
            text = f"csa::floordiv({a[0]}, {a[1]})" if kind == "int" else f"floorf(({a[0]} / {a[1]}))"
            memo[_PRINTED].add("csa::floordiv" if kind == "int" else "float")
        elif op == "mod" and kind == "int":
            text = f"csa::floormod({a[0]}, {a[1]})"
            memo[_PRINTED].add("csa::floormod")
        elif op == "mod":
            text = f"({a[0]} - (floorf(({a[0]} / {a[1]})) * {a[1]}))"
        elif op == "fmod":  # C's own remainder: truncated, with the sign of the dividend
            text = f"({a[0]} % {a[1]})" if kind == "int" else f"fmodf({a[0]}, {a[1]})"
        elif op in _C_SHIFTS:
            text = f"({a[0]} {_C_SHIFTS[op]} {a[1]})"
        elif op in ("minimum", "maximum"):
            fn = op[:3] if kind == "int" else ("fminf" if op == "minimum" else "fmaxf")
            if kind == "int":
                a = [
                    names.typed(arg.data) if arg.op == "lit" else t for arg, t in zip(x.args, a, strict=True)
                ]
            text = f"{fn}({a[0]}, {a[1]})"
        elif op == "abs" and kind == "int":
            text = f"max({a[0]}, (-{a[0]}))"
        elif op in _C_FLOAT_FUNCTIONS:
            text = f"{_C_FLOAT_FUNCTIONS[op]}({a[0]})"
        elif op == "where":
            text = f"({a[0]} ? {a[1]} : {a[2]})"
        else:
            raise AssertionError(f"no C form for {op}")
        memo[id(x)] = text
        return text

    # ---- NumPy / CuPy ----
    def evaluate(self, output: str, env: dict, float_dtype=np.float32, xp=np):
        """The output on arrays: ``env`` maps ``b, h, q, k`` (and ``s``) to broadcasting arrays (integers
        as int64, the score in ``float_dtype``); ``xp`` is ``numpy`` or ``cupy``. The result has the
        broadcast shape of the variables the output uses."""
        values = {"s": None}
        for name in ("b", "h", "q", "k"):
            if name in env:
                values[name] = xp.asarray(env[name], dtype=xp.int64)
        if "s" in env:
            values["s"] = xp.asarray(env["s"], dtype=float_dtype)
        memo: dict[int, object] = {}
        with np.errstate(all="ignore"):
            return self._eval(self.outputs[output], values, np.dtype(float_dtype), xp, memo)

    def _eval(self, x: Expr, values: dict, fdtype: np.dtype, xp, memo: dict):
        found = memo.get(id(x))
        if found is not None:
            return found
        a = [self._eval(arg, values, fdtype, xp, memo) for arg in x.args]
        op, kind = x.op, x.kind
        scalar = {"bool": xp.bool_, "int": xp.int64, "float": fdtype.type}[kind]
        if op == "var":
            out = values[x.data]
        elif op in ("lit", "param"):
            out = scalar(x.data if op == "lit" else x.data.value)
        elif op == "index":
            ref = x.data
            idx = tuple(clamp_index(i, n) for i, n in zip(a, ref.array.shape, strict=True))
            out = ref.array._table_for(idx)[idx].astype(xp.int64 if kind == "int" else fdtype)
        elif op == "cast":
            out = xp.asarray(a[0]).astype(xp.int64 if kind == "int" else fdtype)
        elif op == "floordiv" and kind == "float":
            out = xp.floor(a[0] / a[1])
        elif op == "mod" and kind == "float":
            out = a[0] - xp.floor(a[0] / a[1]) * a[1]
        elif op in _NUMPY_LOGICAL:
            out = getattr(xp, _NUMPY_LOGICAL[op][kind != "bool"])(*a)
        elif op in ("minimum", "maximum") and kind == "float":
            out = (xp.fmin if op == "minimum" else xp.fmax)(*a)  # C's fminf/fmaxf: a NaN operand loses
        else:
            out = getattr(xp, _NUMPY[op])(*a)
        memo[id(x)] = out
        return out


_NUMPY = {
    "add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide", "floordiv": "floor_divide",
    "mod": "remainder", "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal",
    "eq": "equal", "ne": "not_equal", "neg": "negative", "abs": "abs", "minimum": "minimum",
    "maximum": "maximum", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "where": "where",
    "exp2": "exp2", "log2": "log2", "sin": "sin", "cos": "cos", "fmod": "fmod", "lshift": "left_shift",
    "rshift": "right_shift",
}  # fmt: skip
_NUMPY_LOGICAL = {
    "and": ("logical_and", "bitwise_and"),
    "or": ("logical_or", "bitwise_or"),
    "xor": ("logical_xor", "bitwise_xor"),
    "invert": ("logical_not", "invert"),
}


def _non_negative_by_positive(args: tuple, memo: dict) -> bool:
    """Whether a division's dividend is known >= 0 and its divisor > 0 (`_sign`; `memo` is the C printer's,
    the signs keyed apart from its texts)."""
    dividend, divisor = (_sign(a, memo) for a in args)
    return dividend >= 1 and divisor == 2


def _sign(x: Expr, memo: dict) -> int:
    """What is known of an integer node's sign wherever the kernels evaluate it (b, h, q, k >= 0; parameters
    at their values): 2 where it is > 0, 1 where >= 0, 0 where nothing is known. A parameter's value thus
    chooses the C text's division, so a value of the other sign gives another text (and another kernel),
    never a wrong one; a captured array's values, which may change under the same text, count as unknown."""
    key = ("sign", id(x))
    found = memo.get(key)
    if found is not None:
        return found
    signs = [_sign(a, memo) for a in x.args] if x.op in _SIGNED else []
    if x.kind != "int":
        sign = 0
    elif x.op == "var":
        sign = 1
    elif x.op in ("lit", "param"):
        value = _value(x)
        sign = 2 if value > 0 else 1 if value == 0 else 0
    elif x.op == "add":
        sign = 0 if 0 in signs else max(signs)
    elif x.op == "mul":
        sign = min(signs)
    elif x.op == "maximum":
        sign = max(signs)
    elif x.op == "minimum":
        sign = min(signs)
    elif x.op == "floordiv":
        sign = 1 if signs[0] and signs[1] == 2 else 0
    elif x.op == "mod":  # floor's remainder of a divisor > 0 lies in [0, divisor)
        sign = 1 if signs[1] == 2 else 0
    else:
        sign = 1 if x.op == "abs" else 0
    memo[key] = sign
    return sign


_SIGNED = {"add", "mul", "maximum", "minimum", "floordiv", "mod"}


# What a comparison that holds tells of a difference of its sides: (larger, smaller, its sign then).
_FACTS = {"le": (1, 0, 1), "lt": (1, 0, 2), "ge": (0, 1, 1), "gt": (0, 1, 2)}


def _assuming(guard: Expr, memo: dict) -> dict:
    """The C printer's memo for an operand that counts only where `guard` holds: the signs of the differences
    that the guard's comparisons (its top-level ``&&`` terms, integers) bound, where none is known yet; a
    copy, so the facts stay inside that operand."""
    facts = {}
    for term in terms(guard, "and"):
        fact = _FACTS.get(term.op)
        if fact is None or term.args[0].kind != "int" or term.args[1].kind != "int":
            continue
        larger, smaller, sign = term.args[fact[0]], term.args[fact[1]], fact[2]
        difference = guard.graph.node("sub", "int", (larger, smaller))
        if _sign(difference, memo) < sign:
            facts[("sign", id(difference))] = sign
    return {**memo, **facts} if facts else memo


def _lookups_first(args: tuple, memo: dict) -> tuple:
    """The operands of ``&&`` or ``||`` with one that reads an array first: the kernels then read the arrays
    at every element, unconditionally, so that the compiler shares a row's and a column's reads across a
    tile's elements, where behind the other operand each element's read is its own (and held in registers:
    a documents rule written causal term first spilled in the Hopper forward)."""
    left, right = args
    return (right, left) if _reads_array(right, memo) and not _reads_array(left, memo) else args


def _reads_array(x: Expr, memo: dict) -> bool:
    key = ("reads", id(x))
    found = memo.get(key)
    if found is None:
        found = memo[key] = x.op == "index" or any(_reads_array(a, memo) for a in x.args)
    return found


def terms(x: Expr, op: str) -> list[Expr]:
    """The operands of a chain of boolean `op` nodes, in order."""
    if x.op == op and x.kind == "bool":
        return [t for a in x.args for t in terms(a, op)]
    return [x]


def _per_block(x: Expr, block_size: tuple[int, int], memo: dict) -> bool:
    """Whether `x` has one value over each block of `block_size` (`Program.partial_output`)."""
    found = memo.get(id(x))
    if found is not None:
        return found
    if x.op == "var":
        result = x.data in ("b", "h")
    elif x.op in ("lit", "param"):
        result = True
    elif x.op == "floordiv" and x.kind == "int" and (side := _aligned(x.args[0], block_size)) is not None:
        value = _value(x.args[1])
        result = isinstance(value, int) and value > 0 and value % side == 0
    else:
        result = all(_per_block(a, block_size, memo) for a in x.args)
    memo[id(x)] = result
    return result


def _constant_divisor(x: Expr) -> bool:
    """Whether `x` divides integers by a known positive value (a literal, or a parameter at its value). The C
    text spells that divisor as a literal: the compiler turns a division by a constant into a multiply and a
    shift, where a division by a run-time value takes a long sequence (a call, in 64 bits) at every element.
    Another divisor thus compiles another kernel, as a parameter's sign does (`_sign`)."""
    if x.op not in ("floordiv", "mod", "fmod") or x.kind != "int":
        return False
    value = _value(x.args[1])
    return value is not None and value > 0


def _value(x: Expr):
    """A literal's or a parameter's value (None for other nodes)."""
    return x.data if x.op == "lit" else x.data.value if x.op == "param" else None


def _aligned(x: Expr, block_size: tuple[int, int]) -> int | None:
    """The block's side along q or k where `x` is q or k plus multiples of it (so that ``x // c`` is constant
    over a block for c a multiple of the side), else None."""
    if x.op == "var" and x.data in ("q", "k"):
        return block_size[0] if x.data == "q" else block_size[1]
    if x.op == "add":
        for index, offset in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            side, value = _aligned(index, block_size), _value(offset)
            if side is not None and isinstance(value, int) and value % side == 0:
                return side
    return None


def _c_literal(value, kind: str, int_suffix: str = "LL") -> str:
    if kind == "bool":
        return "true" if value else "false"
    if kind == "int":
        return f"{value}{int_suffix}" if value >= 0 else f"(-{-value}{int_suffix})"
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = f"{abs(value)!r}f"
    return text if value >= 0 else f"(-{text})"


def array_module(*xs):
    return next((__import__("cupy") for x in xs if type_root(x) == "cupy"), np)
