"""Arrays of any framework behind one small holder: DLPack in, results back in the caller's kind, signatures.

`wrap` picks a holder class by the array's top-level module (``numpy``, ``cupy``, ``torch``, ``jax``) and
imports nothing else: a NumPy user never imports torch. A holder exposes what the kernel launch reads (shape,
strides in elements, dtype name, device, data pointer, the framework's current stream) and three conversions:
a host NumPy view (zero copy on the CPU), a new array of the same framework and device (kernel outputs), and a
NumPy result handed back in the caller's framework and device; GPU arrays also have a CuPy view of their
memory and take CuPy results back, without a copy (DLPack), for the reference on the GPU. `XlaBuffer` holds
what XLA lends a callback inside a JAX computation on a GPU (device memory and XLA's stream), so the kernels
(and the reference, in CuPy) can run there. `signature` describes an array for a plan's key, `allocator`
makes a GPU framework's outputs; `cusparseattn.call` validates a call's arrays.

>>> import numpy as np
>>> x = wrap(np.ones((1, 2, 3, 4), np.float32).transpose(0, 2, 1, 3), "q")
>>> x.framework, x.dtype, x.device, x.shape, x.strides
('numpy', 'float32', ('cpu', 0), (1, 3, 2, 4), (24, 4, 12, 1))
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

#: The dtypes cusparseattn computes in, by name, with their NumPy dtype (bfloat16 from ml_dtypes). CuPy and
#: JAX take these NumPy dtypes as they are; torch's dtype of the same name is ``getattr(torch, name)``.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}

Device = tuple[str, int]
CPU: Device = ("cpu", 0)


def device_name(device: Device) -> str:
    """``('cpu', 0)`` -> ``'cpu'``, ``('cuda', 1)`` -> ``'cuda:1'``."""
    kind, index = device
    return kind if kind == "cpu" else f"{kind}:{index}"


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Tensor:
    """One array of one framework, seen the way cusparseattn needs it.

    Subclasses fill ``framework`` and the properties; ``native`` is the caller's array, ``name`` the argument
    name used in error messages.
    """

    framework = ""

    def __init__(self, native, name: str = "array"):
        self.native = native
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (not bytes)."""
        raise NotImplementedError

    @property
    def dtype(self) -> str:
        raise NotImplementedError

    @property
    def device(self) -> Device:
        raise NotImplementedError

    @property
    def data_ptr(self) -> int:
        raise NotImplementedError

    @property
    def stream(self) -> int:
        """The framework's current CUDA stream on this array's device (0 on the CPU)."""
        raise NotImplementedError

    def numpy(self) -> np.ndarray:
        """A host NumPy array of the same values: a view of the same memory on the CPU, a copy from a GPU."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: str) -> Tensor:
        """A new, uninitialised, C-contiguous array of this framework on this device."""
        raise NotImplementedError

    def from_numpy(self, arr: np.ndarray) -> Tensor:
        """``arr`` in this framework on this device (no copy on the CPU where the framework allows it)."""
        raise NotImplementedError

    def cupy(self):
        """A CuPy array of the same GPU memory (no copy), for CuPy work in `cupy_stream`."""
        raise TypeError(f"{self.describe()} has no CuPy view: CuPy reads CuPy and torch CUDA arrays")

    def from_cupy(self, arr) -> Tensor:
        """The CuPy array ``arr``, made in `cupy_stream`, in this framework on its GPU (no copy)."""
        raise TypeError(f"{self.describe()}: CuPy results go back to CuPy and torch CUDA arrays only")

    def describe(self) -> str:
        return f"{self.name} {self.dtype} {list(self.shape)} ({self.framework}, {device_name(self.device)})"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class NumpyTensor(Tensor):
    framework = "numpy"

    def __init__(self, native, name: str = "array"):
        super().__init__(np.asarray(native), name)

    @property
    def shape(self):
        return self.native.shape

    @property
    def strides(self):
        size = self.native.itemsize
        if any(s % size for s in self.native.strides):
            raise ValueError(f"{self.name} has byte strides {self.native.strides}, not whole elements")
        return tuple(s // size for s in self.native.strides)

    @property
    def dtype(self):
        return self.native.dtype.name

    @property
    def device(self):
        return CPU

    @property
    def data_ptr(self):
        return self.native.ctypes.data

    @property
    def stream(self):
        return 0

    def numpy(self):
        return self.native

    def empty(self, shape, dtype):
        return NumpyTensor(np.empty(shape, DTYPES[dtype]), self.name)

    def from_numpy(self, arr):
        return NumpyTensor(arr, self.name)


class CupyTensor(Tensor):
    framework = "cupy"

    @property
    def shape(self):
        return self.native.shape

    @property
    def strides(self):
        return tuple(s // self.native.itemsize for s in self.native.strides)

    @property
    def dtype(self):
        return self.native.dtype.name

    @property
    def device(self):
        return ("cuda", self.native.device.id)

    @property
    def data_ptr(self):
        return self.native.data.ptr

    @property
    def stream(self):
        import cupy

        with self.native.device:
            return cupy.cuda.get_current_stream().ptr

    def numpy(self):
        import cupy

        return cupy.asnumpy(self.native)

    def empty(self, shape, dtype):
        import cupy

        with self.native.device:
            return CupyTensor(cupy.empty(shape, DTYPES.get(dtype, np.dtype(dtype))), self.name)

    def from_numpy(self, arr):
        import cupy

        with self.native.device:
            return CupyTensor(cupy.asarray(arr), self.name)

    def cupy(self):
        return self.native

    def from_cupy(self, arr):
        return CupyTensor(arr, self.name)


# torch dtypes and devices by the names and pairs they map to, filled as they are met: holders are made many
# times a call, and formatting a dtype or reading a device's fields cost more than a dictionary lookup.
_TORCH_DTYPE_NAMES: dict = {}
_TORCH_DEVICES: dict = {}


def torch_dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``."""
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = _TORCH_DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def torch_device(device) -> Device:
    """A ``torch.device`` as ``('cpu', 0)`` or ``('cuda', index)``."""
    pair = _TORCH_DEVICES.get(device)
    if pair is None:
        pair = _TORCH_DEVICES[device] = CPU if device.type == "cpu" else (device.type, device.index or 0)
    return pair


