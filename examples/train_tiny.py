"""A tiny transformer trained with block-sparse attention, next to the same model with dense causal attention.

The task needs only local context: next-token prediction on sequences that repeat themselves with a period,
with mutations. A sequence starts with ``period`` random tokens; every later token copies the one ``period``
back, or, with probability ``mutation``, is drawn afresh, so copies drift and the most recent period is the
best guide. A causal sliding window longer than the period holds all the context that pays, so the
block-sparse model (``cusparseattn.attention`` with ``patterns.local``) should learn as well as the dense one
(``F.scaled_dot_product_attention(is_causal=True)``). With ``--attention moba`` the sparse model's layout is
chosen from the data at every step instead, as MoBA does: each query block attends its own block and the
``topk`` earlier blocks whose mean key scores best against it (``cusparseattn.selectors.moba``, a dynamic
layout, causal inside the blocks). Both runs start from the same weights and see the same batches. The first
period of each sequence and the mutations are unpredictable: the loss has a floor, printed.

    python examples/train_tiny.py                          # GPU: bf16 autocast, the CUDA kernels
    python examples/train_tiny.py --device cpu             # a tiny model, the NumPy reference, float32
    python examples/train_tiny.py --attention moba         # the layout chosen at every step (MoBA's gate)
    python examples/train_tiny.py --steps 400 --out runs/  # also writes runs/train_tiny.json and .png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cusparseattn
from cusparseattn import dynamic, patterns, selectors


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the model, the task and the run."""

    vocab: int
    seq: int
    batch: int
    d_model: int
    heads: int
    layers: int
    window: int  # keys each query sees, itself included (the sparse run's causal sliding window)
    block: int  # the layout's block size
    topk: int  # --attention moba: earlier blocks each query block attends beside its own
    period: int  # tokens repeat with this period...
    mutation: float  # ...except for this fraction, drawn afresh
    steps: int
    lr: float
    warmup: int
    log_every: int
    seed: int = 0


GPU = Config(
    vocab=64,
    seq=512,
    batch=32,
    d_model=256,
    heads=4,
    layers=2,
    window=128,
    block=64,
    topk=2,
    period=48,
    mutation=0.1,
    steps=300,
    lr=2e-3,
    warmup=30,
    log_every=25,
)
CPU = Config(
    vocab=16,
    seq=64,
    batch=16,
    d_model=64,
    heads=2,
    layers=2,
    window=16,
    block=16,
    topk=1,
    period=8,
    mutation=0.1,
    steps=40,
    lr=1e-2,
    warmup=5,
    log_every=5,
)


