"""Tracing mask and score functions: one call with symbolic arguments gives NumPy, C and the derivative.

A user writes a FlexAttention-style rule in plain Python, ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or
``score_mod(score, b, h, q_idx, kv_idx) -> score``. `trace` calls it once with `Expr` arguments: every
operator on them builds a node of an expression graph instead of computing. The finished graph (a `Program`)
then

- evaluates itself with NumPy (or CuPy) on broadcasting index arrays: the reference's semantics;
- prints itself as one C expression that the kernels compile (fully parenthesised, ``long long`` integers,
  ``float`` arithmetic, explicit ``(float)`` conversions, Python's floor ``//`` and ``%``);
- differentiates itself with respect to the score, symbolically and simplified, for the backward kernels.

Values never reach the C text. Every number the function uses becomes a run-time parameter (numbers it
captures, in closures, default arguments or module globals, one parameter each; numbers written in its code
one parameter per use), and every captured array becomes an array slot whose dimensions are parameters too.
A new window size, softcap or bias table of the same rank and dtype therefore gives the same C text and the
same `structure`: the kernels do not recompile.

Captured arrays are indexed with their indices clamped into bounds, in NumPy and in C alike: kernels evaluate
rules on whole tiles, past a sequence's end, where a document-id lookup must stay inside its table.

>>> import numpy as np
>>> program = trace(lambda b, h, q, k: (q >= k) & (q - k < 256), "mask_mod")
>>> program.c_text("value", MASK_NAMES), program.int_params
('((q >= k) && ((q - k) < P0))', (256,))
>>> program.evaluate("value", dict(b=0, h=0, q=np.arange(3)[:, None], k=np.arange(3))).astype(int)
array([[1, 0, 0],
       [1, 1, 0],
       [1, 1, 1]])
"""

from __future__ import annotations

import collections
import inspect
import math
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from . import tensorlike
from .rules import TokenRule
from .tensorlike import LN2, Unsupported

MAX_INT_PARAMS, MAX_FLOAT_PARAMS, MAX_ARRAYS = 8, 8, 4

# The arguments each kind of function takes: (C name, kind) in call order.
ROLES = {
    "mask_mod": (("b", "int"), ("h", "int"), ("q", "int"), ("k", "int")),
    "score_mod": (("s", "float"), ("b", "int"), ("h", "int"), ("q", "int"), ("k", "int")),
}
_SIGNATURES = {"mask_mod": "(b, h, q_idx, kv_idx)", "score_mod": "(score, b, h, q_idx, kv_idx)"}

_RANK = {"bool": 0, "int": 1, "float": 2}  # promotion order of the three kinds of value

# Libraries whose Python functions are never rebuilt: their globals and closures hold no user arrays.
_LIBRARIES = {"numpy", "torch", "cupy", "jax", "jaxlib", "ml_dtypes", "builtins", "functools"}

_SUPPORTED = (
    "+ - * / // % (Python floor semantics), unary -, comparisons, & | ^ ~ << >>, abs(); where, "
    "minimum, maximum, abs, exp, log, tanh, sqrt from cusparseattn.mods, torch or jax.numpy, and torch's and "
    "jax.numpy's logical_*, bitwise_*, clamp / clip, exp2, log2, sigmoid, rsqrt, sin, cos, floor_divide, "
    "remainder, fmod, ones_like / zeros_like / full_like, tensor casts and new_ones / new_zeros "
    "(cusparseattn.tensorlike lists them all); numbers; captured arrays and tensors indexed by expressions"
)


class TraceError(TypeError):
    """The function cannot be traced (it needs a concrete value, or uses an operation outside the subset)."""


class NotCompilable(ValueError):
    """The function traced, but the kernels cannot take it (too many parameters, floats in a mask)."""


class _NotATable(ValueError):
    """An array that holds no numbers to look up (strings, or nothing)."""


def _kind(*kinds: str) -> str:
    return max(kinds, key=_RANK.__getitem__)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _is_array(x) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return _root(x) in ("torch", "cupy", "jax", "jaxlib") and hasattr(x, "shape") and hasattr(x, "dtype")


def _root(x) -> str:
    return type(x).__module__.split(".")[0]


