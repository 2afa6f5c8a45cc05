"""Dynamic sparsity on the GPU, from a selection made at every step.

MoBA's shape (``--shapes moba``): each query block's top-k key blocks plus its own, causal, against
FlexAttention with its BlockMask rebuilt from the same indices at every step (the build counted), its
FlashAttention-4 backend where that is installed, and cusparseattn's own static kernels on the same blocks.
NSA's (``--shapes nsa``): each token's KV group picks its key blocks (`cusparseattn.selectors.nsa`: top 16
blocks of 64, the first and the 8 up to its own forced in, a local window of 512), against
flash-linear-attention's selection kernels (``fla.ops.nsa.parallel_nsa``, where installed) on the same
indices, and our dense causal step at that shape.

    python benchmarks/dynamic_bench.py                      # both shapes, S = 16384 and 65536 for MoBA
    python benchmarks/dynamic_bench.py --shapes moba --seqs 16384 --out results/

TFLOP/s count the attended token pairs, forward+backward as 3.5 forward FLOPs. Each call of ours makes its
layout from the indices anew (`block_indices(idx) & causal`, `token_indices(idx)` with ``causal=True``), as a
training step does; the selectors are timed apart, as a share of our forward+backward step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import BACKWARD_FLOPS, _first, _in_turn, bench, compiled_flex, gpu_missing  # noqa: E402

B, H, D, BLOCK, TOPK = 1, 16, 128, 128, 8


def flex_block_mask(idx):
    """FlexAttention's BlockMask of a MoBA selection (ascending, -1 padding, the own block last), built
    from the indices as its users do: the own (diagonal) block partial under the causal mask_mod, the
    others full."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    n_q = idx.shape[2]  # = the key blocks: its indices are [B, H, nQ, nK], nK read off their shape
    own = torch.arange(n_q, device=idx.device, dtype=torch.int32).view(1, 1, n_q, 1)
    full = (idx >= 0) & (idx != own)
    full_counts = full.sum(-1, dtype=torch.int32)
    # Full blocks first, in ascending order: the padding and the own block sort to the end.
    full_idx = torch.where(full, idx, n_q).sort(dim=-1).values.clamp_max(n_q - 1).to(torch.int32)
    pad = (0, n_q - idx.shape[3])
    full_idx = torch.nn.functional.pad(full_idx, pad)
    own_idx = torch.nn.functional.pad(own.expand(*idx.shape[:3], 1), (0, n_q - 1))
    ones = torch.ones(idx.shape[:3], device=idx.device, dtype=torch.int32)
    return BlockMask.from_kv_blocks(
        ones, own_idx.contiguous(), full_counts, full_idx.contiguous(),
        BLOCK_SIZE=BLOCK, mask_mod=lambda b, h, q, k: q >= k,
    )  # fmt: skip


def _timers(dout, leaves):
    """``(forward_ms, step_ms)`` for `_in_turn`: a forward without autograd, and a forward+backward from
    ``dout`` into `leaves` (an output ``[B, H, S, D]`` takes the ``[B, S, H, D]`` dout's transposed view)."""
    import torch

    def forward_ms(name, fn):
        with torch.no_grad():
            return bench(fn)

    def step_ms(name, fn):
        def step():
            out = _first(fn())
            out.backward(dout if out.shape == dout.shape else dout.transpose(1, 2))

        try:
            return bench(step, fwd_only=False, grad_to_none=leaves)
        finally:
            for t in leaves:
                t.grad = None

    return forward_ms, step_ms


