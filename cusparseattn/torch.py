"""PyTorch glue: `attention` on two custom operators, and the `SparseAttention` module.

`cusparseattn.attention` comes here for torch tensors, so it is differentiable. The passes are the operators
``torch.ops.cusparseattn.attention_forward`` (``out, lse``) and ``attention_backward`` (``dq, dk, dv``), each
with a fake implementation (shapes only) and autograd registered through ``torch.library``, so
``torch.compile`` keeps them whole in its graph (``fullgraph=True`` works) while CPU tensors run the NumPy
reference and CUDA tensors the kernels (float32 and float64 ones the reference in CuPy, on their GPU, through
DLPack and on torch's current stream). Outside ``torch.compile``, `attention` runs the same passes through a
``torch.autograd.Function``: the operators' dispatch costs host time that a short call cannot hide.

The forward saves ``q, k, v, out, lse`` for the backward; ``recompute=True`` saves only ``q, k, v`` and runs
the forward again in the backward (less memory held between the passes, one more forward). The log-sum-exp
that ``return_lse=True`` returns is not differentiable.

An operator takes tensors, numbers and strings, not layouts: `attention` validates its arguments, picks
the layout for these lengths and hands the operators an integer key of a process-wide registry that holds
layouts by weak reference. The same layout always gets the same key, so a compiled graph sees a constant.

>>> import torch
>>> from cusparseattn import patterns
>>> q = torch.randn(1, 2, 64, 16, dtype=torch.float64, requires_grad=True)
>>> k, v = torch.randn(2, 1, 2, 64, 16, dtype=torch.float64)
>>> out = attention(q, k, v, patterns.causal(block=16))
>>> out.sum().backward()
>>> q.grad.shape
torch.Size([1, 2, 64, 16])
"""

from __future__ import annotations

import ctypes
import itertools
import math
import numbers
import operator
import threading
import weakref
from typing import NoReturn

import torch

from . import backends, call, plans, token_groups
from .arrays import FixedTensor, torch_device, torch_dtype_name


class _Registry:
    """Integer keys for layouts and score mods, which custom operators cannot take as arguments.

    An object keeps its key while it lives (the same object, the same key: a compiled graph that holds the
    key as a constant stays valid); the registry holds it weakly, so an object nobody else holds is dropped.
    Keys are never reused; -1 stands for None.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._keys: dict[int, int] = {}  # id(object) -> key, while the object lives
        self._objects: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()

    def key(self, obj) -> int:
        if obj is None:
            return -1
        with self._lock:
            key = self._keys.get(id(obj))
            if key is None or self._objects.get(key) is not obj:
                key = next(self._count)
                self._keys[id(obj)] = key
                self._objects[key] = obj
                # Runs as the object dies, before its id can be reused; pop() needs no lock (atomic).
                weakref.finalize(obj, self._keys.pop, id(obj), None)
            return key

    def get(self, key: int):
        if key == -1:
            return None
        obj = self._objects.get(key)
        if obj is None:
            raise RuntimeError(
                f"cusparseattn: key {key} names no live layout or score mod; keys come from "
                "cusparseattn.torch.attention, which keeps each object alive as long as the autograd graph "
                "or compiled code that uses it"
            )
        return obj

    def __len__(self) -> int:
        return len(self._objects)


_OBJECTS = _Registry()


class _Described(FixedTensor):
    """A torch tensor known by its metadata alone, which is all validation and backend choice read.

    Like a traced JAX array it has no memory to check (alignment): the operator checks the real tensors.
    """

    framework = "torch"
    traced = True

    def __init__(self, name, shape, strides, dtype, device):
        super().__init__(None, name, shape, strides, torch_dtype_name(dtype), torch_device(device))


_BY_ID = "cusparseattn:object-id"


def _by_reference(x):
    """``x`` as an argument that `_plan` can take under ``torch.compile``: a plain constant as it is, any
    other object (a layout, a pattern, a function) by its ``id``, which dynamo turns into a constant guarded
    on the object's identity. Older dynamo (PyTorch 2.11) cannot pass the objects themselves as constants."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return (_BY_ID, id(x))