# ---- traced values -----------------------------------------------------------------------------------------
class Expr:
    """A traced value: a node of an expression graph, built by the operators applied to it.

    ``op`` names the operation (``"var"``, ``"param"``, ``"lit"``, ``"index"``, ``"add"``, ...), ``kind``
    is ``"bool"``, ``"int"`` or ``"float"``, ``args`` the operand nodes and ``data`` the leaf's payload.
    Nodes are interned per graph: structurally equal nodes are the same object.

    >>> program = trace(lambda s, b, h, q, k: s + (q - k), "score_mod")
    >>> program.c_text("value", SCORE_NAMES)
    '(s + ((float)((q - k))))'
    """

    __slots__ = ("graph", "op", "kind", "args", "data")
    __array_ufunc__ = None  # NumPy defers to our reflected operators (1 + x) and refuses np.* ufuncs
    __hash__ = object.__hash__  # `==` builds a node; identity keys the graph's tables

    def __init__(self, graph: Graph, op: str, kind: str, args: tuple, data):
        self.graph, self.op, self.kind, self.args, self.data = graph, op, kind, args, data

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        """torch's functions and Tensor's methods on traced values: the graph operation of the same name
        (`cusparseattn.tensorlike`); torch calls this for any function that meets a traced value."""
        graph = _graph_of(args, kwargs)
        name = getattr(func, "__name__", repr(func))
        method = hasattr(func, "__objclass__") or getattr(func, "__qualname__", "").startswith("Tensor.")
        handler = (tensorlike.METHODS if method else tensorlike.OPERATIONS).get(name)
        if handler is None:
            what = f"Tensor.{name}" if method else f"torch.{name}"
            raise Unsupported(f"{what} has no traced form; traced functions: {tensorlike.supported()}")
        graph.frameworks.add("torch")
        return handler(graph, *args, **(kwargs or {}))

    @property
    def dtype(self):
        """The dtype the value computes in (int64, bool, float32), torch's when torch is loaded."""
        name = {"bool": "bool", "int": "int64", "float": "float32"}[self.kind]
        torch = sys.modules.get("torch")
        return getattr(torch, name) if torch is not None else np.dtype(name)

    @property
    def device(self):
        """The CPU: a traced value holds no data (``torch.tensor(x, device=q_idx.device)`` works)."""
        import torch

        return torch.device("cpu")

    shape = ()  # a scalar, as every index is under vmap
    ndim = 0

    def dim(self) -> int:
        return 0

    def __neg__(self):
        return self.graph.apply("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return self.graph.apply("abs", self)

    def __invert__(self):
        return self.graph.apply("invert", self)

    def __pow__(self, other):
        raise TraceError("** is not supported in a traced function (multiply: x * x, or square(x))")

    __rpow__ = __pow__

    def __bool__(self):
        raise TraceError(
            "a traced value has no truth value: Python's if, and, or, not, chained comparisons (a < b < c) "
            "and the builtins min()/max() need one. Use where(cond, x, y), &, |, ~ and minimum/maximum "
            "(torch.where, torch.minimum, jnp.where, or cusparseattn.mods')"
        )

    def __index__(self):
        raise TraceError(
            "a traced value was used as a Python index or int: index only captured arrays with it (NumPy "
            "arrays and tensors in closures, default arguments or globals, or cusparseattn.mods.captured(x) "
            "for arrays held elsewhere)"
        )

    def __float__(self):
        raise TraceError(
            "a traced value was converted to a Python number (math.* functions or float() do that): use "
            "torch's, jax.numpy's or cusparseattn.mods' exp, log, tanh, sqrt"
        )

    __int__ = __index__

    def __repr__(self) -> str:
        return f"<traced {self.kind} {self.op}>"


def _install_operators() -> None:
    """Python's binary operators on `Expr`, forward and reflected (``1 + x``), each one graph operation."""

    def binary(op: str, reflected: bool):
        if reflected:
            return lambda self, other: self.graph.apply(op, other, self)
        return lambda self, other: self.graph.apply(op, self, other)

    for name, op in (
        ("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "truediv"), ("floordiv", "floordiv"),
        ("mod", "mod"), ("and", "and"), ("or", "or"), ("xor", "xor"), ("lshift", "lshift"),
        ("rshift", "rshift"),
    ):  # fmt: skip
        setattr(Expr, f"__{name}__", binary(op, False))
        setattr(Expr, f"__r{name}__", binary(op, True))
    # Python reflects comparisons itself (3 < x calls x.__gt__(3)).
    for op in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Expr, f"__{op}__", binary(op, False))
    # A tensor's methods (x.abs(), x.clamp(lo, hi), x.to(torch.float32), b.new_ones(()), ...).
    for name in tensorlike.OWN_METHODS:
        setattr(Expr, name, _method(tensorlike.METHODS[name]))


def _method(handler: Callable):
    return lambda self, *args, **kwargs: handler(self.graph, self, *args, **kwargs)


def _graph_of(args, kwargs=None):
    """The graph of the first traced value among ``args`` and ``kwargs`` (one level into tuples and lists,
    as an index key holds them); None when there is none."""
    for a in (*args, *(kwargs or {}).values()):
        for x in a if type(a) in (tuple, list) else (a,):
            if isinstance(x, Expr):
                return x.graph
    return None


_install_operators()


@dataclass(eq=False)
class _Param:
    """One run-time parameter: a number the traced function used."""

    value: int | float


class _ArrayRef(NamedTuple):
    """A captured array in one graph: its data and the parameter nodes of its dimensions."""

    array: CapturedArray
    shape: tuple[Expr, ...]


class CapturedArray:
    """An array a traced function indexes: held as int32 (bool and integer arrays) or float32, C-contiguous.

    Indexing with traced values builds an array lookup (a slot ``A0..A3`` / ``SA0..SA3`` in C, clamped into
    bounds). Indexing with NumPy, CuPy or PyTorch indices looks the values up directly (clamped the same way,
    on the indices' device), so a function written with it also runs as a plain NumPy function or under
    PyTorch's FlexAttention. Functions' closures, default arguments and module globals are captured
    automatically; wrap arrays held elsewhere (object attributes, dicts) with `cusparseattn.mods.captured`.

    >>> import numpy as np
    >>> ids = CapturedArray(np.array([0, 0, 1, 1]))
    >>> ids[np.array([1, 2, 9])]  # 9 is clamped to the last element
    array([0, 1, 1])
    """

    def __init__(self, array):
        self.data = _host_array(array)
        self.kind = "float" if self.data.dtype == np.float32 else "int"
        self._lookup = self.data.astype(np.int64) if self.kind == "int" else self.data
        self._copies: dict = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def __len__(self) -> int:
        return self.data.shape[0]

    def __array__(self, dtype=None, copy=None):
        return self.data if dtype is None else self.data.astype(dtype)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        parts = [p for i in key for p in ((i.start, i.stop, i.step) if isinstance(i, slice) else (i,))]
        graph = next((p.graph for p in parts if isinstance(p, Expr)), None)
        if graph is not None:
            return graph.index(self, key)
        if len(key) > self.ndim:
            raise IndexError(f"this captured array has shape {self.shape}: give one index per dimension")
        table = self._table_for(key)
        return table[tuple(_clamp_index(i, n) for i, n in zip(key, self.shape, strict=True))]

    def _table_for(self, key):
        """The values for direct lookups, in the framework and on the device of the indices: integers as
        int64, as the kernels widen them to ``long long``, so arithmetic on them never wraps. Device copies
        are cached, except while ``torch.compile`` (or FlexAttention) traces the call: there a cache would
        be a side effect, and the compiled graph keeps the copy as a constant anyway."""
        root = next((_root(i) for i in key if _root(i) in ("torch", "cupy")), "numpy")
        if root == "numpy":
            return self._lookup
        device = next(i.device for i in key if _root(i) == root)
        tag = (root, str(device))
        copy = self._copies.get(tag)
        if copy is not None:
            return copy
        if root == "torch":
            import torch

            copy = torch.from_numpy(self._lookup).to(device)
            if torch.compiler.is_compiling():
                return copy
        else:
            import cupy

            with device:
                copy = cupy.asarray(self._lookup)
        self._copies[tag] = copy
        return copy

    def __repr__(self) -> str:
        return f"CapturedArray({self.data.dtype.name}{list(self.shape)})"


class _Row:
    """A captured array indexed by fewer values than it has dimensions, in a trace: a row, as under vmap,
    that the next index selects from (``table[q][k]``, ``intervals[doc[q]][0]``, ``lo, hi = spans[i]``)."""

    __slots__ = ("graph", "array", "key")
    __array_ufunc__ = None

    def __init__(self, graph: Graph, array: CapturedArray, key: tuple):
        self.graph, self.array, self.key = graph, array, key

    def __getitem__(self, key):
        return self.graph.index(self.array, self.key + (key if isinstance(key, tuple) else (key,)))

    def __len__(self) -> int:
        return self.array.shape[len(self.key)]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _as_value(self, *args, **kwargs):
        raise TraceError(
            f"a captured array of shape {self.array.shape} was indexed with {len(self.key)} indices and "
            "used as a value: give one integer index per dimension (table[i, j] or table[i][j])"
        )

    __bool__ = __index__ = __float__ = __neg__ = __abs__ = __invert__ = _as_value
    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Row))._as_value()


