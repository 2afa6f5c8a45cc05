"""JAX glue: `attention` as a ``jax.custom_vjp`` whose passes run inside XLA: ``jit``, ``grad`` and ``vmap``
work through it.

`cusparseattn.attention` comes here for JAX arrays. Each pass (forward, backward) is one XLA call, the same
eager and under ``jit``; the backend is chosen when the call is traced, so errors come before any work:

- CUDA kernels, JAX arrays on a GPU: a ``jax.experimental.buffer_callback`` (JAX 0.7 or newer) lends the
  kernels XLA's own buffers and stream. They read the inputs and write the outputs in place, queued on XLA's
  stream: no copy to the host, no synchronisation, no memory besides XLA's.
- NumPy reference, JAX arrays on the CPU: the same ``buffer_callback``; the reference reads XLA's buffers
  without a copy and its results are written into XLA's outputs.
- The reference, float32 and float64 JAX arrays on a GPU (``backend="reference"``, or where the kernels
  cannot take the inputs): the same ``buffer_callback``; the reference runs in CuPy on XLA's buffers and
  stream, and its results are copied into XLA's outputs on the GPU.
- NumPy reference, other JAX arrays on a GPU (``backend="reference"``, or when the kernels cannot take the
  inputs, which warns), or any without CuPy: ``jax.pure_callback`` copies the inputs to the host and the
  results back.
- JAX older than 0.7, which has no ``buffer_callback``: the reference runs through ``jax.pure_callback``; on
  a GPU the kernels cannot run, and a call raises naming the JAX version needed (``backend="reference"``
  still runs on the host).

A `cusparseattn.dynamic.DynamicLayout` hands its index arrays to each call as operands after the pass's
inputs, so a jitted step takes new indices without tracing again, and eager calls of layouts alike (the same
shapes and static parts) share one XLA call. Under ``vmap`` each
element of the mapped axis is one call (``vmap_method="sequential"``). The log-sum-exp that
``return_lse=True`` returns is not differentiable.

>>> import jax, jax.numpy as jnp
>>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, 64, 16))
>>> loss = lambda q: attention(q, k, v, causal=True).sum()
>>> jax.jit(jax.grad(loss))(q).shape
(1, 2, 64, 16)
"""

from __future__ import annotations

import jax
import numpy as np

from . import backends, call, native_backends, plans, token_groups
from .arrays import NumpyTensor, XlaBuffer, cupy_stream, wrap
from .call import Inputs
from .dynamic import DynamicLayout

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # JAX older than 0.7
    buffer_callback = None

#: The arrays each pass reads, and those the kernels write (stats: the backward's float32 scratch), in the
#: order the XLA call takes and returns them; together, the order of `cuda.forward`'s and `cuda.backward`'s.
_INPUTS = {"forward": ("q", "k", "v"), "backward": ("dout", "q", "k", "v", "out", "lse")}
_KERNEL_OUTPUTS = {"forward": ("out", "lse"), "backward": ("dq", "dk", "dv", "stats")}
_GRADS = ("dq", "dk", "dv")


def attention(
    q, k, v, layout=None, *, causal=False, scale=None, return_lse=False, backend=None, score_mod=None
):
    """Differentiable block-sparse attention on JAX arrays; arguments as in `cusparseattn.attention`.

    >>> import jax.numpy as jnp
    >>> q = k = v = jnp.ones((1, 2, 40, 8), jnp.bfloat16)
    >>> out, lse = attention(q, k, v, return_lse=True)
    >>> out.dtype, lse.dtype, lse.shape
    (dtype(bfloat16), dtype('float32'), (1, 2, 40))
    """
    options = dict(causal=causal, scale=scale, return_lse=return_lse, backend=backend, score_mod=score_mod)
    grouped = token_groups.attend(attention, q, k, v, layout, **options)
    if grouped is not None:
        return grouped
    inputs = call.prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
    # A dynamic layout's index arrays are operands of the XLA calls, read where they run.
    dynamic = isinstance(inputs.layout, DynamicLayout)
    indices = [h.native for h in inputs.layout.holders()] if dynamic else []
    attend = _differentiable(inputs.layout, inputs.scale, inputs.score_mod, backend)
    out, lse = attend(q, k, v, *indices)
    # The lse leaves as a constant, so its cotangent in the backward is always zero.
    lse = jax.lax.stop_gradient(lse)
    return (out, lse) if return_lse else out


