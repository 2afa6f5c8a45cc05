"""Traced values: what a mask or score function computes with while it is traced (`Expr`, a node of the
expression graph, with the operators, methods and torch/JAX functions of a tensor), captured arrays
(`CapturedArray`, indexed with clamped indices as FlexAttention's vmap allows), and the vocabulary of kinds
and errors that the tracer shares (`TraceError`, `NotCompilable`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import tensorlike
from .tensorlike import Unsupported

MAX_INT_PARAMS, MAX_FLOAT_PARAMS, MAX_ARRAYS = 8, 8, 4

# The arguments each kind of function takes: (C name, kind) in call order.
ROLES = {
    "mask_mod": (("b", "int"), ("h", "int"), ("q", "int"), ("k", "int")),
    "score_mod": (("s", "float"), ("b", "int"), ("h", "int"), ("q", "int"), ("k", "int")),
}
SIGNATURES = {"mask_mod": "(b, h, q_idx, kv_idx)", "score_mod": "(score, b, h, q_idx, kv_idx)"}

_RANK = {"bool": 0, "int": 1, "float": 2}  # promotion order of the three kinds of value

# Libraries whose Python functions are never rebuilt: their globals and closures hold no user arrays.
LIBRARIES = {"numpy", "torch", "cupy", "jax", "jaxlib", "ml_dtypes", "builtins", "functools"}

SUPPORTED = (
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


class NotATable(ValueError):
    """An array that holds no numbers to look up (strings, or nothing)."""


def promoted_kind(*kinds: str) -> str:
    return max(kinds, key=_RANK.__getitem__)


def is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def is_array(x) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return type_root(x) in ("torch", "cupy", "jax", "jaxlib") and hasattr(x, "shape") and hasattr(x, "dtype")


def type_root(x) -> str:
    return type(x).__module__.split(".")[0]


# ---- traced values -----------------------------------------------------------------------------------------
class Expr:
    """A traced value: a node of an expression graph, built by the operators applied to it.

    ``op`` names the operation (``"var"``, ``"param"``, ``"lit"``, ``"index"``, ``"add"``, ...), ``kind``
    is ``"bool"``, ``"int"`` or ``"float"``, ``args`` the operand nodes and ``data`` the leaf's payload.
    Nodes are interned per graph: structurally equal nodes are the same object.

    >>> from cusparseattn.program import SCORE_NAMES
    >>> from cusparseattn.trace import trace
    >>> program = trace(lambda s, b, h, q, k: s + (q - k), "score_mod")
    >>> program.c_text("value", SCORE_NAMES)
    '(s + ((float)((q - k))))'
    """

    __slots__ = ("graph", "op", "kind", "args", "data")
    __array_ufunc__ = None  # NumPy defers to our reflected operators (1 + x) and refuses np.* ufuncs
    __hash__ = object.__hash__  # `==` builds a node; identity keys the graph's tables

    def __init__(self, graph, op: str, kind: str, args: tuple, data):
        self.graph, self.op, self.kind, self.args, self.data = graph, op, kind, args, data

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        """torch's functions and Tensor's methods on traced values: the graph operation of the same name
        (`cusparseattn.tensorlike`); torch calls this for any function that meets a traced value."""
        graph = graph_of(args, kwargs)
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


def graph_of(args, kwargs=None):
    """The graph of the first traced value among ``args`` and ``kwargs`` (one level into tuples and lists,
    as an index key holds them); None when there is none."""
    for a in (*args, *(kwargs or {}).values()):
        for x in a if type(a) in (tuple, list) else (a,):
            if isinstance(x, Expr):
                return x.graph
    return None


_install_operators()


@dataclass(eq=False)
class Param:
    """One run-time parameter: a number the traced function used."""

    value: int | float


class ArrayRef(NamedTuple):
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
        return table[tuple(clamp_index(i, n) for i, n in zip(key, self.shape, strict=True))]

    def _table_for(self, key):
        """The values for direct lookups, in the framework and on the device of the indices: integers as
        int64, as the kernels widen them to ``long long``, so arithmetic on them never wraps. Device copies
        are cached, except while ``torch.compile`` (or FlexAttention) traces the call: there a cache would
        be a side effect, and the compiled graph keeps the copy as a constant anyway."""
        root = next((type_root(i) for i in key if type_root(i) in ("torch", "cupy")), "numpy")
        if root == "numpy":
            return self._lookup
        device = next(i.device for i in key if type_root(i) == root)
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


class Row:
    """A captured array indexed by fewer values than it has dimensions, in a trace: a row, as under vmap,
    that the next index selects from (``table[q][k]``, ``intervals[doc[q]][0]``, ``lo, hi = spans[i]``)."""

    __slots__ = ("graph", "array", "key")
    __array_ufunc__ = None

    def __init__(self, graph, array: CapturedArray, key: tuple):
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
        next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Row))._as_value()


def _install_row_operators() -> None:
    for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift",
    ):  # fmt: skip
        setattr(Row, f"__{name}__", Row._as_value)
        setattr(Row, f"__r{name}__", Row._as_value)
    for op in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Row, f"__{op}__", Row._as_value)


_install_row_operators()


def _host_array(array) -> np.ndarray:
    """A captured array as int32 or float32 NumPy data (torch and CuPy arrays are copied to the host)."""
    if type_root(array) == "torch":
        array = array.detach().cpu().numpy()
    elif type_root(array) == "cupy":
        array = array.get()
    data = np.asarray(array)
    if data.ndim == 0 or data.size == 0:
        raise NotATable(f"a captured array needs a dimension and an element, got shape {data.shape}")
    if data.dtype == bool or np.issubdtype(data.dtype, np.integer):
        if data.min() < np.iinfo(np.int32).min or data.max() > np.iinfo(np.int32).max:
            raise ValueError("a captured integer array must fit in 32-bit integers (the kernels read int32)")
        return np.ascontiguousarray(data, dtype=np.int32)
    if np.issubdtype(data.dtype, np.floating):
        return np.ascontiguousarray(data, dtype=np.float32)
    raise NotATable(f"a captured array must hold booleans, integers or floats, got dtype {data.dtype}")


def clamp_index(i, n: int):
    if isinstance(i, (int, np.integer)):
        return min(max(int(i), 0), n - 1)
    if type_root(i) == "torch":
        import torch

        return torch.clamp(i, 0, n - 1)
    if type_root(i) == "cupy":
        import cupy

        return cupy.clip(i, 0, n - 1)
    return np.clip(i, 0, n - 1)
