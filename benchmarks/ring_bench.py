"""Context parallelism on one host: correctness and speed of cusparseattn's ring attention over NCCL.

    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --out DIR             # check, then benchmark
    torchrun --nproc-per-node 2 benchmarks/ring_bench.py --parts check         # correctness only
    torchrun --nproc-per-node 4 benchmarks/ring_bench.py --seq 262144 --parts bench

Parts:

- check: the sharded forward and gradients against the same sizes on one GPU (S = 8192, H = 8, Hkv = 2,
  D = 128, bf16, the CUDA backend): causal (contiguous and zigzag), local1024 (contiguous and work-balanced)
  and strided8 (zigzag), both rotate methods. Each result's error against a float32 PyTorch computation of the
  whole sequence must be at most twice the single-GPU kernel's error plus bf16 rounding (2^-8 of the largest,
  or for the mean of the mean, reference value), for out, lse, dq, dk and dv; the kernel calls must equal
  the schedule's windows. Any failure exits with status 1 after the report is written.
- bench: S = 131072 (``--seq``), D = 128, H = 16, B = 1, bf16; causal (zigzag) and local with a window of 4096
  (contiguous): forward and forward+backward per-GPU TFLOP/s of ring attention (both rotate methods), of one
  GPU running the local problem (S / N tokens), of one GPU running the whole sequence (``--whole``), and of
  PyTorch's ``context_parallel`` with SDPA (FlashAttention-2, causal only, its head-tail load balancing,
  rotate ``allgather`` and ``alltoall``); and the K/V bytes each method sends in one forward.

FLOPs count attended work only (ANCHORS.md): forward ``4 * B * H * S^2 * D * density`` with density the
fraction of 128 x 128 blocks visited, forward+backward 3.5 times that; per GPU: divided by the number of
GPUs. Timing: CUDA events around a fixed number of iterations, the same on every rank (``do_bench`` picks its
repeat count per process, which would desynchronise the collectives), median per rank, then the slowest
rank. ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) is set before NCCL starts.

Writes ``ring_bench.md`` (the tables) and ``ring_bench.json`` into ``--out`` (rank 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before NCCL initialises: NVLink multicast off

import argparse
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the checkout's cusparseattn, beside this script

import cusparseattn as ca  # noqa: E402
from cusparseattn import patterns
from cusparseattn.distributed import counters, ring_attention, schedule, shard
from cusparseattn.distributed.api import _layout
from cusparseattn.distributed.balance import resolve

BACKWARD_FLOPS = 3.5  # forward+backward FLOPs per forward FLOP
BF16_EPS = 2.0**-8
CHECK = {"seq": 8192, "heads": 8, "heads_kv": 2, "dim": 128}
# (case, layout argument, causal flag, balances)
CHECK_CASES = [
    ("causal", None, True, (None, "zigzag")),
    ("local1024", patterns.local(window=1024, block=128), False, (None, "work")),
    ("strided8", patterns.strided_blocks(stride_blocks=8, block=128), False, ("zigzag",)),
]
ROTATES = ("ring", "allgather")


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def timed(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls on this rank, then the slowest rank's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    ms = torch.tensor([times[len(times) // 2]], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


def training_step(fn, leaves, grad):
    def step():
        for x in leaves:
            x.grad = None
        fn().backward(grad)

    return step


def total(value: float) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


# ---- check -------------------------------------------------------------------------------------------------
def reference(q, k, v, dout, mask, scale):
    """Float32 attention on the whole sequence with autograd: out, lse, dq, dk, dv."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ vv
    out.backward(dout.float())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def results_of(out, lse, leaves) -> dict:
    dq, dk, dv = (x.grad for x in leaves)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def errors(got: dict, ref: dict) -> dict:
    out = {}
    for name, r in ref.items():
        diff = (got[name].float() - r).abs()
        out[name] = {"max": float(diff.max()), "mean": float(diff.mean())}
    return out


