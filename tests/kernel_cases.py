"""Shared pieces of the GPU kernel tests: random cases, host <-> device transfer, and launches with poisoned
outputs (`cusparseattn.testing.poisoned`: NaN before the kernel runs, so an element a kernel forgets to write
shows).

Tensors travel through PyTorch; the kernels are called through `cusparseattn.cuda` directly, so these tests
see the kernels alone (the backends and adapters have their own tests).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st

import cusparseattn as ca
from cusparseattn import BlockLayout, TokenRule, patterns
from cusparseattn.testing import check_step, poisoned

DTYPES = ["float16", "bfloat16"]
#: float32's precisions on the kernels, with the dtype whose reference bounds each one's error: TF32 keeps
#: float16's 10 bits of mantissa (its inputs and probabilities rounded so), split TF32 float32's rounding.
FLOAT32_BOUNDS = {"high": "float16", "highest": "float32"}


def np_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _torch():
    return pytest.importorskip("torch", reason="the GPU kernel tests hand tensors over with PyTorch")


def to_device(x):
    """A host array on the GPU, keeping a [B, S, H, D] view's strides (a transposed [B, H, S, D] array)."""
    torch = _torch()
    if x.ndim == 4 and x.strides[1] < x.strides[2]:
        return to_device(x.transpose(0, 2, 1, 3)).transpose(1, 2)
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_host(t):
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _wrap(**tensors):
    from cusparseattn import arrays

    return {name: arrays.wrap(t, name) for name, t in tensors.items()}


def run_forward(q, k, v, layout, scale=None, precision="high"):
    """The forward kernel on host arrays (float32 at `precision`): (out, lse) on the host."""
    torch = _torch()
    from cusparseattn import cuda

    tq, tk, tv = (to_device(x) for x in (q, k, v))
    out, lse = poisoned(tq), poisoned(tq, tq.shape[:3], "float32")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    h = _wrap(q=tq, k=tk, v=tv, out=out, lse=lse)
    cuda.forward(h["q"], h["k"], h["v"], h["out"], h["lse"], layout, scale, precision=precision)
    torch.cuda.synchronize()
    return to_host(out), to_host(lse)


def run_backward(dout, q, k, v, out, lse, layout, scale=None, precision="high"):
    """The backward kernels on host arrays (float32 at `precision`): (dq, dk, dv, stats) on the host."""
    torch = _torch()
    from cusparseattn import cuda

    t = {name: to_device(x) for name, x in dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse).items()}
    grads = dict(
        dq=poisoned(t["q"]),
        dk=poisoned(t["k"]),
        dv=poisoned(t["v"]),
        stats=poisoned(t["q"], cuda.stats_shape(t["q"].shape, t["q"].device.index, q.dtype.name), "float32"),
    )
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    h = _wrap(**t, **grads)
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")
    cuda.backward(*(h[n] for n in names), layout, scale, precision=precision)
    torch.cuda.synchronize()
    return tuple(to_host(grads[n]) for n in ("dq", "dk", "dv", "stats"))


def hopper_path(monkeypatch, hopper: bool) -> list[str]:
    """Sends this test's launches to the Hopper kernels (or, with hopper=False, to the portable ones through
    CUSPARSEATTN_HOPPER=0) and returns the list that records each launched kernel's name. Skips off compute
    capability 9.0."""
    from cusparseattn import devices, launches

    if devices.compute_capability(0) != 90:
        pytest.skip("the Hopper kernels need compute capability 9.0")
    monkeypatch.setenv("CUSPARSEATTN_HOPPER", "1" if hopper else "0")
    launched, launch = [], launches.Bound.launch

    def record(self, *args, **kwargs):
        launched.append(self.kernel)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(launches.Bound, "launch", record)
    return launched