class _Described(Tensor):
    """A holder whose shape, strides (in elements), dtype name and device are read once, when it is made: a
    holder lives for one call, and validation and the launch ask for them many times."""

    def _describe(self, shape, strides, dtype: str, device: Device) -> None:
        self._shape, self._strides, self._dtype, self._device = tuple(shape), tuple(strides), dtype, device

    @property
    def shape(self):
        return self._shape

    @property
    def strides(self):
        return self._strides

    @property
    def dtype(self):
        return self._dtype

    @property
    def device(self):
        return self._device


class TorchTensor(_Described):
    framework = "torch"

    def __init__(self, native, name: str = "array"):
        import torch

        if not isinstance(native, torch.Tensor):
            raise TypeError(f"{name} must be an array, got {_type_name(native)}")
        super().__init__(native, name)
        self._describe(
            native.shape, native.stride(), torch_dtype_name(native.dtype), torch_device(native.device)
        )

    @property
    def data_ptr(self):
        return self.native.data_ptr()

    @property
    def stream(self):
        kind, index = self._device
        return torch_current_stream(index) if kind == "cuda" else 0

    def numpy(self):
        import torch

        # DLPack refuses tensors that require grad and views with a pending negation; neither copies here.
        t = self.native.detach().resolve_neg()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            # DLPack has no bfloat16 that NumPy reads: move the bits as uint16 and re-view them.
            return np.from_dlpack(t.view(torch.uint16)).view(DTYPES["bfloat16"])
        return np.from_dlpack(t)

    @classmethod
    def known(cls, native, name: str, shape, strides, dtype: str, device: Device) -> TorchTensor:
        """A holder of `native` as the caller describes it (its shape, strides, dtype name and device, read
        or chosen before): asking the tensor costs microseconds a holder, and a call makes several."""
        held = cls.__new__(cls)
        Tensor.__init__(held, native, name)
        held._describe(shape, strides, dtype, device)
        return held

    def empty(self, shape, dtype):
        import torch

        t = self.native.new_empty(shape, dtype=getattr(torch, dtype))
        return TorchTensor.known(t, self.name, shape, contiguous_strides(shape), dtype, self._device)

    def from_numpy(self, arr):
        import torch

        if not arr.flags.writeable:
            arr = arr.copy()  # torch tensors are always writable; never hand one a read-only buffer
        if arr.dtype == DTYPES["bfloat16"]:
            t = torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        return TorchTensor(t.to(self.native.device) if self.native.device.type != "cpu" else t, self.name)

    def cupy(self):
        import cupy

        # DLPack refuses tensors that require grad and views with a pending negation. Inside `cupy_stream`,
        # CuPy's stream is torch's, so the exchange orders nothing more.
        return cupy.from_dlpack(self.native.detach().resolve_neg())

    def from_cupy(self, arr):
        import torch

        return TorchTensor(torch.from_dlpack(arr), self.name)


