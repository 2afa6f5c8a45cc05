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
>>> from cusparseattn.program import MASK_NAMES
>>> program = trace(lambda b, h, q, k: (q >= k) & (q - k < 256), "mask_mod")
>>> program.c_text("value", MASK_NAMES), program.int_params
('((q >= k) && ((q - k) < P0))', (256,))
>>> program.evaluate("value", dict(b=0, h=0, q=np.arange(3)[:, None], k=np.arange(3))).astype(int)
array([[1, 0, 0],
       [1, 1, 0],
       [1, 1, 1]])
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import tensorlike
from .derivative import Derivative
from .graph import Graph
from .program import SCORE_NAMES, Program, array_module
from .rules import TokenRule
from .traced import (
    LIBRARIES,
    MAX_FLOAT_PARAMS,
    MAX_INT_PARAMS,
    ROLES,
    SIGNATURES,
    SUPPORTED,
    Expr,
    NotCompilable,
    Row,
    TraceError,
    is_array,
    is_number,
    type_root,
)


# ---- tracing -----------------------------------------------------------------------------------------------
def check_arity(fn, role: str, name: str) -> None:
    """Raise a TypeError unless ``fn`` takes the role's positional arguments."""
    if not callable(fn):
        raise TypeError(f"{role} must be a function {SIGNATURES[role]}, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        signature.bind(*range(len(ROLES[role])))
    except TypeError:
        raise TypeError(
            f"{role} must take {len(ROLES[role])} positional arguments {SIGNATURES[role]}; "
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
        f"Supported: {SUPPORTED}"
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
        if root not in LIBRARIES and root != __package__:
            site = f"{frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return site


def defined_at(fn) -> str:
    """``; it is defined at file:line`` for a Python function, else nothing."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    return f"; it is defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _output(graph: Graph, result, role: str, name: str) -> Expr:
    if isinstance(result, Row):
        result._as_value()
    if is_array(result) and len(result.shape) == 0:  # torch.tensor(True), b.new_ones(()) made concrete
        result = result.item()
    if not isinstance(result, Expr) and not isinstance(result, (bool, np.bool_)) and not is_number(result):
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


# ---- what the kernels and the reference take ---------------------------------------------------------------
class TracedMask:
    """A traced mask_mod as a `TokenRule` function: the program on NumPy (or CuPy) indices, the user's own
    function on torch indices (FlexAttention calls it so).

    ``variables`` names the arguments the rule uses (``{"q", "k"}`` for a causal rule).
    """

    def __init__(self, program: Program, original: Callable):
        self.program, self.original = program, original

    @property
    def traced_from(self) -> Callable:
        return self.original

    @property
    def variables(self) -> set[str]:
        return self.program.variables

    def __call__(self, b, h, q, k):
        values = dict(b=b, h=h, q=q, k=k)
        if any(isinstance(x, Expr) for x in (b, h, q, k)):  # a trace of a rule that calls this one
            return self.program.replay("value", values)
        if any(type_root(x) == "torch" for x in (b, h, q, k)):
            return self.original(b, h, q, k)
        return self.program.evaluate("value", values, xp=array_module(b, h, q, k))


class UntracedMask:
    """A mask_mod that cannot be traced or compiled, as a `TokenRule` function: evaluated as FlexAttention
    evaluates it. A rule that reaches torch runs on torch index tensors, and one that reaches JAX on jax
    arrays, vmapped over every axis so that it sees scalars (`cusparseattn.tensorlike.vmapped`): never are
    NumPy arrays handed to a torch function. Other rules run on the NumPy index arrays, and every rule on
    torch indices (FlexAttention calling it) is the user's function itself."""

    def __init__(self, original: Callable, framework: str):
        self.original, self.framework = original, framework

    def __call__(self, b, h, q, k):
        if self.framework == "numpy" or any(type_root(x) == "torch" for x in (b, h, q, k)):
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

    @property
    def traced_from(self) -> Callable:
        return self.fn

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
        xp = array_module(score, b, h, q, k)
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