def _install_row_operators() -> None:
    for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift",
    ):  # fmt: skip
        setattr(_Row, f"__{name}__", _Row._as_value)
        setattr(_Row, f"__r{name}__", _Row._as_value)
    for op in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(_Row, f"__{op}__", _Row._as_value)


_install_row_operators()


def _host_array(array) -> np.ndarray:
    """A captured array as int32 or float32 NumPy data (torch and CuPy arrays are copied to the host)."""
    if _root(array) == "torch":
        array = array.detach().cpu().numpy()
    elif _root(array) == "cupy":
        array = array.get()
    data = np.asarray(array)
    if data.ndim == 0 or data.size == 0:
        raise _NotATable(f"a captured array needs a dimension and an element, got shape {data.shape}")
    if data.dtype == bool or np.issubdtype(data.dtype, np.integer):
        if data.min() < np.iinfo(np.int32).min or data.max() > np.iinfo(np.int32).max:
            raise ValueError("a captured integer array must fit in 32-bit integers (the kernels read int32)")
        return np.ascontiguousarray(data, dtype=np.int32)
    if np.issubdtype(data.dtype, np.floating):
        return np.ascontiguousarray(data, dtype=np.float32)
    raise _NotATable(f"a captured array must hold booleans, integers or floats, got dtype {data.dtype}")


