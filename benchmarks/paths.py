"""The path benchmark: one cusparseattn call through each way a user reaches it, on bench.py's cases.

    python benchmarks/paths.py                                  # every case and path, 50 calls each
    python benchmarks/paths.py --cases local1024 --seqs 4096 --dims 64 --calls 200
    python benchmarks/paths.py --paths eager,compile,eager-train,compile-train --json paths.json
    python benchmarks/paths.py --smoke                          # tiny sizes on the CPU: every path, 2 calls

Paths (``layout`` is the case's Pattern, built once and passed to every call, as a user passes it):

- eager: torch tensors, ``ca.attention(q, k, v, layout)``.
- compile: ``torch.compile(lambda q, k, v: ca.attention(q, k, v, layout), fullgraph=True)``.
- cupy: CuPy arrays, ``ca.attention(q, k, v, layout)`` (CuPy's current stream: the legacy default stream).
- jax: ``jax.jit(lambda q, k, v: ca.attention(q, k, v, layout))`` on JAX GPU arrays.
- eager-train: q, k, v requiring grad, ``loss(q, k, v, grad).backward()`` with
  ``loss = lambda q, k, v, g: (ca.attention(q, k, v, layout) * g).sum()``: the step of the two below.
- compile-train: the same step with ``loss = torch.compile(loss, fullgraph=True)``: AOTAutograd compiles
  the backward too.
- jax-train: ``jax.jit(jax.grad(lambda q, k, v, g: (ca.attention(q, k, v, layout) * g).sum(),
  argnums=(0, 1, 2)))`` (``grad`` an argument, not a constant baked into the executable).

The train steps set the inputs' ``.grad`` to None first, as a training loop's ``zero_grad`` does; ``grad`` is
a fixed random array. Cases: dense, causal, local1024, strided8 (bench.py's patterns), S in {4096, 16384},
D in {128, 64}, bf16, B = 2, H = 16; every framework gets the same input values.

Columns:

- ms: wall time of ``--calls`` calls, synchronised once at the end, divided by the calls, after ``--warmup``
  calls (and a first call, untimed here).
- host ms: the time to issue a call while the GPU is held by a sleep kernel queued first on the stream the
  path launches on, so that no call waits for the GPU: ``--calls`` calls in rounds of 16, each round behind
  its own sleep (as host_time.py does): torch's ``torch.cuda._sleep`` on its current stream; a CuPy kernel
  spinning on ``clock64`` on CuPy's current stream; for JAX the same kernel launched on XLA's stream from a
  ``jax.experimental.buffer_callback`` (needs CuPy) while the calls are dispatched asynchronously. A sleep
  lasts 3 times the round's unheld issue time (at least 20 ms) and is checked afterwards: the first round
  whose sleep ended before its last call was issued goes again behind sleeps 4 times longer, and if a sleep
  ends early after that the row says "not held" (the path waited for the GPU, or a queue filled). Where no
  sleep can be queued (the CPU; JAX without CuPy) the figure is the time for the calls to return, and the
  row says so.
- x eager: ms over the eager forward's ms (forward paths) or over eager-train's (train paths), where that
  path ran too.
- TFLOP/s: ANCHORS.md's count over ms: forward ``4 * B * H * S * S * D * density``, density the fraction
  of 128 x 128 blocks visited (bench.py's layouts); a train step 3.5 times that.
- first s: the first call's seconds (synchronised): tracing and compiling for the compiled paths; the
  kernels' build falls to the first path of each case.
- max |d|: the largest absolute difference of the output (train paths: dq) from that of eager (eager-train).
- notes: the path's error or why it was skipped, a recompile during the timed calls, how host ms was held.

``--floor`` adds a row "<path> floor" after each path: the same path with cusparseattn's call replaced by
an operator that makes the outputs and launches nothing (`Floor`), registered as cusparseattn's are (a
``torch.autograd.Function`` in eager PyTorch, a ``torch.library`` operator with its fake and autograd under
``torch.compile``, ``buffer_callback`` in a ``jax.custom_vjp`` for JAX; CuPy's floor only allocates): the
host time that the framework's own machinery costs such a call.

``--profile N`` runs ``--calls`` more calls of each path under cProfile and prints, after the path's row,
the N functions with the most time of their own: where the host time of a call goes.

Each path imports its framework when it runs and is skipped, with the reason, when that framework or a GPU
is missing, or when a pass would fall to the host reference; a path that raises is reported in its row and the
others go on. cusparseattn must be importable (``pip install -e .``, or ``PYTHONPATH=.`` in the checkout).
``--json PATH`` writes every row. ``--smoke`` runs B = 1, H = 2, S = 256, D = 32, 2 calls, on the CPU (torch
CPU tensors and JAX CPU arrays on the NumPy reference; CuPy, which has no CPU arrays, skips).
XLA_PYTHON_CLIENT_PREALLOCATE is set to false unless set: JAX must not take the memory the torch and CuPy
paths of this process use.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import math
import os
import pstats
import sys
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402  (the benchmark's layouts and FLOP count)

from cusparseattn.testing import gpu_count  # noqa: E402

FORWARD = ["eager", "compile", "cupy", "jax"]
TRAIN = ["eager-train", "compile-train", "jax-train"]
PATHS = FORWARD + TRAIN
BASELINE = {**dict.fromkeys(FORWARD, "eager"), **dict.fromkeys(TRAIN, "eager-train")}
SEQS, DIMS = [4096, 16384], [128, 64]
SMOKE = {"batch": 1, "heads": 2, "seqs": [256], "dims": [32], "calls": 2, "warmup": 1}
MIN_SLEEP_MS, MAX_SLEEP_MS = 20.0, 30_000.0
# Calls issued behind one sleep, as host_time.py's rounds: JAX's dispatch blocked with 50 executions queued
# behind one (an H200, JAX 0.11; 20 passed), and the GPU's launch queue is finite too.
ROUND = 16
CALIBRATION_CYCLES = 10**7

# One thread spinning on the SM's cycle counter, as torch.cuda._sleep does.
SPIN_SOURCE = r"""
extern "C" __global__ void paths_bench_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


