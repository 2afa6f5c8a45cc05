"""cusparseattn's own backends, registered first: its CUDA kernels (``"cuda"``) and its reference
(``"reference"``). `cusparseattn.backends` has the registry and the selection, `cusparseattn.torch_backends`
PyTorch's FlexAttention and SDPA.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np

from .arrays import Tensor, cupy_stream, device_name
from .backends import Backend, Direct, PreparedBackward, PreparedForward, register_backend
from .call import Inputs
from .dynamic import DynamicLayout


def _precision(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


class _CudaForward(PreparedForward):
    def __init__(self, launch):
        self._launch = launch

    def direct(self):
        launch = self._launch
        return None if launch.made is None else Direct(launch.device, launch.made, launch.launch)

    def run(self, inputs):
        q = inputs.q
        out, lse = q.empty(q.shape, q.dtype), q.empty(q.shape[:3], "float32")
        self._launch.run(q, inputs.k, inputs.v, out, lse, inputs.layout)
        out.name, lse.name = "out", "lse"
        return out, lse


class _CudaBackward(PreparedBackward):
    def __init__(self, launch):
        self._launch = launch

    def accepts(self, dout):
        return self._launch.accepts(dout)

    def direct(self, dout):
        launch = self._launch
        return None if launch.made is None else Direct(launch.device, launch.made, launch.launcher(dout))

    def run(self, inputs):
        launch, q, k = self._launch, inputs.q, inputs.k
        dq, dk, dv = q.empty(q.shape, q.dtype), k.empty(k.shape, k.dtype), k.empty(k.shape, k.dtype)
        stats = q.empty(launch.stats_shape, "float32")  # the passes' scratch (cuda.stats_shape)
        launch.run(inputs.dout, q, k, inputs.v, inputs.out, inputs.lse, dq, dk, dv, stats, inputs.layout)
        dq.name, dk.name, dv.name = "dq", "dk", "dv"
        return dq, dk, dv


# How the kernels multiply float32, by precision (call.float32_precision), for runs_on.
_FLOAT32_HOW = {
    "high": "on TF32 tensor cores (precision 'high')",
    "highest": "in split TF32 (precision 'highest': float32's rounding)",
}


class CudaBackend(Backend):
    """The CUDA kernels (``cusparseattn.cuda``), launched on the framework's current stream of the GPU.

    JAX arrays reach the kernels inside an XLA call instead (`cusparseattn.jax`), on XLA's buffers and stream.
    """

    name = "cuda"
    description = "the CUDA kernels, compiled at run time through CuPy"

    @staticmethod
    def _module():
        try:
            from . import cuda
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.cuda":
                raise
            return None
        return cuda

    def available(self):
        if self._module() is None:
            return ["the CUDA kernels are not built into this version"]
        from . import devices

        return devices.available()

    def not_supported_reasons(self, inputs, op):
        if self._module() is None:
            return ["the CUDA kernels are not built into this version"]
        from . import devices

        reasons = []
        dynamic = isinstance(inputs.layout, DynamicLayout)
        if dynamic:
            from . import dynamic_tables

            reasons += dynamic_tables.reasons(inputs.layout)
            if inputs.layout.per == "token":
                from . import token_groups

                reasons += [f"grouped rows cannot take it: {r}" for r in token_groups.reasons(inputs)]
        if not inputs.on_gpu:
            reasons.append(f"the inputs are on {device_name(inputs.device)}, not on a CUDA device")
        reasons += devices.available()
        reasons += devices.reasons(inputs.dtype, inputs.head_dim, inputs.scale)
        if not reasons:
            reasons += devices.device_reasons(inputs.device[1])
        if not reasons:
            shapes = inputs.q.shape, inputs.k.shape, inputs.dtype, dynamic
            reasons += devices.grid_reasons(*shapes, persistent=self._persistent_forward(inputs, op))
        if not reasons:
            # A traced JAX array has no memory yet: cusparseattn.jax checks XLA's buffers when they arrive.
            concrete = [(h.name, h) for h in inputs.holders() if not getattr(h, "traced", False)]
            reasons += devices.tensor_reasons(*concrete)
        return reasons

    @staticmethod
    def _persistent_forward(inputs, op: str) -> bool:
        """Whether this call runs persistent passes alone: a half-precision forward on the Hopper kernels."""
        from . import devices

        if op != "forward" or inputs.dtype == "float32" or devices.hopper_device_reasons(inputs.device[1]):
            return False
        return not devices.hopper_reasons(inputs.q, inputs.k, inputs.v, precision=inputs.precision)

    def runs_on(self, inputs):
        where = device_name(inputs.device)
        if inputs.dtype != "float32":
            return where
        from . import devices

        how = _FLOAT32_HOW[inputs.precision]
        # A Hopper GPU runs float32 in TF32 on its kernels (devices.FLOAT32_ON_HOPPER), and on the portable
        # ones at "highest".
        hopper = not devices.hopper_device_reasons(inputs.device[1]) and inputs.precision == "high"
        kernels = "Hopper kernels" if hopper else "portable kernels"
        return f"{where}, float32 {how}, {kernels}"

    def forward(self, inputs):
        return self.prepare_forward(inputs).run(inputs)

    def backward(self, inputs):
        return self.prepare_backward(inputs).run(inputs)

    def _passes(self, kind: str, inputs, **given):
        """cuda's `kind` (Forward, Backward) for these inputs and the arrays `given`."""
        made = getattr(self._module(), kind)
        mod, precision = inputs.score_mod, inputs.precision
        return made(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.layout,
            inputs.scale,
            score_mod=mod,
            precision=precision,
            **given,
        )

    def prepare_forward(self, inputs):
        return _CudaForward(self._passes("Forward", inputs))

    def prefetch_backward(self, inputs):
        # The backward's kernels compile on background threads while the forward's kernel compiles.
        if not self.not_supported_reasons(inputs, "backward"):
            module = self._module()
            args = (inputs.q, inputs.k, inputs.v, inputs.layout, inputs.score_mod, inputs.precision)
            module.prefetch_backward(*args)

    def prepare_backward(self, inputs):
        # The outputs it makes are C-contiguous: only the arrays it is handed are bound as they are.
        given = dict(dout=inputs.dout, out=inputs.out, lse=inputs.lse)
        launch = self._passes("Backward", inputs, **given)
        return _CudaBackward(launch)


