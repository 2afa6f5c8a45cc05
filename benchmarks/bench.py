"""cusparseattn against its peers on one GPU, with the protocol of ANCHORS.md.

    python benchmarks/bench.py                 # the 16 cases, density sweep, memory, compile time
    python benchmarks/bench.py --quick         # S = 4096 only, no sweep
    python benchmarks/bench.py --out DIR       # where bench.json and bench.png go (default: .)

Timing: ``triton.testing.do_bench`` (median; warmup 25 ms, rep 100 ms). FLOPs count attended work only:
``4 * B * H * S * S * D * density``, density being the fraction of 128 x 128 blocks visited. Peers, each when
importable: FlexAttention (``torch.compile``, Triton backend), SDPA with the flash backend (dense and causal
only), FlashAttention-4 (``flash_attn.cute``: dense, causal, sliding window). bf16, B = 2, H = 16.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import numpy as np

B, H = 2, 16
CASES = ["dense", "causal", "local1024", "strided8"]


def token_rule(case: str):
    """The case as a FlexAttention mask_mod (token level)."""
    if case == "causal":
        return lambda b, h, q, k: q >= k
    if case == "local1024":
        return lambda b, h, q, k: (q >= k) & (q - k < 1024)
    if case == "strided8":
        return lambda b, h, q, k: (q >= k) & ((q // 128 - k // 128 < 8) | (k // 128 % 8 == 7))
    return None


def pattern(case: str):
    from cusparseattn import patterns

    return {
        "dense": patterns.dense(block=128),
        "causal": patterns.causal(block=128),
        "local1024": patterns.local(window=1024, block=128),
        "strided8": patterns.strided_blocks(stride_blocks=8, block=128),
    }[case]


def bench(fn, fwd_only=True) -> float:
    import triton

    warmup, rep = (25, 100) if fwd_only else (10, 50)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peers(case: str, q, k, v):
    """{name: forward callable} for each peer that can run this case."""
    import torch
    import torch.nn.functional as F

    out = {}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        mod = token_rule(case)
        seq = q.shape[2]
        mask = None if mod is None else create_block_mask(mod, None, None, seq, seq, BLOCK_SIZE=128)
        out["flex"] = lambda: flex(q, k, v, block_mask=mask)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        print(f"  flex unavailable: {err}")
    if case in ("dense", "causal"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        out["sdpa"] = sdpa
    try:
        from flash_attn.cute import flash_attn_func

        if case in ("dense", "causal", "local1024"):
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            window = (1023, 0) if case == "local1024" else (None, None)
            out["fa4"] = lambda: flash_attn_func(qt, kt, vt, causal=case == "causal", window_size=window)
    except ImportError:
        pass
    return out


def run_cases(seqs, dims, results):
    import torch

    import cusparseattn as ca

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    for dim in dims:
        for seq in seqs:
            q, k, v = (torch.randn(B, H, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for case in CASES:
                layout = pattern(case).layout(seq)
                density = layout.density
                flops = 4 * B * H * seq * seq * dim * density
                row = {"case": case, "S": seq, "D": dim, "density": density}
                with torch.no_grad():
                    fns = {"cusparseattn": functools.partial(ca.attention_forward, q, k, v, layout)}
                    fns.update(peers(case, q, k, v))
                    for name, fn in fns.items():
                        try:
                            fn()
                            torch.cuda.synchronize()
                            row[name] = flops / bench(fn) / 1e9
                        except Exception as err:  # noqa: BLE001
                            print(f"  {name} failed on {case} S={seq} D={dim}: {str(err)[:200]}")
                results["cases"].append(row)
                ours, flex = row.get("cusparseattn", 0), row.get("flex")
                others = " ".join(f"{n} {row[n]:6.1f}" for n in ("flex", "sdpa", "fa4") if n in row)
                ratio = f"x{ours / flex:.2f} flex" if flex else ""
                print(
                    f"{case:10} S={seq:6} D={dim:4} d={density:.3f}: ours {ours:6.1f}  {others}  {ratio}",
                    flush=True,
                )


def density_sweep(results):
    """S = 16384, D = 128: time against density, windows from S/64 to dense."""
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

    for seq in (4096, 16384, 65536):
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


def compile_time(results):
    """Cold compile of one new specialisation (an unseen rule expression) and a cached call's host time."""
    import torch

    import cusparseattn as ca
    from cusparseattn import BlockLayout, TokenRule, build

    seq = 1024
    q, k, v = (torch.randn(1, 4, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    salt = time.time_ns() % 100000  # a fresh expression: nothing in any cache
    rule = TokenRule("fresh", lambda b, h, qi, ki: ki <= qi + salt % 1, c_expr=f"k <= q + {salt} % 1")
    blocks = np.tril(np.ones((seq // 128, seq // 128), bool))
    layout = BlockLayout(blocks, block_size=128, seq_q=seq, rule=rule)
    start = time.perf_counter()
    ca.attention_forward(q, k, v, layout)
    torch.cuda.synchronize()
    cold = time.perf_counter() - start
    ca.attention_forward(q, k, v, layout)
    torch.cuda.synchronize()
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        ca.attention_forward(q, k, v, layout)
    host_us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    results["compile"] = {
        "cold_first_call_s": cold,
        "host_us_per_cached_call": host_us,
        "loads": dict(build.COMPILE_TIMES),
    }
    print(f"compile: cold first call {cold:.2f} s; cached call {host_us:.1f} us of host time", flush=True)


def plot(results, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    rows = results["cases"]
    labels = [f"{r['case']}\nS{r['S']} D{r['D']}" for r in rows]
    x = np.arange(len(rows))
    names = ["cusparseattn", "flex", "sdpa", "fa4"]
    for i, name in enumerate(names):
        axes[0].bar(x + (i - 1.5) * 0.2, [r.get(name, 0) for r in rows], 0.2, label=name)
    axes[0].set_xticks(x, labels, fontsize=6, rotation=90)
    axes[0].set_ylabel("TFLOP/s (forward, attended work)")
    axes[0].legend()
    if results["sweep"]:
        d = [s["density"] for s in results["sweep"]]
        axes[1].plot(d, [s["ms"] for s in results["sweep"]], "o-", label="cusparseattn")
        axes[1].plot(d, [s["bound_ms"] for s in results["sweep"]], "--", label="1.3 x d x dense + 50 us")
        axes[1].set_xlabel("density")
        axes[1].set_ylabel("ms")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    import torch

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [],
        "sweep": [],
        "memory": [],
    }
    print(f"device: {results['device']}, torch {results['torch']}")
    compile_time(results)
    run_cases([4096] if args.quick else [4096, 16384], [128, 64], results)
    if not args.quick:
        density_sweep(results)
        memory(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "bench.png")
    print(f"\n{'case':10} {'S':>6} {'D':>4} {'ours':>7} {'flex':>7} {'sdpa':>7} {'fa4':>7} {'ours/flex':>9}")
    for r in results["cases"]:

        def f(name, r=r):
            return f"{r[name]:7.1f}" if name in r else "      -"

        ratio = r.get("cusparseattn", 0) / r["flex"] if "flex" in r else math.nan
        print(
            f"{r['case']:10} {r['S']:6} {r['D']:4} {f('cusparseattn')} {f('flex')} {f('sdpa')} {f('fa4')} "
            f"{ratio:9.2f}"
        )


if __name__ == "__main__":
    main()
