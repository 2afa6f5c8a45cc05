"""The public functions: block-sparse attention on NumPy, CuPy, PyTorch and JAX arrays.

Every call validates its arrays, layout and scale before any work, picks a backend (`cusparseattn.backends`)
and returns results in the caller's framework, on the caller's device. `attention` is differentiable with
PyTorch tensors (custom operators with registered autograd, which ``torch.compile`` keeps whole:
`cusparseattn.torch`) and with JAX arrays (a ``custom_vjp``, `cusparseattn.jax`); `attention_forward` and
`attention_backward` are the raw pair, without autograd.

>>> import numpy as np
>>> from cusparseattn import attention, patterns
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 1, 2, 200, 16), dtype=np.float32)
>>> attention(q, k, v, patterns.local(window=64, block=32)).shape
(1, 2, 200, 16)
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref

from . import backends, mods
from .arrays import Sizes, check_layout, validate, wrap
from .backends import Inputs
from .layout import BlockLayout
from .trace import EnvironmentCache

_causal_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The last mask functions' Patterns, per batch, heads and block size.
_mask_cache = EnvironmentCache()


def attention(
    q, k, v, layout=None, *, causal=False, scale=None, return_lse=False, backend=None, score_mod=None
):
    """Block-sparse attention ``softmax(score_mod(scale * q @ k^T), masked by layout) @ v``, differentiable.

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]`` with Hq a multiple of Hkv (grouped-query attention).
            NumPy, CuPy, PyTorch or JAX arrays of one framework, dtype float16, bfloat16, float32 or float64
            (float64: the reference only), any strides with a contiguous last dimension (``[B, S, H, D]``
            arrays pass as the views ``x.transpose(1, 2)``).
        layout: None (dense), a `Pattern` (built for these lengths), a `BlockLayout` of these lengths, or a
            ``mask_mod(b, h, q_idx, kv_idx) -> bool`` function (`cusparseattn.patterns.from_mask` with blocks
            of 128 over these batch elements and heads; its layout is built at the first call with that
            function and kept while the function lives, so captured arrays are read once: pass a new function
            for new values, or build a Pattern yourself).
        causal: intersect the layout with the causal mask, aligned bottom-right when ``Sq != Sk``.
        scale: the factor of the scores, ``1 / sqrt(D)`` by default.
        return_lse: also return the natural-log log-sum-exp ``[B, Hq, Sq]`` of each row (float32; float64 for
            float64 inputs), which is not differentiable.
        backend: force one backend by name (``"cuda"``, ``"reference"``); by default the first that can run.
        score_mod: None, or ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to every scaled score
            before the mask and softmax (FlexAttention's score_mod; ``h`` the query head), written with the
            operators and functions of `cusparseattn.mods` and traced (or a traced
            `cusparseattn.mods.score_mod`). The lse is over the modified scores.

    Returns:
        ``out`` like ``q`` (and ``lse``), in the caller's framework and device. A query row that attends to
        nothing gives 0 (and ``lse = -inf``).

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 4, 100, 32), dtype=np.float32)
    >>> out, lse = attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape, bool(np.allclose(out[:, :, 0], v[:, :, 0], atol=1e-6))
    ((2, 4, 100, 32), (2, 4, 100), True)
    """
    framework = wrap(q, "q").framework
    if framework in ("torch", "jax"):
        if framework == "torch":
            from . import torch as adapter
        else:
            from . import jax as adapter
        mod = {} if score_mod is None else {"score_mod": score_mod}
        return adapter.attention(
            q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse, backend=backend, **mod
        )
    out, lse = attention_forward(
        q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod
    )
    return (out, lse) if return_lse else out


def attention_forward(q, k, v, layout=None, *, causal=False, scale=None, backend=None, score_mod=None):
    """The forward pass alone: ``(out, lse)`` in the caller's framework (no autograd).

    Arguments as in `attention`. ``lse [B, Hq, Sq]`` is the natural-log log-sum-exp of each row's scaled,
    masked scores (float32; float64 for float64 inputs), ``-inf`` for a row that attends to nothing; pass it
    to `attention_backward`.

    >>> import numpy as np
    >>> from cusparseattn import patterns
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = rng.standard_normal((3, 1, 2, 64, 8))
    >>> out, lse = attention_forward(q, k, v, patterns.causal(block=16))
    >>> out.dtype, lse.dtype, bool(np.isclose(lse[0, 0, 0], q[0, 0, 0] @ k[0, 0, 0] / np.sqrt(8)))
    (dtype('float64'), dtype('float64'), True)
    """
    if wrap(q, "q").framework == "torch":
        from . import torch as adapter

        if not adapter.compiling():
            return adapter.attention_forward(q, k, v, layout, causal, scale, backend, score_mod)
    inputs = _prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
    return _run(inputs, "forward", backend)


def attention_backward(
    dout, q, k, v, out, lse, layout=None, *, causal=False, scale=None, backend=None, score_mod=None
):
    """The backward pass: ``(dq, dk, dv)`` from ``dout``, the gradient of the loss with respect to ``out``.

    ``out`` and ``lse`` come from `attention_forward` with the same arguments (``score_mod`` included).
    With grouped-query attention, ``dk`` and ``dv`` sum over the query heads of each group. A query row that
    attends to nothing gets zero gradients.

    >>> import numpy as np
    >>> rng = np.random.default_rng(2)
    >>> q, k, v, dout = rng.standard_normal((4, 1, 4, 40, 8))
    >>> out, lse = attention_forward(q, k[:, :2], v[:, :2])
    >>> dq, dk, dv = attention_backward(dout, q, k[:, :2], v[:, :2], out, lse)
    >>> dq.shape, dk.shape, bool(np.allclose(dv.sum(axis=(1, 2)), dout.sum(axis=(1, 2))))
    ((1, 4, 40, 8), (1, 2, 40, 8), True)
    """
    inputs = _prepare(
        q, k, v, layout, causal=causal, scale=scale, dout=dout, out=out, lse=lse, score_mod=score_mod
    )
    return _run(inputs, "backward", backend)


def _prepare(q, k, v, layout, *, causal, scale, dout=None, out=None, lse=None, score_mod=None) -> Inputs:
    """Wrap and validate every argument (nothing runs before this passes) into a backend's `Inputs`."""
    hq, hk, hv = wrap(q, "q"), wrap(k, "k"), wrap(v, "v")
    extra = {name: wrap(x, name) for name, x in (("dout", dout), ("out", out), ("lse", lse)) if x is not None}
    sizes = validate(hq, hk, hv, **extra)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    resolved = _resolve_layout(layout, causal, sizes)
    mod = None if score_mod is None else mods.score_mod(score_mod)  # names score_mod when it cannot trace
    return Inputs(hq, hk, hv, resolved, _check_scale(scale, sizes.head_dim), score_mod=mod, **extra)


