"""Per-token layouts whose KV group shares the selection (NSA's) as per-block layouts over grouped rows.

When the ``G = Hq / Hkv`` query heads of a KV group share each token's selection (`dynamic.token_indices`
with one selection per KV head, or one for all heads), the group's rows of a token attend the same keys.
Grouped as rows ``t * G + j`` of ``[B, Hkv, Sq * G, D]`` (row ``t * G + j`` of KV head ``hk`` is query head
``hk * G + j`` at token ``t``), a token is a query block of G rows, and the selection is a per-block dynamic
layout of blocks ``(G, bk)`` over those rows, over the same index arrays: the kernels run it as they run
MoBA's, and a tile of the product reads each K/V block once for the group's heads, as NSA's kernels do.
The static parts move to grouped rows as well: a block row per token, the rule evaluated at the row's
token and head (`grouped_part`).

`attention` (eager in torch, eager and under ``jax.jit`` in JAX), `attention_forward` and
`attention_backward` take this path on a GPU (`grouping`, `attend`): q (and dout, out, lse) are copied into
grouped rows by the caller's framework, so autograd, ``jax.jit`` and CUDA graphs see ordinary array
operations, and the results are copied back.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import call
from .dynamic import DynamicLayout
from .layout import MAX_BLOCK, MIN_BLOCK, BlockLayout
from .mods import mask_rule


def reasons(inputs) -> list[str]:
    """Why a call's fitted per-token layout cannot be run over grouped rows (empty when it can)."""
    layout = inputs.layout
    heads_q, heads_kv = inputs.q.shape[1], inputs.k.shape[1]
    group = heads_q // heads_kv
    out = []
    if not (MIN_BLOCK <= group <= MAX_BLOCK and group & (group - 1) == 0):
        out.append(
            f"a KV group of {group} query heads (Hq={heads_q}, Hkv={heads_kv}): grouped rows need a power of "
            f"two from {MIN_BLOCK} to {MAX_BLOCK}"
        )
    if layout.heads not in (1, heads_kv) or layout.heads == heads_q != heads_kv:
        out.append(f"a selection per query head ({layout.heads} heads): the group's heads must share one")
    if inputs.score_mod is not None:
        out.append("a score mod sees grouped rows' positions, not the tokens'")
    for name, part in (("within", layout.within), ("plus", layout.plus)):
        if part is not None:
            out += [f"the static part {name}: {why}" for why in _part_reasons(part)]
    return out


def _part_reasons(part: BlockLayout) -> list[str]:
    out = []
    if part.heads != 1:
        out.append(f"its blocks differ by head ({part.heads} heads)")
    if part.origin != (0, 0):
        out.append(f"it is a window at {part.origin}")
    if part.rule is not None and part.partial.any() and part.rule.traced_from is None:
        out.append(f"its rule {part.rule.name!r} was not traced from a function")
    return out


class Grouping:
    """How one call's arrays and layout go to grouped rows and back (module docstring)."""

    def __init__(self, inputs, layout: DynamicLayout):
        """``inputs``: the call as `cusparseattn.call.prepare` made it (its fitted layout's static parts);
        ``layout``: the caller's, whose index arrays the grouped layout takes (a fitted one may hold host
        copies: eager JAX indices are read at the call)."""
        q, fitted = inputs.q, inputs.layout
        self.scale = inputs.scale
        self.batch, self.heads_q, self.seq_q = q.shape[:3]
        self.heads_kv = inputs.k.shape[1]
        self.group = self.heads_q // self.heads_kv
        parts = (grouped_part(p, self.group) for p in (fitted.within, fitted.plus))
        self.layout = DynamicLayout(
            *[h.native for h in layout.holders()],
            per="block",
            block_size=(self.group, layout.block_size[1]),
            within=next(parts),
            plus=next(parts),
        )

    def rows(self, x):
        """``[B, Hq, Sq, D]`` (or ``[B, Hq, Sq]``) as grouped rows ``[B, Hkv, Sq * G, D]`` (or without D)."""
        tail = x.shape[3:]
        grouped = x.reshape(self.batch, self.heads_kv, self.group, self.seq_q, *tail).swapaxes(2, 3)
        return grouped.reshape(self.batch, self.heads_kv, self.seq_q * self.group, *tail)

    def tokens(self, x):
        """Grouped rows back to ``[B, Hq, Sq, D]`` (or ``[B, Hq, Sq]``)."""
        tail = x.shape[3:]
        split = x.reshape(self.batch, self.heads_kv, self.seq_q, self.group, *tail).swapaxes(2, 3)
        return split.reshape(self.batch, self.heads_q, self.seq_q, *tail)


