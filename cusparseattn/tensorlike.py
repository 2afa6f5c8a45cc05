"""A traced value as a torch tensor and a jax.numpy array: the functions and methods mask and score mods use.

FlexAttention users write rules with torch (``(q - k).abs() <= w``, ``torch.where(c, True, False)``,
``b.new_ones((), dtype=torch.bool)``, ``torch.exp2``, ``q.clamp(lo, hi)``) and JAX users with
``jax.numpy``. `cusparseattn.trace` reads both into the same graph, through the tables here:

- torch: a traced value (`cusparseattn.traced.Expr`) is a tensor-like. Its ``__torch_function__`` hands
  every ``torch.*`` function and ``Tensor`` method that meets one to `OPERATIONS` / `METHODS` by name,
  whatever path reached it: the user's code, FlexAttention's own ``and_masks`` / ``or_masks``, a tensor
  indexed by a traced value. The methods a tensor has (``.abs()``, ``.clamp(...)``, ``.to(dtype)``,
  ``.new_ones(...)``) are the traced value's own, from `METHODS`.
- JAX: ``jax.numpy`` has no protocol for symbolic values (``__jax_array__`` must return a concrete array,
  and jnp functions convert their arguments before anything else), so the tracer recognises the jnp
  functions a rule calls instead: the modules ``jax``, ``jax.numpy`` and ``jax.nn`` that a rule reaches
  through its globals and closures become `Namespace` views whose functions build graph nodes when a traced
  value is among their arguments (and are JAX's own otherwise); jnp functions imported by name become the
  same dispatching functions (`dispatching`). A rule that reaches jnp some other way is not traced, and is
  evaluated by `vmapped`. This holds under ``jax.jit`` too: the rule is traced by us, never by JAX.
- Both follow vmap's semantics, as FlexAttention evaluates a rule: every index is a scalar, so
  ``ones_like(q)`` is the number 1 of q's kind, a reduction of one value (``torch.max(x)``) is the value, and
  a table indexed by fewer traced values than it has dimensions is a row that the next index selects from
  (``table[q][k]``, ``intervals[doc[q]][0]``).

Values have three kinds, ``bool``, ``int`` (64-bit) and ``float`` (float32 in the kernels, the reference's
precision in NumPy), so casts map a dtype to its kind (`kind_of`): ``.int()`` and ``.long()`` are both
integers, ``.half()`` and ``.double()`` both floats.

What cannot be traced is evaluated as FlexAttention does (`vmapped`): the user's function on the
framework's own index tensors, vmapped over every axis of their broadcast shape, so that the mask of a rule
that calls an unknown function is the mask that FlexAttention's ``create_mask`` gives.

The handlers take the graph first: ``graph.apply(op, *operands)``, ``graph.literal``, ``graph.operand``,
``graph.cast`` and ``graph.index`` are all they use (`cusparseattn.graph.Graph`).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import numpy as np

LN2 = math.log(2.0)


class Unsupported(TypeError):
    """An operation without a traced form, or arguments it cannot take in a traced function."""


_KINDS = {"b": "bool", "i": "int", "u": "int", "f": "float"}


def kind_of(dtype) -> str:
    """``"bool"``, ``"int"`` or ``"float"``: the kind of a torch, NumPy or JAX dtype, or of a Python type.

    >>> kind_of(np.int32), kind_of(bool), kind_of("float16")
    ('int', 'bool', 'float')
    """
    if dtype in (bool, int, float):
        return dtype.__name__
    if type(dtype).__module__.split(".")[0] == "torch" and hasattr(dtype, "is_floating_point"):
        if dtype.is_complex:
            raise Unsupported(f"a traced value cannot take the complex dtype {dtype}")
        return "bool" if str(dtype) == "torch.bool" else "float" if dtype.is_floating_point else "int"
    try:
        kind = _KINDS.get(np.dtype(dtype).kind)
    except TypeError:
        kind = None
    if kind is None:
        raise Unsupported(f"expected a boolean, integer or float dtype, got {dtype!r}")
    return kind


def _is_dtype(x) -> bool:
    if isinstance(x, str) or x is None:  # devices are named by strings; dtype strings are NumPy's only
        return False
    try:
        kind_of(x)
    except Unsupported:
        return False
    return True


# ---- handlers: (graph, *args, **kwargs) -> value ---------------------------------------------------------
def _binary(op: str, reflected: bool = False) -> Callable:
    if reflected:
        return lambda g, a, b: g.apply(op, b, a)
    return lambda g, a, b: g.apply(op, a, b)


def _unary(op: str) -> Callable:
    return lambda g, a: g.apply(op, a)


def _logical(op: str) -> Callable:
    """torch.logical_* / jnp.logical_*: the operands as booleans (nonzero), the result boolean."""
    return lambda g, *xs: g.apply(op, *(g.cast(g.operand(x), "bool") for x in xs))


def _add(g, a, b, *, alpha=1):
    return g.apply("add", a, b if alpha == 1 else g.apply("mul", alpha, b))


def _sub(g, a, b, *, alpha=1):
    return g.apply("sub", a, b if alpha == 1 else g.apply("mul", alpha, b))


def _rsub(g, a, b, *, alpha=1):
    return _sub(g, b, a, alpha=alpha) if alpha == 1 else g.apply("sub", b, g.apply("mul", alpha, a))


def _div(g, a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return g.apply("truediv", a, b)
    if rounding_mode == "floor":
        return g.apply("floordiv", a, b)
    raise Unsupported(
        f"div's rounding_mode={rounding_mode!r} has no traced form: use None, 'floor' (//), or fmod"
    )


def _where(g, condition, x=None, y=None):
    if x is None or y is None:
        raise Unsupported("where(condition) alone (the indices where it holds) has no traced form")
    return g.apply("where", condition, x, y)


def _clamp(g, x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002 - torch's and jnp's names
    """clamp / clip as nested maximum and minimum: ``minimum(maximum(x, lo), hi)``, torch's definition."""
    lo, hi = (a_min if min is None else min), (a_max if max is None else max)
    if lo is None and hi is None:
        raise Unsupported("clamp / clip needs min or max")
    out = x if lo is None else g.apply("maximum", x, lo)
    return out if hi is None else g.apply("minimum", out, hi)