def _run(inputs: Inputs, op: str, backend: str | None) -> tuple:
    """Select a backend for ``op`` and run it; native arrays of the caller's framework come back."""
    if inputs.q.framework == "jax":
        from . import jax as adapter

        # JAX arrays run inside an XLA call, eager or traced: the kernels then use XLA's buffers and stream.
        return adapter.run(inputs, op, backend)
    chosen = backends.select(inputs, op, backend)
    results = chosen.forward(inputs) if op == "forward" else chosen.backward(inputs)
    return tuple(r.native for r in results)


@functools.cache
def _default_pattern(causal: bool):
    from . import patterns

    return patterns.causal() if causal else patterns.dense()


def _resolve_layout(layout, causal: bool, sizes: Sizes) -> BlockLayout:
    """The BlockLayout for these sizes: None is dense, a Pattern is built for them, a mask function becomes a
    Pattern; ``causal`` intersects."""
    from .patterns import Pattern

    if layout is None:
        return _default_pattern(causal).layout(sizes.seq_q, sizes.seq_k)
    if callable(layout) and not isinstance(layout, (Pattern, BlockLayout)):
        layout = _mask_pattern(layout, sizes.batch, sizes.heads_q)
    if isinstance(layout, Pattern):
        layout = layout.layout(sizes.seq_q, sizes.seq_k)
    check_layout(layout, sizes)
    return _with_causal(layout) if causal else layout


def _mask_pattern(fn, batch: int | None, heads: int | None, block: int = 128):
    """``patterns.from_mask(fn)`` over these batch elements and heads, in blocks of ``block`` tokens (None:
    rules of ``b`` or ``h`` are refused, naming them). The same function gives the same Pattern (which caches
    its layouts per lengths, so the kernels' tables are reused) while what it captures is unchanged
    (`cusparseattn.trace.environment`: document ids refilled in place in a torch tensor give a new layout).
    Values whose changes cannot be seen (dicts, large writable NumPy arrays) are taken as unchanged: building
    a layout costs far more than a trace."""
    from . import patterns

    def make():
        return patterns.from_mask(fn, block=block, batch=batch, heads=heads)

    return _mask_cache.get((fn, batch, heads, block), fn, make, watch_all=False)


def _with_causal(layout: BlockLayout) -> BlockLayout:
    # The intersection is kept as long as its operand lives: the same layout gives the same object, so caches
    # keyed by layout identity (the kernels' device tables) keep working across calls.
    cached = _causal_cache.get(layout)
    if cached is None:
        from . import patterns

        causal = patterns.causal(block=layout.block_size).layout(layout.seq_q, layout.seq_k)
        cached = _causal_cache[layout] = layout & causal
    return cached


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None (1/sqrt(D)), got {type(scale).__qualname__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)