def cupy_stream(holder: Tensor):
    """A context in which CuPy works on ``holder``'s GPU, on the current stream of its framework: CuPy's own
    for CuPy arrays, an external stream for the others (torch's current stream, XLA's), so that CuPy's work
    is queued in order with the framework's and nothing waits."""
    import cupy

    index = holder.device[1]
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(index))
    if holder.framework != "cupy":
        stack.enter_context(cupy.cuda.ExternalStream(holder.stream, index))
    return stack


def torch_current_stream(index: int) -> int:
    """The raw handle of PyTorch's current stream on cuda:index. The private accessor that
    ``torch.cuda.current_stream`` itself calls (and Triton's launcher uses) takes 0.2 us against its 6."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class JaxTensor(Tensor):
    """A JAX array, or a tracer inside ``jax.jit`` (shape and dtype only: it has no memory yet).

    A tracer's device is JAX's default device (``jax.default_device``), where ``jit`` places a computation
    whose inputs are not committed to another. Kernels never launch on a JAX array directly: XLA keeps its
    CUDA streams to itself, so `cusparseattn.jax` runs them inside an XLA call, on `XlaBuffer` holders.
    """

    framework = "jax"

    def __init__(self, native, name: str = "array"):
        import jax

        super().__init__(native, name)
        self.traced = isinstance(native, jax.core.Tracer)
        if self.traced:
            dev = jax.config.jax_default_device or jax.devices()[0]
            if isinstance(dev, str):  # a platform name, e.g. jax.default_device("cpu")
                dev = jax.devices(dev)[0]
        else:
            devices = native.devices()
            if len(devices) != 1:
                raise ValueError(
                    f"{name} is spread over {len(devices)} devices; pass an array on one device "
                    "(e.g. jax.device_put(x, jax.devices()[0]))"
                )
            (dev,) = devices
        self._jax_device = dev

    @property
    def shape(self):
        return tuple(self.native.shape)

    @property
    def strides(self):
        return contiguous_strides(self.shape)  # JAX arrays are dense and row-major

    @property
    def dtype(self):
        return np.dtype(self.native.dtype).name

    @property
    def device(self):
        dev = self._jax_device
        if dev.platform == "cpu":
            return CPU
        index = getattr(dev, "local_hardware_id", None)
        kind = "cuda" if dev.platform in ("gpu", "cuda") else dev.platform
        return (kind, dev.id if index is None else index)

    def _concrete(self, what: str):
        if self.traced:
            raise TypeError(f"{self.name} is traced inside jax.jit and has no {what} yet")
        return self.native

    @property
    def data_ptr(self):
        return self._concrete("memory").unsafe_buffer_pointer()

    @property
    def stream(self):
        if self.device == CPU:
            return 0
        raise TypeError(
            f"{self.name} is a JAX GPU array, and JAX exposes no stream to launch on outside XLA: "
            "cusparseattn.jax runs the kernels inside an XLA call, on XLA's stream"
        )

    def numpy(self):
        x = self._concrete("values")
        if self.device == CPU and self.dtype != "bfloat16":
            return np.from_dlpack(x)
        # __array__ of a CPU array is a zero-copy view, bfloat16 included; from a GPU it copies to the host.
        return np.asarray(x)

    def empty(self, shape, dtype):
        import jax.numpy as jnp

        return JaxTensor(jnp.empty(shape, DTYPES[dtype], device=self._jax_device), self.name)

    def from_numpy(self, arr):
        import jax
        import jax.numpy as jnp

        if self.device == CPU:
            try:
                return JaxTensor(jnp.from_dlpack(arr, copy=False), self.name)
            except (BufferError, ValueError):
                pass  # unaligned (XLA wants 64 bytes) or bfloat16, which DLPack cannot carry: one copy
        return JaxTensor(jax.device_put(arr, self._jax_device), self.name)


class FixedTensor(_Described):
    """A holder whose shape, strides (in elements), dtype name and device are given once, with its memory and
    stream where it has them: the operands of a call that cusparseattn sees by description, not as arrays.
    Without ``data_ptr`` or ``stream`` reading them raises, as for any holder that has none."""

    def __init__(self, native, name, shape, strides, dtype, device, data_ptr=None, stream=None):
        super().__init__(native, name)
        self._describe(shape, strides, dtype, device)
        self._data_ptr, self._stream = data_ptr, stream

    @property
    def data_ptr(self):
        return super().data_ptr if self._data_ptr is None else self._data_ptr

    @property
    def stream(self):
        return super().stream if self._stream is None else self._stream


def _element_type(name: str) -> np.dtype:
    """The NumPy dtype of a dtype's name: the attention dtypes' (bfloat16's from ml_dtypes), or NumPy's own
    (a dynamic layout's int32 indices)."""
    return DTYPES[name] if name in DTYPES else np.dtype(name)


class XlaBuffer(FixedTensor):
    """One operand or result of an XLA call on a GPU, as a ``jax.experimental.buffer_callback`` hands it over:
    XLA's device memory, seen through its ``__cuda_array_interface__``, and XLA's stream to launch on.

    ``dtype`` is the name of the JAX array's dtype: the interface's type string cannot tell bfloat16 from
    other 2-byte types. Strides the interface leaves out (None) mean a dense row-major buffer, as XLA's are.

    >>> class Buffer:  # what buffer_callback passes on a GPU
    ...     __cuda_array_interface__ = {"shape": (1, 2, 3, 8), "typestr": "<V2", "data": (4096, True)}
    ...     def __dlpack_device__(self):
    ...         return (2, 1)  # (kDLCUDA, device ordinal)
    >>> b = XlaBuffer(Buffer(), "q", "bfloat16", stream=7)
    >>> b.shape, b.strides, b.dtype, b.device, b.data_ptr, b.stream
    ((1, 2, 3, 8), (48, 24, 8, 1), 'bfloat16', ('cuda', 1), 4096, 7)
    """

    framework = "jax"

    def __init__(self, native, name: str, dtype: str, stream: int):
        interface = native.__cuda_array_interface__
        shape = tuple(interface["shape"])
        strides = interface.get("strides")
        itemsize = _element_type(dtype).itemsize
        strides = contiguous_strides(shape) if strides is None else tuple(s // itemsize for s in strides)
        device = ("cuda", native.__dlpack_device__()[1])
        super().__init__(native, name, shape, strides, dtype, device, interface["data"][0], stream)

    def cupy(self):
        import cupy

        # From the address, not the interface: CuPy would synchronise with a stream the interface names.
        kind = _element_type(self.dtype)
        size = max(1, math.prod(self.shape)) * kind.itemsize
        memory = cupy.cuda.UnownedMemory(self.data_ptr, size, self.native, self.device[1])
        strides = tuple(s * kind.itemsize for s in self.strides)
        return cupy.ndarray(self.shape, kind, cupy.cuda.MemoryPointer(memory, 0), strides)

    def from_cupy(self, arr):
        """A CuPy holder of ``arr``: XLA makes an XLA call's results itself, and the call copies ``arr`` into
        its result buffer."""
        return CupyTensor(arr, self.name)


_HOLDERS: dict[str, type[Tensor]] = {
    "numpy": NumpyTensor,
    "cupy": CupyTensor,
    "torch": TorchTensor,
    "jax": JaxTensor,
    "jaxlib": JaxTensor,  # concrete JAX arrays are jaxlib types
}


def framework_of(x, name: str = "array") -> str:
    """The framework of array ``x`` by its type's module alone (``"numpy"``, ``"cupy"``, ``"torch"``,
    ``"jax"``), as `wrap` would hold it: nothing is read from ``x``, so ``torch.compile`` traces no cache.

    >>> framework_of(np.zeros(3)), framework_of(np.float32(1), "q")
    ('numpy', 'numpy')
    """
    if isinstance(x, Tensor):
        return x.framework
    cls = _HOLDERS.get(type(x).__module__.split(".")[0])
    if cls is None:
        raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch or JAX array, got {_type_name(x)}")
    return cls.framework


def wrap(x, name: str = "array") -> Tensor:
    """The holder for ``x``, a NumPy, CuPy, PyTorch or JAX array; ``name`` names it in error messages.

    >>> import numpy as np
    >>> wrap(np.zeros((2, 3), np.float16), "k").describe()
    'k float16 [2, 3] (numpy, cpu)'
    >>> wrap([1, 2], "k")
    Traceback (most recent call last):
    ...
    TypeError: k must be a NumPy, CuPy, PyTorch or JAX array, got builtins.list
    """
    if isinstance(x, Tensor):
        return x
    cls = _HOLDERS.get(type(x).__module__.split(".")[0])
    if cls is None:
        raise TypeError(f"{name} must be a NumPy, CuPy, PyTorch or JAX array, got {_type_name(x)}")
    return cls(x, name)


def _torch_signature(t) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def _cupy_signature(x) -> tuple:
    return x.shape, x.strides, x.dtype, x.device.id, x.data.ptr % 16


def _numpy_signature(x) -> tuple:
    return x.shape, x.strides, x.dtype


_SIGNATURES = {"torch": _torch_signature, "cupy": _cupy_signature, "numpy": _numpy_signature}
_SIGNATURE_OF_TYPE: dict[type, object] = {}


def signature(x) -> tuple | None:
    """What validation, backend choice and the kernels' preparation read of array ``x``: its shape, strides,
    dtype, device and address mod 16, as a hashable value made in about a microsecond; None for what a plan
    does not key (JAX arrays, subclasses, anything that is not an array).

    >>> import numpy as np
    >>> signature(np.zeros((2, 3), np.float32))
    ((2, 3), (12, 4), dtype('float32'))
    >>> signature([1, 2]) is None
    True
    """
    of = _SIGNATURE_OF_TYPE.get(type(x))
    if of is None:
        cls = type(x)
        module = cls.__module__.split(".")[0]
        exact = {"torch": "Tensor", "cupy": "ndarray", "numpy": "ndarray"}.get(module) == cls.__name__
        of = _SIGNATURE_OF_TYPE[cls] = _SIGNATURES[module] if exact else _no_signature
    return of(x)


def _no_signature(x) -> None:
    return None


class Allocator(NamedTuple):
    """What a launch over raw addresses needs of a GPU framework: an array's address, the new C-contiguous
    arrays ``make(made, device index)`` (``made``: (shape, dtype name) pairs), and the framework's current
    stream of a device (a raw handle)."""

    address: object
    make: object
    stream: object


def _torch_allocator() -> Allocator:
    import torch

    dtypes = {name: getattr(torch, name) for name in DTYPES}
    devices: dict[int, object] = {}

    def make(made, device):
        on = devices.get(device) or devices.setdefault(device, torch.device("cuda", device))
        return [torch.empty(shape, dtype=dtypes[dtype], device=on) for shape, dtype in made]

    return Allocator(torch.Tensor.data_ptr, make, torch_current_stream)


def _cupy_allocator() -> Allocator:
    import cupy

    def make(made, device):
        with cupy.cuda.Device(device):
            return [cupy.empty(shape, DTYPES[dtype]) for shape, dtype in made]

    def stream(device):
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr

    return Allocator(lambda x: x.data.ptr, make, stream)


_ALLOCATORS = {"torch": _torch_allocator, "cupy": _cupy_allocator}


@functools.cache
def allocator(framework: str) -> Allocator | None:
    """The `Allocator` of a GPU framework that makes its own arrays (torch, cupy); None for the others
    (NumPy has no GPU, XLA lends its buffers)."""
    make = _ALLOCATORS.get(framework)
    return None if make is None else make()


def known(native, name: str, shape, strides, dtype: str, device: Device) -> Tensor:
    """The holder of ``native`` described as given (read before, for an array of the same signature): a
    torch tensor's holder without asking the tensor again; another framework's holder reads lazily."""
    if type(native).__module__.split(".")[0] == "torch":
        return TorchTensor.known(native, name, shape, strides, dtype, device)
    return wrap(native, name)