def _extremum(op: str, name: str) -> Callable:
    """torch.min / torch.max / jnp.min / jnp.max: of two values elementwise; of one value, the value (a
    reduction over a scalar index)."""

    def extremum(g, a, b=None, *args, **kwargs):
        if b is None:
            return a
        if isinstance(b, (int, np.integer)) or args or kwargs:
            raise Unsupported(f"{name} over a dimension has no traced form: an index is a scalar")
        return g.apply(op, a, b)

    return extremum


def _sigmoid(g, x):
    one = g.literal(1, "float")
    return g.apply("truediv", one, g.apply("add", one, g.apply("exp", g.apply("neg", x))))


def _rsqrt(g, x):
    return g.apply("truediv", g.literal(1, "float"), g.apply("sqrt", x))


def _square(g, x):
    x = g.operand(x)
    return g.apply("mul", x, x)


def _constant_like(value, literal: bool) -> Callable:
    """ones_like / zeros_like (literal: the graph's own 1 and 0) and full_like (the fill value, a parameter
    as any number a function writes), in the kind of ``dtype`` or of the value it is like."""

    def like(g, x, fill=None, *args, dtype=None, **kwargs):
        fill = value if literal else fill
        kind = g.operand(x).kind if dtype is None else kind_of(dtype)
        node = g.literal(fill, kind) if literal else g.operand(fill)
        return g.cast(node, kind)

    return like


def _scalar_size(name: str, size) -> None:
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    if any(not isinstance(d, (int, np.integer)) or d != 1 for d in dims):
        raise Unsupported(
            f"{name}{tuple(dims)}: inside a traced function every value is one scalar, as under vmap; "
            "give the size () (FlexAttention's and_masks does)"
        )


