"""Every switch of cusparseattn in one place, read from environment variables prefixed ``CUSPARSEATTN_``.

- ``CUSPARSEATTN_LINEINFO=1``: compile kernels with ``-lineinfo`` (source lines in ``ncu`` reports).
- ``CUSPARSEATTN_DUMP_SOURCE=DIR``: write each generated kernel source to DIR (read it when NVRTC complains).
- ``CUSPARSEATTN_VERBOSE=1``: log each kernel compile with its time.
- ``CUSPARSEATTN_HOPPER=0``: run the portable (mma.sync) kernels on Hopper GPUs too, for comparison.
- ``CUSPARSEATTN_FUSED_BACKWARD=0``: on Hopper GPUs, run the backward as the dQ and dK/dV passes, not as one
  fused pass (the default; docs/tuning.md gives their measured speeds).
- ``CUSPARSEATTN_DETERMINISTIC=0``: let the fused Hopper backward add each query tile's parts of dQ in the
  order they land (as FlashAttention's atomic adds do), not in an order fixed per query tile: faster at head
  dim 64 (docs/history.md gives by how much), but dQ's last bits may differ from run to run.
- ``CUSPARSEATTN_FLOAT32_PRECISION=high|highest``: how the kernels multiply float32 inputs. ``high`` on TF32
  tensor cores (10 bits of mantissa, as cuBLAS's TF32); ``highest`` in split TF32, three products a multiply,
  to float32's rounding. Unset: PyTorch tensors follow ``torch.get_float32_matmul_precision()`` (its
  ``"highest"``, PyTorch's default, is ``highest``; ``"high"`` and ``"medium"`` are ``high``), JAX arrays
  ``jax.default_matmul_precision`` (``"highest"`` or ``"float32"`` is ``highest``), others take ``high``.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(f"CUSPARSEATTN_{name}", "").strip().lower() in ("1", "true", "yes", "on")


def lineinfo() -> bool:
    return _flag("LINEINFO")


def _on_unless_off(name: str) -> bool:
    return os.environ.get(f"CUSPARSEATTN_{name}", "1").strip().lower() not in ("0", "false", "no", "off")


def hopper() -> bool:
    return _on_unless_off("HOPPER")


def fused_backward() -> bool:
    return _on_unless_off("FUSED_BACKWARD")


def deterministic() -> bool:
    return _on_unless_off("DETERMINISTIC")


def float32_precision() -> str | None:
    """CUSPARSEATTN_FLOAT32_PRECISION: "high", "highest", or None where it is unset."""
    value = os.environ.get("CUSPARSEATTN_FLOAT32_PRECISION", "").strip().lower()
    if value in ("", "high", "highest"):
        return value or None
    raise ValueError(f"CUSPARSEATTN_FLOAT32_PRECISION must be 'high' or 'highest', got {value!r}")


def verbose() -> bool:
    return _flag("VERBOSE")


def dump_dir() -> Path | None:
    value = os.environ.get("CUSPARSEATTN_DUMP_SOURCE", "").strip()
    return Path(value) if value else None


def kernels_dir() -> Path:
    """The CUDA sources: inside the installed package, or `kernels/` beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cusparseattn's CUDA sources (kernels/*.cu) are missing next to {here}")
