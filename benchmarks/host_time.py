"""Where a cached call spends host time: each stage of cusparseattn's call path, timed inclusively.

    python benchmarks/host_time.py                  # S = 4096, D = 64, B = 2, H = 16, local1024 and dense
    python benchmarks/host_time.py --seq 1024 --dim 128 --calls 500

At S = 4096 a forward+backward step issues its kernels faster than they run only when the host path is
short; this names the stage that is not. Three calls are timed, each `--calls` times while a sleep kernel
holds the GPU (so that no call waits on the GPU): `attention_forward`, the functional `attention_backward`,
and a step through autograd (`attention(...).backward(grad)`). Each stage's time is inclusive (a stage
inside another counts in both) and per call of the whole; "issue" is the wall time per call, "rest" what no
listed stage covers (PyTorch's dispatch and autograd)."""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402  (the benchmark's layouts)

# (module, attribute) of each stage, in call order; the first is the outermost.
STAGES = [
    ("plans", "forward"),
    ("plans", "backward"),
    ("plans", "_signature"),
    ("plans", "ForwardPlan.run"),
    ("plans", "BackwardPlan.gradients"),
    ("plans", "_Launch.__call__"),
    ("call", "prepare"),
    ("backends", "select"),
    ("native_backends", "CudaBackend.not_supported_reasons"),
    ("native_backends", "CudaBackend.forward"),
    ("native_backends", "CudaBackend.backward"),
    ("native_backends", "CudaBackend.prepare_forward"),
    ("native_backends", "CudaBackend.prepare_backward"),
    ("native_backends", "_CudaForward.run"),
    ("native_backends", "_CudaBackward.run"),
    ("devices", "hopper_reasons"),
    ("cuda", "_tables"),
    ("launches", "Bound.launch"),
    ("launches", "launch_kernel"),
]


def _timed(totals: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def instrument(totals: dict) -> list:
    """Wraps every stage; returns what `restore` needs to put them back."""
    import importlib

    saved = []
    for module_name, path in STAGES:
        owner = importlib.import_module(f"cusparseattn.{module_name}")
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = owner.__dict__[attr]
        fn = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = _timed(totals, f"{module_name}.{path}", fn)
        setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
        saved.append((owner, attr, original))
    return saved


def restore(saved: list) -> None:
    for owner, attr, original in saved:
        setattr(owner, attr, original)


# Calls issued while one sleep kernel holds the GPU: ROUND calls take less host time than its ~50 ms.
ROUND = 20
SLEEP_CYCLES = 10**8


def measure(name: str, fn, calls: int) -> None:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    saved = instrument(totals)
    rounds, issue = max(1, calls // ROUND), 0.0
    try:
        for _ in range(rounds):
            # The GPU sleeps while the calls are issued: no call waits on a full launch queue, so each
            # figure is host time alone.
            torch.cuda._sleep(SLEEP_CYCLES)
            start = time.perf_counter()
            for _ in range(ROUND):
                fn()
            issue += time.perf_counter() - start
            torch.cuda.synchronize()
    finally:
        restore(saved)
    calls = rounds * ROUND
    outer = max(totals.values(), default=0.0)
    print(f"{name}: issue {issue / calls * 1e6:7.1f} us per call", flush=True)
    for stage, seconds in totals.items():
        print(f"    {stage:45} {seconds / calls * 1e6:7.1f} us")
    rest = (issue - outer) / calls * 1e6
    print(f"    {'rest (outside the outermost stage)':45} {rest:7.1f} us", flush=True)


def measure_case(case: str, layout, q, k, v, grad, calls: int) -> None:
    import torch

    import cusparseattn as ca

    with torch.no_grad():
        out, lse = ca.attention_forward(q, k, v, layout)
        measure(f"{case} attention_forward", functools.partial(ca.attention_forward, q, k, v, layout), calls)
        backward = functools.partial(ca.attention_backward, grad, q, k, v, out, lse, layout)
        measure(f"{case} attention_backward", backward, calls)

    def step():
        ca.attention(q, k, v, layout, backend="cuda").backward(grad)
        for x in (q, k, v):
            x.grad = None

    measure(f"{case} autograd step", step, calls)


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cases", default="local1024,dense")
    args = parser.parse_args(argv)
    shape = (bench.B, bench.H, args.seq, args.dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for case in args.cases.split(","):
        measure_case(
            case, bench.pattern(case, args.seq).layout(args.seq), q, k, v, torch.randn_like(q), args.calls
        )


if __name__ == "__main__":
    main()