def _new_constant(value) -> Callable:
    """Tensor.new_ones / new_zeros: a literal, of ``dtype`` or of the tensor's own kind."""

    def new(g, x, *size, dtype=None, **kwargs):
        _scalar_size("new_ones" if value else "new_zeros", size)
        kind = g.operand(x).kind if dtype is None else kind_of(dtype)
        return g.literal(value, kind)

    return new


def _new_full(g, x, size, fill_value, *, dtype=None, **kwargs):
    _scalar_size("new_full", (size,))
    kind = g.operand(x).kind if dtype is None else kind_of(dtype)
    return g.cast(g.operand(fill_value), kind)


def _cast(kind: str) -> Callable:
    return lambda g, x, *args, **kwargs: g.cast(g.operand(x), kind)


def _to(g, x, *args, dtype=None, **kwargs):
    """Tensor.to(dtype), .to(device, dtype), .to(other): the kind of the dtype (a device changes nothing)."""
    kinds = [kind_of(a) for a in args if _is_dtype(a)] + ([] if dtype is None else [kind_of(dtype)])
    kinds += [g.operand(a).kind for a in (*args, kwargs.get("other")) if _traced(g, a)]
    return g.cast(g.operand(x), kinds[-1]) if kinds else g.operand(x)


def _type(g, x, dtype=None, **kwargs):
    if dtype is None:
        raise Unsupported("Tensor.type() without a dtype returns a name, not a value")
    return g.cast(g.operand(x), kind_of(dtype))


def _method_where(g, x, condition, y):
    """Tensor.where(condition, other): x where condition holds, else other."""
    return g.apply("where", condition, x, y)


def _getitem(g, array, key):
    """A tensor (not captured in advance: an attribute, made inside the function) indexed by traced values."""
    return g.lookup(array, key)


def _identity(g, x, *args, **kwargs):
    return x


def _traced(g, x) -> bool:
    return getattr(x, "graph", None) is g


_FUNCTIONS: dict[str, Callable] = {
    # arithmetic (torch and jax.numpy names)
    "add": _add, "sub": _sub, "subtract": _sub, "rsub": _rsub, "mul": _binary("mul"),
    "multiply": _binary("mul"), "div": _div, "divide": _div, "true_divide": _binary("truediv"),
    "floor_divide": _binary("floordiv"), "remainder": _binary("mod"), "mod": _binary("mod"),
    "fmod": _binary("fmod"), "neg": _unary("neg"), "negative": _unary("neg"), "abs": _unary("abs"),
    "absolute": _unary("abs"), "square": _square, "positive": _identity,
    # comparisons
    "eq": _binary("eq"), "equal": _binary("eq"), "ne": _binary("ne"), "not_equal": _binary("ne"),
    "lt": _binary("lt"), "less": _binary("lt"), "le": _binary("le"), "less_equal": _binary("le"),
    "gt": _binary("gt"), "greater": _binary("gt"), "ge": _binary("ge"), "greater_equal": _binary("ge"),
    # logic and bits
    "logical_and": _logical("and"), "logical_or": _logical("or"), "logical_xor": _logical("xor"),
    "logical_not": _logical("invert"), "bitwise_and": _binary("and"), "bitwise_or": _binary("or"),
    "bitwise_xor": _binary("xor"), "bitwise_not": _unary("invert"), "invert": _unary("invert"),
    "bitwise_invert": _unary("invert"), "bitwise_left_shift": _binary("lshift"),
    "bitwise_right_shift": _binary("rshift"), "left_shift": _binary("lshift"),
    "right_shift": _binary("rshift"),
    # selection and bounds
    "where": _where, "minimum": _binary("minimum"), "maximum": _binary("maximum"),
    "fmin": _binary("minimum"), "fmax": _binary("maximum"), "min": _extremum("minimum", "min"),
    "max": _extremum("maximum", "max"), "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda g, x, lo: _clamp(g, x, lo), "clamp_max": lambda g, x, hi: _clamp(g, x, None, hi),
    # float functions
    "exp": _unary("exp"), "exp2": _unary("exp2"), "log": _unary("log"), "log2": _unary("log2"),
    "tanh": _unary("tanh"), "sqrt": _unary("sqrt"), "sin": _unary("sin"), "cos": _unary("cos"),
    "sigmoid": _sigmoid, "expit": _sigmoid, "special_expit": _sigmoid, "rsqrt": _rsqrt,
    # constants shaped like a value
    "ones_like": _constant_like(1, True), "zeros_like": _constant_like(0, True),
    "full_like": _constant_like(None, False), "asarray": _identity, "array": _identity,
    "as_tensor": _identity,
}  # fmt: skip

