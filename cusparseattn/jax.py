"""JAX glue: `attention` as a ``jax.custom_vjp`` over the forward and backward passes.

`cusparseattn.attention` comes here for JAX arrays, so ``jax.grad`` works through it. Outside ``jax.jit`` the
passes run eagerly on the arrays' memory (DLPack, no copy on the CPU; the CUDA backend on a GPU). Inside
``jit`` (or ``vmap``) on the CPU they run through ``jax.pure_callback`` on the NumPy reference. Inside ``jit``
on a GPU there is no kernel binding yet (an XLA FFI target is a later step): that raises, unless
``backend="reference"`` asks for the reference on the host. The log-sum-exp that ``return_lse=True`` returns
is not differentiable.

>>> import jax, jax.numpy as jnp
>>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, 64, 16))
>>> loss = lambda q: attention(q, k, v, causal=True).sum()
>>> jax.jit(jax.grad(loss))(q).shape
(1, 2, 64, 16)
"""

from __future__ import annotations

import jax
import numpy as np

from . import api, backends
from .arrays import NumpyTensor, wrap
from .backends import Inputs


def attention(q, k, v, layout=None, *, causal=False, scale=None, return_lse=False, backend=None):
    """Differentiable block-sparse attention on JAX arrays; arguments as in `cusparseattn.attention`.

    >>> import jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 2, 40, 8), jnp.bfloat16)
    >>> out, lse = attention(q, k, v, return_lse=True)
    >>> out.dtype, lse.dtype, lse.shape
    (dtype(bfloat16), dtype('float32'), (1, 2, 40))
    """
    inputs = api._prepare(q, k, v, layout, causal=causal, scale=scale)
    out, lse = _differentiable(inputs.layout, inputs.scale, backend)(q, k, v)
    # The lse leaves as a constant, so its cotangent in the backward is always zero.
    lse = jax.lax.stop_gradient(lse)
    return (out, lse) if return_lse else out


def _jax(x, name: str):
    # Inside custom_vjp, JAX may hand over NumPy arrays (constants, cotangents): make them JAX arrays.
    return wrap(x if isinstance(x, (jax.Array, jax.core.Tracer)) else jax.numpy.asarray(x), name)


def _differentiable(layout, scale: float, backend: str | None):
    def forward(q, k, v):
        return api._run(Inputs(_jax(q, "q"), _jax(k, "k"), _jax(v, "v"), layout, scale), "forward", backend)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def attend_bwd(saved, cotangents):
        holders = {name: _jax(x, name) for name, x in zip(("q", "k", "v", "out", "lse"), saved, strict=True)}
        inputs = Inputs(
            holders["q"],
            holders["k"],
            holders["v"],
            layout,
            scale,
            dout=_jax(cotangents[0], "dout"),
            out=holders["out"],
            lse=holders["lse"],
        )
        return api._run(inputs, "backward", backend)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def run_traced(inputs: Inputs, op: str, backend: str | None) -> tuple:
    """Run ``op`` on traced arrays (inside ``jit``/``vmap``) through ``jax.pure_callback`` on the host."""
    if inputs.on_gpu and backend != "reference":
        raise NotImplementedError(
            "cusparseattn has no XLA binding of its CUDA kernels yet, so it cannot run on a GPU inside "
            "jax.jit; call it outside jit, or pass backend='reference' to run the NumPy reference on the host"
        )
    # The arrays reach the callback as NumPy arrays on the host, where only the reference runs (on the CPU the
    # CUDA backend says so; on a GPU the caller asked for it). Choosing at trace time raises before any work.
    chosen = backends.select(inputs, op, backend)
    q, k, v = inputs.q, inputs.k, inputs.v
    if op == "forward":
        names = ("q", "k", "v")
        lse_dtype = np.float64 if q.dtype == "float64" else np.float32
        shapes = (jax.ShapeDtypeStruct(q.shape, q.native.dtype), jax.ShapeDtypeStruct(q.shape[:3], lse_dtype))
    else:
        names = ("dout", "q", "k", "v", "out", "lse")
        shapes = tuple(jax.ShapeDtypeStruct(h.shape, h.native.dtype) for h in (q, k, v))
    natives = [getattr(inputs, name).native for name in names]

    def callback(*arrays):
        given = {name: NumpyTensor(np.asarray(a), name) for name, a in zip(names, arrays, strict=True)}
        extra = {name: given[name] for name in ("dout", "out", "lse") if name in given}
        run = Inputs(given["q"], given["k"], given["v"], inputs.layout, inputs.scale, **extra)
        results = chosen.forward(run) if op == "forward" else chosen.backward(run)
        return tuple(r.native for r in results)

    return tuple(jax.pure_callback(callback, shapes, *natives, vmap_method="sequential"))
