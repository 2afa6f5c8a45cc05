"""Programmable attention: mask and score functions in plain Python, compiled into the kernels.

Write a rule as PyTorch FlexAttention does, ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or
``score_mod(score, b, h, q_idx, kv_idx) -> score`` (``h`` is the query head, ``score`` the scaled score
``scale * q·k``), with Python operators, arrays it captures and the functions here (`where`, `minimum`,
`maximum`, `abs`, `exp`, `log`, `tanh`, `sqrt`). One trace of the function (`cusparseattn.trace`) gives the
NumPy reference, the C expression the kernels compile, and the derivative the backward needs. Numbers and
arrays are run-time parameters: a new window, softcap or bias table never recompiles a kernel.

The functions here work on traced values, and on NumPy, CuPy, PyTorch and JAX arrays directly, so one mod
also runs as plain NumPy code or under PyTorch's FlexAttention.

>>> import numpy as np, cusparseattn as ca
>>> from cusparseattn import mods
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 4, 256, 32), dtype=np.float32)
>>> layout = ca.patterns.from_mask(mods.sliding_window(64), block=64)
>>> bias = mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(20.0))
>>> ca.attention(q, k, v, layout, score_mod=bias).shape
(1, 4, 256, 32)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .captures import EnvironmentCache
from .program import Program
from .rules import TokenRule
from .trace import ScoreMod, TracedMask, trace
from .traced import CapturedArray, Expr

__all__ = [
    "CapturedArray",
    "ScoreMod",
    "abs",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "captured",
    "causal_mask",
    "compose",
    "dilated",
    "document_mask",
    "exp",
    "log",
    "mask_rule",
    "maximum",
    "minimum",
    "or_masks",
    "prefix_lm",
    "relative_bias",
    "score_mod",
    "sliding_window",
    "softcap",
    "sqrt",
    "tanh",
    "where",
]


# ---- entry points ------------------------------------------------------------------------------------------
def mask_rule(
    fn: Callable, *, name: str | None = None, block_size: tuple[int, int] | None = None
) -> TokenRule:
    """Trace a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` into a `TokenRule` the kernels compile.

    The rule's ``c_expr`` is over ``b, h, q, k`` (``long long``), its integer parameters ``P0..P7``
    (``params``) and int32 arrays ``A0..A3`` (``arrays``); ``fn`` evaluates the trace with NumPy (the user's
    own function on torch indices). Raises `cusparseattn.trace.TraceError` (a TypeError) when ``fn`` cannot
    be traced, and a ValueError when the kernels cannot take it (floats, more than 8 parameters or 4 arrays).
    Most users pass the function to `cusparseattn.patterns.from_mask` instead, which calls this. With
    ``block_size``, for a layout of those blocks that classifies them exactly, the rule's program also gets
    what it decides inside partial blocks (its output ``"partial"``:
    `cusparseattn.program.Program.partial_output`).

    >>> rule = mask_rule(sliding_window(128))
    >>> rule.c_expr, rule.params
    ('(((q - k) >= P0) && ((q - k) < P1))', (0, 128))
    """
    if isinstance(fn, TokenRule):
        return fn
    program = trace(fn, "mask_mod", name).check_compilable()
    partial = None if block_size is None else program.partial_output(block_size)
    if partial is not None:
        program = Program({"value": program.outputs["value"], "partial": partial}, "mask_mod", program.name)
    return TokenRule(program.name, TracedMask(program, fn), program)


def score_mod(fn: Callable, *, name: str | None = None) -> ScoreMod:
    """Trace a ``score_mod(score, b, h, q_idx, kv_idx) -> score`` into a `ScoreMod` (a ScoreMod passes).

    Raises `cusparseattn.trace.TraceError` (a TypeError) when ``fn`` cannot be traced, and a ValueError when
    the kernels cannot take it (more than 8 integer or 8 float parameters, or 4 arrays). The same function
    with unchanged captured values (`cusparseattn.captures.environment`) returns the same ScoreMod.

    >>> sm = score_mod(lambda score, b, h, q_idx, kv_idx: score - 0.1 * abs(q_idx - kv_idx))
    >>> sm.c_expr
    '(s - (SF0 * ((float)(max((q - k), (-(q - k)))))))'
    >>> sm.c_grad, sm.float_params
    ('1.0f', (0.1,))
    """
    if isinstance(fn, ScoreMod):
        return fn
    # The same function with an unchanged environment gives the same ScoreMod: no trace (~0.2 ms), and the
    # kernels' device copy of its parameters and tables is reused.
    return _traced.get((fn, name), fn, lambda: ScoreMod.trace(fn, name), watch_all=True)


_traced = EnvironmentCache()


def captured(array) -> CapturedArray:
    """An array for a mod to index, where automatic capture does not reach (attributes, dicts, lists).

    Arrays in a function's closure, default arguments and module globals are captured without this. Indices
    are clamped into the array's bounds; values are held as int32 (bool, integer) or float32.

    >>> import numpy as np
    >>> tables = {"bias": captured(np.linspace(0, 1, 8))}
    >>> sm = score_mod(lambda score, b, h, q_idx, kv_idx: score + tables["bias"][q_idx - kv_idx])
    >>> len(sm.arrays), sm.int_params
    (1, (8,))
    """
    return array if isinstance(array, CapturedArray) else CapturedArray(array)


# ---- functions for traced and concrete values --------------------------------------------------------------
def _apply(op: str, *args):
    """``op`` on traced values (a graph node), else the function of the arrays' own library."""
    for a in args:
        if isinstance(a, Expr):
            return a.graph.apply(op, *args)
    library = np
    for a in args:
        root = type(a).__module__.split(".")[0]
        if root == "torch":
            import torch

            args = tuple(
                x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=a.device) for x in args
            )
            return getattr(torch, op)(*args)
        if root in ("cupy", "jax", "jaxlib"):
            library = __import__("cupy") if root == "cupy" else __import__("jax.numpy").numpy
            break
    return getattr(library, op)(*args)


def where(condition, x, y):
    """``x`` where ``condition`` holds, else ``y`` (elementwise; traced, NumPy, CuPy, torch or JAX).

    >>> import numpy as np
    >>> where(np.array([True, False]), 1.0, -1.0)
    array([ 1., -1.])
    """
    return _apply("where", condition, x, y)


def minimum(x, y):
    """The elementwise minimum (``fminf`` / ``min`` in the kernels).

    >>> int(minimum(3, 5))
    3
    """
    return _apply("minimum", x, y)


def maximum(x, y):
    """The elementwise maximum (``fmaxf`` / ``max`` in the kernels).

    >>> int(maximum(3, 5))
    5
    """
    return _apply("maximum", x, y)


def abs(x):  # noqa: A001 - the name users expect, like numpy.abs
    """The absolute value (Python's ``abs(x)`` works on traced values too).

    >>> int(abs(-4))
    4
    """
    return _apply("abs", x)


def exp(x):
    """The exponential, in float.

    >>> float(exp(0.0))
    1.0
    """
    return _apply("exp", x)


def log(x):
    """The natural logarithm, in float.

    >>> float(log(1.0))
    0.0
    """
    return _apply("log", x)


def tanh(x):
    """The hyperbolic tangent, in float.

    >>> float(tanh(0.0))
    0.0
    """
    return _apply("tanh", x)


def sqrt(x):
    """The square root, in float.

    >>> float(sqrt(4.0))
    2.0
    """
    return _apply("sqrt", x)


# ---- ready-made mask mods ----------------------------------------------------------------------------------
def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def causal_mask(b, h, q_idx, kv_idx):
    """Causal attention: a query sees the keys at or before its own position (top-left aligned, as in
    FlexAttention; `cusparseattn.patterns.causal` aligns bottom-right when ``seq_q != seq_k``).

    >>> from cusparseattn import patterns
    >>> patterns.from_mask(causal_mask, block=64).layout(256) == patterns.causal(block=64).layout(256)
    True
    """
    return q_idx >= kv_idx


def sliding_window(window: int, causal: bool = True) -> Callable:
    """A window of ``window`` keys: causal ``0 <= q - k < window`` (each query sees itself and the
    ``window - 1`` keys before it), else ``|q - k| < window``. `cusparseattn.patterns.local` as a mask_mod.

    >>> from cusparseattn import patterns
    >>> lay = patterns.from_mask(sliding_window(100), block=32).layout(300)
    >>> lay == patterns.local(100, block=32).layout(300)
    True
    """
    w = _positive_int("window", window)
    if causal:

        def sliding_window_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < w)

    else:

        def sliding_window_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < w) & (kv_idx - q_idx < w)

    return sliding_window_mask


def prefix_lm(prefix_len: int) -> Callable:
    """Prefix-LM: the first ``prefix_len`` keys are visible to every query, the rest causally.

    >>> import numpy as np
    >>> prefix_lm(2)(0, 0, np.arange(4)[:, None], np.arange(4)).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 1, 1, 1]])
    """
    n = _positive_int("prefix_len", prefix_len, 0)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (q_idx >= kv_idx)

    return prefix_lm_mask


def document_mask(doc_ids) -> Callable:
    """Packed (jagged) sequences: a query sees only the keys of its own document. ``doc_ids`` holds one
    integer id per token, ``[S]`` (shared by the batch) or ``[B, S]`` (per batch element); NumPy arrays or
    tensors. Combine with `causal_mask` through `and_masks` for causal documents.

    >>> import numpy as np
    >>> from cusparseattn import patterns
    >>> ids = np.repeat([0, 1, 2], [100, 60, 96])
    >>> lay = patterns.from_mask(document_mask(ids), block=32).layout(256)
    >>> lay == patterns.document(ids, block=32).layout(256)
    True
    """
    ids = captured(doc_ids)
    if ids.ndim not in (1, 2) or ids.kind != "int":
        raise ValueError(f"doc_ids must be integer ids of shape [S] or [B, S], got {ids.dtype} {ids.shape}")
    if ids.ndim == 1:

        def document(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]

    else:

        def document(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]

    return document


def dilated(stride: int, causal: bool = True) -> Callable:
    """Strided (dilated) attention: keys at a multiple of ``stride`` from the query, ``(q - k) % stride ==
    0``, and causally ``k <= q`` (`cusparseattn.patterns.strided` as a mask_mod).

    >>> from cusparseattn import patterns
    >>> patterns.from_mask(dilated(4), block=16).layout(64) == patterns.strided(4, block=16).layout(64)
    True
    """
    st = _positive_int("stride", stride)
    if causal:

        def dilated_mask(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx) % st == 0) & (kv_idx <= q_idx)

    else:

        def dilated_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx) % st == 0

    return dilated_mask


def _mask_functions(name: str, mask_mods) -> tuple:
    if not mask_mods:
        raise ValueError(f"{name} needs at least one mask_mod")
    fns = []
    for i, m in enumerate(mask_mods):
        if isinstance(m, TokenRule) and isinstance(m.fn, TracedMask):
            m = m.fn.original
        if not callable(m):
            raise TypeError(f"{name} takes mask_mod functions, got {type(m).__name__} as argument {i}")
        fns.append(m)
    return tuple(fns)


def and_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that holds where every one of ``mask_mods`` holds.

    >>> import numpy as np
    >>> both = and_masks(causal_mask, sliding_window(2, causal=False))
    >>> both(0, 0, np.arange(3)[:, None], np.arange(3)).astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [0, 1, 1]])
    """
    fns = _mask_functions("and_masks", mask_mods)

    def and_mask(b, h, q_idx, kv_idx):
        out = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            out = out & fn(b, h, q_idx, kv_idx)
        return out

    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that holds where any of ``mask_mods`` holds.

    >>> import numpy as np
    >>> either = or_masks(causal_mask, prefix_lm(2))
    >>> either(0, 0, np.arange(3)[:, None], np.arange(3)).astype(int)
    array([[1, 1, 0],
           [1, 1, 0],
           [1, 1, 1]])
    """
    fns = _mask_functions("or_masks", mask_mods)

    def or_mask(b, h, q_idx, kv_idx):
        out = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            out = out | fn(b, h, q_idx, kv_idx)
        return out

    return or_mask


# ---- ready-made score mods ---------------------------------------------------------------------------------
def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes of ``num_heads`` heads (Press et al.): ``2^(-8 i / n)`` for ``i = 1..n``
    when ``n`` is a power of two; otherwise those of the largest power of two below, then every other slope
    of the next power of two.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    n = _positive_int("num_heads", num_heads)

    def geometric(m: int) -> np.ndarray:
        return (2.0 ** (-8.0 / m)) ** np.arange(1, m + 1)

    low = 2 ** int(math.floor(math.log2(n)))
    slopes = geometric(low)
    if low < n:
        slopes = np.concatenate([slopes, geometric(2 * low)[0::2][: n - low]])
    return slopes


def alibi(slopes) -> Callable:
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``, a linear penalty on distance per head. ``slopes`` is
    one float per query head (`alibi_slopes` gives the standard ones).

    >>> sm = score_mod(alibi(alibi_slopes(8)))
    >>> sm.c_expr
    '(s + ((((const float*)SA0)[min(h, (SI0 - 1LL))]) * ((float)((k - q)))))'
    """
    table = captured(slopes)
    if table.ndim != 1:
        raise ValueError(f"slopes must be one value per query head, shape [H], got {table.shape}")

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + table[h] * (kv_idx - q_idx)

    return alibi_bias


def softcap(cap: float) -> Callable:
    """Tanh soft-capping of the scores (Gemma 2, Grok): ``cap * tanh(score / cap)``, which keeps them in
    ``(-cap, cap)``.

    >>> sm = score_mod(softcap(50.0))
    >>> round(float(sm.evaluate(np.float32(1000.0), 0, 0, 0, 0)), 3)
    50.0
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"cap must be a positive number, got {type(cap).__name__}")
    if not 0 < cap < math.inf:
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    c = float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return c * tanh(score / c)

    return softcap_mod


def relative_bias(table, offset: int | None = None) -> Callable:
    """A learned relative-position bias: ``score + table[h, q_idx - kv_idx + offset]`` (``table`` of shape
    ``[H, L]``, one row per query head) or ``score + table[q_idx - kv_idx + offset]`` (shape ``[L]``).
    ``offset`` defaults to ``(L - 1) // 2``, so distance 0 is the middle entry; distances past the table's
    ends take its first or last entry (indices are clamped), as bucketed biases do.

    >>> import numpy as np
    >>> sm = score_mod(relative_bias(np.arange(8.0).reshape(2, 4)))
    >>> sm.evaluate(np.zeros(3, np.float32), 0, 1, 5, np.array([5, 4, 0])).tolist()
    [5.0, 6.0, 7.0]
    """
    bias = captured(table)
    if bias.ndim not in (1, 2) or bias.kind != "float":
        raise ValueError(f"table must be a float array of shape [L] or [H, L], got {bias.dtype} {bias.shape}")
    off = (bias.shape[-1] - 1) // 2 if offset is None else _positive_int("offset", offset, 0)
    if bias.ndim == 1:

        def relative_bias_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx - kv_idx + off]

    else:

        def relative_bias_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + off]

    return relative_bias_mod


def compose(*score_mods: Callable) -> Callable:
    """One score_mod applying ``score_mods`` in order: ``compose(f, g)(score, ...) == g(f(score, ...), ...)``.

    >>> sm = score_mod(compose(alibi(alibi_slopes(4)), softcap(30.0)))
    >>> sm.c_grad.startswith("(1.0f - (tanhf(")
    True
    """
    if not score_mods:
        raise ValueError("compose needs at least one score_mod")
    fns = []
    for i, m in enumerate(score_mods):
        if not callable(m):
            raise TypeError(f"compose takes score_mod functions, got {type(m).__name__} as argument {i}")
        fns.append(m.fn if isinstance(m, ScoreMod) else m)
    fns = tuple(fns)

    def composed(score, b, h, q_idx, kv_idx):
        for fn in fns:
            score = fn(score, b, h, q_idx, kv_idx)
        return score

    return composed
