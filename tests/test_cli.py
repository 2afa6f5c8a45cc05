"""``python -m cusparseattn demo|info``: they run, say which backend ran and why, and fail on errors."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

import cusparseattn
from cusparseattn import backends, devices
from cusparseattn.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cusparseattn", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_demo_runs_checks_and_names_its_backend(capsys):
    """In this process: `.ci/run` runs ``python -m cusparseattn demo`` itself, and `test_version` the
    module's entry point."""
    status = main(["demo"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[-1] == "PASS"
    assert any(line.startswith("max error vs the float64 reference: ") for line in lines)
    backend = next(line for line in lines if line.startswith("backend: "))
    if devices.available():
        # No GPU here: the demo says it ran the reference, and why the kernels could not run.
        assert backend == "backend: reference"
        why = next(line for line in lines if line.startswith("  not cuda: "))
        assert all(reason in why for reason in devices.available())
    else:
        assert backend == "backend: cuda"


def test_info_runs(capsys):
    status = main(["info"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"cusparseattn {cusparseattn.__version__}" in out and "numpy: " in out and "jax: " in out
    assert "backends, in priority order: cuda, reference, flex, sdpa\n" in out
    assert "  reference: can run" in out
    if devices.available():
        assert "GPU: none usable" in out and "  cuda: cannot run: " in out


def test_info_describes_every_backend_and_what_it_can_run(capsys):
    torch = pytest.importorskip("torch")
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, backend in backends.BACKENDS.items():
        line = next(line for line in lines if line.startswith(f"  {name}: {backend.description}; "))
        missing = backend.available()
        assert line.endswith("available here" if not missing else "not available here: " + "; ".join(missing))
    where = "cuda" if not devices.available() and torch.cuda.is_available() else "cpu"
    assert f"q, k, v float16 [1, 4, 256, 64], torch tensors on {where}:" in lines
    assert "  sdpa: can run" in lines
    if where == "cpu":
        reason = f"FlexAttention has no backward on the CPU (torch {torch.__version__})"
        assert f"  flex: forward can run; backward cannot run: {reason}" in lines
        assert lines.count("  chosen: reference (forward), reference (backward)") == 4
        assert lines.count("  runs on: reference (NumPy, on the host)") == 4
    else:
        assert "  chosen: cuda (forward), cuda (backward)" in lines


def test_info_without_pytorch_uses_numpy_and_says_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if it were not installed
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "torch: not installed" in lines
    assert any(
        line.startswith("  sdpa: PyTorch's ")
        and line.endswith("not available here: PyTorch is not installed")
        for line in lines
    )
    kind = "numpy arrays" if devices.available() else "cupy arrays"
    assert f"q, k, v float32 [1, 4, 256, 64], {kind}:" in lines
    assert "  flex: cannot run: PyTorch is not installed" in lines


def test_info_marks_disabled_backends(monkeypatch, capsys):
    monkeypatch.setattr(backends, "_default", backends._INITIAL)
    backends.activate_backend("reference")
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "backends, in priority order: reference" in lines
    assert any(line.startswith("  cuda (disabled): the CUDA kernels") for line in lines)
    assert "  cuda: cannot run: " in "\n".join(
        lines
    ) and "disabled by activate_backend('reference')" in "\n".join(lines)


@pytest.mark.parametrize(
    "args",
    [
        ["--seq-len", "200", "--block", "32", "--dtype", "bfloat16"],
        ["--seq-len", "96", "--block", "16", "--window", "40", "--heads", "2", "--head-dim", "24"],
        ["--seq-len", "128", "--dtype", "float32"],
    ],
)
def test_demo_options(args, capsys):
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "PASS"


def test_demo_writes_a_png(tmp_path, capsys):
    image = pytest.importorskip("PIL.Image")
    path = tmp_path / "layout.png"
    assert main(["demo", "--seq-len", "256", "--block", "32", "--png", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    with image.open(path) as img:
        assert img.width > 1 and img.height > 1


def test_demo_fails_on_a_wrong_result(monkeypatch, capsys):
    exact = cusparseattn.attention
    monkeypatch.setattr(cusparseattn, "attention", lambda *a, **kw: exact(*a, **kw) * 1.01)
    assert main(["demo", "--seq-len", "128", "--block", "16"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL"


@pytest.mark.parametrize(
    ("args", "usage", "message"),
    [
        ([], "usage: cusparseattn [-h]", "the following arguments are required"),
        (["bench"], "usage: cusparseattn [-h]", "invalid choice: 'bench'"),
        (["info", "--seq-len", "8"], "usage: cusparseattn [-h]", "unrecognized arguments: --seq-len 8"),
        (["demo", "--block", "48"], "usage: cusparseattn demo [-h]", "block"),
        (
            ["demo", "--seq-len", "0"],
            "usage: cusparseattn demo [-h]",
            "--seq-len must be a positive integer, got 0",
        ),
        (
            ["demo", "--dtype", "int8"],
            "usage: cusparseattn demo [-h]",
            "argument --dtype: invalid choice: 'int8'",
        ),
    ],
)
def test_errors_show_the_usage_line(args, usage, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and message in err.splitlines()[-1], err


def test_version():
    result = cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"cusparseattn {cusparseattn.__version__}\n"


def _device(name, major: int, gib: int, sms: int) -> dict:
    return {
        "name": name,
        "major": major,
        "minor": 0,
        "totalGlobalMem": gib * 2**30,
        "multiProcessorCount": sms,
    }


@pytest.mark.parametrize("fused", [None, "0"])
def test_info_says_which_kernels_each_gpu_runs(monkeypatch, fused):
    """On stand-ins for CuPy and two GPUs: the Hopper one's kernels and backward, the other's reason."""
    from cusparseattn import __main__ as cli_module

    props = [_device(b"NVIDIA H100", 9, 80, 132), _device("NVIDIA A100", 8, 40, 108)]
    runtime = types.SimpleNamespace(
        driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13000,
        getDeviceCount=lambda: 2,
        getDeviceProperties=lambda i: props[i],
    )
    nvrtc = types.SimpleNamespace(getVersion=lambda: (13, 0))
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, nvrtc=nvrtc))
    )
    monkeypatch.setattr(devices, "available", lambda: [])
    monkeypatch.setattr(devices, "compute_capability", lambda device: [90, 80][device])
    monkeypatch.delenv("CUSPARSEATTN_HOPPER", raising=False)
    monkeypatch.delenv("CUSPARSEATTN_FUSED_BACKWARD", raising=False)
    if fused:
        monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", fused)
    lines = cli_module._gpu_lines()
    assert lines[1] == "GPU 0: NVIDIA H100, compute capability 9.0, 80.0 GiB, 132 SMs"
    backward = "dQ and dK/dV passes (CUSPARSEATTN_FUSED_BACKWARD=0)" if fused else "fused"
    hopper = "  kernels: Hopper (TMA, wgmma) for head dims (64, 128), else portable"
    assert lines[2] == f"{hopper}; backward: {backward}"
    assert lines[3] == f"  float32: {devices.FLOAT32_ON_HOPPER}"
    assert lines[5].startswith("  kernels: portable (mma.sync); not Hopper: the Hopper kernels need")
    assert lines[6].startswith("  float32 precision: high; torch, jax: their float32 matmul precision")
