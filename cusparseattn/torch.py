"""PyTorch glue: `attention` on two custom operators, and the `SparseAttention` module.

`cusparseattn.attention` comes here for torch tensors, so it is differentiable. The passes are the operators
``torch.ops.cusparseattn.attention_forward`` (``out, lse``) and ``attention_backward`` (``dq, dk, dv``), each
with a fake implementation (shapes only) and autograd registered through ``torch.library``, so
``torch.compile`` keeps them whole in its graph (``fullgraph=True`` works) while CPU tensors run the NumPy
reference and CUDA tensors the kernels. Outside ``torch.compile``, `attention` runs the same passes through a
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

from . import api, backends, env
from .arrays import FixedTensor, TorchTensor, torch_current_stream, torch_device, torch_dtype_name
from .layout import BlockLayout
from .patterns import Pattern


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
    inputs = api._prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
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


def attention_forward(q, k, v, layout, causal, scale, backend, score_mod) -> tuple:
    """`cusparseattn.attention_forward` on torch tensors outside ``torch.compile``: ``(out, lse)``, not
    differentiable, through eager mode's keyed path (a call that repeats a signature neither validates nor
    chooses again)."""
    return _eager(q, k, v, layout, causal, scale, backend, score_mod, False, False)


# ---- the passes, shared by eager mode and the operators ---------------------------------------------------


def _outputs(holders) -> tuple[torch.Tensor, ...]:
    return tuple(h.native.contiguous() for h in holders)


def _outputs_of(q, k, v, layout, score_mod, scale: float, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the forward, its arguments checked as `attention` checks them."""
    inputs = api._prepare(q, k, v, layout, causal=False, scale=scale, score_mod=score_mod)
    return _outputs(backends.select(inputs, "forward", backend).forward(inputs))


def _gradients(dout, q, k, v, out, lse, layout, score_mod, scale: float, backend):
    """``(dq, dk, dv)``, contiguous, from ``dout``, the gradient of the loss with respect to ``out``."""
    dout = _last_contiguous(dout)
    inputs = api._prepare(
        q, k, v, layout, causal=False, scale=scale, dout=dout, out=out, lse=lse, score_mod=score_mod
    )
    return _outputs(backends.select(inputs, "backward", backend).backward(inputs))


# ---- eager mode --------------------------------------------------------------------------------------------


def _eager(q, k, v, layout, causal, scale, backend, score_mod, recompute, backward):
    """`attention` outside ``torch.compile``: the passes run without the operators' dispatch, and a call that
    repeats an earlier one's signature (`_signature`) neither validates nor chooses again: it reuses what that
    call decided and its backend prepared (`_Call`). The dispatch and those steps had each doubled a call's
    host time, which at S = 4096 exceeded the kernels' time."""
    key = _signature(q, k, v, layout, causal, scale, backend, score_mod, backward)
    call = None if key is None else _calls.get(key)
    resolved = None if call is None else call.layout(layout)
    inputs = None  # the holders, made here only for a call that validates
    if resolved is None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(_not_a_tensor(name, f"{type(x).__module__}.{type(x).__qualname__}"))
        inputs, chosen = _checked(q, k, v, layout, causal, scale, score_mod, backend, backward)
        call, resolved = _Call(inputs, chosen, backend, layout), inputs.layout
        if key is not None:
            call.keep(key)
    if not backward:
        return call.forward(q, k, v, resolved, inputs)
    return _Attention.apply(q, k, v, call, resolved, inputs, recompute)


_SCALES = (type(None), float, int)


def _signature(q, k, v, layout, causal, scale, backend, score_mod, backward) -> tuple | None:
    """The key of what validation and backend choice read from a call: the arguments, each tensor's shape,
    strides, dtype, device and address mod 16, the backends enabled here and the switches that choose kernels
    (the Hopper kernels, the fused backward, the order of its dQ adds). None for a call that cannot be keyed:
    a score mod or a mask function (what they capture may change between calls), tensor subclasses, arguments
    that validation will refuse."""
    if score_mod is not None or type(causal) is not bool or type(scale) not in _SCALES:
        return None
    if not (layout is None or isinstance(layout, (BlockLayout, Pattern))):
        return None
    if not (backend is None or isinstance(backend, (str, backends.Backend))):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    switches = (env.hopper(), env.fused_backward(), env.deterministic())
    arguments = (id(layout), causal, scale, backend, backward, backends.state(), switches)
    return arguments + _descriptions((q, k, v))


# Keyed calls by `_signature`, the oldest first; a call goes when its layout does.
_calls: dict[tuple, _Call] = {}
_CALLS_KEPT = 64
_calls_lock = threading.Lock()
_UNSET = object()


