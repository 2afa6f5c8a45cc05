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

from . import call, plans, token_groups
from .arrays import framework_of


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
    framework = framework_of(q, "q")
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
    framework = framework_of(q, "q")
    grouped = token_groups.grouping(
        q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod
    )
    if grouped is not None:
        rows = grouped.rows(q)
        results = attention_forward(rows, k, v, grouped.layout, scale=grouped.scale, backend=backend)
        return tuple(map(grouped.tokens, results))
    if framework == "jax":
        from . import jax as adapter

        # JAX arrays run inside an XLA call, eager or traced: the kernels then use XLA's buffers and stream.
        inputs = call.prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
        return adapter.run(inputs, "forward", backend)
    if framework == "torch":
        from . import torch as adapter

        if adapter.compiling():  # the custom operator, which torch.compile keeps in its graph
            return adapter.attention(
                q,
                k,
                v,
                layout,
                causal=causal,
                scale=scale,
                return_lse=True,
                backend=backend,
                score_mod=score_mod,
            )
    plan = plans.forward(q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod)
    return plan.run(q, k, v)


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
    grouped = token_groups.grouping(
        q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod,
        dout=dout, out=out, lse=lse,
    )  # fmt: skip
    if grouped is not None:
        rows = (grouped.rows(x) for x in (dout, q))
        dq, dk, dv = attention_backward(
            *rows, k, v, grouped.rows(out), grouped.rows(lse), grouped.layout, scale=grouped.scale,
            backend=backend,
        )  # fmt: skip
        return grouped.tokens(dq), dk, dv
    if framework_of(q, "q") == "jax":
        from . import jax as adapter

        inputs = call.prepare(
            q, k, v, layout, causal=causal, scale=scale, dout=dout, out=out, lse=lse, score_mod=score_mod
        )
        return adapter.run(inputs, "backward", backend)
    plan = plans.backward(
        dout, q, k, v, out, lse, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod
    )
    return plan.run(dout, q, k, v, out, lse)
