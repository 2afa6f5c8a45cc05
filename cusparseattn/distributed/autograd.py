"""Ring attention as a PyTorch ``autograd.Function``: the backward runs the distributed backward.

Every rank of the group must run the backward (as with any collective): the dk/dv of its keys come home from
the ranks that used them.
"""

from __future__ import annotations

import torch

from . import ring


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of this rank's queries; ``lse`` is not differentiable.

    ``call`` holds the validated plan and options (`cusparseattn.distributed.api.Call`).
    """

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = ring.forward(call.plan, q, k, v, **call.options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        if dout.stride(-1) != 1:
            dout = dout.contiguous()  # e.g. the stride-0 ones that out.sum().backward() sends
        dq, dk, dv = ring.backward(call.plan, dout, q, k, v, out, lse, **call.options)
        return dq, dk, dv, None