class _Call:
    """What an eager call decided, for the calls that repeat its signature: the layout and scale it resolved,
    the backend it chose and what that backend prepared (the forward now, with its `_Direct` launch where it
    has one; the backward at the first forward that autograd records). It holds its layouts weakly: kept
    calls must not keep layouts and their device tables alive."""

    def __init__(self, inputs: backends.Inputs, chosen: backends.Backend, backend, layout_arg):
        self.scale, self.score_mod = inputs.scale, inputs.score_mod
        self.chosen, self.backend = chosen, backend
        self._layout = weakref.ref(inputs.layout)
        self._arg = None if layout_arg is None else weakref.ref(layout_arg)  # its id is in the key
        self._forward = chosen.prepare_forward(inputs)
        self._direct = _Direct.of(None if self._forward is None else self._forward.direct())
        self._backward = _UNSET
        self._kinds = tuple(_kind(h) for h in (inputs.q, inputs.k, inputs.v))

    def keep(self, key: tuple) -> None:
        with _calls_lock:
            _calls[key] = self
            while len(_calls) > _CALLS_KEPT:
                del _calls[next(iter(_calls))]
        weakref.finalize(self._layout(), _calls.pop, key, None)

    def layout(self, layout_arg) -> BlockLayout | None:
        """The layout this call resolved when `layout_arg` is the argument it was made for; None when it was
        another object of the same id or the layout is gone."""
        layout = self._layout()
        if layout is None or (self._arg is None) != (layout_arg is None):
            return None
        if self._arg is not None and self._arg() is not layout_arg:
            return None
        return layout

    def inputs(self, q, k, v, layout: BlockLayout) -> backends.Inputs:
        """This call's `Inputs` over other tensors of its signature."""
        # Described as this call's were: the signature says so.
        kq, kk, kv = self._kinds
        hq, hk, hv = (
            TorchTensor.known(q, "q", *kq),
            TorchTensor.known(k, "k", *kk),
            TorchTensor.known(v, "v", *kv),
        )
        return backends.Inputs(hq, hk, hv, layout, self.scale, score_mod=self.score_mod)

    def forward(self, q, k, v, layout: BlockLayout, inputs=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of tensors of this call's signature: launched directly where the backend can, else
        on `inputs` (the holders the call validated; made now if None)."""
        if self._direct is not None:
            out, lse, *_ = self._direct(q, k, v)  # and the scratch, if any
            return out, lse
        inputs = self.inputs(q, k, v, layout) if inputs is None else inputs
        return _outputs(self.chosen.forward(inputs) if self._forward is None else self._forward.run(inputs))

    def prepared_backward(self, q, k, v, layout: BlockLayout, out, lse, inputs=None) -> _Prepared | None:
        if self._backward is _UNSET:
            inputs = self.inputs(q, k, v, layout) if inputs is None else inputs
            self._backward = _Prepared.make(inputs, out, lse, self.backend)
        return self._backward


class _Direct:
    """A backend's `backends.Direct` launch on torch tensors: its arrays from PyTorch's allocator, the launch
    on PyTorch's current stream of the GPU. Calling it with the call's tensors returns the arrays it made."""

    def __init__(self, direct: backends.Direct):
        self._device, self._index = torch.device("cuda", direct.device), direct.device
        self._made = tuple((shape, getattr(torch, dtype)) for shape, dtype in direct.made)
        self._launch = direct.launch

    @classmethod
    def of(cls, direct: backends.Direct | None) -> _Direct | None:
        return None if direct is None else cls(direct)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        device = self._device
        made = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._made]
        self._launch(torch_current_stream(self._index), tuple(t.data_ptr() for t in (*tensors, *made)))
        return made


class _Attention(torch.autograd.Function):
    """Eager mode's autograd node (under ``torch.compile``, the operators' registered autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, call, layout, inputs, recompute):
        out, lse = call.forward(q, k, v, layout, inputs)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse has no gradient: no zero-filled tensor for it
        # The layout and score mod live as long as the graph that needs them.
        ctx.layout, ctx.score_mod, ctx.scale = layout, call.score_mod, call.scale
        ctx.backend, ctx.recompute = call.backend, recompute
        ctx.save_for_backward(*((q, k, v) if recompute else (q, k, v, out, lse)))
        ctx.prepared = None if recompute else call.prepared_backward(q, k, v, layout, out, lse, inputs)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if dout is None:  # an undefined gradient of out (torch.autograd.grad may pass one): no gradients
            return (None,) * 7
        dout = _last_contiguous(dout)
        q, k, v, *saved = ctx.saved_tensors
        grads = ctx.prepared and ctx.prepared.gradients(dout, (q, k, v, *saved), ctx)
        if not grads:
            args = (ctx.layout, ctx.score_mod, ctx.scale, ctx.backend)
            if ctx.recompute:
                saved = _outputs_of(q, k, v, *args)
            grads = _gradients(dout, q, k, v, *saved, *args)
        return *grads, None, None, None, None