_OPERATORS = {
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv", "div": "truediv",
    "floordiv": "floordiv", "mod": "mod", "and": "and", "or": "or", "xor": "xor", "lshift": "lshift",
    "rshift": "rshift",
}  # fmt: skip

_TENSOR_METHODS: dict[str, Callable] = {
    "where": _method_where, "new_ones": _new_constant(1), "new_zeros": _new_constant(0),
    "new_full": _new_full, "to": _to, "type": _type, "type_as": lambda g, x, other: _to(g, x, other),
    "astype": lambda g, x, dtype, **kwargs: g.cast(g.operand(x), kind_of(dtype)),
    "float": _cast("float"), "double": _cast("float"), "half": _cast("float"), "bfloat16": _cast("float"),
    "int": _cast("int"), "long": _cast("int"), "short": _cast("int"), "bool": _cast("bool"),
    "contiguous": _identity, "clone": _identity, "detach": _identity, "cpu": _identity, "cuda": _identity,
    "squeeze": _identity, "__getitem__": _getitem,
    "__neg__": _unary("neg"), "__abs__": _unary("abs"), "__invert__": _unary("invert"),
    "__lt__": _binary("lt"), "__le__": _binary("le"), "__gt__": _binary("gt"), "__ge__": _binary("ge"),
    "__eq__": _binary("eq"), "__ne__": _binary("ne"),
}  # fmt: skip
for _name, _op in _OPERATORS.items():
    _TENSOR_METHODS[f"__{_name}__"] = _binary(_op)
    _TENSOR_METHODS[f"__r{_name}__"] = _binary(_op, reflected=True)
    _TENSOR_METHODS[f"__i{_name}__"] = _binary(_op)

# torch.* and jax.numpy functions, by name.
OPERATIONS: dict[str, Callable] = dict(_FUNCTIONS)
# Tensor methods (the value first): the functions, then what only a tensor has.
METHODS: dict[str, Callable] = {**_FUNCTIONS, **_TENSOR_METHODS}
# The methods a traced value has itself (Python's operators it has already, from the tracer).
OWN_METHODS = tuple(
    sorted(
        n
        for n in METHODS
        if not n.startswith("__")
        and n not in ("array", "asarray", "as_tensor", "special_expit", "expit")
        and not n.endswith("_like")
    )
)


def supported() -> str:
    """The traced functions, for error messages."""
    return ", ".join(sorted(n for n in OPERATIONS if n not in ("asarray", "array", "as_tensor")))


# ---- JAX: namespaces that dispatch on traced values ----------------------------------------------------
NAMESPACES = ("jax", "jax.numpy", "jax.nn")


class Namespace:
    """``jax``, ``jax.numpy`` or ``jax.nn`` as a traced rule sees it: functions that build graph nodes when
    a traced value is among their arguments (`dispatching`), JAX's own values otherwise.

    ``graph_of(args, kwargs)`` finds the graph of a traced argument (None: no traced value among them).
    """

    def __init__(self, module: types.ModuleType, graph_of: Callable):
        self._module, self._graph_of = module, graph_of

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if isinstance(value, types.ModuleType):
            return Namespace(value, self._graph_of) if value.__name__ in NAMESPACES else value
        if callable(value):
            return dispatching(value, f"{self._module.__name__}.{name}", name, self._graph_of)
        return value

    def __repr__(self) -> str:
        return f"<traced view of {self._module.__name__}>"