def _jax(x, name: str):
    # Inside custom_vjp, JAX may hand over NumPy arrays (constants, cotangents): make them JAX arrays.
    return wrap(x if isinstance(x, (jax.Array, jax.core.Tracer)) else jax.numpy.asarray(x), name)


def _differentiable(layout, scale: float, score_mod, backend: str | None):
    def forward(q, k, v, indices):
        inputs = Inputs(_jax(q, "q"), _jax(k, "k"), _jax(v, "v"), layout, scale, score_mod=score_mod)
        return run(inputs, "forward", backend, indices)

    @jax.custom_vjp
    def attend(q, k, v, *indices):
        return forward(q, k, v, indices)

    def attend_fwd(q, k, v, *indices):
        out, lse = forward(q, k, v, indices)
        return (out, lse), (q, k, v, out, lse, *indices)

    def attend_bwd(saved, cotangents):
        q, k, v, out, lse = (
            _jax(x, name) for name, x in zip(("q", "k", "v", "out", "lse"), saved[:5], strict=True)
        )
        dout = _jax(cotangents[0], "dout")
        inputs = Inputs(q, k, v, layout, scale, dout=dout, out=out, lse=lse, score_mod=score_mod)
        indices = saved[5:]
        return (*run(inputs, "backward", backend, indices), *[None] * len(indices))  # integers: no gradient

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def run(inputs: Inputs, op: str, backend: str | None, indices=()) -> tuple:
    """Run ``op`` (``"forward"`` or ``"backward"``) on JAX arrays or tracers as one XLA call.

    The backend is chosen here, at trace time, on the holders of the arrays or tracers: ``(out, lse)`` or
    ``(dq, dk, dv)`` come back as JAX arrays (tracers inside ``jit``). ``indices``: the native arrays of
    the layout's holders (a `DynamicLayout` traced inside ``jit``), operands after the pass's inputs.
    """
    chosen = backends.select(inputs, op, backend)
    natives = [getattr(inputs, name).native for name in _INPUTS[op]] + list(indices)
    q = inputs.q
    if op == "forward":
        lse_dtype = np.float64 if q.dtype == "float64" else np.float32
        results = (
            jax.ShapeDtypeStruct(q.shape, q.native.dtype),
            jax.ShapeDtypeStruct(q.shape[:3], lse_dtype),
        )
    else:
        results = tuple(jax.ShapeDtypeStruct(h.shape, h.native.dtype) for h in (q, inputs.k, inputs.v))
    if chosen.name == "cuda":
        if buffer_callback is None:
            raise NotImplementedError(
                "cusparseattn runs its CUDA kernels on JAX GPU arrays through "
                f"jax.experimental.buffer_callback, which JAX {jax.__version__} lacks: install JAX 0.7 or "
                "newer, or pass backend='reference' to run the NumPy reference on the host"
            )
        if op == "backward":
            from . import cuda

            # the kernels'; a tracer's device: JAX's default
            scratch = cuda.stats_shape(q.shape, q.device[1], q.dtype)
            results += (jax.ShapeDtypeStruct(scratch, np.float32),)
        call = _Kernels(op, inputs.layout, inputs.scale, inputs.score_mod, q.dtype, inputs.precision)
        outputs = buffer_callback(call, results, vmap_method="sequential")(*natives)
        return tuple(outputs[:3]) if op == "backward" else tuple(outputs)
    if chosen.name != "reference":
        raise NotImplementedError(
            f"backend {chosen.name!r} does not run on JAX arrays; cusparseattn.jax runs 'cuda', 'reference'"
        )
    # The reference runs in place on XLA's buffers where it can (on the CPU, and on a GPU in CuPy), else on
    # host copies.
    on_gpu = native_backends.reference_on_gpu(inputs)
    if buffer_callback is not None and (on_gpu or not inputs.on_gpu):
        in_place = _ReferenceOnGpu if on_gpu else _ReferenceInPlace
        call = in_place(op, inputs.layout, inputs.scale, inputs.score_mod, q.dtype)
        return tuple(buffer_callback(call, results, vmap_method="sequential")(*natives))
    call = _ReferenceOnCopies(op, inputs.layout, inputs.scale, inputs.score_mod, q.dtype)
    return tuple(jax.pure_callback(call, results, *natives, vmap_method="sequential"))