def grouping(q, k, v, layout, *, causal, scale, backend, score_mod, **arrays) -> Grouping | None:
    """A `Grouping` for a call (arguments as in `cusparseattn.attention_backward`) that takes grouped rows:
    a per-token dynamic layout on a GPU, for the CUDA kernels (any backend or ``"cuda"``), that `reasons`
    accepts; else None (the call runs as it is: on the host or in the reference the per-token form costs
    nothing more). The call is validated as it was given first, so errors name the caller's arrays."""
    if not isinstance(layout, DynamicLayout) or layout.per != "token" or backend not in (None, "cuda"):
        return None
    inputs = call.prepare(q, k, v, layout, causal=causal, scale=scale, score_mod=score_mod, **arrays)
    if not inputs.on_gpu or reasons(inputs):
        return None
    return Grouping(inputs, layout)


def attend(fn, q, k, v, layout, *, causal, scale, return_lse, backend, score_mod, **options):
    """``fn`` (an ``attention`` function: `cusparseattn.torch.attention`, `cusparseattn.jax.attention`) on
    grouped rows, its results back in tokens, where `grouping` takes the call; None where it does not."""
    grouped = grouping(q, k, v, layout, causal=causal, scale=scale, backend=backend, score_mod=score_mod)
    if grouped is None:
        return None
    rows, scale = grouped.rows(q), grouped.scale
    out = fn(rows, k, v, grouped.layout, scale=scale, return_lse=return_lse, backend=backend, **options)
    return tuple(map(grouped.tokens, out)) if return_lse else grouped.tokens(out)


# Grouped static parts, kept while the token-level part lives (its object is what plans are keyed by).
_grouped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grouped_part(part: BlockLayout | None, group: int) -> BlockLayout | None:
    """A token-level static part of a per-token layout over grouped rows of `group` heads: a block row per
    token (its block row's states), the rule evaluated at the row's token ``q // group`` and query head
    ``h * group + q % group``. The same part gives the same object.

    >>> from cusparseattn import patterns
    >>> part = patterns.causal(block=16).layout(32)
    >>> grouped = grouped_part(part, 16)
    >>> grouped.seq_q, grouped.block_size, grouped.num_blocks, grouped_part(part, 16) is grouped
    (512, (16, 16), (32, 2), True)
    >>> bool(grouped.rule(0, 0, 16 * 5 + 3, 5)), bool(grouped.rule(0, 0, 16 * 5 + 3, 6))
    (True, False)
    """
    if part is None:
        return None
    kept = _grouped.setdefault(part, {})
    if group not in kept:
        kept[group] = _build(part, group)
    return kept[group]


def _build(part: BlockLayout, group: int) -> BlockLayout:
    bq, bk = part.block_size
    rows = np.arange(part.seq_q) // bq
    rule = None
    if part.rule is not None and part.partial.any():
        fn = part.rule.traced_from

        def grouped(b, h, q, k):
            return fn(b, h * group + q % group, q // group, k)

        rule = mask_rule(grouped, name=f"{part.rule.name} over grouped rows")
    return BlockLayout(
        part.blocks[:, :, rows],
        block_size=(group, bk),
        seq_q=part.seq_q * group,
        seq_k=part.seq_k,
        partial=part.partial[:, :, rows] if rule is not None else None,
        rule=rule,
    )