def within(ring: dict, single: dict, ref: dict) -> list[str]:
    """The quantities whose error exceeds twice the single-GPU error plus bf16 rounding."""
    bad = []
    for name, r in ref.items():
        scale_max, scale_mean = float(r.abs().max()), float(r.abs().mean())
        limit_max = 2 * single[name]["max"] + BF16_EPS * scale_max
        limit_mean = 2 * single[name]["mean"] + BF16_EPS * scale_mean
        if not (ring[name]["max"] <= limit_max and ring[name]["mean"] <= limit_mean):
            bad.append(
                f"{name}: max {ring[name]['max']:.3g} (limit {limit_max:.3g}), "
                f"mean {ring[name]['mean']:.3g} (limit {limit_mean:.3g})"
            )
    return bad


def check(args, results) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    seq, heads, heads_kv, dim = CHECK["seq"], CHECK["heads"], CHECK["heads_kv"], CHECK["dim"]
    gen = torch.Generator().manual_seed(0)  # CPU: the same inputs on every rank
    q, dout = (torch.randn(1, heads, seq, dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, heads_kv, seq, dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    scale = dim**-0.5
    ok = True
    for case, layout, causal, balances in CHECK_CASES:
        whole = _layout(layout, causal, seq, world, None)
        mask = torch.from_numpy(whole.to_dense()[0, 0]).cuda()
        ref = reference(q, k, v, dout, mask, scale)
        del mask
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = ca.attention(*leaves, layout, causal=causal, return_lse=True, backend="cuda")
        out.backward(dout)
        single = errors(results_of(out, lse, leaves), ref)
        for balance in balances:
            kw = {"causal": causal, "balance": balance}
            local_ref = {name: shard(x, layout, **kw, dim=2) for name, x in ref.items()}
            order = resolve(balance, seq, world, _layout(layout, causal, seq, world, balance))
            calls = schedule.build(_layout(layout, causal, seq, world, balance), order).calls(rank)
            for rotate in ROTATES:
                parts = [shard(x, layout, **kw).detach().clone().requires_grad_() for x in (q, k, v)]
                counters.reset()
                out, lse = ring_attention(
                    *parts, layout, rotate=rotate, return_lse=True, backend="cuda", **kw
                )
                out.backward(shard(dout, layout, **kw))
                torch.cuda.synchronize()
                ring = errors(results_of(out, lse, parts), local_ref)
                bad = within(ring, single, local_ref)
                if counters.calls != 2 * calls:
                    bad.append(f"{counters.calls} kernel calls, the schedule has {calls} windows per pass")
                flag = torch.tensor([len(bad)], device="cuda")
                dist.all_reduce(flag)
                ok &= flag.item() == 0
                row = {"case": case, "balance": balance, "rotate": rotate, "rank": rank, "ring": ring}
                row.update({"single": single, "failures": bad})
                results["check"].append(row)
                worst = {name: f"{e['max']:.2e}/{single[name]['max']:.2e}" for name, e in ring.items()}
                status = "ok" if flag.item() == 0 else "FAIL"
                where = f"{case:9} balance={balance!s:6} rotate={rotate:9}"
                log(f"check {where} max err ring/1 GPU {worst}: {status}")
                if bad:
                    print(f"  rank {rank}: " + "; ".join(bad), flush=True)
    return ok


# ---- bench -------------------------------------------------------------------------------------------------
def bench_cases(args):
    return [
        ("causal", patterns.causal(block=128), "zigzag"),
        (f"local{args.window}", patterns.local(window=args.window, block=128), None),
    ]


def rates(name: str, fwd_ms: float, fwdbwd_ms: float, flops: float) -> dict:
    return {
        "method": name,
        "fwd_ms": fwd_ms,
        "fwdbwd_ms": fwdbwd_ms,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwdbwd_tflops": BACKWARD_FLOPS * flops / fwdbwd_ms / 1e9,
    }


def measure(fn, leaves, grad, args) -> tuple[float, float]:
    with torch.no_grad():
        fwd = timed(fn, args.warmup, args.reps)
    fwdbwd = timed(training_step(fn, leaves, grad), args.warmup, args.reps)
    for x in leaves:
        x.grad = None
    return fwd, fwdbwd


def bench_ring(case, pat, balance, args, rows, traffic):
    world = dist.get_world_size()
    seq, local = args.seq, args.seq // world
    density = pat.layout(seq).density
    per_gpu = 4 * args.heads * seq * seq * args.dim * density / world
    q, k, v = (
        torch.randn(1, args.heads, local, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    for rotate in ROTATES:

        def fn(rotate=rotate):
            return ring_attention(q, k, v, pat, balance=balance, rotate=rotate, backend="cuda")

        with torch.no_grad():
            fn()
            counters.reset()
            fn()
        torch.cuda.synchronize()
        traffic[f"{case}/{rotate}"] = total(counters.bytes_sent)
        fwd, fwdbwd = measure(fn, [q, k, v], grad, args)
        row = rates(f"cusparseattn ring, {world} GPUs", fwd, fwdbwd, per_gpu)
        row.update({"case": case, "rotate": rotate, "balance": balance, "density": density})
        rows.append(row)
        log(fmt(row))
    # One GPU on the local problem: the same kernel on S / N tokens with the pattern's layout for them.
    lay = pat.layout(local)
    flops = 4 * args.heads * local * local * args.dim * lay.density

    def single():
        return ca.attention(q, k, v, lay, backend="cuda")

    fwd, fwdbwd = measure(single, [q, k, v], grad, args)
    row = rates(f"cusparseattn 1 GPU, S/{world}", fwd, fwdbwd, flops)
    row.update({"case": case, "rotate": "-", "balance": None, "density": lay.density})
    rows.append(row)
    log(fmt(row))
    kv_bytes = 2 * args.heads * local * args.dim * 2
    traffic[f"{case}/dense ring"] = world * (world - 1) * kv_bytes


def bench_whole(case, pat, args, rows):
    seq = args.seq
    lay = pat.layout(seq)
    q, k, v = (
        torch.randn(1, args.heads, seq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    flops = 4 * args.heads * seq * seq * args.dim * lay.density
    fwd, fwdbwd = measure(
        lambda: ca.attention(q, k, v, lay, backend="cuda"), [q, k, v], torch.randn_like(q), args
    )
    row = rates("cusparseattn 1 GPU, whole S", fwd, fwdbwd, flops)
    row.update({"case": case, "rotate": "-", "balance": None, "density": lay.density})
    rows.append(row)
    log(fmt(row))


def bench_torch_cp(args, rows, mesh) -> None:
    """PyTorch's context_parallel with SDPA (flash), causal, head-tail load balancing (its default)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError as err:
        log(f"PyTorch context_parallel unavailable: {err}")
        return
    world = dist.get_world_size()
    seq = args.seq
    density = patterns.causal(block=128).layout(seq).density
    per_gpu = 4 * args.heads * seq * seq * args.dim * density / world
    for rotate in ("allgather", "alltoall"):
        set_rotate_method(rotate)
        fwd, fwdbwd = _torch_cp_times(context_parallel, mesh, args)
        row = rates(f"PyTorch context_parallel + SDPA, {world} GPUs", fwd, fwdbwd, per_gpu)
        row.update({"case": "causal", "rotate": rotate, "balance": "head-tail", "density": density})
        rows.append(row)
        log(fmt(row))


def _torch_cp_times(context_parallel, mesh, args) -> tuple[float, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(1)
    buffers = [
        torch.randn(1, args.heads, args.seq, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    ]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
        q, k, v = (b.detach().requires_grad_() for b in buffers)

        def fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                # looked up at call time: context_parallel patches F.scaled_dot_product_attention
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return measure(fn, [q, k, v], torch.randn_like(q), args)


def fmt(row: dict) -> str:
    return (
        f"{row['case']:10} {row['method']:42} rotate={row['rotate']:9} balance={row['balance']!s:9} "
        f"fwd {row['fwd_ms']:9.2f} ms {row['fwd_tflops']:6.1f} TFLOP/s/GPU | "
        f"fwd+bwd {row['fwdbwd_ms']:9.2f} ms {row['fwdbwd_tflops']:6.1f} TFLOP/s/GPU"
    )


def markdown(results, args) -> str:
    world = results["world"]
    lines = [
        f"# Ring attention, {world} x {results['device']}, torch {results['torch']}",
        "",
        f"B = 1, H = {args.heads}, D = {args.dim}, S = {args.seq}, bf16; TFLOP/s per GPU (attended work).",
        "",
        "| case | method | rotate | balance | fwd ms | fwd TFLOP/s/GPU | fwd+bwd ms | fwd+bwd TFLOP/s/GPU "
        "| vs 1 GPU S/N (fwd / fwd+bwd) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = {r["case"]: r for r in results["bench"] if "S/" in r["method"]}
    for r in results["bench"]:
        b = base.get(r["case"])
        versus = (
            f"{r['fwd_tflops'] / b['fwd_tflops']:.2f} / {r['fwdbwd_tflops'] / b['fwdbwd_tflops']:.2f}"
            if b
            else "-"
        )
        lines.append(
            f"| {r['case']} | {r['method']} | {r['rotate']} | {r['balance']} | {r['fwd_ms']:.2f} "
            f"| {r['fwd_tflops']:.1f} | {r['fwdbwd_ms']:.2f} | {r['fwdbwd_tflops']:.1f} | {versus} |"
        )
    if results["bytes"]:
        lines += [
            "",
            "K/V bytes sent in one forward, all ranks together:",
            "",
            "| what | MiB |",
            "| --- | --- |",
        ]
        lines += [f"| {name} | {b / 2**20:.1f} |" for name, b in results["bytes"].items()]
    if results["check"]:
        lines += ["", "Check (rank 0): max error of ring / one GPU against float32", ""]
        lines += ["| case | balance | rotate | out | lse | dq | dk | dv | ok |", "| --- " * 9 + "|"]
        for r in results["check"]:
            if r["rank"] == 0:
                cells = " | ".join(
                    f"{r['ring'][n]['max']:.2e} / {r['single'][n]['max']:.2e}" for n in r["ring"]
                )
                passed = "no" if r["failures"] else "yes"
                lines.append(f"| {r['case']} | {r['balance']} | {r['rotate']} | {cells} | {passed} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="check,bench", help="comma-separated: check, bench")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--whole", action="store_true", help="also time one GPU on the whole sequence")
    parser.add_argument("--no-torch-cp", action="store_true", help="skip PyTorch's context_parallel")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(minutes=10))
    world = dist.get_world_size()
    results = {
        "world": world,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
        "args": vars(args),
        "check": [],
        "bench": [],
        "bytes": {},
    }
    ok = True
    if "check" in parts:
        ok = check(args, results)
        torch.cuda.empty_cache()
    if "bench" in parts:
        mesh = None
        if not args.no_torch_cp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda", (world,))
        for case, pat, balance in bench_cases(args):
            bench_ring(case, pat, balance, args, results["bench"], results["bytes"])
            if args.whole:
                bench_whole(case, pat, args, results["bench"])
            torch.cuda.empty_cache()
        if mesh is not None:
            bench_torch_cp(args, results["bench"], mesh)
        window = f"local{args.window}"
        if world > 1:  # one rank sends nothing
            ratio = results["bytes"][f"{window}/ring"] / results["bytes"][f"{window}/dense ring"]
            results["bytes_ratio_local_to_dense_ring"] = ratio
            limit = 1 / (world - 1)
            log(f"bytes: {window} ring sends {ratio:.4f} of a dense ring's (limit 1/(N-1) = {limit:.4f})")
            if not ratio <= 1 / (world - 1):
                log("FAIL: the sliding window sends more than 1/(N-1) of a dense ring's bytes")
                ok = False
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring_bench.json").write_text(json.dumps(results, indent=1, default=_json))
        (out / "ring_bench.md").write_text(markdown(results, args))
        print(markdown(results, args), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        print(f"rank {local_rank}: ring_bench FAILED (see above)", file=sys.stderr, flush=True)
    return 0 if ok else 1


def _json(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


if __name__ == "__main__":
    sys.exit(main())