_SAVED = ("q", "k", "v", "out", "lse")


class _Prepared:
    """Eager mode's backward for one call signature, prepared in its first forward
    (`Backend.prepare_backward`): the backward, which PyTorch runs on its autograd thread, then goes from
    dout to its first launch without validating and choosing again. It is used when autograd hands back
    tensors described as the forward's were (a saved-tensor hook may hand back others) and the backend
    accepts dout; otherwise the backward takes the usual path. The backend is chosen under the forward's
    `use_backends`."""

    def __init__(self, prepared: backends.PreparedBackward, holders):
        self.prepared = prepared
        self.saved = _descriptions(h.native for h in holders)
        self._kinds = tuple(_kind(h) for h in holders)
        # The last dout accepted: (description, kind, its `_Direct` launch or None).
        self._dout = None

    @classmethod
    def make(cls, inputs: backends.Inputs, out, lse, backend) -> _Prepared | None:
        """For the forward's `inputs` and its outputs `out`, `lse` (the tensors autograd saves)."""
        out, lse = TorchTensor(out, "out"), TorchTensor(lse, "lse")
        # out stands in for dout, which will have its shape, dtype and device: `accepts` checks the rest.
        backward = backends.Inputs(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.layout,
            inputs.scale,
            score_mod=inputs.score_mod,
            out=out,
            lse=lse,
            dout=out,
        )
        try:
            chosen, _ = backends.choose(backward, "backward", backend)
        except ValueError:  # the backward raises it, with its own arguments
            return None
        prepared = chosen.prepare_backward(backward)
        return None if prepared is None else cls(prepared, (inputs.q, inputs.k, inputs.v, out, lse))

    def gradients(self, dout: torch.Tensor, tensors, ctx) -> tuple | None:
        """``(dq, dk, dv)`` from the saved `tensors` (q, k, v, out, lse) and the layout, scale and score mod
        of the forward's `ctx`; None when they or dout are not what this backward was prepared for."""
        if _descriptions(tensors) != self.saved:
            return None
        # A backend's answer depends on dout's description alone (`PreparedBackward.accepts`).
        (described,) = _descriptions((dout,))
        accepted = self._dout
        if accepted is None or accepted[0] != described:
            holder = TorchTensor(dout, "dout")
            if not self.prepared.accepts(holder):
                return None
            accepted = self._dout = (described, _kind(holder), _Direct.of(self.prepared.direct(holder)))
        if accepted[2] is not None:
            dq, dk, dv, *_ = accepted[2](*tensors, dout)  # and the scratch
            return dq, dk, dv
        q, k, v, out, lse = (
            TorchTensor.known(t, n, *kind) for t, n, kind in zip(tensors, _SAVED, self._kinds, strict=True)
        )
        holder = TorchTensor.known(dout, "dout", *accepted[1])
        inputs = backends.Inputs(
            q, k, v, ctx.layout, ctx.scale, score_mod=ctx.score_mod, dout=holder, out=out, lse=lse
        )
        return _outputs(self.prepared.run(inputs))


def _kind(holder) -> tuple:
    """What `TorchTensor.known` takes of a holder: shape, strides, dtype name, device."""
    return holder.shape, holder.strides, holder.dtype, holder.device


def _descriptions(tensors) -> tuple:
    """How each tensor is laid out, with its address mod 16: what the kernels' choice and copies depend on."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


def _last_contiguous(dout: torch.Tensor) -> torch.Tensor:
    # e.g. the stride-0 ones that out.sum().backward() sends
    return dout if dout.stride(-1) == 1 else dout.contiguous()


# ---- the operators -----------------------------------------------------------------------------------------


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("cusparseattn::attention_forward", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout_key: int,
    score_key: int,
    scale: float,
    backend: str | None,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``, contiguous. ``recompute`` changes only what autograd saves for the backward."""
    return _outputs_of(q, k, v, _OBJECTS.get(layout_key), _OBJECTS.get(score_key), scale, backend)


@_forward.register_fake
def _forward_fake(q, k, v, layout_key, score_key, scale, backend, recompute):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cusparseattn::attention_backward", mutates_args=())
def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout_key: int,
    score_key: int,
    scale: float,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, contiguous, from ``dout``, the gradient of the loss with respect to ``out``."""
    layout, score_mod = _OBJECTS.get(layout_key), _OBJECTS.get(score_key)
    return _gradients(dout, q, k, v, out, lse, layout, score_mod, scale, backend)


@_backward.register_fake
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


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


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