def _dereference(x):
    """The object of a `_by_reference` argument. `_plan` runs while its caller holds the object, so the id
    names a live object."""
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _BY_ID:
        return ctypes.cast(x[1], ctypes.py_object).value
    return x


def _describe(t):
    """``t``'s shape, strides, dtype and device as plain constants (a non-tensor by its type's name).

    ``operator.index`` makes ``torch.compile`` specialise dynamic sizes here: a layout is built for one pair
    of lengths, so the graph is too.
    """
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__module__}.{type(t).__qualname__}"
    shape = tuple(operator.index(n) for n in t.shape)
    strides = tuple(operator.index(s) for s in t.stride())
    return shape, strides, t.dtype, t.device


@torch.compiler.assume_constant_result
def _plan(layout, score_mod, causal, backend, backward, q, k, v):
    """Validate one call from its arguments and tensor descriptions: ``(layout key, score mod key, default
    scale, (layout, score mod), error)``, where ``error`` is None or the ``(exception type name, message)``
    that the caller raises.

    ``torch.compile`` runs this once while it traces (the result depends on the arguments alone, which it
    guards) and keeps the result, whose layout and score mod then live as long as the compiled code. The
    caller raises the error so that it is an exception of the traced code, which eager PyTorch then raises
    as it is.
    """
    try:
        holders = []
        for name, x in (("q", q), ("k", k), ("v", v)):
            if isinstance(x, str):
                raise TypeError(_not_a_tensor(name, x))
            holders.append(_Described(name, *x))
        layout, score_mod = _dereference(layout), _dereference(score_mod)
        inputs, _ = _checked(*holders, layout, causal, None, score_mod, backend, backward)
    except (TypeError, ValueError) as err:
        return None, None, None, None, ("TypeError" if isinstance(err, TypeError) else "ValueError", str(err))
    held = (inputs.layout, inputs.score_mod)
    return _OBJECTS.key(inputs.layout), _OBJECTS.key(inputs.score_mod), inputs.scale, held, None


def _checked(q, k, v, layout, causal, scale, score_mod, backend, backward: bool):
    """One call's validated `Inputs` and the backend that runs its forward; a forced backend must also be able
    to run the backward when there will be one: say so now, not in the backward."""
    inputs = call.prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
    chosen = backends.select(inputs, "forward", backend)
    if backend is not None and backward:
        backends.select(inputs, "backward", backend)
    return inputs, chosen


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


@torch.compiler.disable
def _raise(kind: str, message: str) -> NoReturn:
    """Raise ``_ERRORS[kind](message)`` outside the traced code: PyTorch 2.11's dynamo, seeing a raise in the
    code it traces, stops compiling that function for good, and then traces its callees (the eager path)."""
    raise _ERRORS[kind](message)


def _not_a_tensor(name: str, type_name: str) -> str:
    why = "cusparseattn.attention takes arrays of any framework"
    return f"{name} must be a torch.Tensor, got {type_name}; {why}"


def _scale(scale, default: float) -> float:
    """``scale`` checked, or ``default`` for None. Traceable also where ``torch.compile`` has made a float
    argument symbolic (it changed between calls), which `_plan` could not take.
    """
    if scale is None:
        return default
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        got = type(scale).__qualname__
        _raise("TypeError", f"scale must be a real number or None (1/sqrt(D)), got {got}")
    if not -math.inf < scale < math.inf:
        _raise("ValueError", f"scale must be finite, got {scale!r}")
    return float(scale)