def dispatching(fn: Callable, qualname: str, name: str, graph_of: Callable) -> Callable:
    """``fn`` that, on traced arguments, builds the graph node of `OPERATIONS` ``name`` instead (a scalar
    type such as ``jnp.int32`` casts), and raises `Unsupported` naming ``qualname`` when it has none."""
    if isinstance(fn, type):
        try:
            kind = kind_of(fn)
        except Unsupported:
            return fn  # a class (jnp.ndarray for isinstance): never called on traced values
        handler = _cast(kind)
    else:
        handler = OPERATIONS.get(name)

    def call(*args, **kwargs):
        graph = graph_of(args, kwargs)
        if graph is None:
            return fn(*args, **kwargs)
        if handler is None:
            raise Unsupported(f"{qualname} has no traced form; traced functions: {supported()}")
        return handler(graph, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__wrapped__ = fn
    return call


def jax_functions() -> dict[int, tuple[Callable, str]]:
    """The jax.numpy and jax.nn functions of `OPERATIONS` by identity (for functions imported by name)."""
    import jax.nn
    import jax.numpy as jnp

    out = {}
    for module in (jnp, jax.nn):
        for name in OPERATIONS:
            fn = getattr(module, name, None)
            if callable(fn):
                out[id(fn)] = (fn, f"{module.__name__}.{name}")
    return out


# ---- what cannot be traced: FlexAttention's evaluation ---------------------------------------------------
def vmapped(fn: Callable, framework: str, args) -> np.ndarray:
    """``fn(*args)`` as FlexAttention evaluates a rule: ``args`` (broadcasting integer arrays or numbers) as
    the framework's (``"torch"`` or ``"jax"``) integer arrays, ``fn`` vmapped over every axis of their
    broadcast shape, so that it sees scalars. Returns a NumPy array of the broadcast shape."""
    arrays = [np.asarray(a, dtype=np.int64) for a in args]
    ndim = max(a.ndim for a in arrays)
    arrays = [a.reshape((1,) * (ndim - a.ndim) + a.shape) for a in arrays]
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    axes = [[ax for ax in range(ndim) if a.shape[ax] > 1] for a in arrays]
    squeezed = [a.reshape([a.shape[ax] for ax in used]) for a, used in zip(arrays, axes, strict=True)]
    if framework == "torch":
        import torch

        vmap, inputs = torch.vmap, [torch.from_numpy(np.ascontiguousarray(a)) for a in squeezed]
    else:
        import jax
        import jax.numpy as jnp

        def vmap(f, in_dims):
            return jax.vmap(f, in_axes=in_dims)

        inputs = [jnp.asarray(a) for a in squeezed]
    call = fn
    for ax in reversed(range(ndim)):
        dims = tuple(0 if ax in used else None for used in axes)
        if 0 in dims:
            call = vmap(call, in_dims=dims)
    out = call(*inputs)
    if framework == "torch" and hasattr(out, "detach"):
        out = out.detach().cpu()
    out = np.asarray(out)
    mapped = [shape[ax] for ax in range(ndim) if any(ax in used for used in axes)]
    if out.shape != tuple(mapped):
        raise ValueError(
            f"the function returned a value of shape {out.shape[len(mapped) :]} per index; expected one "
            "scalar per (b, h, q_idx, kv_idx)"
        )
    return out.reshape(shape)


def framework_of(value) -> str | None:
    """``"torch"`` or ``"jax"`` for a module, array or function of that library; None otherwise."""
    if isinstance(value, types.ModuleType):
        root = value.__name__.split(".")[0]
    elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        root = (getattr(value, "__module__", None) or "").split(".")[0]
    else:
        root = type(value).__module__.split(".")[0]
    return {"torch": "torch", "jax": "jax", "jaxlib": "jax"}.get(root)
