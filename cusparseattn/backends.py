"""Which implementation runs a call, and why not the others: a registry of backends, like PyTorch's
``torch.nn.attention`` for SDPA.

Each backend is a `Backend` with a ``name``, ``not_supported_reasons(inputs, op)`` (an empty list when it can
run ``op``, ``"forward"`` or ``"backward"``, on these inputs) and the ``forward`` / ``backward`` themselves;
optionally ``prepare_forward`` / ``prepare_backward``, the passes made ready once for a call signature, which
PyTorch's eager calls reuse while the signature repeats.
Four are registered, in this priority order (the first two in `cusparseattn.native_backends`):

- ``"cuda"``: the CUDA kernels (`cusparseattn.cuda`), for GPU arrays;
- ``"reference"``: the reference (`cusparseattn.reference`), for any inputs: NumPy arrays on the host, GPU
  arrays of `GPU_DTYPES` on their GPU through CuPy (`reference_on_gpu`), other GPU arrays copied to the host
  and back;
- ``"flex"`` and ``"sdpa"``: PyTorch's FlexAttention and SDPA with a dense mask
  (`cusparseattn.torch_backends`), for torch tensors, to compare with. They come after the reference,
  which runs everything, so automatic selection never picks them: name them (``backend="sdpa"``, or
  ``use_backends("sdpa")``) to use them.

Automatic selection walks the enabled backends in priority order and takes the first with no reasons; a
backend the caller forces goes through the same check, and when nothing can run, one error lists the inputs
and every reason. `why_not` says, for every backend, why it cannot take a call; `current_backend` which one
would, and `runs_on` where. When the choice falls back to a slow path (the reference on host copies of GPU
inputs) because backends ahead of it could not run, a RuntimeWarning names their reasons, once per distinct
set of reasons.

Which backends are enabled, and their order, is decided at two levels:

- `activate_backend` sets the process-wide default, for every thread;
- `use_backends` overrides it inside a ``with`` block, in this thread only (blocks nest; the innermost one
  counts, and the enclosing state comes back on exit, also on an exception).

Both take names (or registered `Backend` objects); ``set_priority=True`` makes the given order the priority
order, otherwise the current priority order is kept and only the set changes. `register_backend` adds a
backend.

>>> import numpy as np
>>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
>>> list_backends()
['cuda', 'reference', 'flex', 'sdpa']
>>> current_backend(q, k, v)
'reference'
>>> with use_backends("reference"):
...     list_backends()
['reference']
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from . import token_groups
from .arrays import Tensor, device_name
from .call import Inputs, prepare

OPS = ("forward", "backward")


class Backend:
    """One implementation of the forward and backward passes. Subclass it, set ``name`` (and a one-line
    ``description``), and pass an instance to `register_backend`.

    >>> class Nothing(Backend):
    ...     name, description = "nothing", "runs nothing"
    ...     def not_supported_reasons(self, inputs, op):
    ...         return ["it is an example"]
    >>> Nothing()
    <backend 'nothing'>
    """

    name = ""
    description = ""

    def available(self) -> list[str]:
        """Why this backend cannot run anything in this process (missing packages, no GPU); empty when it
        can run some inputs. `not_supported_reasons` repeats these for each call."""
        return []

    def not_supported_reasons(self, inputs: Inputs, op: str) -> list[str]:
        """Why this backend cannot run ``op`` (``"forward"`` or ``"backward"``) on ``inputs``; empty when it
        can. Decided before any work, from metadata: a traced array has no values yet."""
        raise NotImplementedError

    def runs_on(self, inputs: Inputs) -> str:
        """Where this backend runs ``inputs``, for messages (the inputs' device by default)."""
        return device_name(inputs.device)

    def slow_path(self, inputs: Inputs) -> str | None:
        """A phrase saying what running ``inputs`` here costs, when that makes this backend a slow fallback
        (automatic selection then warns, naming why the backends ahead of it could not run); else None."""
        return None

    def forward(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` holders in the inputs' framework and device."""
        raise NotImplementedError

    def backward(self, inputs: Inputs) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` holders in the inputs' framework and device."""
        raise NotImplementedError

    def prepare_forward(self, inputs: Inputs) -> PreparedForward | None:
        """The forward for ``inputs``' signature, its work that does not depend on the arrays' values or
        addresses done now, or None where this backend has nothing to do ahead (the default)."""
        return None

    def prepare_backward(self, inputs: Inputs) -> PreparedBackward | None:
        """The backward for ``inputs``' signature (q, k, v, out and lse; dout comes later), its work that does
        not depend on the arrays' values or addresses done now, or None (the default)."""
        return None

    def prefetch_backward(self, inputs: Inputs) -> None:
        """Starts, beside the forward's preparation, what this backend can of the backward of ``inputs``
        (the first call of a training step, whose backward is sure to follow); nothing by default."""

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"


class Direct(NamedTuple):
    """A prepared pass over raw device addresses, for a caller that makes the arrays itself (PyTorch's eager
    calls: holding each array in a `Tensor` cost a forward+backward step at S = 4096 more host time than its
    kernels took). ``launch(stream, addresses)`` runs it on a raw CUDA stream handle of GPU `device`, over
    the addresses of the call's arrays (the forward's q, k, v; the backward's q, k, v, out, lse, dout), then
    of those that `made` lists: ``(shape, dtype name)`` each, C-contiguous on that GPU, made by the caller
    for this launch, the outputs first (out, lse; dq, dk, dv), then any scratch."""

    device: int
    made: tuple[tuple[tuple[int, ...], str], ...]
    launch: Callable[[int, tuple[int, ...]], None]


class PreparedForward:
    """A backend's forward made ready for one call signature (`Backend.prepare_forward`): ``run(inputs)``
    gives the ``(out, lse)`` holders for inputs of that signature (the same layout, scale and score mod;
    holders described as the prepared ones were: shapes, strides, dtypes, device, addresses mod 16). It
    validates and chooses nothing: the caller checks that the inputs match. It holds no array and not the
    layout, which its caller may keep it longer than."""

    def run(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def direct(self) -> Direct | None:
        """The same forward over raw addresses (`Direct`), or None where it has none (the default)."""
        return None


class PreparedBackward:
    """A backend's backward made ready before its dout exists (`Backend.prepare_backward`), for one call
    signature: ``run(inputs)`` gives the ``(dq, dk, dv)`` holders for inputs of that signature when
    ``accepts(inputs.dout)`` (the caller checks the rest, as for `PreparedForward`); a dout that it does not
    accept goes the usual way, through validation and backend selection. Its answer must depend only on
    dout's description (shape, strides, dtype, device, address mod 16): callers keep it for douts described
    alike. It holds no array (saved-tensor hooks may move the forward's) and not the layout."""

    def accepts(self, dout: Tensor) -> bool:
        raise NotImplementedError

    def run(self, inputs: Inputs) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def direct(self, dout: Tensor) -> Direct | None:
        """The same backward over raw addresses (`Direct`) for douts described as this one, which it accepts;
        or None where it has none (the default)."""
        return None


# ---- the registry and the selection state ----------------------------------------------------------------


@dataclass(frozen=True)
class _Selection:
    """Which backends are enabled and in what order, as one `activate_backend` or `use_backends` call left it.

    ``enabled`` None means every registered backend. ``priority`` lists the names that come first, in that
    order; the other registered backends follow in registry order. ``by`` is the call, for messages.
    """

    enabled: tuple[str, ...] | None
    priority: tuple[str, ...]
    by: str

    def order(self) -> list[str]:
        registered = BACKENDS
        first = [n for n in self.priority if n in registered]
        return first + [n for n in registered if n not in self.priority]

    def enabled_order(self) -> list[str]:
        return [n for n in self.order() if self.enabled is None or n in self.enabled]


_INITIAL = _Selection(None, (), "")
_lock = threading.Lock()  # guards the process-wide state below; readers take one consistent snapshot
_default = _INITIAL
_state = threading.local()  # .selection: this thread's innermost use_backends block
_warned: set[str] = set()
_version = 0  # counts the registry's changes, for `state`

#: Every registered backend by name, in registry order (the default priority order). Read-only:
#: `register_backend` replaces it with a new mapping, so a reader never sees it change under it.
BACKENDS: Mapping[str, Backend] = types.MappingProxyType({})


def register_backend(backend: Backend, *, priority: int | None = None) -> Backend:
    """Add ``backend`` (a `Backend` instance with a name of its own) to the registry and return it.

    ``priority`` is its place in the registry order (0: first, ahead of ``"cuda"``); None puts it last. It is
    enabled wherever the enabled set is the default one (every backend); where `activate_backend` or
    `use_backends` named a set, it joins only once named.

    >>> from cusparseattn.native_backends import ReferenceBackend
    >>> class Echo(ReferenceBackend):
    ...     name, description = "echo", "the reference, under another name"
    >>> _ = register_backend(Echo())
    >>> list_backends()[-1]
    'echo'
    >>> _ = unregister_backend("echo")
    """
    global BACKENDS, _version
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be an instance of a Backend subclass, got {_type_name(backend)}")
    name = backend.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend.name must be a non-empty string, got {name!r} for {_type_name(backend)}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or priority < 0):
        raise ValueError(f"priority must be None (last) or a place 0, 1, ... in the order, got {priority!r}")
    with _lock:
        if name in BACKENDS:
            raise ValueError(
                f"a backend named {name!r} is registered already ({BACKENDS[name]!r}); choose another name"
            )
        items = list(BACKENDS.items())
        items.insert(len(items) if priority is None else priority, (name, backend))
        BACKENDS = types.MappingProxyType(dict(items))
        _version += 1
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove the backend ``name`` from the registry and return it. Names it leaves in an `activate_backend`
    or `use_backends` state are ignored from then on.

    >>> from cusparseattn.native_backends import ReferenceBackend
    >>> class Twin(ReferenceBackend):
    ...     name = "twin"
    >>> twin = register_backend(Twin())
    >>> unregister_backend("twin") is twin
    True
    """
    global BACKENDS, _version
    with _lock:
        _check_names([name])
        items = dict(BACKENDS)
        backend = items.pop(name)
        BACKENDS = types.MappingProxyType(items)
        _version += 1
    return backend


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _name(backend) -> str:
    if isinstance(backend, Backend):
        if BACKENDS.get(backend.name) is not backend:
            raise ValueError(f"{backend!r} is not registered: pass it to register_backend first")
        return backend.name
    if not isinstance(backend, str):
        raise TypeError(f"a backend is named by a string or a registered Backend, got {_type_name(backend)}")
    return backend


def _check_names(names) -> None:
    for name in names:
        if name not in BACKENDS:
            known = ", ".join(repr(n) for n in BACKENDS)
            raise ValueError(f"backend must be one of {known}, got {name!r}")


def _call(function: str, names: tuple[str, ...], set_priority: bool) -> str:
    args = ", ".join(repr(n) for n in names) + (", set_priority=True" if set_priority else "")
    return f"{function}({args})"


def _narrowed(base: _Selection, backends, set_priority: bool, function: str) -> _Selection:
    names = tuple(dict.fromkeys(_name(b) for b in backends))
    _check_names(names)
    priority = names + tuple(n for n in base.order() if n not in names) if set_priority else base.priority
    return _Selection(names, priority, _call(function, names, set_priority))


def _current() -> _Selection:
    return getattr(_state, "selection", None) or _default


def state() -> tuple:
    """What selection depends on besides a call's inputs, as a hashable value: the backends enabled in this
    thread, their order, and the registry's version. Equal states choose alike for equal inputs."""
    return _current(), _version


def list_backends() -> list[str]:
    """The backends that automatic selection may pick in this thread, in priority order.

    >>> with use_backends("reference", "cuda", set_priority=True):
    ...     list_backends()
    ['reference', 'cuda']
    """
    return _current().enabled_order()


def activate_backend(*backends, set_priority: bool = False) -> tuple[str, ...]:
    """Set the process-wide default: automatic selection uses only these backends (in every thread, outside
    `use_backends` blocks). ``set_priority=True`` makes the given order the priority order; otherwise the
    current one is kept. With no backends, back to the initial state: every registered backend, in registry
    order.

    Returns the previous default's enabled backends in its priority order (``()`` for the initial state), so
    that ``activate_backend(*previous, set_priority=True)`` restores it.

    >>> previous = activate_backend("reference")
    >>> list_backends(), previous
    (['reference'], ())
    >>> _ = activate_backend(*previous, set_priority=True)
    >>> list_backends()
    ['cuda', 'reference', 'flex', 'sdpa']
    """
    global _default
    with _lock:
        previous = _default
        _default = _narrowed(previous, backends, set_priority, "activate_backend") if backends else _INITIAL
    return () if previous.enabled is None else tuple(previous.enabled_order())


@contextlib.contextmanager
def use_backends(*backends, set_priority: bool = False) -> Iterator[None]:
    """Let automatic selection use only these backends inside the ``with`` block, in this thread: like
    PyTorch's ``sdpa_kernel``. ``set_priority=True`` makes the given order the priority order; otherwise the
    current priority order is kept. Blocks nest (the innermost one counts) and restore the enclosing state
    on exit, also on an exception. Other threads, including threads started inside the block, keep the
    process-wide default (`activate_backend`).

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 1, 16, 8), np.float32)
    >>> with use_backends("reference"):
    ...     why_not(q, k, v)["cuda"][-1]
    "disabled by use_backends('reference')"
    """
    if not backends:
        raise ValueError("use_backends needs a backend name, e.g. use_backends('cuda', 'reference')")
    outer = getattr(_state, "selection", None)
    selection = _narrowed(outer or _default, backends, set_priority, "use_backends")
    _state.selection = selection
    try:
        yield
    finally:
        _state.selection = outer


# ---- selection -------------------------------------------------------------------------------------------


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be 'forward' or 'backward', got {op!r}")


def choose(inputs: Inputs, op: str, backend) -> tuple[Backend, dict[str, list[str]]]:
    """The backend that runs ``op`` on ``inputs``, and the reasons of the enabled ones it passed over; as
    `select`, without its warning."""
    _check_op(op)
    registered = BACKENDS
    if backend is not None:
        name = _name(backend)
        _check_names([name])
        reasons = registered[name].not_supported_reasons(inputs, op)
        if reasons:
            listed = "".join(f"\n  - {reason}" for reason in reasons)
            raise ValueError(f"backend {name!r} cannot run the {op} for {inputs.describe()}:{listed}")
        return registered[name], {}
    selection, rejected = _current(), {}
    for name in selection.enabled_order():
        reasons = registered[name].not_supported_reasons(inputs, op)
        if not reasons:
            return registered[name], rejected
        rejected[name] = reasons
    lines = "".join(f"\n  {name}: " + "; ".join(reasons) for name, reasons in rejected.items())
    if not rejected:
        lines = f" none is enabled ({selection.by or 'no backend is registered'})"
    raise ValueError(f"no enabled backend can run the {op} for {inputs.describe()}:{lines}")


def select(inputs: Inputs, op: str = "forward", backend=None) -> Backend:
    """The backend that runs ``op`` on ``inputs``: ``backend`` (a name or a registered Backend) if given,
    which must be able to, else the first enabled one that can. Raises one ValueError with the inputs and
    every reason when none can.

    When the chosen backend is a slow fallback for these inputs (the reference, for GPU inputs that it copies
    to the host and the results back) and enabled backends ahead of it could not run, a RuntimeWarning names
    their reasons, once per distinct message.
    """
    chosen, rejected = choose(inputs, op, backend)
    slow = chosen.slow_path(inputs) if rejected else None
    if slow is not None:
        _warn_fallback(slow, rejected)
    return chosen


def _warn_fallback(slow: str, rejected: dict[str, list[str]]) -> None:
    because = ". ".join(f"{name}: " + "; ".join(reasons) for name, reasons in rejected.items())
    message = f"cusparseattn: running {slow} because {because}"
    if message not in _warned:
        _warned.add(message)
        frame, level = sys._getframe(0), 1
        # Point at the caller's line: the first frame outside this package, JAX (its custom_vjp machinery)
        # and torch (its custom-operator dispatch).
        while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            __package__,
            "jax",
            "torch",
        ):
            frame, level = frame.f_back, level + 1
        warnings.warn(message, RuntimeWarning, stacklevel=level)


def _inputs_of(q, k, v, layout, op: str, causal: bool, score_mod) -> Inputs:
    _check_op(op)
    # A per-token layout that `attention` runs over grouped rows is asked about as that call (a copy of q).
    mod = dict(scale=None, backend=None, score_mod=score_mod)
    grouped = token_groups.grouping(q, k, v, layout, causal=causal, **mod)
    if grouped is not None:
        return prepare(grouped.rows(q), k, v, grouped.layout, causal=False, scale=grouped.scale)
    # The backward's questions are about q, k, v (dtype, head dim, device): asked before any forward.
    return prepare(q, k, v, layout, causal=causal, scale=None, score_mod=score_mod)


def runs_on(q, k, v, layout=None, op: str = "forward", *, causal: bool = False, score_mod=None) -> str:
    """The backend that automatic selection would pick for ``op`` on these arrays, and where it runs them
    (``"reference (CuPy, on cuda:0)"``). Raises the selection's ValueError when none can. Arguments
    as in `why_not`.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
    >>> runs_on(q, k, v)
    'reference (NumPy, on the host)'
    """
    inputs = _inputs_of(q, k, v, layout, op, causal, score_mod)
    chosen = choose(inputs, op, None)[0]
    return f"{chosen.name} ({chosen.runs_on(inputs)})"


def why_not(
    q, k, v, layout=None, op: str = "forward", *, causal: bool = False, score_mod=None
) -> dict[str, list[str]]:
    """For every registered backend, in priority order, why it cannot run ``op`` on these arrays (an empty
    list: it can). Backends that are disabled here (by `use_backends` or `activate_backend`) say so last.

    ``layout`` and ``score_mod`` as in `cusparseattn.attention`: a layout is None (dense), a Pattern, a
    BlockLayout or a mask function; a score_mod None, a function or a traced `cusparseattn.mods.score_mod`.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
    >>> why = why_not(q, k, v)
    >>> "the inputs are on cpu, not on a CUDA device" in why["cuda"], why["reference"]
    (True, [])
    """
    inputs = _inputs_of(q, k, v, layout, op, causal, score_mod)
    selection = _current()
    enabled = selection.enabled_order()
    registered = BACKENDS
    result = {}
    for name in selection.order():
        reasons = registered[name].not_supported_reasons(inputs, op)
        result[name] = reasons if name in enabled else [*reasons, f"disabled by {selection.by}"]
    return result


def current_backend(
    q, k, v, layout=None, op: str = "forward", *, causal: bool = False, score_mod=None
) -> str:
    """The name of the backend that automatic selection would pick for ``op`` on these arrays, here (this
    thread's `use_backends` block or the process default). Raises the selection's ValueError when none can.
    Arguments as in `why_not`.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
    >>> current_backend(q, k, v, causal=True)
    'reference'
    """
    return choose(_inputs_of(q, k, v, layout, op, causal, score_mod), op, None)[0].name