class _Pass:
    """One pass of one call, as the Python function of an XLA call (its subclasses say which kind).

    Two are equal when they run the same pass on the same layout and score mod (the same objects), scale,
    dtype and float32 precision (chosen when the call is traced): JAX compiles an eager call of a primitive
    once per distinct parameters, the function among them, so a fresh closure per call would compile again on
    every eager call.
    """

    def __init__(self, op: str, layout, scale: float, score_mod, dtype: str, precision: str = "high"):
        self.op, self.layout, self.scale, self.score_mod, self.dtype = op, layout, scale, score_mod, dtype
        self.precision = precision

    def _key(self) -> tuple:
        mod = id(self.score_mod)
        layout = self.layout.signature() if isinstance(self.layout, DynamicLayout) else id(self.layout)
        return (type(self), self.op, layout, self.scale, mod, self.dtype, self.precision)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Pass) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def reference(self, holders: list, indices=()) -> tuple:
        """The reference on holders of the pass's inputs, in `_INPUTS` order, and a traced dynamic layout's
        `indices` (its arrays, now with values): its results, native arrays."""
        given = dict(zip(_INPUTS[self.op], holders, strict=True))
        extra = {name: given[name] for name in ("dout", "out", "lse") if name in given}
        layout = self.layout.with_arrays(*indices) if indices else self.layout
        inputs = Inputs(
            given["q"], given["k"], given["v"], layout, self.scale, score_mod=self.score_mod, **extra
        )
        reference = backends.BACKENDS["reference"]
        results = reference.forward(inputs) if self.op == "forward" else reference.backward(inputs)
        return tuple(r.native for r in results)

    def host(self, arrays) -> list[NumpyTensor]:
        return [NumpyTensor(np.asarray(a), name) for name, a in zip(_INPUTS[self.op], arrays, strict=True)]

    def split(self, args) -> tuple[list, list]:
        """An XLA call's operands: the pass's inputs (`_INPUTS`), then a traced dynamic layout's arrays."""
        n = len(_INPUTS[self.op])
        return list(args[:n]), list(args[n:])


