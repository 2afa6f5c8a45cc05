"""The plan of a call: what validation, backend choice and the backend's preparation decided for one call
signature, so that a call that repeats the signature only makes its outputs and launches.

A signature is everything those steps read: each array's shape, strides, dtype, device and address mod 16
(`cusparseattn.arrays.signature`), the layout and the score mod by identity, causal, scale, the backend
asked for, the backends enabled here (`cusparseattn.backends.state`) and the switches that choose kernels.
A mask function or a score function is first resolved to the Pattern or ScoreMod that its captured values
give (`cusparseattn.captures.EnvironmentCache`: the same function with unchanged captures, the same object),
so those are keyed too. A dynamic layout on a GPU, a new object at every step, is keyed by what its plan
depends on (`DynamicLayout.plan_key`: its static parts by identity, its arrays' signatures), and a plan found
so runs over the call's arrays (`ForwardPlan.rebound`). Every path looks its plan up here: eager PyTorch
(`cusparseattn.torch`), its ``torch.compile`` operators, CuPy and NumPy arrays (`cusparseattn.api`), JAX's
XLA calls (`cusparseattn.jax`) and ring attention's steps. A miss is the only place that validates, chooses a
backend, builds tables or schedules; `builds` counts them.

A plan holds what its key names by identity (the layout or pattern argument, the score mod), so no id in a
kept key is reused; the last `KEPT` plans are kept.

>>> import numpy as np
>>> q = np.ones((1, 2, 64, 16), np.float32)
>>> before = builds()
>>> plan = forward(q, q, q, None, causal=True)
>>> forward(q, q, q, None, causal=True) is plan, builds() - before
(True, 1)
>>> out, lse = plan.run(q, q, q)
>>> out.shape, lse.shape
((1, 2, 64, 16), (1, 2, 64))
"""

from __future__ import annotations

import copy
import threading

from . import backends, call, env, mods
from .arrays import allocator, known, signature, wrap
from .call import Inputs
from .dynamic import DynamicLayout
from .layout import BlockLayout
from .patterns import Pattern
from .recent import Recent

KEPT = 64

_plans = Recent(KEPT)
_lock = threading.Lock()  # for the count of builds
_built = 0


def builds() -> int:
    """How many plans were made in this process: a call that repeats a signature makes none."""
    return _built


def _count() -> None:
    global _built
    with _lock:
        _built += 1


def kept(key: tuple, make):
    """The plan kept under ``key``, or ``make()``'s, kept (the last `KEPT`) and counted in `builds`."""
    plan = _plans.get(key)
    if plan is not None:
        return plan
    plan = make()
    _count()
    return _plans.put(key, plan)


def clear() -> None:
    """Forget every kept plan (their layouts' device tables go with the layouts)."""
    _plans.clear()


_SCALES = (type(None), float, int)
_NOT_KEYED = object()


def _keyed_layout(layout, shape):
    """The object a layout argument is keyed by: itself, or for a mask function the Pattern its captures give
    (`call.mask_pattern`); `_NOT_KEYED` when it is neither."""
    if layout is None or isinstance(layout, (Pattern, BlockLayout, DynamicLayout)):
        return layout
    if callable(layout) and len(shape) == 4:
        try:
            return call.mask_pattern(layout, shape[0], shape[1])
        except Exception:  # the validation of the miss raises it, with its arguments
            return _NOT_KEYED
    return _NOT_KEYED


def _keyed_mod(score_mod):
    if score_mod is None:
        return None
    try:
        return mods.score_mod(score_mod)
    except Exception:  # as for layouts
        return _NOT_KEYED


def _signature(op: str, arrays, layout, causal, scale, backend, score_mod, backward: bool, q: int = 0):
    """``(key, layout, score_mod)``: the signature of a call (None where it cannot be keyed: arrays that are
    not plain NumPy, CuPy or torch arrays, arguments that validation will refuse), and the layout argument
    and score mod as resolved for it. ``q``: q's place among the arrays."""
    described = tuple(signature(x) for x in arrays)
    if None in described or type(causal) is not bool or type(scale) not in _SCALES:
        return None, layout, score_mod
    if not (backend is None or isinstance(backend, (str, backends.Backend))):
        return None, layout, score_mod
    keyed, mod = _keyed_layout(layout, described[q][0]), _keyed_mod(score_mod)
    if keyed is _NOT_KEYED or mod is _NOT_KEYED:
        return None, layout, score_mod
    # float32's precision (call.float32_precision) follows a framework's switch: the q's framework's.
    precision = call.float32_precision(type(arrays[q]).__module__.split(".")[0])
    switches = (env.hopper(), env.fused_backward(), env.deterministic(), precision)
    # A dynamic layout on a GPU is a new object at every step: keyed by what its plan depends on.
    by = (keyed.plan_key() if isinstance(keyed, DynamicLayout) else None) or id(keyed)
    key = (op, by, causal, scale, backend, id(mod), backward, backends.state(), switches, described)
    return key, keyed, mod


