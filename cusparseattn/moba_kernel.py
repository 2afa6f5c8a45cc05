"""MoBA's gate as one CUDA kernel (kernels/moba_select.cu) on PyTorch and CuPy GPU arrays: what
`cusparseattn.selectors.moba` runs there, in three launches on the caller's stream and with no host
synchronisation, where the array-API code would take a launch per operation. `reasons` says when it cannot.

It pools the keys (and, per query block, the queries) into float32 scratch, then gives each row a warp that
scores every candidate key block into shared memory and takes the top k, ties to the smaller block: the
same indices as the array-API code on the same pooled values.
"""

from __future__ import annotations

import struct

import numpy as np

from . import build, devices
from .arrays import Tensor
from .launches import bind_device, launch_kernel, scratch, struct_arguments
from .recent import Recent

_POOL_THREADS, _SELECT_WARPS = 256, 4  # kernels/moba_select.cu's
_MAX_HEAD_DIM = 256  # eight values a lane while a warp scores a row


def reasons(q: Tensor, k: Tensor, n_k: int) -> list[str]:
    """Why the kernel cannot take these arrays (held, `cusparseattn.arrays`) with `n_k` key blocks."""
    out = []
    if q.framework not in ("torch", "cupy") or q.device[0] != "cuda":
        out.append("the kernel takes PyTorch and CuPy arrays on a GPU")
    elif q.framework == "torch" and _compiling():
        out.append("under torch.compile the array-API code runs, traced into the graph")
    if q.dtype not in build.DTYPES or k.dtype != q.dtype:
        out.append(f"the kernel takes q and k of one dtype among {sorted(build.DTYPES)}")
    if q.shape[3] > _MAX_HEAD_DIM:
        out.append(f"the kernel takes head dims up to {_MAX_HEAD_DIM}")
    if _SELECT_WARPS * n_k * 4 > build.SelectSpec.shared_bytes:
        most = build.SelectSpec.shared_bytes // (4 * _SELECT_WARPS)
        out.append(f"the kernel holds a row's scores of at most {most} key blocks")
    if not out:
        out += devices.device_reasons(q.device[1])
    return out


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def _vec(*arrays: Tensor) -> int:
    """Elements a pooling thread loads at once: 16 bytes' worth where every row of every array is aligned to
    it, else 1."""
    vec = 16 // build.DTYPES[arrays[0].dtype]
    for x in arrays:
        *outer, inner = x.strides
        if inner != 1 or x.shape[3] % vec or x.data_ptr % 16 or any(s % vec for s in outer):
            return 1
    return vec


def select(q: Tensor, k: Tensor, *, block: int, topk: int, causal: bool, per: str, n_k: int):
    """``selectors.moba``'s indices for held arrays that `reasons` accepts: int32 ``[B, Hq, rows, width]``,
    in q's framework and on its device."""
    described = tuple((x.shape, x.strides, x.data_ptr % 16) for x in (q, k))
    key = (*described, q.dtype, q.device, block, topk, causal, per)
    launch = _kept.get(key)
    if launch is None:
        launch = _kept.put(key, _Launch(q, k, block, topk, causal, per, n_k))
    return launch(q, k)


class _Launch:
    """The kernel's steps for arrays described as `q` and `k` are, with these arguments: grids and packed
    parameters made once, so that a call only allocates its outputs, writes their addresses and launches."""

    def __init__(self, q: Tensor, k: Tensor, block: int, topk: int, causal: bool, per: str, n_k: int):
        (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_k, _) = q.shape, k.shape
        self.device = q.device[1]
        rows = -(-seq_q // block) if per == "block" else seq_q
        width = topk + 1 if causal else topk
        self.k_pool = (batch, heads_kv, n_k, head_dim)
        self.q_pool = (batch, heads_q, rows, head_dim) if per == "block" else None
        self.out = (batch, heads_q, rows, width)
        t = np.zeros((), build.SELECT_PARAMS)
        for name, strides in (("q", q.strides), ("k", k.strides)):
            for axis, stride in zip("bhsd", strides, strict=True):
                t[f"{name}_s{axis}"] = stride
        for name, value in dict(
            batch=batch, heads_q=heads_q, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
            block=block, rows=rows, n_k=n_k, topk=topk, width=width, causal=int(causal),
        ).items():  # fmt: skip
            t[name] = value
        steps = [(0, (n_k, heads_kv, batch), _POOL_THREADS, 0)]
        if self.q_pool is not None:
            steps.append((1, (rows, heads_q, batch), _POOL_THREADS, 0))
        select_ctas = -(-batch * heads_q * rows // _SELECT_WARPS)
        steps.append((2, (select_ctas, 1, 1), 32 * _SELECT_WARPS, _SELECT_WARPS * n_k * 4))
        self.steps = []
        for step, grid, threads, shared in steps:
            t["step"] = step
            self.steps.append((grid, (threads, 1, 1), shared, t.tobytes()))
        fields = build.SELECT_PARAMS.fields
        self._inputs, self._outputs = fields["q"][1], fields["k_pool"][1]
        self._function = build.load(build.SelectSpec(q.dtype, _vec(q, k)), self.device).kernel.ptr

    def __call__(self, q: Tensor, k: Tensor):
        import cupy

        k_pool = scratch(q, self.k_pool, self.device)
        q_pool = scratch(q, self.q_pool, self.device).data_ptr if self.q_pool else 0
        out = q.empty(self.out, "int32")
        stream = q.stream
        with cupy.cuda.Device(self.device):
            bind_device(self.device)
            for grid, threads, shared, packed in self.steps:
                params = bytearray(packed)
                struct.pack_into("<2Q", params, self._inputs, q.data_ptr, k.data_ptr)
                struct.pack_into("<3Q", params, self._outputs, k_pool.data_ptr, q_pool, out.data_ptr)
                table, values = struct_arguments(params)  # values: alive until the launch returns
                launch_kernel(self._function, grid, threads, shared, stream, table)
        return out.native


_kept = Recent(16)