#: The dtypes that the reference runs in on a GPU, through CuPy: bfloat16 has no CuPy dtype, and float16 is
#: the kernels' (a reference asked for on GPU float16 arrays runs on host copies, as bfloat16 does).
GPU_DTYPES = ("float32", "float64")

#: The arrays each pass of the reference reads, in the order `cusparseattn.reference` takes them.
_OPERANDS = {"forward": ("q", "k", "v"), "backward": ("dout", "q", "k", "v", "out", "lse")}


@functools.cache
def _has_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None


def reference_on_gpu(inputs: Inputs) -> bool:
    """Whether the reference runs ``inputs`` on their GPU, through CuPy and without a copy to the host: GPU
    arrays of `GPU_DTYPES`, with CuPy installed."""
    return inputs.on_gpu and inputs.dtype in GPU_DTYPES and _has_cupy()


class ReferenceBackend(Backend):
    """The reference (``cusparseattn.reference``) where the arrays are: NumPy on the host, CuPy on the GPU
    for GPU arrays of `GPU_DTYPES` (torch's through DLPack, on torch's current stream); other GPU arrays are
    copied to the host and back."""

    name = "reference"
    description = (
        "the reference: NumPy on the host, CuPy on the GPU for float32 and float64 GPU arrays "
        "(other GPU arrays are copied to the host and back)"
    )

    def not_supported_reasons(self, inputs, op):
        return []

    def runs_on(self, inputs):
        if not inputs.on_gpu:
            return "NumPy, on the host"
        if reference_on_gpu(inputs):
            return f"CuPy, on {device_name(inputs.device)}"
        return f"NumPy, on the host, copied from {device_name(inputs.device)} and back"

    def slow_path(self, inputs):
        copies = inputs.on_gpu and not reference_on_gpu(inputs)
        return "the NumPy reference on the host" if copies else None

    def forward(self, inputs):
        return self._run(inputs, "forward")

    def backward(self, inputs):
        return self._run(inputs, "backward")

    def _run(self, inputs, op: str) -> tuple[Tensor, ...]:
        from . import reference

        q = inputs.q
        run = reference.forward if op == "forward" else reference.backward
        holders = [getattr(inputs, name) for name in _OPERANDS[op]]
        options = dict(scale=inputs.scale, precision=_precision(q.dtype), score_mod=inputs.score_mod)
        if not reference_on_gpu(inputs):
            results = run(*(h.numpy() for h in holders), inputs.layout, **options)
            return tuple(q.from_numpy(r) for r in results)
        with cupy_stream(q):
            results = run(*(h.cupy() for h in holders), inputs.layout, **options)
            return tuple(q.from_cupy(r) for r in results)


register_backend(CudaBackend(), priority=0)
register_backend(ReferenceBackend(), priority=1)