class Skipped(Exception):
    """A path that cannot run here; the message says why."""


class Runner:
    """One path on one case, ready to call.

    ``call()`` issues one call and returns what it made (None for a train step); ``sync(made)`` waits for all
    queued work; ``hold(ms)`` queues a sleep of about ``ms`` on the path's stream and returns a function that
    says whether it has ended (None: nothing can be held, ``note`` says why); ``sample(made)`` is the output
    (train: dq) as float32 NumPy; ``compiled()`` counts the compiled graphs or executables (None: not known).
    """

    def __init__(self, call, sync, sample, hold=None, note="", compiled=None):
        self.call, self.sync, self.sample, self.hold = call, sync, sample, hold
        self.note, self.compiled = note, compiled


# ---- holding the GPU ------------------------------------------------------------------------------------


class TorchSleep:
    """``torch.cuda._sleep`` on torch's current stream, in milliseconds (its cycles calibrated once)."""

    def __init__(self, torch):
        self.torch = torch
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        for _ in range(2):  # the first warms the clocks up
            start.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
        self.cycles_per_ms = CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)

    def __call__(self, ms: float):
        self.torch.cuda._sleep(int(ms * self.cycles_per_ms))
        ended = self.torch.cuda.Event()
        ended.record()
        return ended.query


class CupySleep:
    """A kernel spinning on ``clock64`` on CuPy's current stream, in milliseconds (calibrated once)."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.kernel = cupy.RawKernel(SPIN_SOURCE, "paths_bench_spin")
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(2):
            start.record()
            self.spin(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
        self.cycles_per_ms = CALIBRATION_CYCLES / max(self.cupy.cuda.get_elapsed_time(start, end), 1e-3)

    def spin(self, cycles: int) -> None:
        self.kernel((1,), (1,), (np.int64(cycles),))

    def __call__(self, ms: float):
        self.spin(int(ms * self.cycles_per_ms))
        ended = self.cupy.cuda.Event(disable_timing=True)
        ended.record()
        return lambda: ended.done


class JaxSleep:
    """The spinning kernel queued on XLA's stream: a jitted ``buffer_callback`` launches it on the stream XLA
    hands over. Its output is ready when the sleep has ended."""

    def __init__(self, jax, cupy, device):
        from jax.experimental.buffer_callback import buffer_callback

        self.spinner = CupySleep(cupy)
        self.cycles = 0

        def launch(ctx, out, x):
            with cupy.cuda.ExternalStream(int(ctx.stream)):
                self.spinner.spin(self.cycles)

        shape = jax.ShapeDtypeStruct((1,), np.float32)
        self.fn = jax.jit(buffer_callback(launch, shape, has_side_effect=True))
        self.x = jax.device_put(np.zeros(1, np.float32), device)
        jax.block_until_ready(self.queue(1.0))  # compiles it

    def queue(self, ms: float):
        self.cycles = int(ms * self.spinner.cycles_per_ms)
        return self.fn(self.x)

    def __call__(self, ms: float):
        return self.queue(ms).is_ready


_SLEEPS: dict = {}


def _sleep(name: str, make):
    """One calibrated sleep per framework for the whole run; an exception is kept and raised again."""
    if name not in _SLEEPS:
        try:
            _SLEEPS[name] = make()
        except Exception as err:  # noqa: BLE001 - reported as the path's note
            _SLEEPS[name] = err
    if isinstance(_SLEEPS[name], Exception):
        raise _SLEEPS[name]
    return _SLEEPS[name]


# ---- the paths ------------------------------------------------------------------------------------------


def _import(name: str):
    try:
        return __import__(name)
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install
        raise Skipped(f"{name} is not importable ({type(err).__name__}: {err})") from None


def _torch(smoke: bool):
    torch = _import("torch")
    if smoke:
        return torch, "cpu"
    if not torch.cuda.is_available():
        raise Skipped("torch sees no CUDA GPU (--smoke runs on the CPU)")
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    return torch, "cuda"


def _torch_runner(torch, device, call, sample):
    def sync(_made):
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        return Runner(call, sync, sample, hold=_sleep("torch", lambda: TorchSleep(torch)))
    return Runner(call, sync, sample, note="CPU: nothing to hold, host ms = the calls' time")


def _on_cuda(ca, q, k, v, layout, ops) -> None:
    """Skip a GPU path whose passes would not run on the CUDA kernels: the host reference at these sizes would
    take minutes a call, and is not what the benchmark is after."""
    for op in ops:
        chosen = ca.backends.current_backend(q, k, v, layout, op)
        if chosen != "cuda":
            why = "; ".join(ca.backends.why_not(q, k, v, layout, op)["cuda"])
            raise Skipped(f"the {op} would run on the {chosen!r} backend, not the CUDA kernels: {why}")


def _tensors(torch, device, host, names, grad: bool):
    def tensor(a):
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).to(device)
        return t.requires_grad_(True) if grad else t

    return [tensor(host[n]) for n in names]


def _from_torch(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _graphs(torch):
    from torch._dynamo.utils import counters

    return lambda: counters["stats"]["unique_graphs"]


def torch_forward(ca, layout, host, smoke: bool, compiled: bool) -> Runner:
    torch, device = _torch(smoke)
    q, k, v = _tensors(torch, device, host, "qkv", grad=False)
    if device == "cuda":
        _on_cuda(ca, q, k, v, layout, ["forward"])
    if compiled:
        torch._dynamo.reset()  # each case compiles afresh: no guards of earlier cases to walk
        fn = torch.compile(lambda q, k, v: ca.attention(q, k, v, layout), fullgraph=True)
    else:

        def fn(q, k, v):
            return ca.attention(q, k, v, layout)

    runner = _torch_runner(torch, device, lambda: fn(q, k, v), _from_torch)
    runner.compiled = _graphs(torch) if compiled else None
    return runner


def torch_train(ca, layout, host, smoke: bool, compiled: bool) -> Runner:
    torch, device = _torch(smoke)
    q, k, v = _tensors(torch, device, host, "qkv", grad=True)
    (grad,) = _tensors(torch, device, host, ["grad"], grad=False)
    if device == "cuda":
        _on_cuda(ca, q, k, v, layout, ["forward", "backward"])

    def loss(q, k, v, g):
        return (ca.attention(q, k, v, layout) * g).sum()

    if compiled:
        torch._dynamo.reset()
        loss = torch.compile(loss, fullgraph=True)

    def call():
        q.grad = k.grad = v.grad = None
        loss(q, k, v, grad).backward()

    runner = _torch_runner(torch, device, call, lambda _made: _from_torch(q.grad))
    runner.compiled = _graphs(torch) if compiled else None
    return runner


def cupy_forward(ca, layout, host, smoke: bool) -> Runner:
    if smoke:
        raise Skipped("--smoke runs on the CPU, and CuPy arrays live on a GPU")
    cupy = _import("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001 - CUDARuntimeError without a driver
        raise Skipped(f"CuPy finds no CUDA device ({type(err).__name__}: {err})") from None
    if count < 1:
        raise Skipped("CuPy finds no CUDA device")
    q, k, v = (cupy.asarray(host[n]) for n in "qkv")
    _on_cuda(ca, q, k, v, layout, ["forward"])

    def sync(_made):
        cupy.cuda.get_current_stream().synchronize()

    return Runner(
        lambda: ca.attention(q, k, v, layout),
        sync,
        lambda out: cupy.asnumpy(out).astype(np.float32),
        hold=_sleep("cupy", lambda: CupySleep(cupy)),
    )


def _jax(smoke: bool):
    jax = _import("jax")
    if smoke:
        return jax, jax.devices("cpu")[0], None, "CPU: not held, host ms = time for the async calls to return"
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as err:
        raise Skipped(f"JAX sees no GPU ({err})") from None
    try:
        cupy = __import__("cupy")
        hold = _sleep("jax", lambda: JaxSleep(jax, cupy, device))
        return jax, device, hold, ""
    except Exception as err:  # noqa: BLE001 - then the calls' return time is what can be measured
        why = f"{type(err).__name__}: {str(err)[:120]}"
        return jax, device, None, f"not held ({why}): host ms = time for the async calls to return"


def _jax_on_cuda(ca, smoke: bool, args, layout, ops) -> None:
    """`_on_cuda` on JAX GPU arrays, where it can tell (the choice is also made, and kept, as XLA traces)."""
    if smoke:
        return
    try:
        _on_cuda(ca, *args[:3], layout, ops)
    except Skipped:
        raise
    except Exception:  # noqa: BLE001 - the traced call chooses again, and raises what it finds
        pass


def _jax_runner(jax, fn, args, device, smoke: bool, hold, note, first) -> Runner:
    def sample(made):
        return np.asarray(first(made)).astype(np.float32)

    def call():
        return fn(*args)

    def call_on_device():
        # cusparseattn takes a traced array's device to be JAX's default one: on a host with a GPU that is
        # the GPU, whatever device the (CPU) arrays are on.
        with jax.default_device(device):
            return fn(*args)

    cache = getattr(fn, "_cache_size", None)
    chosen = call_on_device if smoke else call
    return Runner(chosen, jax.block_until_ready, sample, hold=hold, note=note, compiled=cache)


def jax_forward(ca, layout, host, smoke: bool) -> Runner:
    jax, device, hold, note = _jax(smoke)
    args = [jax.device_put(host[n], device) for n in "qkv"]
    _jax_on_cuda(ca, smoke, args, layout, ["forward"])
    fn = jax.jit(lambda q, k, v: ca.attention(q, k, v, layout))
    return _jax_runner(jax, fn, args, device, smoke, hold, note, lambda out: out)


def jax_train(ca, layout, host, smoke: bool) -> Runner:
    jax, device, hold, note = _jax(smoke)
    args = [jax.device_put(host[n], device) for n in ("q", "k", "v", "grad")]
    _jax_on_cuda(ca, smoke, args, layout, ["forward", "backward"])

    def loss(q, k, v, g):
        return (ca.attention(q, k, v, layout) * g).sum()

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return _jax_runner(jax, fn, args, device, smoke, hold, note, lambda grads: grads[0])


class Floor:
    """Stands in for the cusparseattn module on the floor rows (`--floor`): ``attention(q, k, v, layout)``
    makes out and lse (and the backward dq, dk, dv) as cusparseattn's does, through the same framework
    machinery, and computes nothing."""

    def __init__(self, ca):
        self.backends = ca.backends  # the paths' check that cusparseattn would run the CUDA kernels

    def attention(self, q, k, v, layout):
        kind = type(q).__module__.split(".")[0]
        if kind == "torch":
            return self._torch_attention(q, k, v)
        if kind == "cupy":
            import cupy

            cupy.empty(q.shape[:3], cupy.float32)  # the lse, which cusparseattn makes and drops here too
            return cupy.empty_like(q)
        return self._jax_attention(q, k, v)

    @functools.cached_property
    def _torch_attention(self):
        return _torch_floor()

    @functools.cached_property
    def _jax_attention(self):
        return _jax_floor()


def _torch_floor():
    import torch

    def forward(q, k, v):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward(dout, q, k, v, out, lse):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = forward(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            return backward(dout, *ctx.saved_tensors)

    lib = torch.library.Library("paths_bench_floor", "DEF")
    lib.define("forward(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")
    lib.define(
        "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) "
        "-> (Tensor, Tensor, Tensor)"
    )
    ops = torch.ops.paths_bench_floor
    for name, kernel in (("forward", forward), ("backward", backward)):
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"paths_bench_floor::{name}", kernel, lib=lib)

    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, *output)

    def grads(ctx, dout, _dlse):
        return ops.backward(dout, *ctx.saved_tensors)

    torch.library.register_autograd("paths_bench_floor::forward", grads, setup_context=setup_context, lib=lib)

    def attention(q, k, v):
        if torch.compiler.is_compiling():
            return ops.forward(q, k, v)[0]
        return Eager.apply(q, k, v)

    attention.library = lib  # the operators live as long as the library object does
    return attention


def _jax_floor():
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    def nothing(ctx, outputs, *args):
        pass

    def shapes(*arrays):
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)

    @jax.custom_vjp
    def attention(q, k, v):
        return forward(q, k, v)[0]

    def forward(q, k, v):
        lse = jax.ShapeDtypeStruct(q.shape[:3], np.float32)
        out, lse = buffer_callback(nothing, (shapes(q)[0], lse))(q, k, v)
        return out, (q, k, v, out, lse)

    def backward(saved, dout):
        return buffer_callback(nothing, shapes(*saved[:3]))(dout, *saved)

    attention.defvjp(forward, backward)
    return attention


MAKERS = {
    "eager": lambda *a: torch_forward(*a, compiled=False),
    "compile": lambda *a: torch_forward(*a, compiled=True),
    "cupy": cupy_forward,
    "jax": jax_forward,
    "eager-train": lambda *a: torch_train(*a, compiled=False),
    "compile-train": lambda *a: torch_train(*a, compiled=True),
    "jax-train": jax_train,
}


# ---- measuring ------------------------------------------------------------------------------------------


def _issue(runner: Runner, calls: int) -> tuple[float, object]:
    """Seconds to issue `calls` calls, and what the last one made (not waited for)."""
    start = time.perf_counter()
    made = None
    for _ in range(calls):
        made = runner.call()
    return time.perf_counter() - start, made


def held_issue(runner: Runner, calls: int, unheld_s: float) -> tuple[float, bool, float]:
    """``(host ms a call, held, the last sleep's ms)``: `calls` calls issued in rounds of `ROUND`, each round
    behind a sleep of 3 times its unheld issue time (`unheld_s` a call). The first round whose sleep ends
    before its last call was issued goes again behind sleeps 4 times longer (once: a path that waits for the
    GPU would wait for every sleep); held is False if any round's sleep ended early.
    """
    sleep_ms = min(max(MIN_SLEEP_MS, 3e3 * unheld_s * ROUND), MAX_SLEEP_MS)
    total, issued, held, retry = 0.0, 0, True, True
    while issued < calls:
        count = min(ROUND, calls - issued)
        while True:
            ended = runner.hold(sleep_ms)
            seconds, made = _issue(runner, count)
            over = ended()
            runner.sync(made)
            del made
            if not over or not retry or sleep_ms >= MAX_SLEEP_MS:
                break
            sleep_ms, retry = min(4 * sleep_ms, MAX_SLEEP_MS), False
        total, issued, held = total + seconds, issued + count, held and not over
    return total / calls * 1e3, held, sleep_ms


def profile(runner: Runner, calls: int, top: int) -> str:
    """cProfile's table of `calls` more calls (synchronised once at the end): the `top` functions by the time
    spent in them, not in what they call, per call."""
    profiler = cProfile.Profile()
    made = None
    profiler.enable()
    for _ in range(calls):
        made = runner.call()
    profiler.disable()
    runner.sync(made)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def measure(runner: Runner, calls: int, warmup: int, row: dict, top: int = 0) -> None:
    """Fills `row` with the path's first-call seconds, ms a call, host ms a call and its output sample (and
    with its profile, `top` functions, if `top`)."""
    start = time.perf_counter()
    made = runner.call()
    runner.sync(made)
    row["first_s"] = time.perf_counter() - start
    for _ in range(warmup):
        made = runner.call()
    runner.sync(made)
    row["sample"] = runner.sample(made)
    del made
    before = runner.compiled() if runner.compiled else None

    start = time.perf_counter()
    issued, made = _issue(runner, calls)
    runner.sync(made)
    row["ms"] = (time.perf_counter() - start) / calls * 1e3
    del made

    if runner.hold is None:
        row["host_ms"], row["held"] = issued / calls * 1e3, None
    else:
        row["host_ms"], row["held"], row["sleep_ms"] = held_issue(runner, calls, issued / calls)
    if before is not None:
        row["recompiles"] = runner.compiled() - before
    if top:
        row["profile"] = profile(runner, calls, top)


def run_path(ca, path: str, layout, host, args, row: dict) -> None:
    try:
        runner = MAKERS[row["path"].split()[0]](ca, layout, host, args.smoke)
    except Skipped as why:
        row["status"], row["reason"] = "skipped", str(why)
        return
    except Exception as err:  # noqa: BLE001 - a path that cannot start is reported, not fatal
        _failed(row, err)
        return
    row["status"] = "ok"
    if runner.note:
        row["notes"].append(runner.note)
    try:
        measure(runner, args.calls, args.warmup, row, args.profile)
    except Exception as err:  # noqa: BLE001 - a path that fails is reported, not fatal
        _failed(row, err)
    if row.get("held") is False:
        row["notes"].append("not held: the sleep ended before the last call was issued")
    if row.get("recompiles"):
        row["notes"].append(f"{row['recompiles']} recompile(s) during the timed calls")


def _failed(row: dict, err: Exception) -> None:
    row["status"], row["error"] = "error", f"{type(err).__name__}: {err}"
    row["traceback"] = traceback.format_exc()


def _free_memory() -> None:
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.empty_cache()
    if "cupy" in sys.modules and gpu_count():  # CuPy without a driver has no pool to free
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def host_inputs(batch: int, heads: int, seq: int, dim: int) -> dict:
    """q, k, v and the train steps' grad: bf16 NumPy arrays (ml_dtypes), the same for every framework."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    shape = (batch, heads, seq, dim)
    return {
        n: rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
        for n in ("q", "k", "v", "grad")
    }


