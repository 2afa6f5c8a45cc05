"""Dynamic sparsity on the GPU: MoBA-shaped attention (each query block's top-k key blocks plus its own,
causal) from a selection made at every step, against FlexAttention with its BlockMask rebuilt from the
same indices at every step (the build counted), its FlashAttention-4 backend where that is installed, and
cusparseattn's own static kernels on the same blocks.

    python benchmarks/dynamic_bench.py                      # S = 16384 and 65536, B = 1, H = 16, D = 128
    python benchmarks/dynamic_bench.py --seqs 16384 --out results/

TFLOP/s count the attended token pairs (the layout's density), forward+backward as 3.5 forward FLOPs. Each
call of ours makes its layout from the indices anew (`block_indices(idx) & causal`), as a training step does;
the selector (`cusparseattn.selectors.moba`) is timed apart, as a share of our forward+backward step.
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

    def forward_ms(name, fn):
        with torch.no_grad():
            return bench(fn)

    def step_ms(name, fn):
        def step():
            _first(fn()).backward(dout)

        try:
            return bench(step, fwd_only=False, grad_to_none=[q, k, v])
        finally:
            q.grad = k.grad = v.grad = None

    row = {"S": seq, "B": B, "H": H, "D": D, "block": BLOCK, "topk": TOPK, "density": static.density}
    row["fwd"], _ = _in_turn(fns, forward_ms, flops, repeats, f"forward failed at S={seq}")
    row["fwdbwd"], _ = _in_turn(fns, step_ms, BACKWARD_FLOPS * flops, repeats, f"training failed at S={seq}")
    with torch.no_grad():
        select_ms = bench(lambda: selectors.moba(q, k, block=BLOCK, topk=TOPK))
    step = BACKWARD_FLOPS * flops / row["fwdbwd"]["dynamic"] / 1e9
    row["selector_ms"], row["selector_share"] = select_ms, select_ms / step
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="16384,65536", help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="timings of each, taken in turn")
    parser.add_argument("--out", type=Path, help="folder for dynamic.json")
    args = parser.parse_args(argv)
    if (missing := gpu_missing()) is not None:
        print(missing)
        return 1
    rows = [measure(int(s), args.repeats) for s in args.seqs.split(",")]
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
        (args.out / "dynamic.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