def _clamp_index(i, n: int):
    if isinstance(i, (int, np.integer)):
        return min(max(int(i), 0), n - 1)
    if _root(i) == "torch":
        import torch

        return torch.clamp(i, 0, n - 1)
    if _root(i) == "cupy":
        import cupy

        return cupy.clip(i, 0, n - 1)
    return np.clip(i, 0, n - 1)


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
        self._arrays: dict[int, _ArrayRef] = {}
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
            return self.node("param", kind, (), _Param(value))
        key = (kind, repr(value))
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = self.node("param", kind, (), _Param(value))
        return found

    def operand(self, x) -> Expr:
        """``x`` as a node: traced values pass, Python bools become literals, numbers parameters."""
        if isinstance(x, Expr):
            if x.graph is not self:
                raise TraceError("a traced function mixed values of two different traces")
            return x
        if isinstance(x, (bool, np.bool_)):
            return self.literal(bool(x), "bool")
        if _is_number(x):
            return self.param(x)
        if _is_array(x) and len(x.shape) == 0:
            return self.operand(x.item())
        if isinstance(x, _Row):
            x._as_value()
        raise TraceError(
            f"a traced value met a {type(x).__module__}.{type(x).__qualname__}: only numbers, traced values "
            "and captured arrays indexed by them take part in a traced function"
        )

    def index(self, array: CapturedArray, key: tuple) -> Expr | _Row:
        """``array[key]``: a lookup node, or a `_Row` while ``key`` has fewer indices than dimensions.
        Integers written as indices are part of the structure (literals; negative ones count from the end,
        as in Python); indices of the other kinds are clamped into bounds."""
        if len(key) > array.ndim:
            raise TraceError(
                f"a captured array of shape {array.shape} was indexed with {len(key)} indices: give one "
                "integer index per dimension (slices are not supported)"
            )
        for i in key:
            if i is None or i is Ellipsis or isinstance(i, slice) or _is_array(i) and len(i.shape):
                raise TraceError(f"captured arrays take integer indices, not {i!r}")
        if len(key) < array.ndim:
            return _Row(self, array, tuple(key))
        ref = self._arrays.get(id(array))
        if ref is None:
            ref = self._arrays[id(array)] = _ArrayRef(array, tuple(self.param(n) for n in array.shape))
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

    def lookup(self, array, key) -> Expr | _Row:
        """``array[key]`` for an array that was not captured before the call (a tensor made inside the
        function, or reached through an object): captured now, once per trace."""
        found = self._tensors.get(id(array))
        if found is None:
            try:
                found = self._tensors[id(array)] = (array, CapturedArray(array))
            except _NotATable as err:
                raise TraceError(f"a traced value indexed an array that holds no numbers ({err})") from None
        if _root(array) in ("torch", "jax", "jaxlib"):
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
            kind = _kind(*kinds, "int")
            return self.node(op, kind, tuple(self.cast(a, kind) for a in args))
        if op == "truediv":
            return self.node(op, "float", tuple(self.cast(a, "float") for a in args))
        if op in _COMPARISONS:
            kind = _kind(*kinds)
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
            kind = _kind(*kinds, "int")
            return self.node(op, kind, tuple(self.cast(a, kind) for a in args))
        if op in ("neg", "abs"):
            kind = _kind(kinds[0], "int")
            return self.node(op, kind, (self.cast(args[0], kind),))
        if op in _MATH:
            return self.node(op, "float", (self.cast(args[0], "float"),))
        if op == "where":
            cond, x, y = args
            kind = _kind(x.kind, y.kind)
            if kind == "bool" and x.op == y.op == "lit" and x.data != y.data:  # where(c, True, False)
                cond = self.cast(cond, "bool")
                return cond if x.data else self.node("invert", "bool", (cond,))
            return self.node(op, kind, (self.cast(cond, "bool"), self.cast(x, kind), self.cast(y, kind)))
        raise TraceError(f"unsupported operation {op!r}; supported: {_SUPPORTED}")

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
        if _is_number(value):
            return self.param(value) if self.symbolic_numbers else value
        framework = tensorlike.framework_of(value)
        if framework is not None:
            self.frameworks.add(framework)
        if isinstance(value, types.ModuleType):
            if value.__name__ in tensorlike.NAMESPACES:
                return tensorlike.Namespace(value, _graph_of)
            return value
        if framework == "jax" and callable(value):
            dispatched = _jax_function(value)
            if dispatched is not value:
                return dispatched
        if _is_array(value):
            if len(value.shape) == 0:
                return self._capture(value.item(), memo)
            try:
                return CapturedArray(value)
            except _NotATable:  # names, say, or nothing: the function uses it some other way
                return value
        if isinstance(value, types.FunctionType):
            return self._rebuild(value, memo)
        if isinstance(value, ScoreMod):
            return self.capture(value.fn, memo)
        if isinstance(value, TokenRule) and isinstance(value.fn, TracedMask):
            return self.capture(value.fn.original, memo)
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
        if package in _LIBRARIES:
            if fn.__closure__ is None or not any(_holds_functions(c) for c in fn.__closure__):
                return fn
            cells = tuple(self._cell(c, memo) if _holds_functions(c) else c for c in fn.__closure__)
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
            for name in _global_names(fn.__code__):
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


