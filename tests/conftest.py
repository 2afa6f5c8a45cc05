"""Test session setup: GPU tests skip without a GPU, Hypothesis runs under one reproducible profile, and the
JAX tests share two fixtures (JAX on the CPU, float64 for one test).

``@pytest.mark.gpu`` tests run only where CuPy sees a CUDA GPU (``python -m pytest -m gpu`` on a GPU host);
elsewhere they skip with the reason. The Hypothesis profile ``ci`` has no deadline (the first call of a kernel
compiles it), prints the reproduction blob of a failure, and derandomizes when ``CI=true`` so a CI run is
repeatable; locally examples vary from run to run and failures are replayed from Hypothesis' database.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from cusparseattn.testing import NO_GPU, gpu_count

# JAX takes 75 % of the GPU's memory when first used; the torch and CuPy tests of this process need it too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

settings.register_profile("ci", deadline=None, derandomize=_CI, print_blob=True)
settings.load_profile("ci")


def pytest_report_header(config) -> list[str]:
    mode = "derandomized (CI=true)" if _CI else "random examples (set CI=true to derandomize)"
    gpus = f"{gpu_count()} CUDA GPU(s) visible: gpu tests run" if gpu_count() else f"gpu tests skip: {NO_GPU}"
    return [f"hypothesis profile 'ci': {mode}", f"cusparseattn: {gpus}"]


def pytest_collection_modifyitems(config, items) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and gpu_count() == 0:
        skip = pytest.mark.skip(reason=NO_GPU)
        for item in gpu_items:
            item.add_marker(skip)


# The JAX tests' fixtures: a module takes `jax_on_cpu` for all its tests (pytestmark) and `x64` by name.
@pytest.fixture
def jax_on_cpu(request):
    """CPU tests keep JAX on the CPU also on a GPU host (where JAX's default device is a GPU)."""
    jax = pytest.importorskip("jax")
    if request.node.get_closest_marker("gpu"):
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


@pytest.fixture
def x64():
    """JAX with float64 for the duration of one test (it is a process-wide switch)."""
    jax = pytest.importorskip("jax")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
