"""The package's doctests (``--doctest-modules`` over ``cusparseattn/``, pyproject's pytest options) run where
the frameworks they use are installed, and skip with the reason elsewhere.

The package imports PyTorch, JAX and CuPy lazily, so a NumPy-only machine imports every module but the
front ends written for one framework; those are left out of collection there (`pytest_ignore_collect`), and
an example that imports a framework (``>>> import torch``) skips where it is not installed (an example that
imports CuPy also where no GPU is visible). ``find_spec`` answers without importing the framework.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
# The modules that import a framework when they are imported, by the framework.
_FRONT_ENDS = {
    "torch": ("cusparseattn/torch.py", "cusparseattn/distributed"),
    "jax": ("cusparseattn/jax.py",),
}
_IMPORTS = re.compile(r"^\s*(?:import|from)\s+(torch|jax|cupy)\b", re.MULTILINE)


def _installed(framework: str) -> bool:
    return importlib.util.find_spec(framework) is not None


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    path = collection_path.resolve()
    relative = path.relative_to(ROOT).as_posix() if ROOT in path.parents else ""
    for framework, paths in _FRONT_ENDS.items():
        if relative in paths and not _installed(framework):
            return True
    return None


def _missing(framework: str) -> str | None:
    if not _installed(framework):
        return f"{framework} is not installed"
    if framework == "cupy":
        from cusparseattn.testing import NO_GPU, gpu_count

        return NO_GPU if gpu_count() == 0 else None
    return None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if not isinstance(item, pytest.DoctestItem):
            continue
        frameworks = {m for example in item.dtest.examples for m in _IMPORTS.findall(example.source)}
        reasons = [reason for reason in map(_missing, sorted(frameworks)) if reason]
        if reasons:
            item.add_marker(pytest.mark.skip(reason=f"the example needs {'; '.join(reasons)}"))