def _rebound(plan, layout):
    """`plan` for this call's layout: a plan of a dynamic layout's signature over this call's arrays."""
    if isinstance(layout, DynamicLayout) and plan.held[0] is not layout:
        return plan.rebound(layout)
    return plan


def forward(q, k, v, layout=None, *, causal=False, scale=None, backend=None, score_mod=None, backward=False):
    """The `ForwardPlan` of a call with these arguments (as `cusparseattn.attention_forward` takes them).
    ``backward``: an autograd graph will run the backward, so a forced backend must be able to: said now."""
    key, layout, score_mod = _signature(
        "forward", (q, k, v), layout, causal, scale, backend, score_mod, backward
    )

    def make():
        inputs = call.prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod)
        chosen = backends.select(inputs, "forward", backend)
        if backend is not None and backward:
            backends.select(inputs, "backward", backend)
        return ForwardPlan(inputs, chosen, backend, held=(layout, score_mod), backward=backward)

    if key is None:
        _count()
        return make()
    return _rebound(kept(key, make), layout)


def backward(dout, q, k, v, out, lse, layout=None, *, causal=False, scale=None, backend=None, score_mod=None):
    """The `BackwardPlan` of a call with these arguments (as `cusparseattn.attention_backward` takes them)."""
    arrays = (dout, q, k, v, out, lse)
    key, layout, score_mod = _signature(
        "backward", arrays, layout, causal, scale, backend, score_mod, True, 1
    )

    def make():
        inputs = call.prepare(
            q, k, v, layout, causal=causal, scale=scale, dout=dout, out=out, lse=lse, score_mod=score_mod
        )
        return BackwardPlan(inputs, backends.select(inputs, "backward", backend), held=(layout, score_mod))

    if key is None:
        _count()
        return make()
    return _rebound(kept(key, make), layout)


def _kind(holder) -> tuple:
    """What `arrays.known` takes of a holder: shape, strides, dtype name, device."""
    return holder.shape, holder.strides, holder.dtype, holder.device


class _Launch:
    """A backend's `backends.Direct` launch on arrays of a framework that makes its own (torch, CuPy): the
    arrays it makes from that framework's allocator, the launch on its current stream of the GPU. Called with
    the call's arrays, it returns those it made (the outputs first)."""

    def __init__(self, direct: backends.Direct, allocator):
        self._device, self._made, self._launch = direct.device, direct.made, direct.launch
        self._address, self._make, self._stream = allocator

    @classmethod
    def of(cls, direct: backends.Direct | None, framework: str) -> _Launch | None:
        made_by = None if direct is None else allocator(framework)
        return None if made_by is None else cls(direct, made_by)

    def __call__(self, *arrays) -> list:
        device, address = self._device, self._address
        made = self._make(self._made, device)
        self._launch(self._stream(device), tuple(address(a) for a in (*arrays, *made)))
        return made


class ForwardPlan:
    """A forward's plan: the layout, scale and score mod its call resolved, the backend chosen and what that
    backend prepared (with a `_Launch` over raw addresses where it has one). `run` takes arrays of the
    plan's signature; `backward_plan` makes the backward's, once, at the first forward that autograd
    records. `backward`: autograd will run the backward, whose preparation the backend may start beside the
    forward's (`backends.Backend.prefetch_backward`)."""

    def __init__(self, inputs: Inputs, chosen: backends.Backend, backend, held: tuple, backward=False):
        self.layout, self.scale, self.score_mod = inputs.layout, inputs.scale, inputs.score_mod
        self.chosen, self.backend, self.held = chosen, backend, held
        self.framework = inputs.framework
        self._kinds = tuple(_kind(h) for h in (inputs.q, inputs.k, inputs.v))
        if backward:
            chosen.prefetch_backward(inputs)
        self._prepared = chosen.prepare_forward(inputs)
        self._launch = _Launch.of(self._prepared and self._prepared.direct(), self.framework)
        self._backward = None
        self._backward_made = False
        self._base = self  # the plan that makes the backward's (`rebound` shares it)

    def rebound(self, layout: DynamicLayout) -> ForwardPlan:
        """This plan over another dynamic layout of its signature (`DynamicLayout.plan_key`): its arrays in
        place of those the plan was made with, the same static parts and preparation."""
        view = copy.copy(self)
        view.layout = _with_arrays(self.layout, layout)
        view.held = (layout, self.score_mod)
        return view

    def inputs(self, q, k, v) -> Inputs:
        """This plan's `Inputs` over arrays of its signature."""
        holders = (known(x, name, *kind) for x, name, kind in zip((q, k, v), "qkv", self._kinds, strict=True))
        return Inputs(*holders, self.layout, self.scale, score_mod=self.score_mod)

    def run(self, q, k, v) -> tuple:
        """``(out, lse)``, native arrays of the caller's framework, for arrays of this plan's signature."""
        if self._launch is not None:
            out, lse, *_ = self._launch(q, k, v)  # and the scratch, if any
            return out, lse
        inputs = self.inputs(q, k, v)
        results = self._prepared.run(inputs) if self._prepared else self.chosen.forward(inputs)
        return tuple(r.native for r in results)

    def backward_plan(self, q, k, v, out, lse) -> BackwardPlan | None:
        """The backward of this plan's calls, made at the first call (before its dout exists: the forward's
        out stands in for it), for ``out`` and ``lse`` as this forward makes them; None when no backend can
        run it (the backward then raises, with its own arguments)."""
        base = self._base
        if not base._backward_made:
            inputs = base.inputs(q, k, v)
            out, lse = wrap(out, "out"), wrap(lse, "lse")
            inputs.out, inputs.lse, inputs.dout = out, lse, out
            try:
                chosen, _ = backends.choose(inputs, "backward", base.backend)
            except ValueError:
                chosen = None
            base._backward = None if chosen is None else BackwardPlan(inputs, chosen, held=base.held)
            base._backward_made = True
            _count()
        if base is self or base._backward is None:
            return base._backward
        return base._backward.rebound(self.held[0])


