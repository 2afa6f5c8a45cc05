"""cusparseattn: block-sparse attention for any array framework.

CUDA kernels compiled at run time through CuPy, a NumPy reference that defines the right answer, and DLPack so
that PyTorch, JAX, CuPy and NumPy arrays go in and come back in their own framework without a copy.

>>> import numpy as np, cusparseattn as ca
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 256, 64), dtype=np.float32)
>>> lay = ca.patterns.local(window=64, block=64).layout(256)
>>> out = ca.attention(q, k, v, lay)
>>> out.shape
(1, 2, 256, 64)
"""

from . import backends, dynamic, mods, native_backends, patterns, reference, selectors, torch_backends, trace
from .api import attention, attention_backward, attention_forward
from .dynamic import DynamicLayout
from .layout import BlockLayout
from .patterns import Pattern
from .rules import TokenRule
from .trace import ScoreMod

__version__ = "0.1.0"

__all__ = [
    "BlockLayout",
    "DynamicLayout",
    "Pattern",
    "ScoreMod",
    "TokenRule",
    "attention",
    "attention_backward",
    "attention_forward",
    "backends",
    "dynamic",
    "mods",
    "native_backends",
    "patterns",
    "reference",
    "selectors",
    "torch_backends",
    "trace",
]