def run(args) -> list[dict]:
    import cusparseattn as ca

    rows = []
    for dim in args.dims:
        for seq in args.seqs:
            host = host_inputs(args.batch, args.heads, seq, dim)
            for case in args.cases:
                rows += run_case(ca, case, seq, dim, host, args)
    return rows


def run_case(ca, case: str, seq: int, dim: int, host: dict, args) -> list[dict]:
    """The rows of every path of `args.paths` on one case (each followed by its floor's, with `--floor`)."""
    layout = bench.pattern(case, seq)  # the Pattern: built once, passed to every call of every path
    density = layout.layout(seq).density
    flops = 4 * args.batch * args.heads * seq * seq * dim * density
    rows = {}
    for name in args.paths:
        for path, module in ((name, ca), (f"{name} floor", args.floor)):
            if module is None:
                continue
            row = {
                "case": case,
                "S": seq,
                "D": dim,
                "B": args.batch,
                "H": args.heads,
                "density": density,
                "path": path,
                "train": name in TRAIN,
                "calls": args.calls,
                "warmup": args.warmup,
                "notes": [],
            }
            run_path(module, path, layout, host, args, row)
            _free_memory()
            if "ms" in row and module is ca:
                row["tflops"] = (bench.BACKWARD_FLOPS if row["train"] else 1) * flops / row["ms"] / 1e9
            rows[path] = row
            print(f"  {case} S={seq} D={dim} {path}: {_cell(row)}", file=sys.stderr, flush=True)
            if "profile" in row:
                print(row.pop("profile"), file=sys.stderr, flush=True)
    _compare(rows)
    return list(rows.values())


