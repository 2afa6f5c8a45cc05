"""cusparseattn against its peers on one GPU, with the protocol of ANCHORS.md.

    python benchmarks/bench.py                       # every part below (each prints its seconds)
    python benchmarks/bench.py --quick               # S = 4096 only: compile time and the cases
    python benchmarks/bench.py --cases local1024,strided8 --seqs 16384 --dims 128
    python benchmarks/bench.py --only train-memory   # parts: compile mods cases sweep memory train-memory
    python benchmarks/bench.py --no-backward         # forward only
    python benchmarks/bench.py --peers cusparseattn,flex  # whom the cases time (benchmarks/ab.py uses it)
    python benchmarks/bench.py --only cases --repeats 5   # each case timed 5 times, the peers in turn
    python benchmarks/bench.py --out DIR             # where bench.json and bench.png go (default: .)
    python benchmarks/bench.py --only cases --dtype float32  # the cases on float32 tensors (TF32, "high")

Parts:

- compile: the first call of an unseen mask function (traced, classified, compiled and run): the process's
  first, another's, and a third's training step; and a cached call's host time.
- mods: packed documents (causal in each) with ALiBi and tanh soft-capping at S = 8192, D = 128, against
  FlexAttention with the same mods: first-call seconds (compiling for the mods), then TFLOP/s.
- cases: dense, causal, local1024, strided8 and documents (8 packed documents cut at random tokens, causal
  in each, GQA with 4 key and value heads to 16 query heads, the mask function reading a captured tensor of
  document ids) at S = 4096 and 16384, D = 128 and 64; forward and forward+backward TFLOP/s of cusparseattn
  and each peer, and cusparseattn / Flex for both.
- sweep: forward time against density (S = 16384, D = 128, windows from S/64 to dense).
- memory: peak extra GPU memory of one forward at S = 4096, 16384, 65536.
- train-memory: the same for one forward+backward (B = 1, H = 16, D = 128, causal and local1024, S = 16384,
  32768, 65536), less the gradients dq, dk, dv; bytes per token stay flat when it is O(S).
- precision: float32 inputs (causal, B = 1, H = 8, S = 4096, D = 64 and 128): the error of the output and
  the gradients against float64, for cusparseattn at "high" and "highest", SDPA (its own float32 kernel, and
  its math backend at TF32) and Flex; then float64 CUDA tensors, cusparseattn (the reference on the GPU)
  against the host round trip (copies to NumPy, the reference there, copies back).

Timing: ``triton.testing.do_bench`` (median); forward with warmup 25 ms and rep 100 ms under ``no_grad``,
forward+backward (the forward, then ``out.backward(grad)`` with a fixed random ``grad``; the inputs' ``.grad``
reset before each call) with warmup 10 ms and rep 50 ms. FLOPs count attended work only: forward
``4 * B * H * S * S * D * density``, density being the fraction of 128 x 128 blocks visited; forward+backward
3.5 times that. With ``--repeats N`` each case's peers are timed in turn N times and the figures are the
medians (``bench.json`` keeps each timing), so that a drift of the GPU's clocks weighs on all. Peers, each
when importable: FlexAttention (``torch.compile``, Triton backend), "flexfa4" FlexAttention with
``kernel_options={"BACKEND": "FLASH"}`` (its mask compiled into FlashAttention-4: needs ``flash_attn.cute``),
SDPA with the flash backend (dense and causal only), FlashAttention-4 (``flash_attn.cute``: dense, causal,
sliding window); on an H100/H200 also "portable", cusparseattn's mma.sync kernels beside its Hopper ones;
and "mask", cusparseattn given the case as a FlexAttention user writes it, the mask function that Flex gets
(`token_rule`: every case but dense), in place of its built-in pattern. bf16 (``--dtype``), B = 2, H = 16.
With ``--dtype float32`` PyTorch's float32 matmul precision is "high" (TF32, every peer's and cusparseattn's
default), SDPA runs the backend it picks for float32, and the peers that take half precision only
(FlashAttention-4, Flex+FA4; "portable", which is what runs float32 on Hopper) are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

B, H = 2, 16
CASES = ["dense", "causal", "local1024", "strided8", "documents"]
GQA = {"documents": 4}  # the key and value heads of the cases with fewer of them than of queries
DOCUMENTS = 8  # packed in each sequence of the "documents" case
PARTS = ["compile", "mods", "cases", "sweep", "memory", "train-memory", "precision"]
DTYPES = ["bfloat16", "float16", "float32"]
HALF_ONLY = ("flexfa4", "fa4", "portable")  # peers left out of float32 cases
# "portable": cusparseattn's mma.sync kernels on a Hopper GPU, beside its Hopper ones (CUSPARSEATTN_HOPPER=0).
PEERS = ["cusparseattn", "portable", "mask", "flex", "flexfa4", "sdpa", "fa4"]
PASSES = {"fwd": "forward", "fwdbwd": "forward+backward"}
FIRSTS = (("call", "first_call_s"), ("step", "first_step_s"))  # seconds of each peer's first call and step
BACKWARD_FLOPS = 3.5  # forward+backward FLOPs per forward FLOP: 2 matmuls forward, 5 backward
# Bytes per token that one forward+backward must hold at H = 16, D = 128 (bf16): the saved output, its
# float32 log-sum-exp and the backward's float32 delta = rowsum(dout * out).
SAVED_PER_TOKEN = H * (128 * 2 + 4 + 4)
MEMORY_SEQS = (4096, 16384, 65536)  # forward memory
TRAIN_MEMORY_SEQS = (16384, 32768, 65536)  # forward+backward memory


@functools.cache
def document_ids(seq: int) -> np.ndarray:
    """The "documents" case's document of each token: `DOCUMENTS` documents cut at random tokens."""
    rng = np.random.default_rng(seq)
    cuts = np.sort(rng.choice(np.arange(1, seq), size=DOCUMENTS - 1, replace=False))
    return np.repeat(np.arange(DOCUMENTS, dtype=np.int32), np.diff([0, *cuts, seq]))