def check_jitted_dynamic_steps(host, dout, make, draw, block):
    """A jitted training step (``jax.vjp`` of causal ``attention``) over a dynamic layout ``make(idx,
    block=block)`` whose indices are traced operands: each of two steps' new indices (``draw()``) refills
    its tables on XLA's stream without tracing again, and its out and gradients match the reference of the
    host arrays ``host`` (q, k, v) and ``dout``. Skips where JAX sees no GPU."""
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU (a CPU-only jaxlib)")
    q, k, v, jd = (jax.device_put(x, gpus[0]) for x in (*host, dout))

    def step(q, k, v, idx):
        lay = make(idx, block=block)
        out, vjp = jax.vjp(lambda q, k, v: ca.attention(q, k, v, lay, causal=True), q, k, v)
        return out, *vjp(jd)

    jitted = jax.jit(step)
    for _ in range(2):
        idx = draw()
        results = jax.block_until_ready(jitted(q, k, v, jax.device_put(idx, gpus[0])))
        lay_host = make(idx, block=block) & patterns.causal(block=block)
        check_step([np.asarray(r) for r in results], dout, *host, lay_host, dtype="bfloat16")
    assert jitted._cache_size() == 1


def random_layout(rng, sq, sk, block, batch, heads, with_rule):
    """Random blocks with an empty query row; with a rule (no C expression: a bit mask) in half the blocks."""
    nq, nk = -(-sq // block), -(-sk // block)
    blocks = rng.random((batch, heads, nq, nk)) < 0.5
    blocks[..., rng.integers(nq), :] = False  # an empty row
    if not with_rule:
        return BlockLayout(blocks, block_size=block, seq_q=sq, seq_k=sk)
    rule = TokenRule("mod3", lambda b, h, q, k: (q + 2 * k + h) % 3 != 0)
    partial = blocks & (rng.random(blocks.shape) < 0.5)
    return BlockLayout(blocks, block_size=block, seq_q=sq, seq_k=sk, partial=partial, rule=rule)


@st.composite
def cases(draw, max_seq=400, dtypes=tuple(DTYPES)):
    """(dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, seed) of one random kernel case."""
    dtype = draw(st.sampled_from(dtypes))
    head_dim = draw(st.sampled_from([32, 40, 64, 96, 128, 256]))
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    seq_q = draw(st.integers(1, max_seq))
    seq_k = draw(st.sampled_from([seq_q, draw(st.integers(1, max_seq))]))
    block = draw(st.sampled_from([16, 32, 64, 128]))
    kind = draw(st.sampled_from(["dense", "causal", "local", "random", "random_rule"]))
    order = draw(st.sampled_from(["bhsd", "bshd"]))
    return dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, draw(st.integers(0, 2**31))


def layout_for(kind, rng, b, hq, sq, sk, block):
    if kind == "dense":
        return patterns.dense(block=block).layout(sq, sk)
    if kind == "causal":
        return patterns.causal(block=block).layout(sq, sk)
    if kind == "local":
        return patterns.local(window=int(rng.integers(1, 200)), block=block).layout(sq, sk)
    return random_layout(rng, sq, sk, block, int(rng.integers(1, b + 1)), hq, kind == "random_rule")


BANDS = ["two_sided", "traced", "heads", "near"]


def band_pattern(name: str, window: int):
    """Rules that are one run of keys a query and of queries a key (`cusparseattn.analyses.band`), which the
    kernels mask partial tiles by from each row's two ends: both bounds, a traced mask function, bounds that
    move with the head, runs of 8 keys (shorter than a thread's column pairs are apart)."""
    if name == "two_sided":
        return patterns.local(window=window, causal=False, block=32)
    if name == "near":
        return patterns.from_mask(lambda b, h, q, k: (k - 5 <= q) & (q <= k + 2), block=32, name="near")
    if name == "heads":
        return patterns.from_mask(lambda b, h, q, k: (k <= q + h) & (k + window > q), heads=4, block=64)
    return patterns.from_mask(lambda b, h, q, k: (q >= k) & (q - k < window), block=64)