def _holds_functions(cell) -> bool:
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
    return tensorlike.dispatching(fn, found[1], found[1].rsplit(".", 1)[1], _graph_of)


_jax_tables: list = []


def _jax_table() -> dict:
    if not _jax_tables:
        _jax_tables.append(tensorlike.jax_functions())
    return _jax_tables[0]


# ---- the environment a trace depends on ------------------------------------------------------------------
class Unversioned(Exception):
    """A value a function reaches whose changes cannot be seen without tracing again (a dict, an object, a
    large writable NumPy array, a CuPy array): such a function is traced on every call."""


# Writable NumPy arrays up to this size are compared by content; larger ones are not worth the copy.
_COMPARED_BYTES = 4096


def environment(fn) -> tuple[tuple, list]:
    """``(key, held)``: a key that changes whenever anything `Graph.capture` reads from ``fn`` (closure cells,
    default arguments, user-module globals, recursively) changes, and the objects the key names by identity,
    which the caller holds so that their ids are not reused. Numbers and strings count by value, code by
    identity, arrays by identity and version (PyTorch's in-place counter; content for small writable NumPy
    arrays; JAX arrays and read-only NumPy arrays cannot change). Raises `Unversioned` otherwise."""
    held: list = []
    return _environment(fn, held, {}), held


def _environment(value, held: list, memo: dict):
    if id(value) in memo:
        return ("seen", memo[id(value)])
    memo[id(value)] = len(memo)
    if value is None or isinstance(value, (bool, np.bool_, str, bytes, types.ModuleType)):
        return ("value", value)
    if _is_number(value):
        return ("number", type(value).__name__, value)
    if isinstance(value, CapturedArray):  # a snapshot taken when it was made
        held.append(value)
        return ("captured", id(value))
    if _is_array(value):
        held.append(value)
        return ("array", id(value), *_array_version(value))
    if isinstance(value, ScoreMod):
        return _environment(value.fn, held, memo)
    if isinstance(value, TokenRule) and isinstance(value.fn, TracedMask):
        return _environment(value.fn.original, held, memo)
    if type(value) in (tuple, list):
        return (type(value).__name__, *(_environment(v, held, memo) for v in value))
    if isinstance(value, types.FunctionType):
        package = (getattr(value, "__module__", None) or "").split(".")[0]
        if package in _LIBRARIES:  # its own values are fixed; the functions it combines are the user's
            held.append(value)
            cells = (c for c in value.__closure__ or () if _holds_functions(c))
            return ("library", id(value), *(_environment(c.cell_contents, held, memo) for c in cells))
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_environment(cell.cell_contents, held, memo))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        namespace = value.__globals__
        names = sorted(_global_names(value.__code__)) if package != __package__ else []
        held.append(value.__code__)
        return (
            "function",
            id(value.__code__),
            tuple(cells),
            _environment(value.__defaults__, held, memo),
            tuple((n, _environment(v, held, memo)) for n, v in sorted((value.__kwdefaults__ or {}).items())),
            tuple((n, _environment(namespace[n], held, memo)) for n in names if n in namespace),
        )
    raise Unversioned(f"{type(value).__name__} values are not tracked between calls")


class EnvironmentCache:
    """The last ``size`` values made from functions, each reused while its function's `environment` is
    unchanged: no new trace, and the same object for the caches keyed by identity (the kernels' tables). A
    value holds its function (a ScoreMod, a Pattern), so the cache is bounded rather than weak."""

    def __init__(self, size: int = 16):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key, fn, make: Callable, *, watch_all: bool):
        """``make()``'s value for ``key`` (a hashable tuple naming ``fn`` and what else ``make`` depends on).
        With ``watch_all``, a function reaching values whose changes cannot be seen (`Unversioned`) is made
        anew each call; without, those values count as unchanged."""
        try:
            env, held = environment(fn)
        except Unversioned:
            if watch_all:
                return make()
            env, held = None, []
        try:
            with self._lock:
                cached = self._entries.get(key)
        except TypeError:  # an unhashable callable
            return make()
        if cached is not None and cached[0] == env:
            with self._lock:
                self._entries.move_to_end(key)
            return cached[2]
        value = make()
        with self._lock:
            self._entries[key] = (env, held, value)  # held: what env names by identity, so no id is reused
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value


