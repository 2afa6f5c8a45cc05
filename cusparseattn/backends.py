"""Which implementation runs a call: the CUDA kernels, else the NumPy reference, and why not the others.

Each backend is a class with a ``name``, ``not_supported_reasons(inputs, op)`` (an empty list when it can run
``op``, ``"forward"`` or ``"backward"``) and the ``forward`` / ``backward`` themselves. Automatic selection
walks the enabled backends in priority order and takes the first with no reasons; a backend the caller forces
goes through the same check and, when it cannot run, one error lists the inputs and every reason.
`use_backends` restricts and orders the choice inside a ``with`` block (per thread), like PyTorch's
``sdpa_kernel``.

>>> import numpy as np
>>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
>>> list_backends()
['cuda', 'reference']
>>> why_not(q, k, v)["reference"]
[]
>>> with use_backends("reference"):
...     list_backends()
['reference']
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator

import numpy as np

from .arrays import Tensor, device_name
from .layout import BlockLayout

OPS = ("forward", "backward")


class Inputs:
    """The validated arrays (holders) of one call, its layout and scale: what a backend decides on and runs.

    ``dout``, ``out`` and ``lse`` are set for the backward.
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layout: BlockLayout,
        scale: float,
        *,
        dout: Tensor | None = None,
        out: Tensor | None = None,
        lse: Tensor | None = None,
    ):
        self.q, self.k, self.v, self.layout, self.scale = q, k, v, layout, scale
        self.dout, self.out, self.lse = dout, out, lse

    @property
    def dtype(self) -> str:
        return self.q.dtype

    @property
    def device(self) -> tuple[str, int]:
        return self.q.device

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def on_gpu(self) -> bool:
        return self.device[0] == "cuda"

    def holders(self) -> list[Tensor]:
        return [h for h in (self.dout, self.q, self.k, self.v, self.out, self.lse) if h is not None]

    def describe(self) -> str:
        arrays = "; ".join(h.describe() for h in self.holders())
        return f"{arrays}; scale {self.scale:.6g}; layout {self.layout!r}"


