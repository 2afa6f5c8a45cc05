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
import sys
import weakref
from typing import NamedTuple

from . import env, mods, patterns
from .arrays import DTYPES, Device, Tensor, device_name, wrap
from .captures import EnvironmentCache
from .dynamic import DynamicLayout
from .layout import BlockLayout


# ---- the arrays' sizes ----------------------------------------------------------------------------------
class Sizes(NamedTuple):
    """The sizes of one attention call, read off validated inputs."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    device: Device
    framework: str


def _set(values) -> str:
    return "{" + ", ".join(repr(v) for v in sorted(set(values))) + "}"


def _names(holders) -> str:
    return ", ".join(h.name for h in holders)


def validate(q, k, v, *, dout=None, out=None, lse=None) -> Sizes:
    """Check one attention call's arrays (or their holders) and return its sizes; raise naming the argument.

    ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, Sk, D]`` with Hq a multiple of Hkv; for the backward also ``dout``
    and ``out`` shaped like q and ``lse [B, Hq, Sq]``. Any strides with a contiguous last dimension, so
    ``[B, S, H, D]`` arrays pass as the views ``x.transpose(1, 2)`` without a copy.

    >>> import numpy as np
    >>> q, k = np.ones((1, 12, 8, 4), np.float32), np.ones((1, 8, 8, 4), np.float32)
    >>> validate(q, k, k)
    Traceback (most recent call last):
    ...
    ValueError: k has 8 heads, and q's 12 heads are not a multiple of it
    """
    q, k, v = wrap(q, "q"), wrap(k, "k"), wrap(v, "v")
    dout, out, lse = (
        None if x is None else wrap(x, name) for name, x in (("dout", dout), ("out", out), ("lse", lse))
    )
    grads = [h for h in (dout, out) if h is not None]
    arrays = [h for h in (dout, q, k, v, out) if h is not None]
    everything = arrays + ([lse] if lse is not None else [])

    frameworks = {h.framework for h in everything}
    if len(frameworks) > 1:
        raise TypeError(f"{_names(everything)} must be arrays of one framework, got {_set(frameworks)}")

    for h in arrays:
        if h.ndim != 4:
            raise ValueError(
                f"{h.name} must be 4-D [batch, heads, seq, head_dim], got shape {h.shape}; "
                "for [batch, seq, heads, head_dim] arrays pass the view x.transpose(1, 2)"
            )
        if 0 in h.shape:
            raise ValueError(f"{h.name} has an empty dimension: shape {h.shape}")
    (B, Hq, Sq, D), (Bk, Hkv, Sk, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"k has batch size {Bk}, expected q's batch size {B}")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk}, expected q's head dim {D}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}, expected k's shape {k.shape}")
    if Hq % Hkv:
        raise ValueError(f"k has {Hkv} heads, and q's {Hq} heads are not a multiple of it")
    for h in grads:
        if h.shape != q.shape:
            raise ValueError(f"{h.name} has shape {h.shape}, expected q's shape {q.shape}")
    if lse is not None and lse.shape != (B, Hq, Sq):
        raise ValueError(f"lse has shape {lse.shape}, expected (batch, q heads, q tokens) = {(B, Hq, Sq)}")

    dtypes = {h.dtype for h in arrays}
    if len(dtypes) > 1:
        raise ValueError(f"{_names(arrays)} must have one dtype, got {_set(dtypes)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"{_names(arrays)} have dtype {q.dtype}, expected one of {', '.join(DTYPES)}")
    if lse is not None and lse.dtype not in ("float32", "float64"):
        raise ValueError(f"lse has dtype {lse.dtype}, expected float32 (or float64)")

    devices = {device_name(h.device) for h in everything}
    if len(devices) > 1:
        raise ValueError(f"{_names(everything)} must be on one device, got {_set(devices)}")
    if q.device[0] not in ("cpu", "cuda"):
        raise ValueError(f"{_names(everything)} are on {device_name(q.device)}; expected cpu or cuda arrays")

    for h in everything:
        if h.shape[-1] > 1 and h.strides[-1] != 1:
            raise ValueError(
                f"{h.name}'s last dimension must be contiguous (stride 1), got strides {h.strides}; "
                "copy it (e.g. x.contiguous()): views such as [B, S, H, D] transposes are fine as they are"
            )
    return Sizes(B, Hq, Hkv, Sq, Sk, D, q.dtype, q.device, q.framework)


def check_layout(layout: BlockLayout, sizes: Sizes) -> None:
    """Check that a BlockLayout fits the inputs: its lengths, batch (1 or B) and heads (1 or Hq).

    >>> import numpy as np
    >>> lay = BlockLayout(np.ones((2, 2), bool), block_size=64, seq_q=128)
    >>> check_layout(lay, Sizes(1, 4, 4, 100, 100, 64, "float32", ("cpu", 0), "numpy"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: layout was built for seq_q=128, seq_k=128, but q has 100 tokens ...(100, 100), or pass...
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(
            "layout must be None, a Pattern, a BlockLayout or a DynamicLayout, "
            f"got {type(layout).__qualname__}"
        )
    if (layout.seq_q, layout.seq_k) != (sizes.seq_q, sizes.seq_k):
        raise ValueError(
            f"layout was built for seq_q={layout.seq_q}, seq_k={layout.seq_k}, but q has {sizes.seq_q} "
            f"tokens and k has {sizes.seq_k}; build the layout for these lengths with "
            f"pattern.layout({sizes.seq_q}, {sizes.seq_k}), or pass the Pattern"
        )
    if layout.batch not in (1, sizes.batch):
        raise ValueError(
            f"layout has batch {layout.batch}, expected 1 (shared) or q's batch size {sizes.batch}"
        )
    if layout.heads not in (1, sizes.heads_q):
        raise ValueError(
            f"layout has {layout.heads} heads, expected 1 (shared) or q's {sizes.heads_q} heads "
            "(layouts count query heads)"
        )


# ---- the call ---------------------------------------------------------------------------------------------
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

    @property
    def precision(self) -> str:
        """How the kernels multiply these inputs: float32's `float32_precision`, "high" for the others."""
        return float32_precision(self.framework) if self.dtype == "float32" else "high"

    def holders(self) -> list[Tensor]:
        return [h for h in (self.dout, self.q, self.k, self.v, self.out, self.lse) if h is not None]

    def describe(self) -> str:
        arrays = "; ".join(h.describe() for h in self.holders())
        mod = "" if self.score_mod is None else f"; score_mod {score_mod_name(self.score_mod)}"
        return f"{arrays}; scale {self.scale:.6g}{mod}; layout {self.layout!r}"


def float32_precision(framework: str) -> str:
    """How the kernels multiply float32 inputs of `framework`: "high" (TF32 tensor cores) or "highest" (split
    TF32, float32's rounding). CUSPARSEATTN_FLOAT32_PRECISION where it is set; else PyTorch tensors follow
    ``torch.get_float32_matmul_precision()`` ("highest" is "highest"; "high" and "medium" are TF32), JAX
    arrays ``jax.default_matmul_precision`` ("highest" and "float32" are "highest"; unset, the default, is
    TF32 as JAX's on a GPU), and other arrays take "high".

    >>> float32_precision("numpy")
    'high'
    """
    chosen = env.float32_precision()
    if chosen is not None:
        return chosen
    if framework == "torch":
        highest = sys.modules["torch"].get_float32_matmul_precision() == "highest"
    elif framework == "jax":
        highest = sys.modules["jax"].config.jax_default_matmul_precision in _JAX_HIGHEST
    else:
        highest = False
    return "highest" if highest else "high"


# jax.default_matmul_precision's names of float32's own rounding: its precision and its dot algorithms'.
_JAX_HIGHEST = ("highest", "float32", "F32_F32_F32", "TF32_TF32_F32_X3")


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


@functools.cache
def causal_pattern(block: tuple[int, int]) -> patterns.Pattern:
    """The causal Pattern of ``causal=True`` with a dynamic layout of these blocks: one object, whose
    layouts (cached per lengths) and their joins with the layout's parts are then the same at every step."""
    return patterns.causal(block=block)


def resolve_layout(layout, causal: bool, sizes: Sizes) -> BlockLayout | DynamicLayout:
    """The BlockLayout for these sizes: None is dense, a Pattern is built for them, a mask function becomes a
    Pattern (`mask_pattern`); ``causal`` intersects. A `DynamicLayout` stays one, checked against the sizes
    and its static parts built for them (`DynamicLayout.fit`)."""
    if isinstance(layout, DynamicLayout):
        block = layout.block_size
        return layout.fit(sizes, causal_pattern(block).layout(sizes.seq_q, sizes.seq_k) if causal else None)
    if layout is None:
        return default_pattern(causal).layout(sizes.seq_q, sizes.seq_k)
    if callable(layout) and not isinstance(layout, (patterns.Pattern, BlockLayout, DynamicLayout)):
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
    (`cusparseattn.captures.environment`: document ids refilled in place in a torch tensor give a new layout).
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