def measure(seq: int, repeats: int) -> dict:
    import torch

    import cusparseattn as ca
    from cusparseattn import dynamic, patterns, selectors

    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, k, v = (
        torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    causal = patterns.causal(block=BLOCK)
    idx = selectors.moba(q, k, block=BLOCK, topk=TOPK)
    static = (dynamic.block_indices(idx.cpu().numpy(), block=BLOCK) & causal).to_layout(seq, seq)
    flops = 4 * B * H * seq * seq * D * static.density
    flex = compiled_flex()
    # Each length, pass and backend is a specialisation of its own: past dynamo's limit Flex runs unfused.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def ours():
        return ca.attention(q, k, v, dynamic.block_indices(idx, block=BLOCK) & causal)

    fns = {
        "dynamic": ours,
        "static": functools.partial(ca.attention, q, k, v, static),
        "flex": lambda: flex(q, k, v, block_mask=flex_block_mask(idx)),
        "flexfa4": lambda: flex(
            q, k, v, block_mask=flex_block_mask(idx), kernel_options={"BACKEND": "FLASH"}
        ),
    }
    dout = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    forward_ms, step_ms = _timers(dout, [q, k, v])
    row = {"S": seq, "B": B, "H": H, "D": D, "block": BLOCK, "topk": TOPK, "density": static.density}
    row["fwd"], _ = _in_turn(fns, forward_ms, flops, repeats, f"forward failed at S={seq}")
    row["fwdbwd"], _ = _in_turn(fns, step_ms, BACKWARD_FLOPS * flops, repeats, f"training failed at S={seq}")
    with torch.no_grad():
        select_ms = bench(lambda: selectors.moba(q, k, block=BLOCK, topk=TOPK))
    step = BACKWARD_FLOPS * flops / row["fwdbwd"]["dynamic"] / 1e9
    row["selector_ms"], row["selector_share"] = select_ms, select_ms / step
    return row


NSA = dict(B=1, S=65536, Hq=64, Hkv=4, D=128, block=64, topk=16, init=1, local=8)


def measure_nsa(repeats: int, seq: int = NSA["S"]) -> dict:
    import torch

    import cusparseattn as ca
    from cusparseattn import dynamic, selectors

    b, hq, hkv, d, block = NSA["B"], NSA["Hq"], NSA["Hkv"], NSA["D"], NSA["block"]
    gen = torch.Generator(device="cuda").manual_seed(seq)
    # [B, S, H, D] as flash-linear-attention takes them; ours see the [B, H, S, D] views.
    q, k, v = (
        torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    choose = dict(block=block, topk=NSA["topk"], init_blocks=NSA["init"], local_blocks=NSA["local"])
    with torch.no_grad():
        idx = selectors.nsa(qt, kt, **choose)  # [B, Hkv, S, topk], ascending, -1 padding
    t = torch.arange(seq, device="cuda").view(1, 1, seq, 1)
    pairs = int(torch.where(idx >= 0, (t - idx * block + 1).clamp(0, block), 0).sum())
    flops = 4 * d * (hq // hkv) * pairs
    fns = {"ours": lambda: ca.attention(qt, kt, vt, dynamic.token_indices(idx, block=block), causal=True)}
    try:
        from fla.ops.nsa.parallel import parallel_nsa
    except ImportError:
        print("flash-linear-attention is not installed: no NSA peer", file=sys.stderr)
    else:
        fla_idx = idx.transpose(1, 2).contiguous()  # [B, S, Hkv, topk]
        fns["fla"] = lambda: parallel_nsa(
            q, k, v, block_indices=fla_idx, block_counts=NSA["topk"], block_size=block
        )
    dout = torch.randn(b, seq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    forward_ms, step_ms = _timers(dout, [q, k, v])
    row = {"shape": "nsa", **NSA, "S": seq, "density": pairs / (hkv * b * seq * (seq + 1) / 2)}
    row["fwd"], _ = _in_turn(fns, forward_ms, flops, repeats, f"NSA forward failed at S={seq}")
    row["fwdbwd"], _ = _in_turn(
        fns, step_ms, BACKWARD_FLOPS * flops, repeats, f"NSA training failed at S={seq}"
    )
    dense_flops = BACKWARD_FLOPS * 4 * b * hq * seq * (seq + 1) / 2 * d
    dense = {"dense causal": lambda: ca.attention(qt, kt, vt, causal=True)}
    step, _ = _in_turn(dense, step_ms, dense_flops, 1, f"dense causal training failed at S={seq}")
    row["dense_causal_fwdbwd"] = step["dense causal"]
    row["step_ms"] = BACKWARD_FLOPS * flops / row["fwdbwd"]["ours"] / 1e9
    row["dense_step_ms"] = dense_flops / step["dense causal"] / 1e9
    with torch.no_grad():
        row["selector_ms"] = bench(lambda: selectors.nsa(qt, kt, **choose))
    row["selector_share"] = row["selector_ms"] / row["step_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="moba,nsa", help="moba, nsa or both (comma-separated)")
    parser.add_argument("--seqs", default="16384,65536", help="MoBA's sequence lengths, comma-separated")
    parser.add_argument("--nsa-seq", type=int, default=NSA["S"], help="NSA's sequence length")
    parser.add_argument("--repeats", type=int, default=1, help="timings of each, taken in turn")
    parser.add_argument("--out", type=Path, help="folder for dynamic.json")
    args = parser.parse_args(argv)
    if (missing := gpu_missing()) is not None:
        print(missing)
        return 1
    shapes = args.shapes.split(",")
    if not set(shapes) <= {"moba", "nsa"}:
        parser.error(f"--shapes takes moba and nsa, got {args.shapes!r}")
    rows = [measure(int(s), args.repeats) for s in args.seqs.split(",")] if "moba" in shapes else []
    nsa = [measure_nsa(args.repeats, args.nsa_seq)] if "nsa" in shapes else []
    for row in nsa:
        for pass_ in ("fwd", "fwdbwd"):
            t = row[pass_]
            vs = f"; ours/fla {t['ours'] / t['fla']:.2f}" if "fla" in t else ""
            print(
                f"NSA S={row['S']} {pass_}: "
                + ", ".join(f"{n} {x:.0f}" for n, x in t.items())
                + f" TFLOP/s{vs}"
            )
        print(
            f"NSA S={row['S']} step {row['step_ms']:.1f} ms, dense causal {row['dense_step_ms']:.1f} ms "
            f"(x{row['step_ms'] / row['dense_step_ms']:.3f}); selector {row['selector_ms']:.2f} ms, "
            f"{row['selector_share']:.1%} of the step; density {row['density']:.4f}"
        )
    for row in rows:
        for pass_ in ("fwd", "fwdbwd"):
            t = row[pass_]
            best = max((t[p] for p in ("flex", "flexfa4") if p in t), default=float("nan"))
            print(
                f"S={row['S']} {pass_}: " + ", ".join(f"{name} {value:.0f}" for name, value in t.items())
                + f" TFLOP/s; dynamic/best peer {t['dynamic'] / best:.2f}, dynamic/static "
                f"{t['dynamic'] / t['static']:.2f}"
            )  # fmt: skip
        print(f"S={row['S']} selector: {row['selector_ms']:.3f} ms, {row['selector_share']:.1%} of the step")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dynamic.json").write_text(json.dumps(rows + nsa, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