class BackwardPlan:
    """A backward's plan for one signature of q, k, v, out and lse: the backend chosen and what it prepared.
    `gradients` takes each dout as it comes (a transposed view is common) and runs on the prepared path when
    the backend accepts it (`backends.PreparedBackward.accepts`; a backend without one takes a dout shaped,
    typed and placed like q), else answers None and the caller takes the keyed path of `backward`."""

    def __init__(self, inputs: Inputs, chosen: backends.Backend, held: tuple):
        self.layout, self.scale, self.score_mod = inputs.layout, inputs.scale, inputs.score_mod
        self.chosen, self.held = chosen, held
        self.framework = inputs.framework
        saved = (inputs.q, inputs.k, inputs.v, inputs.out, inputs.lse)
        self._saved = tuple(signature(h.native) for h in saved)
        self._kinds = tuple(_kind(h) for h in saved)
        self._prepared = chosen.prepare_backward(inputs)
        # The last dout asked about: (its signature, then its kind and `_Launch` or None; or None, refused).
        self._dout = None
        self._take(inputs.dout)

    def rebound(self, layout: DynamicLayout) -> BackwardPlan:
        """This plan over another dynamic layout of its signature (as `ForwardPlan.rebound`)."""
        view = copy.copy(self)
        view.layout = _with_arrays(self.layout, layout)
        view.held = (layout, self.score_mod)
        return view

    def _take(self, dout) -> tuple | None:
        """(kind, launch) of a dout holder for this plan (the backend's answer depends on dout's signature
        alone, and the last answer is kept); None when the plan does not take it."""
        prepared, described = self._prepared, signature(dout.native)
        if self._dout is not None and self._dout[0] == described:
            return self._dout[1]
        if prepared is not None:
            taken = (
                (_kind(dout), _Launch.of(prepared.direct(dout), self.framework))
                if prepared.accepts(dout)
                else None
            )
        else:
            q_kind = self._kinds[0]
            same = (dout.shape, dout.dtype, dout.device) == (q_kind[0], q_kind[2], q_kind[3])
            taken = (_kind(dout), None) if same else None
        self._dout = (described, taken)
        return taken

    def gradients(self, dout, q, k, v, out, lse) -> tuple | None:
        """``(dq, dk, dv)``, native arrays, from arrays of this plan's signature and ``dout``; None when they
        are not what the plan was made for (a saved-tensor hook may hand back others)."""
        arrays = (q, k, v, out, lse)
        if tuple(signature(x) for x in arrays) != self._saved:
            return None
        last = self._dout
        if last is not None and last[0] == signature(dout):
            taken = last[1]
        else:
            taken = self._take(wrap(dout, "dout"))
        if taken is None:
            return None
        if taken[1] is not None:
            dq, dk, dv, *_ = taken[1](*arrays, dout)  # and the scratch
            return dq, dk, dv
        holders = [known(x, name, *kind) for x, name, kind in zip(arrays, _SAVED, self._kinds, strict=True)]
        inputs = Inputs(
            *holders[:3], self.layout, self.scale, score_mod=self.score_mod,
            dout=known(dout, "dout", *taken[0]), out=holders[3], lse=holders[4],
        )  # fmt: skip
        results = self._prepared.run(inputs) if self._prepared else self.chosen.backward(inputs)
        return tuple(r.native for r in results)

    def run(self, dout, q, k, v, out, lse) -> tuple:
        """`gradients` for arrays of the signature this plan was looked up by (`backward`), dout included:
        where the prepared passes do not take that dout, the chosen backend runs it as it comes."""
        grads = self.gradients(dout, q, k, v, out, lse)
        if grads is None:
            inputs = call.prepare(
                q, k, v, self.layout, causal=False, scale=self.scale, dout=dout, out=out, lse=lse,
                score_mod=self.score_mod,
            )  # fmt: skip
            grads = tuple(r.native for r in self.chosen.backward(inputs))
        return grads


_SAVED = ("q", "k", "v", "out", "lse")


def _with_arrays(fitted: DynamicLayout, layout: DynamicLayout) -> DynamicLayout:
    """The plan's fitted layout (its static parts built for the call, causal in) over `layout`'s arrays."""
    return fitted.with_arrays(layout.indices, layout.counts)