def batches(cfg: Config, device: str):
    """Endless ``(inputs, targets)`` pairs ``[batch, seq]``, the same sequence of them for a given seed.

    A sequence starts with ``period`` random tokens; each later token copies the one ``period`` back, except
    that with probability ``mutation`` it is drawn afresh. Copies drift from the original, so the most recent
    period is the best guide: the context that pays is local.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    while True:
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        keep = torch.rand(cfg.batch, cfg.seq + 1, generator=gen) >= cfg.mutation
        for start in range(cfg.period, cfg.seq + 1, cfg.period):
            span = slice(start, min(start + cfg.period, cfg.seq + 1))
            back = slice(start - cfg.period, span.stop - cfg.period)
            tokens[:, span] = torch.where(keep[:, span], tokens[:, back], tokens[:, span])
        tokens = tokens.to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def loss_floor(cfg: Config) -> float:
    """The loss of the best possible predictor: the first period is random, later tokens mostly copies."""
    p_copy = 1 - cfg.mutation + cfg.mutation / cfg.vocab
    p_other = cfg.mutation / cfg.vocab
    copied = -p_copy * math.log(p_copy) - (cfg.vocab - 1) * p_other * math.log(p_other) if p_other else 0.0
    first = cfg.period - 1  # the first target is the second token
    return (first * math.log(cfg.vocab) + (cfg.seq - first) * copied) / cfg.seq


def attention_fn(kind: str, cfg: Config, device: str):
    """``f(q, k, v) -> out`` on ``[B, H, S, Dh]``: "local" (cusparseattn, a causal window), "moba"
    (cusparseattn, the blocks MoBA's gate picks from q and k at each call) or "dense"."""
    if kind == "dense":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # Forcing the backend makes a GPU run fail loudly rather than fall back to the host reference.
    backend = "cuda" if device.startswith("cuda") else "reference"
    if kind == "local":
        pattern = patterns.local(window=cfg.window, block=cfg.block)
        return lambda q, k, v: cusparseattn.attention(q, k, v, pattern, backend=backend)
    causal = patterns.causal(block=cfg.block)  # made once: a new Pattern each step would be a new plan

    def moba(q, k, v):
        # The gate is a top-k: no gradient flows through the choice, only through the attention on it.
        chosen = selectors.moba(q, k, block=cfg.block, topk=cfg.topk)
        layout = dynamic.block_indices(chosen, block=cfg.block) & causal
        return cusparseattn.attention(q, k, v, layout, backend=backend)

    return moba


class Block(nn.Module):
    """A pre-norm transformer block whose attention is a function of ``(q, k, v)``."""

    def __init__(self, cfg: Config, attend):
        super().__init__()
        self.heads, self.attend = cfg.heads, attend
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        # [B, H, S, Dh] views of one projection laid out [B, S, 3, H, Dh]: v goes in strided, no copy.
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def rotate(x, cos, sin):
    """Rotary position embedding of ``x [B, H, S, Dh]`` (halves rotated as pairs), in ``x``'s dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class TinyLM(nn.Module):
    """Token embeddings, ``cfg.layers`` blocks with rotary positions, a final norm and the output head."""

    def __init__(self, cfg: Config, attend):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        half = cfg.d_model // cfg.heads // 2
        angles = torch.outer(torch.arange(cfg.seq), 10000.0 ** (-torch.arange(half) / half))
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def train(cfg: Config, kind: str, device: str) -> list[float]:
    """Trains a fresh model (weights from ``cfg.seed``) with ``kind`` attention; the loss of every step."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg, attention_fn(kind, cfg, device)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    # Linear warmup, then a cosine decay to a tenth of the rate.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / cfg.warmup) * (0.55 + 0.45 * math.cos(math.pi * min(i, cfg.steps) / cfg.steps))
        ),
    )
    on_gpu = device.startswith("cuda")
    losses = []
    data = batches(cfg, device)
    for _ in range(cfg.steps):
        inputs, targets = next(data)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


# The plot's size, margins (left, top, right, bottom) and colours: sparse blue, dense orange, the floor grey.
PLOT_SIZE, PLOT_MARGINS = (840, 480), (70, 20, 20, 60)
COLOURS = {"sparse": (31, 119, 180), "dense": (255, 127, 14), "floor": (128, 128, 128)}


