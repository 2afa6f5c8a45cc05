"""The wheel: it carries every module and the CUDA sources, and works installed away from the checkout."""

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
# Build outputs and tool caches of the checkout: never part of a build's input.
_NOT_SOURCES = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".*")


def _offline_build_ok() -> bool:
    """Whether this environment has the build backend, so pip can build without fetching it (no isolation)."""
    try:
        return int(version("setuptools").split(".")[0]) >= 68 and bool(version("wheel"))
    except PackageNotFoundError:
        return False


def _run(*cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout (the build writes egg-info and build/ into its source)."""
    src = tmp_path_factory.mktemp("src")
    for entry in ROOT.iterdir():
        skipped = entry.name.startswith(".") or entry.name in ("build", "dist", "out")
        if skipped or entry.suffix == ".egg-info":
            continue
        if entry.is_dir():
            shutil.copytree(entry, src / entry.name, ignore=_NOT_SOURCES)
        else:
            shutil.copy2(entry, src / entry.name)
    out = tmp_path_factory.mktemp("wheel")
    isolation = ["--no-build-isolation"] if _offline_build_ok() else []
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(out), str(src))
    (found,) = out.glob("cusparseattn-*.whl")
    return found


def test_wheel_has_every_module_and_the_cuda_sources(wheel):
    cuda_sources = sorted(p.name for p in KERNELS.glob("*.cu*"))
    if not any(name.endswith(".cu") for name in cuda_sources):
        pytest.skip(f"{KERNELS} has no .cu file yet: nothing to check in the wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f"cusparseattn/kernels/{n}" for n in cuda_sources if f"cusparseattn/kernels/{n}" not in names]
    package = ROOT / "cusparseattn"
    modules = [p.relative_to(ROOT).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts]
    missing += [m for m in modules if m not in names]
    assert not missing, f"the wheel {wheel.name} lacks {missing}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "cusparseattn = cusparseattn.__main__:main" in text


def test_installed_wheel_imports_and_runs(wheel, tmp_path):
    target = tmp_path / "site"
    pip = (sys.executable, "-m", "pip", "install", "--no-deps", "--no-index")
    _run(*pip, "--target", str(target), str(wheel))
    script = (
        "import numpy as np, cusparseattn as ca\n"
        "from cusparseattn import env\n"
        "print(ca.__file__)\n"
        "print(env.kernels_dir())\n"
        "q = k = v = np.random.default_rng(0).standard_normal((1, 2, 64, 16), dtype=np.float32)\n"
        "print(ca.attention(q, k, v, causal=True).shape)\n"
    )
    # Away from the checkout: only the installed copy (and the test environment's dependencies) is visible.
    env = {**os.environ, "PYTHONPATH": str(target)}
    lines = _run(sys.executable, "-c", script, cwd=tmp_path, env=env).stdout.splitlines()
    assert Path(lines[0]).is_relative_to(target), lines[0]
    assert Path(lines[1]).is_relative_to(target) and any(Path(lines[1]).glob("*.cu")), lines[1]
    assert lines[2] == "(1, 2, 64, 16)"