def _precision(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


class Backend:
    """One implementation of the forward and backward passes."""

    name = ""

    def not_supported_reasons(self, inputs: Inputs, op: str) -> list[str]:
        raise NotImplementedError

    def forward(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` holders in the inputs' framework and device."""
        raise NotImplementedError

    def backward(self, inputs: Inputs) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` holders in the inputs' framework and device."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"


class CudaBackend(Backend):
    """The CUDA kernels (``cusparseattn.cuda``), launched on the framework's current stream of the GPU.

    JAX arrays reach the kernels inside an XLA call instead (`cusparseattn.jax`), on XLA's buffers and stream.
    """

    name = "cuda"

    @staticmethod
    def _module():
        try:
            from . import cuda
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.cuda":
                raise
            return None
        return cuda

    def not_supported_reasons(self, inputs, op):
        cuda = self._module()
        if cuda is None:
            return ["the CUDA kernels are not built into this version"]
        reasons = []
        if not inputs.on_gpu:
            reasons.append(f"the inputs are on {device_name(inputs.device)}, not on a CUDA device")
        reasons += cuda.available()
        reasons += cuda.reasons(inputs.dtype, inputs.head_dim, inputs.scale)
        if not reasons:
            reasons += cuda.device_reasons(inputs.device[1])
        if not reasons:
            # A traced JAX array has no memory yet: cusparseattn.jax checks XLA's buffers when they arrive.
            concrete = [(h.name, h) for h in inputs.holders() if not getattr(h, "traced", False)]
            reasons += cuda.tensor_reasons(*concrete)
        return reasons

    def forward(self, inputs):
        import cupy

        cuda = self._module()
        q = inputs.q
        with cupy.cuda.Device(q.device[1]):
            out = q.empty(q.shape, q.dtype)
            lse = q.empty(q.shape[:3], "float32")
            cuda.forward(q, inputs.k, inputs.v, out, lse, inputs.layout, inputs.scale)
        out.name, lse.name = "out", "lse"
        return out, lse

    def backward(self, inputs):
        import cupy

        cuda = self._module()
        q, k = inputs.q, inputs.k
        with cupy.cuda.Device(q.device[1]):
            dq, dk, dv = q.empty(q.shape, q.dtype), k.empty(k.shape, k.dtype), k.empty(k.shape, k.dtype)
            delta = q.empty(q.shape[:3], "float32")  # scratch: rowsum(dout * out), written by the dq pass
            saved = (inputs.dout, q, k, inputs.v, inputs.out, inputs.lse)
            cuda.backward(*saved, dq, dk, dv, delta, inputs.layout, inputs.scale)
        dq.name, dk.name, dv.name = "dq", "dk", "dv"
        return dq, dk, dv


class ReferenceBackend(Backend):
    """The NumPy reference (``cusparseattn.reference``) on the host: GPU inputs are copied there and back."""

    name = "reference"

    def not_supported_reasons(self, inputs, op):
        return []

    def forward(self, inputs):
        from . import reference

        q = inputs.q
        out, lse = reference.forward(
            q.numpy(),
            inputs.k.numpy(),
            inputs.v.numpy(),
            inputs.layout,
            scale=inputs.scale,
            precision=_precision(q.dtype),
        )
        return q.from_numpy(out), q.from_numpy(lse)

    def backward(self, inputs):
        from . import reference

        q = inputs.q
        grads = reference.backward(
            inputs.dout.numpy(),
            q.numpy(),
            inputs.k.numpy(),
            inputs.v.numpy(),
            inputs.out.numpy(),
            inputs.lse.numpy(),
            inputs.layout,
            scale=inputs.scale,
            precision=_precision(q.dtype),
        )
        return tuple(q.from_numpy(g) for g in grads)


#: Every backend by name, in priority order.
BACKENDS: dict[str, Backend] = {b.name: b for b in (CudaBackend(), ReferenceBackend())}

_state = threading.local()
_warned: set[str] = set()


def _enabled() -> tuple[str, ...]:
    return getattr(_state, "enabled", tuple(BACKENDS))


def list_backends() -> list[str]:
    """The backends that automatic selection may pick in this thread, in priority order."""
    return list(_enabled())


def _check_names(names) -> None:
    for name in names:
        if name not in BACKENDS:
            known = ", ".join(repr(n) for n in BACKENDS)
            raise ValueError(f"backend must be one of {known}, got {name!r}")


@contextlib.contextmanager
def use_backends(*names: str) -> Iterator[None]:
    """Let automatic selection use only these backends, in this order, inside the ``with`` block.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 1, 16, 8), np.float32)
    >>> with use_backends("reference"):
    ...     why_not(q, k, v)["cuda"][-1]
    "disabled by use_backends('reference')"
    """
    if not names:
        raise ValueError("use_backends needs a backend name, e.g. use_backends('cuda', 'reference')")
    _check_names(names)
    previous = getattr(_state, "enabled", None)
    _state.enabled = tuple(dict.fromkeys(names))
    try:
        yield
    finally:
        if previous is None:
            del _state.enabled
        else:
            _state.enabled = previous


def select(inputs: Inputs, op: str = "forward", backend: str | None = None) -> Backend:
    """The backend that runs ``op`` on ``inputs``: ``backend`` if given (it must be able to), else the first
    enabled one that can. Raises one ValueError with the inputs and every reason when none can.

    Falling back from the CUDA kernels to the reference for GPU inputs warns once per reason, as it copies the
    inputs to the host and the results back.
    """
    _check_op(op)
    if backend is not None:
        _check_names([backend])
        reasons = BACKENDS[backend].not_supported_reasons(inputs, op)
        if reasons:
            listed = "".join(f"\n  - {reason}" for reason in reasons)
            raise ValueError(f"backend {backend!r} cannot run the {op} for {inputs.describe()}:{listed}")
        return BACKENDS[backend]
    rejected: dict[str, list[str]] = {}
    for name in _enabled():
        reasons = BACKENDS[name].not_supported_reasons(inputs, op)
        if not reasons:
            if name == "reference" and inputs.on_gpu and "cuda" in rejected:
                _warn_fallback(rejected["cuda"])
            return BACKENDS[name]
        rejected[name] = reasons
    lines = "".join(f"\n  {name}: " + "; ".join(reasons) for name, reasons in rejected.items())
    raise ValueError(f"no enabled backend can run the {op} for {inputs.describe()}:{lines}")


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be 'forward' or 'backward', got {op!r}")


def _warn_fallback(reasons: list[str]) -> None:
    message = "cusparseattn: running the NumPy reference on the host because cuda: " + "; ".join(reasons)
    if message not in _warned:
        _warned.add(message)
        frame, level = sys._getframe(0), 1
        # Point at the caller's line: the first frame outside this package and JAX (its custom_vjp machinery).
        while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (__package__, "jax"):
            frame, level = frame.f_back, level + 1
        warnings.warn(message, RuntimeWarning, stacklevel=level)


def why_not(q, k, v, layout=None, op: str = "forward", *, causal: bool = False) -> dict[str, list[str]]:
    """For every backend, why it cannot run ``op`` on these arrays (an empty list: it can).

    ``layout`` is None (dense), a Pattern or a BlockLayout, as in `cusparseattn.attention`. Backends that
    `use_backends` has disabled in this thread say so.

    >>> import numpy as np
    >>> q = k = v = np.ones((1, 2, 16, 8), np.float32)
    >>> "the inputs are on cpu, not on a CUDA device" in why_not(q, k, v)["cuda"]
    True
    """
    from .api import _prepare

    _check_op(op)
    # The backward's questions are about q, k, v (dtype, head dim, device): asked before any forward.
    inputs = _prepare(q, k, v, layout, causal=causal, scale=None)
    enabled = _enabled()
    result = {}
    for name, backend in BACKENDS.items():
        reasons = backend.not_supported_reasons(inputs, op)
        if name not in enabled:
            reasons = [*reasons, f"disabled by use_backends({', '.join(repr(n) for n in enabled)})"]
        result[name] = reasons
    return result
