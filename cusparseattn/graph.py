"""The expression graph of a trace (`Graph`): its nodes, folded where their values are known, the parameters
that numbers become, and the captured values of the traced function (its closure, defaults and globals,
rebuilt with arrays as `CapturedArray` and numbers as parameters).
"""

from __future__ import annotations

import math
import types

import numpy as np

from . import tensorlike
from .traced import (
    LIBRARIES,
    SUPPORTED,
    ArrayRef,
    CapturedArray,
    Expr,
    NotATable,
    Param,
    Row,
    TraceError,
    graph_of,
    is_array,
    is_number,
    promoted_kind,
    type_root,
)

# ---- the graph ---------------------------------------------------------------------------------------------
_ARITHMETIC = {"add", "sub", "mul", "floordiv", "mod", "minimum", "maximum"}
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}
_LOGICAL = {"and", "or", "xor"}
_MATH = {"exp", "exp2", "log", "log2", "tanh", "sqrt", "sin", "cos"}
_SHIFTS = {"lshift", "rshift"}


class Graph:
    """The expression graph of one trace: interned nodes, parameters and captured arrays.

    ``symbolic_numbers`` turns the numbers a function captures into parameters before the call (one each);
    without it they stay Python numbers and become one parameter per use. ``shared_numbers`` makes one
    parameter per distinct value instead, for functions that would need more than the kernels take.
    """

    def __init__(self, symbolic_numbers: bool = True, shared_numbers: bool = False):
        self.symbolic_numbers, self.shared_numbers = symbolic_numbers, shared_numbers
        self._shared: dict[tuple, Expr] = {}
        self._nodes: dict[tuple, Expr] = {}
        self._arrays: dict[int, ArrayRef] = {}
        self._tensors: dict[int, tuple] = {}  # id(tensor) -> (tensor, its CapturedArray): met while tracing
        self.frameworks: set[str] = set()  # "torch" / "jax": what the function reaches or calls

    # ---- leaves ----
    def node(self, op: str, kind: str, args: tuple = (), data=None) -> Expr:
        """The interned node: structurally equal nodes are one object (the derivative's cancellations and
        ``where(c, x, x)`` rely on it)."""
        if op == "lit":
            tag = (type(data).__name__, repr(data))
        elif op in ("param", "index"):
            tag = id(data)
        else:
            tag = data
        key = (op, kind, tuple(id(a) for a in args), tag)
        found = self._nodes.get(key)
        if found is None:
            found = self._nodes[key] = Expr(self, op, kind, tuple(args), data)
        return found

    def var(self, name: str, kind: str) -> Expr:
        return self.node("var", kind, (), name)

    def literal(self, value, kind: str) -> Expr:
        """A constant of the graph's own making (0, 1, true): part of the structure, never a parameter."""
        cast = {"bool": bool, "int": int, "float": float}[kind]
        return self.node("lit", kind, (), cast(value))

    def param(self, value) -> Expr:
        """A new run-time parameter holding ``value`` (an int or a float)."""
        if isinstance(value, (int, np.integer)):
            kind, value = "int", int(value)
            if not -(2**63) <= value < 2**63:
                raise TraceError(f"the integer {value} does not fit in 64 bits")
        else:
            kind, value = "float", float(value)
        if not self.shared_numbers:
            return self.node("param", kind, (), Param(value))
        key = (kind, repr(value))
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = self.node("param", kind, (), Param(value))
        return found

    def operand(self, x) -> Expr:
        """``x`` as a node: traced values pass, Python bools become literals, numbers parameters."""
        if isinstance(x, Expr):
            if x.graph is not self:
                raise TraceError("a traced function mixed values of two different traces")
            return x
        if isinstance(x, (bool, np.bool_)):
            return self.literal(bool(x), "bool")
        if is_number(x):
            return self.param(x)
        if is_array(x) and len(x.shape) == 0:
            return self.operand(x.item())
        if isinstance(x, Row):
            x._as_value()
        raise TraceError(
            f"a traced value met a {type(x).__module__}.{type(x).__qualname__}: only numbers, traced values "
            "and captured arrays indexed by them take part in a traced function"
        )

    def index(self, array: CapturedArray, key: tuple) -> Expr | Row:
        """``array[key]``: a lookup node, or a `Row` while ``key`` has fewer indices than dimensions.
        Integers written as indices are part of the structure (literals; negative ones count from the end,
        as in Python); indices of the other kinds are clamped into bounds."""
        if len(key) > array.ndim:
            raise TraceError(
                f"a captured array of shape {array.shape} was indexed with {len(key)} indices: give one "
                "integer index per dimension (slices are not supported)"
            )
        for i in key:
            if i is None or i is Ellipsis or isinstance(i, slice) or is_array(i) and len(i.shape):
                raise TraceError(f"captured arrays take integer indices, not {i!r}")
        if len(key) < array.ndim:
            return Row(self, array, tuple(key))
        ref = self._arrays.get(id(array))
        if ref is None:
            ref = self._arrays[id(array)] = ArrayRef(array, tuple(self.param(n) for n in array.shape))
        indices = []
        for i, n in zip(key, ref.shape, strict=True):
            if self.symbolic_numbers and isinstance(i, int) and not isinstance(i, bool):
                node = self.literal(i, "int")
                node = node if i >= 0 else self.node("add", "int", (n, node))
            else:
                node = self.operand(i)
            if node.kind == "float":
                raise TraceError("a captured array was indexed with a float: indices must be integers")
            indices.append(self.cast(node, "int"))
        return self.node("index", array.kind, tuple(indices), ref)

    def lookup(self, array, key) -> Expr | Row:
        """``array[key]`` for an array that was not captured before the call (a tensor made inside the
        function, or reached through an object): captured now, once per trace."""
        found = self._tensors.get(id(array))
        if found is None:
            try:
                found = self._tensors[id(array)] = (array, CapturedArray(array))
            except NotATable as err:
                raise TraceError(f"a traced value indexed an array that holds no numbers ({err})") from None
        if type_root(array) in ("torch", "jax", "jaxlib"):
            self.frameworks.add(tensorlike.framework_of(array))
        return self.index(found[1], key if isinstance(key, tuple) else (key,))

    # ---- operations ----
    def apply(self, op: str, *operands) -> Expr:
        """The node of ``op`` on ``operands``, with Python's promotion rules (bool < int < float).
        Arithmetic on numbers alone (``KERNEL // 2``, ``(H - 1) - K // 2``) is one parameter holding the
        result: the kernels take few parameters, and a new value is a new trace anyway."""
        out = self._apply(op, *operands)
        if out.op in _FOLDED and out.args and all(a.op == "param" or a.op == "lit" for a in out.args):
            if any(a.op == "param" for a in out.args):
                value = _fold(
                    out.op, out.kind, [a.data.value if a.op == "param" else a.data for a in out.args]
                )
                if value is not None:
                    return self.param(value)
        return out

    def _apply(self, op: str, *operands) -> Expr:
        args = [self.operand(x) for x in operands]
        kinds = [a.kind for a in args]
        if op in _ARITHMETIC:
            kind = promoted_kind(*kinds, "int")
            return self.node(op, kind, tuple(self.cast(a, kind) for a in args))
        if op == "truediv":
            return self.node(op, "float", tuple(self.cast(a, "float") for a in args))
        if op in _COMPARISONS:
            kind = promoted_kind(*kinds)
            return self.node(op, "bool", tuple(self.cast(a, kind) for a in args))
        if op in _LOGICAL or op == "invert":
            if "float" in kinds:
                raise TraceError(f"& | ^ ~ take booleans or integers, got a float operand of {op}")
            kind = "bool" if all(k == "bool" for k in kinds) else "int"
            if op in ("and", "or") and kind == "bool":
                return self._logical(op, *args)
            return self.node(op, kind, tuple(self.cast(a, kind) for a in args))
        if op in _SHIFTS:
            if "float" in kinds:
                raise TraceError(f"<< and >> take integers, got a float operand of {op}")
            return self.node(op, "int", tuple(self.cast(a, "int") for a in args))
        if op == "fmod":
            kind = promoted_kind(*kinds, "int")
            return self.node(op, kind, tuple(self.cast(a, kind) for a in args))
        if op in ("neg", "abs"):
            kind = promoted_kind(kinds[0], "int")
            return self.node(op, kind, (self.cast(args[0], kind),))
        if op in _MATH:
            return self.node(op, "float", (self.cast(args[0], "float"),))
        if op == "where":
            cond, x, y = args
            kind = promoted_kind(x.kind, y.kind)
            if kind == "bool" and x.op == y.op == "lit" and x.data != y.data:  # where(c, True, False)
                cond = self.cast(cond, "bool")
                return cond if x.data else self.node("invert", "bool", (cond,))
            return self.node(op, kind, (self.cast(cond, "bool"), self.cast(x, kind), self.cast(y, kind)))
        raise TraceError(f"unsupported operation {op!r}; supported: {SUPPORTED}")

    def cast(self, x: Expr, kind: str) -> Expr:
        if x.kind == kind:
            return x
        if kind == "bool":
            return self.node("ne", "bool", (x, self.literal(0, x.kind)))
        return self.node("cast", kind, (x,))

    def _logical(self, op: str, a: Expr, b: Expr) -> Expr:
        """``a && b`` / ``a || b`` of booleans, where a literal operand decides or drops out: FlexAttention's
        and_masks starts from ``new_ones(())`` (true) and or_masks from false, and print as ours do."""
        neutral = op == "and"  # true for &&, false for ||
        for x, y in ((a, b), (b, a)):
            if x.op == "lit":
                return y if x.data == neutral else x
        return self.node(op, "bool", (a, b))

    # ---- capturing the function's environment ----
    def capture(self, value, memo: dict):
        """``value`` as the traced function should see it: arrays captured, numbers symbolic (if asked),
        functions rebuilt over captured values; anything else as it is."""
        found = memo.get(id(value))
        if found is not None:
            return found[1]
        memo[id(value)] = (value, value)  # a cycle back to this value sees it unchanged
        out = self._capture(value, memo)
        memo[id(value)] = (value, out)  # the value itself stays referenced, so its id is not reused
        return out

    def _capture(self, value, memo: dict):
        if isinstance(value, (Expr, CapturedArray, bool, np.bool_)):
            return value
        if is_number(value):
            return self.param(value) if self.symbolic_numbers else value
        framework = tensorlike.framework_of(value)
        if framework is not None:
            self.frameworks.add(framework)
        if isinstance(value, types.ModuleType):
            if value.__name__ in tensorlike.NAMESPACES:
                return tensorlike.Namespace(value, graph_of)
            return value
        if framework == "jax" and callable(value):
            dispatched = _jax_function(value)
            if dispatched is not value:
                return dispatched
        if is_array(value):
            if len(value.shape) == 0:
                return self._capture(value.item(), memo)
            try:
                return CapturedArray(value)
            except NotATable:  # names, say, or nothing: the function uses it some other way
                return value
        if isinstance(value, types.FunctionType):
            return self._rebuild(value, memo)
        origin = traced_from(value)
        if origin is not None:
            return self.capture(origin, memo)
        if type(value) in (tuple, list):
            items = [self.capture(v, memo) for v in value]
            changed = any(a is not b for a, b in zip(items, value, strict=True))
            return type(value)(items) if changed else value
        return value

    def _rebuild(self, fn: types.FunctionType, memo: dict) -> types.FunctionType:
        """A copy of ``fn`` whose closure cells, default arguments and globals hold captured values. A
        library's function keeps its own values, but the functions its closure holds (the mask mods that
        FlexAttention's and_masks combines) are rebuilt."""
        package = (getattr(fn, "__module__", None) or "").split(".")[0]
        if package in LIBRARIES:
            if fn.__closure__ is None or not any(holds_functions(c) for c in fn.__closure__):
                return fn
            cells = tuple(self._cell(c, memo) if holds_functions(c) else c for c in fn.__closure__)
            out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
            out.__kwdefaults__, out.__qualname__ = fn.__kwdefaults__, fn.__qualname__
            return out
        cells, defaults, kwdefaults = fn.__closure__, fn.__defaults__, fn.__kwdefaults__
        if cells is not None:
            cells = tuple(self._cell(c, memo) for c in cells)
        if defaults is not None:
            defaults = tuple(self.capture(v, memo) for v in defaults)
        if kwdefaults:
            kwdefaults = {n: self.capture(v, memo) for n, v in kwdefaults.items()}
        namespace = fn.__globals__
        if package != __package__:  # user code: its module globals may hold arrays and numbers
            changed = {}
            for name in global_names(fn.__code__):
                if name in namespace:
                    new = self.capture(namespace[name], memo)
                    if new is not namespace[name]:
                        changed[name] = new
            if changed:
                namespace = {**namespace, **changed}
        old = (*(fn.__closure__ or ()), *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
        new = (*(cells or ()), *(defaults or ()), *(kwdefaults or {}).values())
        if namespace is fn.__globals__ and all(a is b for a, b in zip(old, new, strict=True)):
            return fn
        out = types.FunctionType(fn.__code__, namespace, fn.__name__, defaults, cells)
        out.__kwdefaults__ = kwdefaults
        out.__qualname__ = fn.__qualname__
        return out

    def _cell(self, cell, memo: dict):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            return cell
        new = self.capture(value, memo)
        return cell if new is value else types.CellType(new)


_FOLDED = {"add", "sub", "mul", "truediv", "floordiv", "mod", "fmod", "neg", "abs", "minimum", "maximum"}


def _fold(op: str, kind: str, values: list):
    """``op`` on numbers as the node computes it (floor ``//`` and ``%``, C's ``fmod``); None where it has
    no value (a division by zero), so the node stays."""
    a, b = (values + [None])[:2]
    try:
        if op == "fmod":
            out = math.fmod(a, b) if kind == "float" else int(math.copysign(abs(a) % abs(b), a))
        else:
            out = {
                "add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "truediv": lambda: a / b,
                "floordiv": lambda: a // b, "mod": lambda: a % b, "neg": lambda: -a, "abs": lambda: abs(a),
                "minimum": lambda: min(a, b), "maximum": lambda: max(a, b),
            }[op]()  # fmt: skip
    except (ZeroDivisionError, OverflowError, ValueError):
        return None
    out = float(out) if kind == "float" else int(out)
    return out if kind == "float" or -(2**63) <= out < 2**63 else None


def holds_functions(cell) -> bool:
    """Whether a closure cell holds a function, or a tuple or list of callables (and_masks' mask mods)."""
    try:
        value = cell.cell_contents
    except ValueError:
        return False
    if type(value) in (tuple, list):
        return bool(value) and all(callable(v) for v in value)
    return isinstance(value, types.FunctionType)


def _jax_function(fn):
    """A jax.numpy or jax.nn function imported by name, as the traced rule calls it (`tensorlike`)."""
    try:
        table = _jax_table()
    except ImportError:
        return fn
    found = table.get(id(fn))
    if found is None or found[0] is not fn:
        return fn
    return tensorlike.dispatching(fn, found[1], found[1].rsplit(".", 1)[1], graph_of)


_jax_tables: list = []


def _jax_table() -> dict:
    if not _jax_tables:
        _jax_tables.append(tensorlike.jax_functions())
    return _jax_tables[0]


def global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def traced_from(value):
    """The function a traced score mod (`cusparseattn.trace.ScoreMod`) or a traced rule (a TokenRule over a
    `cusparseattn.trace.TracedMask`) was traced from, or None: what a capture of one captures instead."""
    return getattr(value, "traced_from", None)
