"""Small forward and backward cases for compute-sanitizer (run by tests/run_sanitizer.sh on a GPU host,
not by pytest).

Each case covers one path of the kernel: full tiles, C-expression masks, bit masks, empty rows and key tiles,
ragged lengths, GQA, [B, S, H, D] strides, head dims that are padded (40) or kept in shared memory (256),
persistent kernels' CTAs that take many work items in turn, dynamic layouts' tables built on the GPU, and
MoBA's gate.
Arguments: run only the cases whose names hold one of them (``python3 tests/sanitize_cases.py dynamic``).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

import cusparseattn as ca
from cusparseattn import BlockLayout, TokenRule, cuda, devices, patterns


def random_layout(seq: int) -> BlockLayout:
    rng = np.random.default_rng(0)
    blocks = rng.random((2, 4, -(-seq // 32), -(-seq // 32))) < 0.4
    blocks[..., 1, :] = False  # an empty row
    blocks[..., 4:8] = False  # keys 128-255, the Hopper backward's second key tile: an item without visits
    rule = TokenRule("mod3", lambda b, h, q, k: (q + k) % 3 != 0)
    return BlockLayout(blocks, block_size=32, seq_q=seq, partial=blocks, rule=rule)


CASES = [
    ("dense fp16 d64", torch.float16, 64, 2, 256, patterns.dense(block=64)),
    ("causal bf16 d128 ragged", torch.bfloat16, 128, 1, 333, patterns.causal(block=128)),
    # "wide" (tuning.WIDE_TILES): three consumers at head dim 64, query tiles of 192 rows, whose warps mask
    # their own rows where a tile crosses the layout's blocks; key tiles of 192 at 128, one Q buffer.
    ("dense bf16 d64 wide", torch.bfloat16, 64, 2, 384, patterns.dense(block=128)),
    ("causal fp16 d64 wide ragged", torch.float16, 64, 1, 400, patterns.causal(block=128)),
    ("causal bf16 d128 wide ragged", torch.bfloat16, 128, 2, 400, patterns.causal(block=128)),
    ("local bf16 d40 bshd", torch.bfloat16, 40, 2, 300, patterns.local(window=70, block=16)),
    ("random bits fp16 d256", torch.float16, 256, 4, 200, None),
    # The Hopper kernels' empty rows: a persistent CTA writes one while the row before it is still in flight.
    ("random bits bf16 d64", torch.bfloat16, 64, 1, 200, None),
    # The fused backward at head dim 128 stages an empty key tile's zeros apart from its K and V.
    ("random bits bf16 d128", torch.bfloat16, 128, 2, 300, None),
    # On three SMs the Hopper forward's deal splits its last row into parts (schedule.work_order): their
    # outputs go to a scratch, and a combine pass writes the row.
    ("dense bf16 d128 split", torch.bfloat16, 128, 2, 2176, patterns.dense(block=128)),
    ("dense fp16 d64 wide split", torch.float16, 64, 1, 2048, patterns.dense(block=128)),
    # float32: TF32 ("high": on Hopper its forward and two-pass backward after the transposed copies they
    # read, padded past the lengths) and split TF32 ("highest", the portable passes).
    ("causal fp32 high d64 ragged", torch.float32, 64, 2, 333, patterns.causal(block=64)),
    ("random bits fp32 high d128", torch.float32, 128, 2, 300, None),
    ("dense fp32 high d128 split", torch.float32, 128, 2, 2176, patterns.dense(block=128)),
    ("random bits fp32 highest d128", torch.float32, 128, 1, 200, None),
    ("local fp32 highest d40 bshd", torch.float32, 40, 2, 300, patterns.local(window=70, block=16)),
    # Dynamic layouts: tables built on the GPU from indices with padding, repeats, out-of-range entries and
    # counts; causal inside the chosen blocks, and with first blocks always on.
    ("dynamic bf16 d128 causal", torch.bfloat16, 128, 2, 700, "dynamic"),
    ("dynamic fp16 d64 sinks", torch.float16, 64, 1, 500, "dynamic sinks"),
]


def dynamic_layout(seq: int, sinks: bool):
    block, rng = 64, np.random.default_rng(1)
    n = -(-seq // block)
    idx = rng.integers(-1, n, (2, 4, n, 5))
    idx[rng.random(idx.shape) < 0.2] = n + 3
    idx[rng.random(idx.shape) < 0.1] = -7
    counts = rng.integers(0, 6, idx.shape[:3])
    as_cuda = functools.partial(torch.tensor, device="cuda", dtype=torch.int32)
    layout = ca.dynamic.block_indices(as_cuda(idx), as_cuda(counts), block=block) & patterns.causal(
        block=block
    )
    if not sinks:
        return layout
    first = np.zeros((1, 1, n, n), bool)
    first[..., 0] = True
    return layout | BlockLayout(first, block_size=block, seq_q=seq)


# MoBA's gate as a kernel (cusparseattn.moba_kernel): ragged lengths, GQA, a topk past the candidates, rows
# that start at no key, unaligned rows (loads of one element), per block and per token.
SELECTOR_CASES = [
    ("moba bf16 d64 gqa", torch.bfloat16, 64, (2, 4, 1000), (2, 2, 1300), 30, False),
    ("moba fp16 d63 unaligned", torch.float16, 63, (1, 2, 700), (1, 2, 500), 3, True),
    ("moba fp32 d128", torch.float32, 128, (1, 2, 512), (1, 1, 512), 4, False),
]


def selector_cases(names: list[str]) -> None:
    from cusparseattn import selectors

    for name, dtype, dim, q_shape, k_shape, topk, unaligned in SELECTOR_CASES:
        if names and not any(n in name for n in names):
            continue
        extra = int(unaligned)
        q, k = (
            torch.randn(*s, dim + extra, device="cuda", dtype=dtype)[..., extra:] for s in (q_shape, k_shape)
        )
        for per in ("block", "token"):
            for causal in (True, False):
                idx = selectors.moba(q, k, block=64, topk=topk, per=per, causal=causal)
                torch.cuda.synchronize()
                assert int(idx.max()) < -(-k_shape[2] // 64), name
        print(f"ran {name}", flush=True)


def main(names: list[str]) -> None:
    """Runs the cases whose names hold one of `names` (every case without)."""
    selector_cases(names)
    for name, dtype, dim, group, seq, pattern in CASES:
        if names and not any(n in name for n in names):
            continue
        # Two SMs' worth of persistent CTAs (three to split rows): each walks many work items, reusing its
        # buffers and barriers.
        devices.sm_count = lambda device, sms=(3 if "split" in name else 2): sms
        cuda._wide_pays = lambda *args, wide="wide" in name: wide
        torch.set_float32_matmul_precision("highest" if "highest" in name else "high")
        if isinstance(pattern, str):
            layout = dynamic_layout(seq, "sinks" in pattern)
        else:
            layout = random_layout(seq) if pattern is None else pattern.layout(seq)
        q = torch.randn(2, seq, 4, dim, device="cuda", dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(2, 4 // group, seq, dim, device="cuda", dtype=dtype) for _ in "kv")
        out, lse = ca.attention_forward(q, k, v, layout)
        grads = ca.attention_backward(torch.randn_like(out), q, k, v, out, lse, layout)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
        assert not any(torch.isnan(g).any() for g in grads), name
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
