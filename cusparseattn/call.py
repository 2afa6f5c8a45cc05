"""One call, validated: the arrays' holders, the layout for their lengths, the scale and the score mod.

The bottom of the house: the public functions, the PyTorch and JAX glue, the plans and ring attention all
validate through `prepare`, and nothing runs before it passes. A call's `Inputs` are what a backend decides
on and runs.

>>> import numpy as np
>>> q = np.ones((1, 2, 100, 16), np.float32)
>>> inputs = prepare(q, q, q, None, causal=True, scale=None)
>>> inputs.layout.seq_q, round(inputs.scale, 4), inputs.framework
(100, 0.25, 'numpy')
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref

from . import mods, patterns
from .arrays import Sizes, Tensor, check_layout, validate, wrap
from .layout import BlockLayout
from .trace import EnvironmentCache


class Inputs:
    """The validated arrays (holders) of one call, its layout, scale and score mod: what a backend decides
    on and runs.

    ``dout``, ``out`` and ``lse`` are set for the backward. ``score_mod`` is None or a `cusparseattn.trace`
    ``ScoreMod`` (its ``fn`` is the user's function, ``c_expr`` the same as C).
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
        score_mod=None,
    ):
        self.q, self.k, self.v, self.layout, self.scale = q, k, v, layout, scale
        self.dout, self.out, self.lse = dout, out, lse
        self.score_mod = score_mod

    @property
    def framework(self) -> str:
        return self.q.framework

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
        mod = "" if self.score_mod is None else f"; score_mod {score_mod_name(self.score_mod)}"
        return f"{arrays}; scale {self.scale:.6g}{mod}; layout {self.layout!r}"


def score_mod_name(score_mod) -> str:
    """A score mod's name for messages: its ``name``, else its function's, else its type's."""
    name = getattr(score_mod, "name", None) or getattr(getattr(score_mod, "fn", None), "__name__", None)
    return str(name or type(score_mod).__name__)


def prepare(q, k, v, layout, *, causal, scale, dout=None, out=None, lse=None, score_mod=None) -> Inputs:
    """Wrap and validate every argument (nothing runs before this passes) into a backend's `Inputs`.
    Arguments as in `cusparseattn.attention` and `cusparseattn.attention_backward`."""
    hq, hk, hv = wrap(q, "q"), wrap(k, "k"), wrap(v, "v")
    extra = {name: wrap(x, name) for name, x in (("dout", dout), ("out", out), ("lse", lse)) if x is not None}
    sizes = validate(hq, hk, hv, **extra)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    resolved = resolve_layout(layout, causal, sizes)
    mod = None if score_mod is None else mods.score_mod(score_mod)  # names score_mod when it cannot trace
    return Inputs(hq, hk, hv, resolved, check_scale(scale, sizes.head_dim), score_mod=mod, **extra)


@functools.cache
def default_pattern(causal: bool) -> patterns.Pattern:
    """The Pattern of ``layout=None``: dense, or causal."""
    return patterns.causal() if causal else patterns.dense()


def resolve_layout(layout, causal: bool, sizes: Sizes) -> BlockLayout:
    """The BlockLayout for these sizes: None is dense, a Pattern is built for them, a mask function becomes a
    Pattern (`mask_pattern`); ``causal`` intersects."""
    if layout is None:
        return default_pattern(causal).layout(sizes.seq_q, sizes.seq_k)
    if callable(layout) and not isinstance(layout, (patterns.Pattern, BlockLayout)):
        layout = mask_pattern(layout, sizes.batch, sizes.heads_q)
    if isinstance(layout, patterns.Pattern):
        layout = layout.layout(sizes.seq_q, sizes.seq_k)
    check_layout(layout, sizes)
    return with_causal(layout) if causal else layout


# The last mask functions' Patterns, per batch, heads and block size.
_mask_cache = EnvironmentCache()


def mask_pattern(fn, batch: int | None, heads: int | None, block: int = 128) -> patterns.Pattern:
    """``patterns.from_mask(fn)`` over these batch elements and heads, in blocks of ``block`` tokens (None:
    rules of ``b`` or ``h`` are refused, naming them). The same function gives the same Pattern (which caches
    its layouts per lengths, so the kernels' tables are reused) while what it captures is unchanged
    (`cusparseattn.trace.environment`: document ids refilled in place in a torch tensor give a new layout).
    Values whose changes cannot be seen (dicts, large writable NumPy arrays) are taken as unchanged: building
    a layout costs far more than a trace."""

    def make():
        return patterns.from_mask(fn, block=block, batch=batch, heads=heads)

    return _mask_cache.get((fn, batch, heads, block), fn, make, watch_all=False)


_causal_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def with_causal(layout: BlockLayout) -> BlockLayout:
    """``layout`` intersected with the causal mask (bottom-right aligned), kept as long as ``layout`` lives:
    the same layout gives the same object, so caches keyed by layout identity (plans, device tables) hold."""
    cached = _causal_cache.get(layout)
    if cached is None:
        causal = patterns.causal(block=layout.block_size).layout(layout.seq_q, layout.seq_k)
        cached = _causal_cache[layout] = layout & causal
    return cached


def check_scale(scale, head_dim: int) -> float:
    """``scale`` as a float, checked; None is ``1 / sqrt(head_dim)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None (1/sqrt(D)), got {type(scale).__qualname__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)