def plot(result: dict, path: Path) -> None:
    """Both loss curves and the task's floor against the step, drawn with Pillow (the ``plot`` extra)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print("Pillow missing (pip install 'cusparseattn[plot]'): no plot")
        return
    (width, height), (left, top, right, bottom) = PLOT_SIZE, PLOT_MARGINS
    curves = [result["sparse"], result["dense"]]
    low, high = min(result["floor"], *map(min, curves)), max(map(max, curves))
    steps = max(len(c) for c in curves) - 1 or 1
    span = high - low or 1.0

    def point(step, loss):
        x = left + (width - left - right) * step / steps
        return x, top + (height - top - bottom) * (high - loss) / span

    img = Image.new("RGB", PLOT_SIZE, "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for kind, losses in zip(("sparse", "dense"), curves, strict=True):
        draw.line([point(i, x) for i, x in enumerate(losses)], fill=COLOURS[kind], width=2)
    y_floor = point(0, result["floor"])[1]
    for x in range(left, width - right, 12):  # dashed
        draw.line([(x, y_floor), (min(x + 6, width - right), y_floor)], fill=COLOURS["floor"])
    for loss in (low, high):
        draw.text((4, point(0, loss)[1] - 6), f"{loss:.2f}", fill="black")
    draw.text((left, height - bottom + 4), "0", fill="black")
    draw.text((width - right - 30, height - bottom + 4), str(steps), fill="black")
    draw.text((left, height - 22), "x: step; y: training loss (nats/token)", fill="black")
    names = {**result["labels"], "floor": "task floor"}
    for i, kind in enumerate(("sparse", "dense", "floor")):
        y = top + 8 + 14 * i
        draw.line([(width - right - 330, y + 6), (width - right - 310, y + 6)], fill=COLOURS[kind], width=2)
        draw.text((width - right - 305, y), names[kind], fill="black")
    img.save(path)


def main(argv=None) -> dict:
    """Runs both trainings and prints their losses side by side; returns them (and writes them with --out)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, help="training steps (default: 300 on GPU, 40 on CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    parser.add_argument(
        "--attention", choices=["local", "moba"], default="local", help="the sparse run's attention"
    )
    parser.add_argument("--window", type=int, help="the sparse run's window (default: 128 on GPU, 16 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="directory for train_tiny.json and train_tiny.png")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPU if device == "cuda" else CPU
    overrides = {"steps": args.steps, "window": args.window, "seed": args.seed}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.attention == "local" and cfg.window <= cfg.period:
        print(f"note: the window ({cfg.window}) does not reach one period ({cfg.period}) back")

    floor = loss_floor(cfg)
    if args.attention == "local":
        density = patterns.local(window=cfg.window, block=cfg.block).layout(cfg.seq).density
        sparse = f"cusparseattn local({cfg.window}), block {cfg.block}, density {density:.3f}"
    else:
        sparse = f"cusparseattn MoBA: own block + top {cfg.topk} of blocks of {cfg.block}, chosen each step"
    labels = {"sparse": sparse, "dense": "SDPA, dense causal"}
    print(
        f"device {device}; {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads of "
        f"{cfg.d_model // cfg.heads}; batch {cfg.batch} x {cfg.seq} tokens, vocabulary {cfg.vocab}, period "
        f"{cfg.period}, mutation {cfg.mutation}; loss floor {floor:.3f}"
    )
    result = {"config": dataclasses.asdict(cfg), "device": device, "floor": floor, "labels": labels}
    result["attention"] = args.attention
    for kind in ("sparse", "dense"):
        start = time.perf_counter()
        result[kind] = train(cfg, args.attention if kind == "sparse" else kind, device)
        result[f"{kind}_seconds"] = time.perf_counter() - start
        print(f"{kind:6}: {labels[kind]}; {result[f'{kind}_seconds']:.1f} s")

    print(f"\n{'step':>6} {'sparse':>8} {'dense':>8}")
    for i in range(0, cfg.steps, cfg.log_every):
        print(f"{i:6} {result['sparse'][i]:8.4f} {result['dense'][i]:8.4f}")
    tail = max(1, cfg.steps // 10)  # the last tenth, averaged: one batch's loss is noisy
    for kind in ("sparse", "dense"):
        result[f"{kind}_final"] = sum(result[kind][-tail:]) / tail
    gap = result["sparse_final"] / result["dense_final"] - 1
    print(
        f"final loss (mean of the last {tail} steps): sparse {result['sparse_final']:.4f}, "
        f"dense {result['dense_final']:.4f} ({gap:+.1%}); first step {result['sparse'][0]:.4f} / "
        f"{result['dense'][0]:.4f}; floor {floor:.4f}"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "train_tiny.json").write_text(json.dumps(result, indent=1))
        plot(result, args.out / "train_tiny.png")
        print(f"wrote {args.out / 'train_tiny.json'}")
    return result


if __name__ == "__main__":
    main()
