"""PyTorch glue: `attention` as an ``autograd.Function`` and the `SparseAttention` module.

`cusparseattn.attention` comes here for torch tensors, so it is differentiable. The forward saves ``q, k, v,
out, lse`` for the backward; ``recompute=True`` saves only ``q, k, v`` and runs the forward again in the
backward (less memory held between the passes, one more forward). The log-sum-exp that ``return_lse=True``
returns is not differentiable.

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

import torch
from torch.autograd.function import once_differentiable

from . import api, backends
from .arrays import wrap
from .backends import Inputs


def attention(
    q, k, v, layout=None, *, causal=False, scale=None, return_lse=False, backend=None, recompute=False
):
    """Differentiable block-sparse attention on torch tensors; arguments as in `cusparseattn.attention`.

    ``recompute=True`` keeps only ``q, k, v`` for the backward and recomputes ``out`` and ``lse`` there.

    >>> import torch
    >>> q = k = v = torch.randn(1, 4, 50, 8)
    >>> out, lse = attention(q, k, v, causal=True, return_lse=True)
    >>> out.dtype, lse.dtype, lse.shape
    (torch.float32, torch.float32, torch.Size([1, 4, 50]))
    """
    inputs = api._prepare(q, k, v, layout, causal=causal, scale=scale)
    chosen = backends.select(inputs, "forward", backend)
    if backend is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        backends.select(inputs, "backward", backend)  # a forced backend must run the backward too: say so now
    out, lse = _Attention.apply(q, k, v, inputs.layout, inputs.scale, chosen, backend, recompute)
    return (out, lse) if return_lse else out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, chosen, backend, recompute):
        inputs = Inputs(wrap(q, "q"), wrap(k, "k"), wrap(v, "v"), layout, scale)
        out, lse = (h.native for h in chosen.forward(inputs))
        ctx.mark_non_differentiable(lse)
        ctx.layout, ctx.scale, ctx.backend, ctx.recompute = layout, scale, backend, recompute
        ctx.save_for_backward(*((q, k, v) if recompute else (q, k, v, out, lse)))
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, *saved = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()  # e.g. the stride-0 ones that out.sum().backward() sends
        inputs = Inputs(wrap(q, "q"), wrap(k, "k"), wrap(v, "v"), ctx.layout, ctx.scale)
        if ctx.recompute:
            out, lse = backends.select(inputs, "forward", ctx.backend).forward(inputs)
        else:
            out, lse = wrap(saved[0], "out"), wrap(saved[1], "lse")
        inputs.dout, inputs.out, inputs.lse = wrap(dout, "dout"), out, lse
        dq, dk, dv = backends.select(inputs, "backward", ctx.backend).backward(inputs)
        return dq.native, dk.native, dv.native, None, None, None, None, None


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

    def __init__(self, layout=None, *, causal=False, scale=None, backend=None, recompute=False):
        super().__init__()
        self.layout, self.causal, self.scale = layout, causal, scale
        self.backend, self.recompute = backend, recompute

    def forward(self, q, k, v):
        return attention(
            q,
            k,
            v,
            self.layout,
            causal=self.causal,
            scale=self.scale,
            backend=self.backend,
            recompute=self.recompute,
        )

    def extra_repr(self) -> str:
        return (
            f"layout={self.layout!r}, causal={self.causal}, scale={self.scale}, backend={self.backend!r}, "
            f"recompute={self.recompute}"
        )
