"""``python -m cusparseattn demo|info`` (also the ``cusparseattn`` command).

- ``demo``: builds a local-window layout, shows it, runs `cusparseattn.attention` on the best backend this
  machine has (saying which, and why not the others) and checks the result against the float64 reference.
  Exits 1 when the check fails.
- ``info``: versions, the GPU, every backend (what it is, whether this machine can run it, the priority
  order) and which backends can run sample inputs here, and why not.

Examples (shell)::

    python -m cusparseattn --version
    python -m cusparseattn demo
    python -m cusparseattn demo --seq-len 1000 --block 32 --dtype bfloat16 --png layout.png
    python -m cusparseattn info
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
from pathlib import Path

import numpy as np

_DESCRIPTION = "cusparseattn: block-sparse attention for NumPy, CuPy, PyTorch and JAX arrays."
# The dtypes the demo runs in; its check is the test suite's rule (cusparseattn.testing): the reference's own
# error against float64 doubled, plus a slack of a few units in the last place (testing.ATOL).
_DTYPES = ("bfloat16", "float16", "float32")


def _gpu_reasons() -> list[str]:
    from . import devices

    return devices.available()


def _inputs(shape, dtype: str, on_gpu: bool):
    """Standard-normal q, k, v in ``dtype``: CuPy arrays on the current GPU when ``on_gpu``, else NumPy."""
    from .arrays import DTYPES

    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(DTYPES[dtype]) for _ in range(3)]
    if not on_gpu:
        return host
    import cupy

    return [cupy.asarray(x) for x in host]


def _to_host(x) -> np.ndarray:
    from .arrays import wrap

    return wrap(x).numpy()


def _first_runnable(why: dict[str, list[str]]) -> str | None:
    from . import backends

    return next((name for name in backends.list_backends() if not why[name]), None)


def demo(args: argparse.Namespace) -> int:
    from . import attention, backends, patterns, reference
    from .testing import ATOL

    seq_len, block = args.seq_len, args.block
    window = args.window or max(block, seq_len // 4)
    try:
        layout = patterns.local(window=window, block=block).layout(seq_len)
    except ValueError as err:  # a block size or window the library refuses: the usage and why, no traceback
        args.parser.error(str(err))
    print(f"layout: local window of {window} tokens, block {block}, seq_len {seq_len}")
    print(str(layout))
    if args.png:
        try:
            layout.save_png(args.png)
            print(f"wrote {args.png}")
        except ImportError as err:
            print(f"no PNG written: {err} (pip install pillow)", file=sys.stderr)

    shape = (1, args.heads, seq_len, args.head_dim)
    gpu_reasons = _gpu_reasons()
    q, k, v = _inputs(shape, args.dtype, on_gpu=not gpu_reasons)
    why = backends.why_not(q, k, v, layout)
    chosen = _first_runnable(why)
    if chosen is None:
        lines = "".join(f"\n  {name}: {'; '.join(reasons)}" for name, reasons in why.items())
        print(f"FAIL: no backend can run q, k, v {args.dtype} {list(shape)}:{lines}")
        return 1
    where = "on the GPU" if not gpu_reasons else "on the CPU"
    print(f"inputs: q, k, v {args.dtype} {list(shape)} ({type(q).__module__.split('.')[0]}, {where})")
    print(f"backend: {chosen}")
    for name, reasons in why.items():
        if name != chosen and reasons:
            print(f"  not {name}: {'; '.join(reasons)}")
    if chosen == "reference":
        print("  (the NumPy reference: correct, not fast; the CUDA kernels need a CUDA GPU and CuPy)")

    start = time.perf_counter()
    out = attention(q, k, v, layout, backend=chosen)
    if not gpu_reasons:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
    elapsed = time.perf_counter() - start
    print(f"ran in {elapsed * 1e3:.1f} ms (first call: includes any kernel compile)")

    qh, kh, vh = (_to_host(x) for x in (q, k, v))
    ref64, _ = reference.forward(*(x.astype(np.float64) for x in (qh, kh, vh)), layout, precision=np.float64)
    low, _ = reference.forward(qh, kh, vh, layout)
    err = float(np.abs(_to_host(out).astype(np.float64) - ref64).max())
    low_err = float(np.abs(low.astype(np.float64) - ref64).max())
    allowed = 2 * low_err + ATOL[args.dtype]
    print(
        f"max error vs the float64 reference: {err:.3e} (allowed {allowed:.3e}: twice the {args.dtype} "
        f"reference's own {low_err:.3e}, plus {ATOL[args.dtype]:g})"
    )
    ok = bool(np.isfinite(err) and err <= allowed)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return "not installed"
    except Exception as err:  # installed and broken: info reports it, never fails on it
        return f"installed, fails to import ({type(err).__name__}: {err})"
    return str(getattr(mod, "__version__", "unknown version"))


def _gpu_lines() -> list[str]:
    reasons = _gpu_reasons()
    if reasons:
        return [f"GPU: none usable ({'; '.join(reasons)})"]
    import cupy

    from . import devices, env, tuning

    runtime = cupy.cuda.runtime
    lines = [
        f"CUDA: driver {runtime.driverGetVersion()}, runtime {runtime.runtimeGetVersion()}, "
        f"NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}"
    ]
    for i in range(runtime.getDeviceCount()):
        props = runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(
            f"GPU {i}: {name}, compute capability {props['major']}.{props['minor']}, "
            f"{props['totalGlobalMem'] / 2**30:.1f} GiB, {props['multiProcessorCount']} SMs"
        )
        hopper = devices.hopper_device_reasons(i)
        if hopper:
            lines.append(f"  kernels: portable (mma.sync); not Hopper: {'; '.join(hopper)}")
            continue
        backward = "fused" if env.fused_backward() else "dQ and dK/dV passes (CUSPARSEATTN_FUSED_BACKWARD=0)"
        lines.append(
            f"  kernels: Hopper (TMA, wgmma) for head dims {tuning.HOPPER_HEAD_DIMS}, else portable; "
            f"backward: {backward}"
        )
        lines.append(f"  float32: {devices.FLOAT32_ON_HOPPER}")
    precision = env.float32_precision() or "high; torch, jax: their float32 matmul precision"
    lines.append(f"  float32 precision: {precision} (CUSPARSEATTN_FLOAT32_PRECISION)")
    return lines


def _framework_inputs(shape, dtype: str, on_gpu: bool):
    """Sample q, k, v for ``info``: torch tensors where PyTorch is installed (every backend, PyTorch's too,
    can then say whether it runs them), else NumPy or CuPy arrays; on the GPU when ``on_gpu``."""
    try:
        import torch
    except ImportError:
        return _inputs(shape, dtype, on_gpu), f"{'cupy' if on_gpu else 'numpy'} arrays"
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator).to(device, getattr(torch, dtype)) for _ in range(3))
    return (q, k, v), f"torch tensors on {device}"


def _can(reasons: list[str]) -> str:
    return "can run" if not reasons else "cannot run: " + "; ".join(reasons)


def info(args: argparse.Namespace) -> int:
    from . import __version__, backends, env

    print(f"cusparseattn {__version__} ({Path(__file__).resolve().parent})")
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    for module in ("numpy", "ml_dtypes", "cupy", "torch", "jax"):
        print(f"{module}: {_version(module)}")
    print(f"pillow: {_version('PIL')}")
    for line in _gpu_lines():
        print(line)
    try:
        print(f"kernel sources: {env.kernels_dir()}")
    except FileNotFoundError as err:
        print(f"kernel sources: missing ({err})")

    enabled = backends.list_backends()
    print(f"backends, in priority order: {', '.join(enabled)}")
    for name, backend in backends.BACKENDS.items():
        missing = backend.available()
        here = "available here" if not missing else "not available here: " + "; ".join(missing)
        state = "" if name in enabled else " (disabled)"
        print(f"  {name}{state}: {backend.description}; {here}")
    on_gpu = not _gpu_reasons()
    shape = (1, 4, 256, 64)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        (q, k, v), what = _framework_inputs(shape, dtype, on_gpu)
        print(f"q, k, v {dtype} {list(shape)}, {what}:")
        forward, backward = (backends.why_not(q, k, v, op=op) for op in ("forward", "backward"))
        for name, reasons in forward.items():
            if backward[name] == reasons:
                print(f"  {name}: {_can(reasons)}")
            else:
                print(f"  {name}: forward {_can(reasons)}; backward {_can(backward[name])}")
        chosen = [_chosen(backends.current_backend, q, k, v, op) for op in ("forward", "backward")]
        print(f"  chosen: {chosen[0]} (forward), {chosen[1]} (backward)")
        print(f"  runs on: {_chosen(backends.runs_on, q, k, v, 'forward')}")
    return 0


def _chosen(choose, q, k, v, op: str) -> str:
    try:
        return choose(q, k, v, op=op)
    except ValueError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (``main(["info"])`` prints the environment report). A usage
    error exits with status 2 after the usage line and the reason, as argparse's own errors do."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="cusparseattn", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"cusparseattn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,info}")
    run = commands.add_parser("demo", help="run a small block-sparse attention and check it against float64")
    run.add_argument("--seq-len", type=int, default=512, help="sequence length (default 512)")
    run.add_argument("--block", type=int, default=64, help="layout block size, 16 to 128 (default 64)")
    run.add_argument("--window", type=int, help="local window in tokens (default max(block, seq_len / 4))")
    run.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    run.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    run.add_argument("--dtype", choices=_DTYPES, default="float16", help="dtype (default float16)")
    run.add_argument("--png", type=Path, help="also draw the layout into this PNG file (needs pillow)")
    run.set_defaults(func=demo, parser=run)
    commands.add_parser("info", help="versions, GPU, and which backends can run here").set_defaults(func=info)
    args = parser.parse_args(argv)
    if args.command == "demo":
        for name in ("seq_len", "window", "heads", "head_dim"):
            value = getattr(args, name)
            if value is not None and value < 1:
                run.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