def attention(
    q,
    k,
    v,
    layout=None,
    *,
    causal=False,
    scale=None,
    return_lse=False,
    backend=None,
    score_mod=None,
    recompute=False,
):
    """Differentiable block-sparse attention on torch tensors; arguments as in `cusparseattn.attention`.

    ``recompute=True`` keeps only ``q, k, v`` for the backward and recomputes ``out`` and ``lse`` there.
    Works inside ``torch.compile`` without a graph break.

    >>> import torch
    >>> q = k = v = torch.randn(1, 4, 50, 8)
    >>> out, lse = attention(q, k, v, causal=True, return_lse=True)
    >>> out.dtype, lse.dtype, lse.shape
    (torch.float32, torch.float32, torch.Size([1, 4, 50]))
    """
    backward = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
    )
    if not torch.compiler.is_compiling():
        # A per-token layout whose KV group shares the selection runs the kernels over grouped rows.
        options = dict(causal=causal, scale=scale, backend=backend, score_mod=score_mod, recompute=recompute)
        grouped = token_groups.attend(attention, q, k, v, layout, return_lse=return_lse, **options)
        if grouped is not None:
            return grouped
        out, lse = _eager(q, k, v, layout, causal, scale, backend, score_mod, recompute, backward)
        return (out, lse) if return_lse else out
    layout_key, score_key, default_scale, _, error = _plan(
        _by_reference(layout),
        _by_reference(score_mod),
        causal,
        backend,
        backward,
        _describe(q),
        _describe(k),
        _describe(v),
    )
    if error is not None:
        _raise(*error)
    scale = _scale(scale, default_scale)
    out, lse = torch.ops.cusparseattn.attention_forward(
        q, k, v, layout_key, score_key, scale, backend, recompute
    )
    return (out, lse) if return_lse else out


def compiling() -> bool:
    return torch.compiler.is_compiling()


# ---- the passes, shared by eager mode and the operators ---------------------------------------------------


def _contiguous(results) -> tuple[torch.Tensor, ...]:
    return tuple(r.contiguous() for r in results)


def _outputs_of(q, k, v, layout, score_mod, scale: float, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the forward, through its plan (`cusparseattn.plans`)."""
    plan = plans.forward(q, k, v, layout, scale=scale, backend=backend, score_mod=score_mod)
    return _contiguous(plan.run(q, k, v))


def _gradients(dout, q, k, v, out, lse, layout, score_mod, scale: float, backend):
    """``(dq, dk, dv)``, contiguous, from ``dout``, the gradient of the loss with respect to ``out``."""
    dout = _last_contiguous(dout)
    plan = plans.backward(dout, q, k, v, out, lse, layout, scale=scale, backend=backend, score_mod=score_mod)
    return _contiguous(plan.run(dout, q, k, v, out, lse))


# ---- eager mode --------------------------------------------------------------------------------------------


def _eager(q, k, v, layout, causal, scale, backend, score_mod, recompute, backward):
    """`attention` outside ``torch.compile``: the call's plan (`cusparseattn.plans`: a call that repeats a
    signature neither validates nor chooses again) runs without the operators' dispatch, which had doubled a
    call's host time."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(_not_a_tensor(name, f"{type(x).__module__}.{type(x).__qualname__}"))
    plan = plans.forward(
        q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod, backward=backward
    )
    if not backward:
        return plan.run(q, k, v)
    return _Attention.apply(q, k, v, plan, recompute)


