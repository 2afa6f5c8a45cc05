"""FlexAttention's ``BlockMask`` to and from a layout: the KV lists that FlexAttention keeps, and a layout's
rule as a FlexAttention ``mask_mod`` on torch indices.
"""

from __future__ import annotations

import numpy as np

from .rules import is_torch


def kv_lists(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FlexAttention's per-row block lists: counts [B, H, nQ], indices [B, H, nQ, nK] (set columns first)."""
    counts = np.count_nonzero(mask, axis=-1).astype(np.int32)
    order = np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)
    return counts, order


def from_kv_lists(counts, indices) -> np.ndarray:
    counts, indices = (np.asarray(t.detach().cpu().numpy()) for t in (counts, indices))
    valid = np.arange(indices.shape[-1]) < counts[..., None]
    out = np.zeros(indices.shape, dtype=bool)
    b, h, q, j = np.nonzero(valid)
    out[b, h, q, indices[b, h, q, j]] = True
    return out


def _getitem_to_index():
    """FlexAttention's context that lets ``tensor[index]`` run under ``vmap`` with a batched index."""
    import contextlib

    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # older or newer torch without it: plain indexing works under vmap there
        return contextlib.nullcontext()
    return TransformGetItemToIndex()


class FlexRule:
    """A FlexAttention ``mask_mod`` as a rule function: called directly on torch indices, and through
    ``torch.vmap`` on NumPy ones (one flat batch of pairs)."""

    def __init__(self, mask_mod):
        self.mask_mod = mask_mod

    def __call__(self, b, h, q, k):
        if any(is_torch(x) for x in (b, h, q, k)):
            return self.mask_mod(b, h, q, k)
        import torch

        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (b, h, q, k)))
        if arrays[0].size == 0:
            return np.zeros(arrays[0].shape, dtype=bool)
        flat = [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in arrays]
        with _getitem_to_index():
            out = torch.vmap(self.mask_mod)(*flat)
        return out.numpy().astype(bool).reshape(arrays[0].shape)


def flex_mask_mod(layout):
    def layout_mask(b, h, q_idx, kv_idx):
        return layout._torch_token_mask(b, h, q_idx, kv_idx)

    return layout_mask


def probe_torch_rule(layout, mask_mod, device) -> None:
    """Runs ``mask_mod`` once, eagerly on ``device``: that checks that the rule runs on torch ops, and makes
    the lookup tables of the layout (and of the layouts its rule is made of) that the mask reads there."""
    import torch

    idx = torch.arange(4, device=device)
    try:
        with _getitem_to_index():
            out = torch.vmap(mask_mod)(idx * 0, idx * 0, idx % layout.seq_q, idx % layout.seq_k)
        if not is_torch(out) or out.dtype != torch.bool or tuple(out.shape) != (4,):
            raise TypeError(
                f"it gave {type(out).__name__} {getattr(out, 'dtype', '')}, not a torch bool tensor"
            )
    except Exception as exc:
        if layout.rule is None:  # the mask is this module's own torch code: a failure here is a bug
            raise
        raise ValueError(
            f"the layout's rule {layout.rule.name!r} cannot be evaluated with torch ops, so FlexAttention "
            f"cannot apply it ({type(exc).__name__}: {exc}); to_flex supports rules written with Python "
            "operators and indexing only, as every pattern of cusparseattn.patterns is"
        ) from exc