@functools.cache
def token_rule(case: str, seq: int):
    """The case as a FlexAttention mask_mod (token level), one function object per case and length."""
    if case == "causal":
        return lambda b, h, q, k: q >= k
    if case == "local1024":
        return lambda b, h, q, k: (q >= k) & (q - k < 1024)
    if case == "strided8":
        return lambda b, h, q, k: (q >= k) & ((q // 128 - k // 128 < 8) | (k // 128 % 8 == 7))
    if case == "documents":
        import torch

        ids = torch.as_tensor(document_ids(seq), device="cuda" if torch.cuda.is_available() else "cpu")
        return lambda b, h, q, k: (q >= k) & (ids[q] == ids[k])
    return None


def pattern(case: str, seq: int):
    from cusparseattn import patterns

    if case == "documents":
        return patterns.document(document_ids(seq), causal=True, block=128)
    return {
        "dense": patterns.dense(block=128),
        "causal": patterns.causal(block=128),
        "local1024": patterns.local(window=1024, block=128),
        "strided8": patterns.strided_blocks(stride_blocks=8, block=128),
    }[case]


def bench(fn, fwd_only=True, grad_to_none=None) -> float:
    import triton

    warmup, rep = (25, 100) if fwd_only else (10, 50)
    return triton.testing.do_bench(
        fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"
    )


def _first(out):
    """The attention output of a call that may also return the log-sum-exp."""
    return out[0] if isinstance(out, tuple) else out


def backward_reasons(q, k, v, layout) -> list[str]:
    """Why cusparseattn's CUDA backward cannot run on these inputs (empty when it can)."""
    from cusparseattn import backends

    return backends.why_not(q, k, v, layout, op="backward")["cuda"]


@functools.cache
def compiled_flex():
    """One compiled flex_attention for the whole run: every case shares its cache of specialisations."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def peers(case: str, q, k, v, names=PEERS) -> tuple[dict, list]:
    """``({name: callable}, leaves)``: each peer of `names` that can run this case as a call returning its
    output (or ``(out, lse)``), differentiable when q, k, v require grad; leaves are the tensors the backward
    fills."""
    import torch.nn.functional as F

    out, leaves = {}, [q, k, v]
    if "flex" in names or "flexfa4" in names:
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            flex = compiled_flex()
            seq = q.shape[2]
            mod = token_rule(case, seq)
            mask = None if mod is None else create_block_mask(mod, None, None, seq, seq, BLOCK_SIZE=128)
            gqa = k.shape[1] != q.shape[1]
            if "flex" in names:
                out["flex"] = lambda: flex(q, k, v, block_mask=mask, enable_gqa=gqa)
            if "flexfa4" in names:
                # Without FlashAttention-4 installed its first call raises: reported as that peer's failure.
                fa4 = {"BACKEND": "FLASH"}
                out["flexfa4"] = lambda: flex(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=fa4)
        except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            print(f"  flex unavailable: {err}")
    if case in ("dense", "causal") and "sdpa" in names:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # Flash takes half precision only; float32 runs what SDPA itself picks for it.
        half = q.element_size() == 2
        flash = functools.partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)
        chosen = flash if half else contextlib.nullcontext

        def sdpa():
            with chosen():
                return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        out["sdpa"] = sdpa
    try:
        from flash_attn.cute import flash_attn_func

        if case in ("dense", "causal", "local1024") and "fa4" in names:
            # FA4 takes [B, S, H, D]: contiguous copies, leaves of their own for the backward.
            qt, kt, vt = (
                x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v)
            )
            leaves += [qt, kt, vt]
            window = (1023, 0) if case == "local1024" else (None, None)
            out["fa4"] = lambda: flash_attn_func(qt, kt, vt, causal=case == "causal", window_size=window)
    except ImportError:
        pass
    return out, leaves


@contextlib.contextmanager
def _kernels_of(name: str):
    """The portable kernels while a "portable" peer is timed; nothing otherwise."""
    if name != "portable":
        yield
        return
    old = os.environ.get("CUSPARSEATTN_HOPPER")
    os.environ["CUSPARSEATTN_HOPPER"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUSPARSEATTN_HOPPER"]
        else:
            os.environ["CUSPARSEATTN_HOPPER"] = old


def _on_hopper(device: int) -> bool:
    from cusparseattn import devices

    return not devices.hopper_device_reasons(device)


def measure_case(case: str, q, k, v, backward: bool, names=PEERS, repeats: int = 1) -> dict:
    """One row: forward (and forward+backward) TFLOP/s of each of `names` (ours, peers) on this case, the
    median of `repeats` timings taken in turn."""
    import torch

    import cusparseattn as ca

    batch, heads, seq, dim = q.shape
    layout = pattern(case, seq).layout(seq)
    flops = 4 * batch * heads * seq * seq * dim * layout.density
    row = {
        "case": case,
        "S": seq,
        "D": dim,
        "density": layout.density,
        "kv_heads": k.shape[1],
        "fwd": {},
        "fwdbwd": {},
        "repeats": repeats,
    }
    others, leaves = peers(case, q, k, v, names)
    where = f"{case} S={seq} D={dim}"
    ours = functools.partial(ca.attention_forward, q, k, v, layout)
    portable = {"portable": ours} if "portable" in names and _on_hopper(q.device.index or 0) else {}
    spelled = token_rule(case, seq) if "mask" in names else None
    mask = {} if spelled is None else {"mask": functools.partial(ca.attention_forward, q, k, v, spelled)}
    forward = {**({"cusparseattn": ours} if "cusparseattn" in names else {}), **portable, **mask, **others}

    def forward_ms(name, fn):
        with torch.no_grad(), _kernels_of(name):
            return bench(fn)

    row["first_call_s"] = _first_seconds(forward, lambda fn: _first(fn()))

    row["fwd"], row["fwd_each"] = _in_turn(forward, forward_ms, flops, repeats, f"forward failed on {where}")
    if not backward:
        return row
    training = dict(others)
    reasons = backward_reasons(q, k, v, layout)
    if reasons:
        print(f"  cusparseattn backward cannot run on {where}: {'; '.join(reasons)}")
    else:
        # Forced: a backward that cannot run on the GPU raises rather than timing the host reference.
        ours = functools.partial(ca.attention, q, k, v, layout, backend="cuda")
        training = {**{name: ours for name in ("cusparseattn", "portable") if name in forward}, **others}
        if "mask" in forward:
            training["mask"] = functools.partial(ca.attention, q, k, v, spelled, backend="cuda")
    gen = torch.Generator(device=q.device)
    grads = {}

    def step_ms(name, fn):
        if name not in grads:
            out = _first(fn())
            grads[name] = torch.randn(
                out.shape, device=out.device, dtype=out.dtype, generator=gen.manual_seed(0)
            )
            del out  # and the graph it holds

        def step():
            _first(fn()).backward(grads[name])

        try:
            with _kernels_of(name):
                return bench(step, fwd_only=False, grad_to_none=leaves)
        finally:
            for x in leaves:
                x.grad = None

    def first_step(fn):
        _first(fn()).sum().backward()
        for x in leaves:
            x.grad = None

    row["first_step_s"] = _first_seconds(training, first_step)
    failed = f"forward+backward failed on {where}"
    row["fwdbwd"], row["fwdbwd_each"] = _in_turn(training, step_ms, BACKWARD_FLOPS * flops, repeats, failed)
    return row


def _first_seconds(fns: dict, call) -> dict:
    """``{name: seconds}`` of each of `fns`'s first call, ``call(fn)`` (compiling what it needs), with the
    GPU's work; a name whose call raises is left out here (`_in_turn` reports it)."""
    import torch

    seconds = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        try:
            with _kernels_of(name):
                call(fn)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001, S112 - _in_turn times the same call and reports why it fails
            continue
        seconds[name] = time.perf_counter() - start
    return seconds


def _in_turn(fns: dict, time_ms, flops: float, repeats: int, failed: str) -> tuple[dict, dict]:
    """``({name: TFLOP/s}, {name: [TFLOP/s of each timing]})``: the median of `repeats` timings
    ``time_ms(name, fn)`` of each of `fns`, taken in turn (every name once, then again), so that a drift of
    the GPU's clocks weighs on all of them alike. A name whose call raises is reported and left out."""
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if times[name] is None:
                continue
            try:
                if not times[name]:
                    time_ms(name, fn)  # untimed: compiles, and makes the first call's allocations
                times[name].append(time_ms(name, fn))
            except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                print(f"  {name} {failed}: {str(err)[:200]}")
                times[name] = None
    each = {name: [flops / t / 1e9 for t in ms] for name, ms in times.items() if ms}
    return {name: statistics.median(values) for name, values in each.items()}, each


def _ratio(row: dict, pass_: str, against: str = "flex") -> float:
    """``ours / against`` (Flex's), or for ``"mask"`` the mask function's figure over the built-in's."""
    ours, other = row[pass_].get("cusparseattn"), row[pass_].get(against)
    if against == "mask":
        ours, other = other, ours
    return ours / other if ours and other else math.nan


def run_cases(seqs, dims, cases, backward: bool, results, names=PEERS, repeats: int = 1, dtype="bfloat16"):
    import torch

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    dtype = getattr(torch, dtype)
    if dtype == torch.float32:
        torch.set_float32_matmul_precision("high")
        names = [n for n in names if n not in HALF_ONLY]
    for dim in dims:
        for seq in seqs:
            q, k, v = (
                torch.randn(B, H, seq, dim, device="cuda", dtype=dtype, requires_grad=backward)
                for _ in range(3)
            )
            for case in cases:
                # GQA cases take the first of the heads as their own leaves.
                kv = (k, v)
                if case in GQA:
                    kv = [x[:, : GQA[case]].detach().clone().requires_grad_(backward) for x in kv]
                row = measure_case(case, q, *kv, backward, names, repeats)
                row["dtype"] = str(dtype).removeprefix("torch.")
                results["cases"].append(row)
                parts = []
                for pass_, values in ((p, row[p]) for p in PASSES):
                    if values:
                        figures = " ".join(f"{n} {values[n]:6.1f}" for n in PEERS if n in values)
                        ratio = _ratio(row, pass_)
                        versus = "" if math.isnan(ratio) else f" (x{ratio:.2f} flex)"
                        spelled = _ratio(row, pass_, "mask")
                        versus += "" if math.isnan(spelled) else f" (mask x{spelled:.2f} pattern)"
                        parts.append(f"{pass_}: {figures}{versus}")
                firsts = [(what, row.get(key, {}).get("mask")) for what, key in FIRSTS]
                parts += [f"mask's first {what} {s:.2f} s" for what, s in firsts if s is not None]
                print(
                    f"{case:10} S={seq:6} D={dim:4} d={row['density']:.3f} | {' | '.join(parts)}", flush=True
                )


def density_sweep(results):
    """S = 16384, D = 128: forward time against density, windows from S/64 to dense."""
    import torch

    import cusparseattn as ca
    from cusparseattn import patterns

    seq, dim = 16384, 128
    q, k, v = (torch.randn(B, H, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dense_ms = bench(lambda: ca.attention_forward(q, k, v, patterns.dense(block=128).layout(seq)))
    for frac in (64, 32, 16, 8, 4, 2, 1):
        layout = patterns.local(window=seq // frac, causal=False, block=128).layout(seq)
        with torch.no_grad():
            ms = bench(lambda layout=layout: ca.attention_forward(q, k, v, layout))
        bound = 1.3 * layout.density * dense_ms + 0.05
        results["sweep"].append(
            {"window": seq // frac, "density": layout.density, "ms": ms, "bound_ms": bound}
        )
        print(
            f"sweep window {seq // frac:6}: density {layout.density:.3f} {ms:8.3f} ms "
            f"(1.3 x d x dense + 50 us = {bound:.3f}) {'ok' if ms <= bound else 'OVER'}",
            flush=True,
        )


def memory(results):
    """Peak extra GPU memory of one forward against S (must grow as O(S))."""
    import torch

    import cusparseattn as ca
    from cusparseattn import patterns

    for seq in MEMORY_SEQS:
        q, k, v = (torch.randn(1, H, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        layout = patterns.local(window=1024, block=128).layout(seq)
        ca.attention_forward(q, k, v, layout)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ca.attention_forward(q, k, v, layout)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        results["memory"].append({"S": seq, "extra_bytes": extra, "per_token": extra / seq})
        print(
            f"memory S={seq:6}: peak extra {extra / 2**20:8.1f} MiB ({extra / seq:.0f} B/token)", flush=True
        )


def train_memory(results):
    """Peak extra GPU memory of one forward+backward through `cusparseattn.attention` against S (B = 1).

    Extra is ``max_memory_allocated`` during the call less what was allocated before it (q, k, v and the
    output gradient) and less the gradients dq, dk, dv it leaves: what attention itself holds (the saved
    output and log-sum-exp, the backward's scratch). The device tables of a layout live in CuPy's pool,
    outside torch's count: reported apart, once per layout.
    """
    import torch

    import cusparseattn as ca
    from cusparseattn import patterns

    try:
        import cupy

        pool = cupy.get_default_memory_pool()
    except ImportError:
        pool = None
    cases = {"causal": patterns.causal(block=128), "local1024": patterns.local(window=1024, block=128)}
    for name, pat in cases.items():
        for seq in TRAIN_MEMORY_SEQS:
            q, k, v = (
                torch.randn(1, H, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            grad = torch.randn_like(q)
            layout = pat.layout(seq)
            reasons = backward_reasons(q, k, v, layout)
            if reasons:
                print(f"train memory {name} S={seq}: cusparseattn backward cannot run: {'; '.join(reasons)}")
                return
            held = pool.used_bytes() if pool is not None else 0
            ca.attention(q, k, v, layout, backend="cuda").backward(grad)  # compiles, uploads the layout
            torch.cuda.synchronize()
            tables = pool.used_bytes() - held if pool is not None else None
            q.grad = k.grad = v.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ca.attention(q, k, v, layout, backend="cuda").backward(grad)
            torch.cuda.synchronize()
            grads = sum(x.grad.numel() * x.grad.element_size() for x in (q, k, v))
            extra = torch.cuda.max_memory_allocated() - base - grads
            results["train_memory"].append(
                {
                    "case": name,
                    "S": seq,
                    "extra_bytes": extra,
                    "per_token": extra / seq,
                    "grads_bytes": grads,
                    "cupy_tables_bytes": tables,
                }
            )
            in_cupy = "?" if tables is None else f"{tables / 2**20:.2f}"
            print(
                f"train memory {name:9} S={seq:6}: peak extra {extra / 2**20:8.1f} MiB "
                f"({extra / seq:.0f} B/token, {SAVED_PER_TOKEN} expected; dq, dk, dv {grads / 2**20:.0f} MiB "
                f"apart; layout tables in CuPy {in_cupy} MiB)",
                flush=True,
            )
            del q, k, v, grad
    for name in cases:
        per_token = [r["per_token"] for r in results["train_memory"] if r["case"] == name]
        if len(per_token) > 1 and min(per_token) > 0:
            spread = max(per_token) / min(per_token)
            verdict = "O(S)" if spread < 1.1 else "NOT O(S)"
            print(
                f"train memory {name}: bytes per token vary x{spread:.3f} over S in {TRAIN_MEMORY_SEQS}: "
                f"{verdict}"
            )


def precision(results, seq: int = 4096, heads: int = 8):
    """float32's error against float64 (causal, B = 1), each of ours and the peers', on the output and the
    gradients (the largest absolute difference over the largest magnitude of float64's); then float64 on the
    GPU against the host round trip."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    import cusparseattn as ca
    from cusparseattn import patterns

    layout = patterns.causal(block=128).layout(seq)
    flex = compiled_flex()
    mask = create_block_mask(token_rule("causal", seq), None, None, seq, seq, BLOCK_SIZE=128)

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run

    calls = {
        "cusparseattn high": ("high", lambda q, k, v: ca.attention(q, k, v, layout, backend="cuda")),
        "cusparseattn highest": ("highest", lambda q, k, v: ca.attention(q, k, v, layout, backend="cuda")),
        "sdpa (its float32 kernel)": ("high", sdpa(SDPBackend.EFFICIENT_ATTENTION)),
        "sdpa math, TF32": ("high", sdpa(SDPBackend.MATH)),
        "flex": ("high", lambda q, k, v: flex(q, k, v, block_mask=mask)),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dim in (64, 128):
        inputs = [torch.randn(1, heads, seq, dim, device="cuda", generator=gen) for _ in range(4)]
        leaves = [x.double().requires_grad_() for x in inputs[:3]]
        with sdpa_kernel(SDPBackend.MATH):
            exact = F.scaled_dot_product_attention(*leaves, is_causal=True)
        exact_grads = torch.autograd.grad(exact, leaves, inputs[3].double())
        exact = [exact.detach(), *exact_grads]
        row = {"S": seq, "D": dim, "H": heads, "errors": {}}
        for name, (matmul, fn) in calls.items():
            torch.set_float32_matmul_precision(matmul)
            q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
            try:
                out = _first(fn(q, k, v))
                got = [out.detach(), *torch.autograd.grad(out, (q, k, v), inputs[3])]
            except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                print(f"precision: {name} failed at D={dim}: {str(err)[:200]}")
                continue
            finally:
                torch.set_float32_matmul_precision("high")
            row["errors"][name] = {
                part: ((g.double() - e).abs().max() / e.abs().max()).item()
                for part, g, e in zip(("out", "dq", "dk", "dv"), got, exact, strict=True)
            }
        results["precision"].append(row)
        for name, errs in row["errors"].items():
            figures = " ".join(f"{part} {err:.2e}" for part, err in errs.items())
            print(f"precision D={dim} {name:26} | {figures}", flush=True)
    q, k, v = (x.double() for x in inputs[:3])
    ca.attention_forward(q, k, v, layout)  # builds the reference's GPU code
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        ca.attention_forward(q, k, v, layout)
    torch.cuda.synchronize()
    gpu_s = (time.perf_counter() - start) / 3
    start = time.perf_counter()
    host = [x.cpu().numpy() for x in (q, k, v)]
    out, lse = ca.attention_forward(*host, layout)
    torch.as_tensor(out, device="cuda"), torch.as_tensor(lse, device="cuda")
    torch.cuda.synchronize()
    host_s = time.perf_counter() - start
    results["float64"] = {"S": seq, "D": q.shape[-1], "gpu_s": gpu_s, "host_round_trip_s": host_s}
    print(
        f"float64 causal S={seq} D={q.shape[-1]} H={heads}: on the GPU {gpu_s * 1e3:.1f} ms a call, "
        f"host round trip {host_s * 1e3:.0f} ms (x{host_s / gpu_s:.0f})",
        flush=True,
    )


def compile_time(results, backward: bool):
    """The first call of unseen rules, each a mask function traced, its layout classified and its kernels
    compiled: the process's first (with the imports and set-up that only it pays), another's forward, and a
    third's training step (forward and backward); then a cached forward call's host time."""
    import torch

    import cusparseattn as ca
    from cusparseattn import build, patterns

    seq = 1024
    q, k, v = (torch.randn(1, 4, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def fresh_rule(salt: int):
        """A causal mask function whose C text no cache holds (a division by `salt` is a literal there),
        passed as the layout: its first call traces it and classifies its blocks."""
        return lambda b, h, qi, ki: (ki <= qi) & (qi % salt < salt)

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    salt = time.time_ns() % 100000 + 2
    firsts = [fresh_rule(salt + i) for i in range(3)]
    results["compile"] = {}
    seconds = results["compile"]
    seconds["cold_first_call_s"] = timed(lambda: ca.attention_forward(q, k, v, firsts[0]))
    seconds["first_call_s"] = timed(lambda: ca.attention_forward(q, k, v, firsts[1]))
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        ca.attention_forward(q, k, v, firsts[1])
    seconds["host_us_per_cached_call"] = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    line = (
        f"compile: the process's first call {seconds['cold_first_call_s']:.2f} s, an unseen rule's first "
        f"call {seconds['first_call_s']:.2f} s; cached call {seconds['host_us_per_cached_call']:.1f} us of "
        "host time"
    )
    reasons = backward_reasons(q, k, v, patterns.causal().layout(seq)) if backward else []
    if reasons:
        print(f"compile: cusparseattn backward cannot run: {'; '.join(reasons)}")
    elif backward:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step():
            out = ca.attention(*leaves, firsts[2], backend="cuda")
            out.backward(torch.randn_like(out))

        seconds["first_step_s"] = timed(step)
        line += f"; an unseen rule's first training step {seconds['first_step_s']:.2f} s"
    seconds["loads"] = dict(build.COMPILE_TIMES)
    print(line, flush=True)


def mods_case(results, backward: bool, seq: int = 8192, dim: int = 128):
    """Packed documents (causal inside each) with ALiBi and tanh soft-capping, traced by cusparseattn and
    written for FlexAttention with torch ops: first-call time of each (compiling for these mods), then
    forward and forward+backward TFLOP/s."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import cusparseattn as ca
    from cusparseattn import mods, patterns

    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, seq // 128), size=7, replace=False)) * 128
    ids = np.repeat(np.arange(8), np.diff([0, *cuts, seq]))
    slopes, cap = mods.alibi_slopes(H), 30.0
    mask_mod = mods.and_masks(mods.causal_mask, mods.document_mask(ids))
    score_mod = mods.compose(mods.alibi(slopes), mods.softcap(cap))
    ids_t = torch.as_tensor(ids, device="cuda")
    slopes_t = torch.as_tensor(slopes, device="cuda", dtype=torch.float32)

    def flex_mask(b, h, q, kv):
        return (q >= kv) & (ids_t[q] == ids_t[kv])

    def flex_score(s, b, h, q, kv):
        return cap * torch.tanh((s + slopes_t[h] * (kv - q)) / cap)

    q, k, v = (
        torch.randn(B, H, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    flex = compiled_flex()
    row = {"case": "doc+alibi+softcap", "S": seq, "D": dim, "fwd": {}, "fwdbwd": {}, "first_call_s": {}}
    # The first call builds the masks and compiles for the mods; the timed calls reuse what it built, as a
    # training loop does.
    built = {}

    def first_call(name):
        if name == "cusparseattn":
            built[name] = (patterns.from_mask(mask_mod).layout(seq), mods.score_mod(score_mod))
            return ca.attention(q, k, v, built[name][0], score_mod=built[name][1], backend="cuda")
        built[name] = create_block_mask(flex_mask, None, None, seq, seq, BLOCK_SIZE=128)
        return flex(q, k, v, score_mod=flex_score, block_mask=built[name])

    calls = {
        "cusparseattn": lambda: ca.attention(
            q, k, v, built["cusparseattn"][0], score_mod=built["cusparseattn"][1], backend="cuda"
        ),
        "flex": lambda: flex(q, k, v, score_mod=flex_score, block_mask=built["flex"]),
    }
    for name, fn in calls.items():
        start = time.perf_counter()
        out = _first(first_call(name))
        if backward:
            out.backward(grad)
        torch.cuda.synchronize()
        row["first_call_s"][name] = time.perf_counter() - start
        layout = built["cusparseattn"][0]  # built first: the attended fraction counts for both
        row["density"] = layout.density
        flops = 4 * B * H * seq * seq * dim * layout.density
        for x in (q, k, v):
            x.grad = None
        with torch.no_grad():
            row["fwd"][name] = flops / bench(fn) / 1e9
        if backward:
            ms = bench(lambda fn=fn: _first(fn()).backward(grad), fwd_only=False, grad_to_none=[q, k, v])
            row["fwdbwd"][name] = BACKWARD_FLOPS * flops / ms / 1e9
    results["mods"].append(row)
    first = ", ".join(f"{n} {s:.1f} s" for n, s in row["first_call_s"].items())
    print(f"mods: {row['case']} S={seq} D={dim} d={row['density']:.3f} | first call (fwd+bwd): {first}")
    for pass_ in PASSES:
        if row[pass_]:
            figures = " ".join(f"{n} {x:6.1f}" for n, x in row[pass_].items())
            print(f"  {pass_}: {figures} (x{_ratio(row, pass_):.2f} flex)", flush=True)


def plot(results, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(20, 5))
    rows = results["cases"]
    labels = [f"{r['case']}\nS{r['S']} D{r['D']}" for r in rows]
    x = np.arange(len(rows))
    for ax, (pass_, title) in zip(axes[:2], PASSES.items(), strict=True):
        for i, name in enumerate(PEERS):
            ax.bar(x + (i - 1.5) * 0.2, [r[pass_].get(name, 0) for r in rows], 0.2, label=name)
        ax.set_xticks(x, labels, fontsize=6, rotation=90)
        ax.set_ylabel(f"TFLOP/s ({title}, attended work)")
        ax.legend()
    if results["sweep"]:
        d = [s["density"] for s in results["sweep"]]
        axes[2].plot(d, [s["ms"] for s in results["sweep"]], "o-", label="cusparseattn forward")
        axes[2].plot(d, [s["bound_ms"] for s in results["sweep"]], "--", label="1.3 x d x dense + 50 us")
        axes[2].set_xlabel("density")
        axes[2].set_ylabel("ms")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(rows) -> None:
    """The table of every case: TFLOP/s per peer, forward and forward+backward, and cusparseattn / Flex."""
    head = " ".join(f"{'ours' if n == 'cusparseattn' else n:>7}" for n in PEERS)
    width = 8 * len(PEERS) + 9
    print(f"\n{'':22} | {'forward':^{width}} | {'forward+backward':^{width}}")
    print(f"{'case':10} {'S':>6} {'D':>4} | {head} {'ours/flex':>9} | {head} {'ours/flex':>9}")
    for r in rows:
        cells = []
        for pass_ in PASSES:
            figures = " ".join(f"{r[pass_][n]:7.1f}" if n in r[pass_] else "      -" for n in PEERS)
            ratio = _ratio(r, pass_)
            cells.append(f"{figures} {'-' if math.isnan(ratio) else f'{ratio:.2f}':>9}")
        print(f"{r['case']:10} {r['S']:6} {r['D']:4} | {' | '.join(cells)}")


def comma_names(text: str, allowed: list[str], what: str) -> list[str]:
    """An argument's comma-separated names, each one of ``allowed`` (the scripts beside this one share it)."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what} must be a comma-separated subset of {allowed}, got {text!r}"
        )
    return names


def comma_ints(text: str) -> list[int]:
    """An argument's comma-separated positive integers."""
    try:
        values = [int(n) for n in text.split(",") if n]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    values = comma_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def gpu_missing() -> str | None:
    """Why this machine cannot run the benchmark (it times CUDA kernels on PyTorch's tensors), or None."""
    try:
        import torch
    except ImportError:
        return "needs PyTorch with CUDA, and PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU; PyTorch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="S = 4096, the parts compile and cases")
    parser.add_argument(
        "--only", type=lambda s: comma_names(s, PARTS, "--only"), help=f"parts to run, from {','.join(PARTS)}"
    )
    parser.add_argument(
        "--cases",
        type=lambda s: comma_names(s, CASES, "--cases"),
        default=CASES,
        help=f"from {','.join(CASES)}",
    )
    parser.add_argument("--seqs", type=comma_ints, help="sequence lengths of the cases (default 4096,16384)")
    parser.add_argument(
        "--dims", type=comma_ints, default=[128, 64], help="head dims of the cases (default 128,64)"
    )
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument(
        "--peers",
        type=lambda s: comma_names(s, PEERS, "--peers"),
        default=PEERS,
        help=f"whom the cases time, from {','.join(PEERS)} (default all)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=1,
        help="timings of each case and peer, taken in turn; the figures are their medians (default 1)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="the cases' dtype (default bfloat16)"
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    parts = args.only or (["compile", "cases"] if args.quick else PARTS)
    seqs = args.seqs or ([4096] if args.quick else [4096, 16384])
    backward = not args.no_backward
    missing = gpu_missing()
    if missing:
        print(f"benchmarks/bench.py {missing}", file=sys.stderr)
        return 1
    import torch

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [],
        "mods": [],
        "sweep": [],
        "memory": [],
        "train_memory": [],
        "precision": [],
        "seconds": {},
        "errors": {},
    }
    print(f"device: {results['device']}, torch {results['torch']}")
    steps = {
        "compile": lambda: compile_time(results, backward),
        "mods": lambda: mods_case(results, backward),
        "cases": lambda: run_cases(
            seqs, args.dims, args.cases, backward, results, args.peers, args.repeats, args.dtype
        ),
        "sweep": lambda: density_sweep(results),
        "memory": lambda: memory(results),
        "train-memory": lambda: train_memory(results),
        "precision": lambda: precision(results),
    }
    for part in PARTS:
        if part in parts and (part != "train-memory" or backward):
            start = time.perf_counter()
            try:
                steps[part]()
            except Exception as err:  # noqa: BLE001 - one failing part must not lose the others' figures
                results["errors"][part] = f"{type(err).__name__}: {err}"
                print(f"{part} failed: {results['errors'][part][:500]}")
            results["seconds"][part] = time.perf_counter() - start
            print(f"({part}: {results['seconds'][part]:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "bench.png")
    summary(results["cases"])
    print(f"total {sum(results['seconds'].values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