class _Kernels(_Pass):
    """For ``buffer_callback`` on a GPU: the kernels read and write XLA's buffers, queued on XLA's stream.

    The backend was chosen when the call was traced; the kernels' passes are planned at the first call of
    each layout of XLA's buffers (their shapes, strides and addresses mod 16, `cusparseattn.plans`), so that
    a jitted step's later calls only launch."""

    def __call__(self, ctx, outputs, *args) -> None:
        args, indices = self.split(args)
        buffers = (*args, *outputs)
        interfaces = [b.__cuda_array_interface__ for b in (*buffers, *indices)]
        addresses = tuple(i["data"][0] for i in interfaces[: len(buffers)])
        device = buffers[0].__dlpack_device__()[1]
        described = (device, *((i["shape"], i.get("strides"), i["data"][0] % 16) for i in interfaces))
        # The key holds self, which holds the layout: no other layout gets its id while the plan is kept.
        launch = plans.kept(("jax", self, described), lambda: self._plan(buffers, ctx.stream))
        # A dynamic layout's passes refill its tables from this call's index buffers.
        layout = None
        if indices:
            held = self.layout.holders()
            layout = self.layout.with_arrays(
                *(XlaBuffer(b, h.name, h.dtype, ctx.stream) for b, h in zip(indices, held, strict=True))
            )
        launch(ctx.stream, addresses, layout)

    def _plan(self, buffers, stream: int):
        """``launch(stream, addresses, layout)``: the kernels' passes for buffers laid out as these are (in
        XLA's order: `_INPUTS`, then `_KERNEL_OUTPUTS`), after a check of the inputs: traced arrays had no
        memory to check when the backend was chosen. XLA's buffers are dense and aligned; the check (the
        outputs are XLA's own) turns a surprise into an error instead of a misaligned access. `layout`: a
        dynamic layout over this call's index buffers, else None."""
        from . import cuda, devices

        names = _INPUTS[self.op] + _KERNEL_OUTPUTS[self.op]
        arrays = {
            name: XlaBuffer(buffer, name, "float32" if name in ("lse", "stats") else self.dtype, stream)
            for name, buffer in zip(names, buffers, strict=True)
        }
        reasons = devices.tensor_reasons(*((name, arrays[name]) for name in _INPUTS[self.op]))
        if reasons:
            raise ValueError("the CUDA kernels cannot read XLA's buffers: " + "; ".join(reasons))
        q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
        options = dict(score_mod=self.score_mod, precision=self.precision, **arrays)
        if self.op == "forward":
            return cuda.Forward(q, k, v, self.layout, self.scale, **options).run_at
        passes, dout = cuda.Backward(q, k, v, self.layout, self.scale, **options), arrays["dout"]
        # XLA's order (dout, q, k, v, out, lse, dq, dk, dv, stats) to the passes' (q, k, v, out, lse, dout,
        # dq, dk, dv, stats)
        return lambda stream, a, layout: passes.run_at(stream, (*a[1:6], a[0], *a[6:]), dout, layout)


class _ReferenceInPlace(_Pass):
    """For ``buffer_callback`` on the CPU: the reference reads XLA's buffers and fills XLA's outputs."""

    def __call__(self, ctx, outputs, *args) -> None:
        args, indices = self.split(args)
        results = self.reference(self.host(args), [np.asarray(a) for a in indices])
        for output, result in zip(outputs, results, strict=True):
            np.asarray(output)[...] = result


class _ReferenceOnGpu(_Pass):
    """For ``buffer_callback`` on a GPU: the reference in CuPy reads XLA's buffers, on XLA's stream, and its
    results are copied into XLA's outputs there (device to device)."""

    def __call__(self, ctx, outputs, *args) -> None:
        # The reference's lse has the working precision: float64 for float64 inputs, else float32.
        lse = "float64" if self.dtype == "float64" else "float32"
        args, indices = self.split(args)
        holders = [
            XlaBuffer(a, name, lse if name == "lse" else self.dtype, ctx.stream)
            for name, a in zip(_INPUTS[self.op], args, strict=True)
        ]
        # Index operands come only with a traced dynamic layout: a static one has no arrays.
        described = self.layout.holders() if indices else []
        indices = [
            XlaBuffer(a, h.name, h.dtype, ctx.stream).cupy() for a, h in zip(indices, described, strict=True)
        ]
        kinds = {"out": self.dtype, "lse": lse} if self.op == "forward" else dict.fromkeys(_GRADS, self.dtype)
        with cupy_stream(holders[0]):
            results = self.reference(holders, indices)
            for output, (name, kind), result in zip(outputs, kinds.items(), results, strict=True):
                XlaBuffer(output, name, kind, ctx.stream).cupy()[...] = result


class _ReferenceOnCopies(_Pass):
    """For ``jax.pure_callback``: the reference on host copies of the inputs, returning its results."""

    def __call__(self, *arrays) -> tuple[np.ndarray, ...]:
        arrays, indices = self.split(arrays)
        return self.reference(self.host(arrays), indices)