def _array_version(array) -> tuple:
    root = _root(array)
    if root == "torch":
        return ("torch", array._version)
    if root in ("jax", "jaxlib"):
        return ("jax",)
    if isinstance(array, np.ndarray):
        if not array.flags.writeable:
            return ("numpy",)
        if array.nbytes <= _COMPARED_BYTES:
            return ("numpy", array.dtype.str, array.shape, array.tobytes())
    raise Unversioned(f"a {type(array).__name__} of {getattr(array, 'nbytes', '?')} bytes is not tracked")


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# ---- tracing -----------------------------------------------------------------------------------------------
def check_arity(fn, role: str, name: str) -> None:
    """Raise a TypeError unless ``fn`` takes the role's positional arguments."""
    if not callable(fn):
        raise TypeError(f"{role} must be a function {_SIGNATURES[role]}, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind(*range(len(ROLES[role])))
    except TypeError:
        raise TypeError(
            f"{role} must take {len(ROLES[role])} positional arguments {_SIGNATURES[role]}; "
            f"{name}{signature} does not"
        ) from None


def trace(fn: Callable, role: str, name: str | None = None) -> Program:
    """Call ``fn`` once with traced arguments and return its `Program` (outputs ``"value"`` and, for score
    mods, ``"grad"``).

    Numbers the function captures become one parameter each; if that fails because the function needs one
    of them as a concrete value (a Python ``if`` or ``range`` on it), it is traced again with them left
    concrete (each use then becomes its own parameter). A program that needs more parameters than the
    kernels take is traced again with one parameter per distinct value. Raises `TraceError` when it cannot
    be traced; its message names the construct and the line of the user's code that stopped the trace
    (``site``), and its ``frameworks`` the libraries the function reaches (``{"torch"}`` for a torch rule).
    """
    name = name or getattr(fn, "__name__", type(fn).__name__)
    check_arity(fn, role, name)
    error, frameworks = None, set()
    for symbolic_numbers in (True, False):
        graph = Graph(symbolic_numbers)
        try:
            program = _trace_once(fn, role, name, graph)
        except NotCompilable:
            raise
        except Exception as exc:  # anything the user's code raises on traced values: not traceable
            error = exc
            frameworks |= graph.frameworks
            continue
        if len(program.int_params) > MAX_INT_PARAMS or len(program.float_params) > MAX_FLOAT_PARAMS:
            return _trace_once(fn, role, name, Graph(symbolic_numbers, shared_numbers=True))
        return program
    site = user_site(error.__traceback__)
    where = f" at {site}" if site else ""
    out = TraceError(
        f"{role} {name!r} cannot be traced ({type(error).__name__}: {error}){where}{defined_at(fn)}. "
        f"Supported: {_SUPPORTED}"
    )
    out.site, out.frameworks, out.reason = site, frameworks, f"{type(error).__name__}: {error}{where}"
    raise out from error


def _trace_once(fn: Callable, role: str, name: str, graph: Graph) -> Program:
    target = graph.capture(fn, {})
    args = [graph.var(v, kind) for v, kind in ROLES[role]]
    value = _output(graph, target(*args), role, name)
    outputs = {"value": value}
    if role == "score_mod":
        outputs["grad"] = Derivative(graph, args[0]).of(value)
    return Program(outputs, role, name)


def user_site(tb) -> str | None:
    """``file:line`` of the innermost frame of a traceback in the user's code (not this package's, nor a
    library's): where a traced function did what cannot be traced."""
    site = None
    while tb is not None:
        frame = tb.tb_frame
        root = (frame.f_globals.get("__name__") or "").split(".")[0]
        if root not in _LIBRARIES and root != __package__:
            site = f"{frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return site


def defined_at(fn) -> str:
    """``; it is defined at file:line`` for a Python function, else nothing."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    return f"; it is defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _output(graph: Graph, result, role: str, name: str) -> Expr:
    if isinstance(result, _Row):
        result._as_value()
    if _is_array(result) and len(result.shape) == 0:  # torch.tensor(True), b.new_ones(()) made concrete
        result = result.item()
    if not isinstance(result, Expr) and not isinstance(result, (bool, np.bool_)) and not _is_number(result):
        raise TraceError(
            f"{role} {name!r} returned a {type(result).__qualname__}, not a traced value: np.* functions "
            "compute on concrete arrays; use torch's, jax.numpy's or cusparseattn.mods' functions"
        )
    node = graph.operand(result)
    if role == "mask_mod":
        if node.kind == "float":
            raise NotCompilable(f"mask_mod {name!r} returns a float: it must return a boolean")
        return graph.cast(node, "bool")
    return graph.cast(node, "float")


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


# ---- the finished program ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CNames:
    """How a program's parameters and arrays are spelled in C, for one kernel interface."""

    int_param: str  # prefix of the long long parameters
    float_param: str | None  # prefix of the float parameters (None: floats are not allowed)
    array_int: str  # format of an int array's element: {slot}, {index}
    array_float: str | None


MASK_NAMES = CNames("P", None, "((long long)A{slot}[{index}])", None)
SCORE_NAMES = CNames(
    "SI", "SF", "((long long)((const int*)SA{slot})[{index}])", "(((const float*)SA{slot})[{index}])"
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


class Program:
    """A finished trace: named output nodes with their parameters and arrays numbered in a fixed order.

    Slots are numbered by a depth-first walk of the outputs, so the same structure always gets the same
    numbering (and the same C text), whatever the values.
    """

    def __init__(self, outputs: dict[str, Expr], role: str, name: str):
        self.outputs, self.role, self.name = outputs, role, name
        self._slots: dict[int, int] = {}  # id(_Param) or id(_ArrayRef) -> slot
        ints: list[int] = []
        floats: list[float] = []
        arrays: list[_ArrayRef] = []
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
            for a in x.args:
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
        memo: dict[int, str] = {}
        return self._c(self.outputs[output], names, memo)

    def _c(self, x: Expr, names: CNames, memo: dict[int, str]) -> str:
        found = memo.get(id(x))
        if found is not None:
            return found
        a = [self._c(arg, names, memo) for arg in x.args]
        op, kind = x.op, x.kind
        if op == "var":
            text = x.data
        elif op == "lit":
            text = _c_literal(x.data, kind)
        elif op == "param":
            prefix = names.int_param if kind == "int" else names.float_param
            text = f"{prefix}{self._slots[id(x.data)]}"
        elif op == "index":
            ref = x.data
            shape = [self._c(d, names, memo) for d in ref.shape]
            flat = None
            for i, n in zip(a, shape, strict=True):
                clamped = f"min(max({i}, 0LL), ({n} - 1LL))"
                flat = clamped if flat is None else f"(({flat} * {n}) + {clamped})"
            form = names.array_int if kind == "int" else names.array_float
            text = form.format(slot=self._slots[id(ref)], index=flat)
        elif op == "cast":
            text = f"((float)({a[0]}))" if kind == "float" else f"((long long)({a[0]}))"
        elif op in _C_BINARY:
            text = f"({a[0]} {_C_BINARY[op]} {a[1]})"
        elif op in _C_LOGICAL:
            text = f"({a[0]} {_C_LOGICAL[op][kind != 'bool']} {a[1]})"
        elif op == "invert":
            text = f"(!{a[0]})" if kind == "bool" else f"(~{a[0]})"
        elif op == "neg":
            text = f"(-{a[0]})"
        elif op == "floordiv":
            text = f"csa::floordiv({a[0]}, {a[1]})" if kind == "int" else f"floorf(({a[0]} / {a[1]}))"
        elif op == "mod" and kind == "int":
            text = f"csa::floormod({a[0]}, {a[1]})"
        elif op == "mod":
            text = f"({a[0]} - (floorf(({a[0]} / {a[1]})) * {a[1]}))"
        elif op == "fmod":  # C's own remainder: truncated, with the sign of the dividend
            text = f"({a[0]} % {a[1]})" if kind == "int" else f"fmodf({a[0]}, {a[1]})"
        elif op in _C_SHIFTS:
            text = f"({a[0]} {_C_SHIFTS[op]} {a[1]})"
        elif op in ("minimum", "maximum"):
            fn = op[:3] if kind == "int" else ("fminf" if op == "minimum" else "fmaxf")
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
            idx = tuple(_clamp_index(i, n) for i, n in zip(a, ref.array.shape, strict=True))
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


def _c_literal(value, kind: str) -> str:
    if kind == "bool":
        return "true" if value else "false"
    if kind == "int":
        return f"{value}LL" if value >= 0 else f"(-{-value}LL)"
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = f"{abs(value)!r}f"
    return text if value >= 0 else f"(-{text})"


def _array_module(*xs):
    return next((__import__("cupy") for x in xs if _root(x) == "cupy"), np)


# ---- what the kernels and the reference take ---------------------------------------------------------------
class TracedMask:
    """A traced mask_mod as a `TokenRule` function: the program on NumPy (or CuPy) indices, the user's own
    function on torch indices (FlexAttention calls it so).

    ``variables`` names the arguments the rule uses (``{"q", "k"}`` for a causal rule).
    """

    def __init__(self, program: Program, original: Callable):
        self.program, self.original = program, original

    @property
    def variables(self) -> set[str]:
        return self.program.variables

    def __call__(self, b, h, q, k):
        if any(_root(x) == "torch" for x in (b, h, q, k)):
            return self.original(b, h, q, k)
        return self.program.evaluate("value", dict(b=b, h=h, q=q, k=k), xp=_array_module(b, h, q, k))


class UntracedMask:
    """A mask_mod that cannot be traced or compiled, as a `TokenRule` function: evaluated as FlexAttention
    evaluates it. A rule that reaches torch runs on torch index tensors, and one that reaches JAX on jax
    arrays, vmapped over every axis so that it sees scalars (`cusparseattn.tensorlike.vmapped`): never are
    NumPy arrays handed to a torch function. Other rules run on the NumPy index arrays, and every rule on
    torch indices (FlexAttention calling it) is the user's function itself."""

    def __init__(self, original: Callable, framework: str):
        self.original, self.framework = original, framework

    def __call__(self, b, h, q, k):
        if self.framework == "numpy" or any(_root(x) == "torch" for x in (b, h, q, k)):
            return self.original(b, h, q, k)
        return tensorlike.vmapped(self.original, self.framework, (b, h, q, k))

    @property
    def how(self) -> str:
        if self.framework == "numpy":
            return "on NumPy index arrays"
        return f"as FlexAttention does (vmapped over {self.framework} index arrays)"


def untraced_mask(fn: Callable, name: str, error: Exception) -> TokenRule:
    """``fn``, which `trace` refused with ``error``, as a rule without a C expression (the kernels get its
    partial blocks as bit masks), after one evaluation on a 2 x 2 grid: where that fails too, a `TraceError`
    names both causes and where in the user's code they are, before any layout is built.

    A rule that reaches torch or JAX (a module, array or function of theirs) runs on that framework's
    arrays; one that reaches neither, on NumPy arrays, and where that fails (tensor methods such as
    ``.clamp``) on torch's, then JAX's, of those already imported."""
    graph = Graph(symbolic_numbers=False)
    graph.capture(fn, {})
    frameworks = graph.frameworks | getattr(error, "frameworks", set())
    found = [f for f in ("torch", "jax") if f in frameworks]
    loaded = [f for f, module in (("torch", "torch"), ("jax", "jax.numpy")) if module in sys.modules]
    zero = np.zeros((1, 1, 1, 1), np.int64)
    for framework in found[:1] or ["numpy", *loaded]:
        rule = TokenRule(name, UntracedMask(fn, framework))
        try:
            rule(zero, zero, np.arange(2).reshape(1, 1, 2, 1), np.arange(2).reshape(1, 1, 1, 2))
            return rule
        except Exception as exc:  # anything the user's function raises: tell it, with the trace's reason
            failure = exc
    site = user_site(failure.__traceback__)
    reason = getattr(error, "reason", f"{type(error).__name__}: {error}")
    out = TraceError(
        f"mask_mod {name!r} cannot be traced ({reason}), and evaluating it {rule.fn.how} fails "
        f"({type(failure).__name__}: {failure}{f' at {site}' if site else ''}){defined_at(fn)}. Write it "
        "with operations on the indices (torch.where for an if, & | ~ for and / or / not)"
    )
    out.site = getattr(error, "site", None) or site
    raise out from failure


@dataclass(frozen=True, eq=False, repr=False)
class ScoreMod:
    """A traced score_mod: ``score -> score`` per (batch, query head, query, key), for the kernels and the
    reference alike.

    ``c_expr`` computes the modified score from ``s`` (the scaled score ``scale * q·k``, float), ``b, h, q,
    k`` (long long: batch, query head, global query and key positions), the parameters ``SI0..SI7`` (long
    long, values in ``int_params``) and ``SF0..SF7`` (float, ``float_params``) and the arrays ``SA0..SA3``
    (``const void*``, cast in the text; values in ``arrays``, int32 or float32, flattened). ``c_grad`` is
    d(c_expr)/ds over the same names. ``structure`` is what changes the compiled code, never values.
    Calling the object calls the user's function (so it also runs under PyTorch's FlexAttention).

    >>> from cusparseattn import mods
    >>> sm = mods.score_mod(mods.softcap(30.0))
    >>> sm.c_expr, sm.c_grad, sm.float_params
    ('(SF0 * tanhf((s / SF0)))', '(1.0f - (tanhf((s / SF0)) * tanhf((s / SF0))))', (30.0,))
    """

    name: str
    fn: Callable
    c_expr: str
    c_grad: str
    int_params: tuple[int, ...]
    float_params: tuple[float, ...]
    arrays: tuple[np.ndarray, ...]
    program: Program = field(repr=False)

    @classmethod
    def trace(cls, fn: Callable, name: str | None = None) -> ScoreMod:
        """Trace ``fn``; raises `TraceError` or `NotCompilable` (see `cusparseattn.mods.score_mod`)."""
        program = trace(fn, "score_mod", name).check_compilable()
        return cls(
            program.name,
            fn,
            program.c_text("value", SCORE_NAMES),
            program.c_text("grad", SCORE_NAMES),
            program.int_params,
            program.float_params,
            program.arrays,
            program,
        )

    @property
    def structure(self) -> tuple:
        return self.program.structure

    @property
    def variables(self) -> set[str]:
        return self.program.variables

    def evaluate(self, score, b, h, q, k):
        """The modified scores, broadcast over all arguments, in the dtype of ``score`` (NumPy or CuPy)."""
        return self._run("value", score, b, h, q, k)

    def grad(self, score, b, h, q, k):
        """d(modified score)/d(score), broadcast over all arguments, in the dtype of ``score``."""
        return self._run("grad", score, b, h, q, k)

    def _run(self, output: str, score, b, h, q, k):
        xp = _array_module(score, b, h, q, k)
        score = xp.asarray(score)
        dtype = score.dtype if score.dtype.kind == "f" else np.dtype(np.float32)
        fdtype = np.result_type(dtype, np.float32)
        out = self.program.evaluate(output, dict(s=score, b=b, h=h, q=q, k=k), fdtype, xp)
        shape = np.broadcast_shapes(*(np.shape(x) for x in (score, b, h, q, k)))
        return xp.broadcast_to(xp.asarray(out), shape).astype(dtype)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        counts = (
            f"{len(self.int_params)} int, {len(self.float_params)} float params, {len(self.arrays)} arrays"
        )
        return f"ScoreMod({self.name!r}: {self.c_expr}; {counts})"