class _Attention(torch.autograd.Function):
    """Eager mode's autograd node (under ``torch.compile``, the operators' registered autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, recompute):
        out, lse = plan.run(q, k, v)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse has no gradient: no zero-filled tensor for it
        # The plan holds the layout and score mod as long as the graph that needs them.
        ctx.plan, ctx.recompute = plan, recompute
        ctx.save_for_backward(*((q, k, v) if recompute else (q, k, v, out, lse)))
        ctx.prepared = None if recompute else plan.backward_plan(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if dout is None:  # an undefined gradient of out (torch.autograd.grad may pass one): no gradients
            return (None,) * 5
        dout = _last_contiguous(dout)
        q, k, v, *saved = ctx.saved_tensors
        grads = ctx.prepared and ctx.prepared.gradients(dout, q, k, v, *saved)
        if not grads:
            plan = ctx.plan
            args = (plan.layout, plan.score_mod, plan.scale, plan.backend)
            if ctx.recompute:
                saved = _outputs_of(q, k, v, *args)
            grads = _gradients(dout, q, k, v, *saved, *args)
        return *grads, None, None


def _last_contiguous(dout: torch.Tensor) -> torch.Tensor:
    # e.g. the stride-0 ones that out.sum().backward() sends
    return dout if dout.stride(-1) == 1 else dout.contiguous()


# ---- the operators -----------------------------------------------------------------------------------------


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Defined through `torch.library.Library` with one kernel for every device, not `torch.library.custom_op`,
# whose per-call wrappers (an aliasing check and a dynamo guard around the kernel) cost more host time than
# a short call's kernels take.
_LIB = torch.library.Library("cusparseattn", "DEF")
_LIB.define(
    "attention_forward(Tensor q, Tensor k, Tensor v, int layout_key, int score_key, float scale, "
    "str? backend, bool recompute) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, int layout_key, "
    "int score_key, float scale, str? backend) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _forward(q, k, v, layout_key: int, score_key: int, scale: float, backend, recompute: bool):
    """``(out, lse)``, contiguous. ``recompute`` changes only what autograd saves for the backward."""
    return _outputs_of(q, k, v, _OBJECTS.get(layout_key), _OBJECTS.get(score_key), scale, backend)


def _forward_fake(q, k, v, layout_key, score_key, scale, backend, recompute):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


def _backward(dout, q, k, v, out, lse, layout_key: int, score_key: int, scale: float, backend):
    """``(dq, dk, dv)``, contiguous, from ``dout``, the gradient of the loss with respect to ``out``."""
    layout, score_mod = _OBJECTS.get(layout_key), _OBJECTS.get(score_key)
    return _gradients(dout, q, k, v, out, lse, layout, score_mod, scale, backend)


def _backward_fake(dout, q, k, v, out, lse, layout_key, score_key, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, layout_key, score_key, scale, backend, recompute = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    # lse has no gradient: no zero-filled tensor for it on every backward (an allocation and a fill kernel).
    ctx.set_materialize_grads(False)
    ctx.args, ctx.recompute = (layout_key, score_key, scale, backend), recompute
    # Keeps the layout and score mod alive until the backward has run.
    ctx.held = (_OBJECTS.get(layout_key), _OBJECTS.get(score_key))
    ctx.save_for_backward(*((q, k, v) if recompute else (q, k, v, out, lse)))


def _autograd_backward(ctx, dout, _dlse):
    if dout is None:  # an undefined gradient of out (torch.autograd.grad may pass one): no gradients
        return None, None, None, None, None, None, None, None
    q, k, v, *saved = ctx.saved_tensors
    if ctx.recompute:
        saved = torch.ops.cusparseattn.attention_forward(q, k, v, *ctx.args, False)
    dq, dk, dv = torch.ops.cusparseattn.attention_backward(dout, q, k, v, *saved, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


for _name, _kernel, _fake in (
    ("attention_forward", _forward, _forward_fake),
    ("attention_backward", _backward, _backward_fake),
):
    _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cusparseattn::{_name}", _fake, lib=_LIB)
torch.library.register_autograd(
    "cusparseattn::attention_forward", _autograd_backward, setup_context=_setup_context, lib=_LIB
)


class SparseAttention(torch.nn.Module):
    """A drop-in attention module holding its layout: ``forward(q, k, v)`` on ``[B, H, S, D]`` tensors.

    ``layout`` is None (dense), a Pattern (built for each call's lengths, cached by the pattern) or a
    BlockLayout; the other arguments as in `attention`.

    >>> import torch
    >>> from cusparseattn import patterns
    >>> attn = SparseAttention(patterns.local(window=32, block=16))
    >>> attn(*torch.randn(3, 2, 4, 100, 16)).shape
    torch.Size([2, 4, 100, 16])
    """

    def __init__(
        self, layout=None, *, causal=False, scale=None, backend=None, score_mod=None, recompute=False
    ):
        super().__init__()
        self.layout, self.causal, self.scale = layout, causal, scale
        self.backend, self.score_mod, self.recompute = backend, score_mod, recompute

    def forward(self, q, k, v):
        return attention(
            q,
            k,
            v,
            self.layout,
            causal=self.causal,
            scale=self.scale,
            backend=self.backend,
            score_mod=self.score_mod,
            recompute=self.recompute,
        )

    def extra_repr(self) -> str:
        return (
            f"layout={self.layout!r}, causal={self.causal}, scale={self.scale}, backend={self.backend!r}, "
            f"score_mod={self.score_mod!r}, recompute={self.recompute}"
        )