def _compare(case_rows: dict) -> None:
    """Each row's ratio to its baseline's ms and the largest difference of its sample from the baseline's."""
    for row in case_rows.values():
        base = case_rows.get(BASELINE.get(row["path"]))  # a floor's outputs are not computed: no ratio
        if base is None or "ms" not in base or "ms" not in row:
            continue
        row["ratio"] = row["ms"] / base["ms"]
        if "sample" in base and "sample" in row and base["sample"].shape == row["sample"].shape:
            row["max_diff"] = float(np.max(np.abs(row["sample"] - base["sample"])))
    for row in case_rows.values():
        row.pop("sample", None)


# ---- output ---------------------------------------------------------------------------------------------


def _cell(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row['reason']}"
    if row["status"] == "error":
        # A callback's error carries its traceback in the message: the exception is its last line.
        lines = [line.strip() for line in row["error"].splitlines() if line.strip()]
        return f"error: {lines[0] if len(lines) == 1 else f'{lines[0][:100]} ... {lines[-1]}'}"
    return f"{row['ms']:.3f} ms, host {row['host_ms']:.3f} ms"


def _number(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["case", "S", "D", "density", "path", "ms", "host ms", "x eager", "TFLOP/s", "first s", "max |d|"]
    lines = ["| " + " | ".join([*head, "notes"]) + " |", "|" + " --- |" * (len(head) + 1)]
    for r in rows:
        notes = list(r["notes"])
        if r["status"] != "ok":
            notes.insert(0, _cell(r).replace("\n", " ")[:300])
        tflops = r.get("tflops")
        cells = [
            r["case"],
            str(r["S"]),
            str(r["D"]),
            f"{r['density']:.3f}",
            r["path"],
            _number(r.get("ms"), ".3f"),
            _number(r.get("host_ms"), ".3f"),
            _number(r.get("ratio"), ".2f"),
            _number(tflops, ".1f" if tflops is not None and tflops >= 1 else ".3g"),
            _number(r.get("first_s"), ".2f"),
            _number(r.get("max_diff"), ".3g"),
            "; ".join(notes).replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for name in ("cusparseattn", "torch", "cupy", "jax"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "?")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    return out


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {minimum}, got {text!r}")
        return value

    return parse


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cases = ",".join(bench.CASES)
    parser.add_argument(
        "--cases",
        type=lambda s: bench.comma_names(s, bench.CASES, "--cases"),
        default=bench.CASES,
        help=f"from {cases}",
    )
    parser.add_argument("--seqs", type=bench.comma_ints, help="sequence lengths (default 4096,16384)")
    parser.add_argument("--dims", type=bench.comma_ints, help="head dims (default 128,64)")
    parser.add_argument(
        "--paths",
        type=lambda s: bench.comma_names(s, PATHS, "--paths"),
        default=PATHS,
        help=f"from {','.join(PATHS)} (default all)",
    )
    parser.add_argument("--calls", type=_count(1), help="timed calls per path (default 50)")
    parser.add_argument("--warmup", type=_count(0), help="calls after the first, before timing (default 5)")
    parser.add_argument("--json", type=Path, help="write every row to this file")
    parser.add_argument("--floor", action="store_true", help="a floor row after each path (see above)")
    parser.add_argument(
        "--profile",
        type=_count(1),
        default=0,
        metavar="N",
        help="print each path's cProfile: its top N functions",
    )
    parser.add_argument("--smoke", action="store_true", help="B=1 H=2 S=256 D=32, 2 calls, on the CPU")
    args = parser.parse_args(argv)
    smoke = SMOKE if args.smoke else {}
    args.batch, args.heads = smoke.get("batch", bench.B), smoke.get("heads", bench.H)
    args.seqs = args.seqs or smoke.get("seqs", SEQS)
    args.dims = args.dims or smoke.get("dims", DIMS)
    args.calls = args.calls or smoke.get("calls", 50)
    args.warmup = smoke.get("warmup", 5) if args.warmup is None else args.warmup

    args.floor = Floor(__import__("cusparseattn")) if args.floor else None
    start = time.perf_counter()
    rows = run(args)
    versions = _versions()
    print(", ".join(f"{k} {v}" for k, v in versions.items()))
    print(
        f"B={args.batch} H={args.heads} bf16, {args.calls} calls after {args.warmup} warm-up"
        f"{' (smoke, CPU)' if args.smoke else ''}, {time.perf_counter() - start:.0f} s\n"
    )
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        settings["floor"] = args.floor is not None
        report = {"versions": versions, "args": settings, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1))
    return rows


if __name__ == "__main__":
    main()
