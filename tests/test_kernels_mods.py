"""Traced mods in the CUDA kernels, on the GPU (``python -m pytest -m gpu``).

Forward and backward run through the public functions with ``backend="cuda"`` (CuPy float16 and torch
bfloat16 inputs) and are compared with the reference on the same layout and score mod, by the STYLE rule
(`cusparseattn.testing.check_close`): every ready-made mask mod as a layout (`patterns.from_mask`, its rule
compiled as a C expression), every ready-made score mod, and random traced expressions. New values (a window,
a softcap, slopes, a bias table) must not compile a new kernel.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from kernel_cases import DTYPES, np_dtype, to_device, to_host
from test_trace import Expressions, make_function

import cusparseattn as ca
from cusparseattn import build, mods, patterns, plan, reference, user_patterns
from cusparseattn.testing import check_close, random_qkv

pytestmark = pytest.mark.gpu

SEQ = 333
IDS = np.repeat([0, 1, 2, 3], [100, 1, 150, 82])
IDS2 = np.stack([IDS, np.repeat([0, 1], [200, 133])])

MASKS = {
    "causal": (mods.causal_mask, 1),
    "sliding_window": (mods.sliding_window(70), 1),
    "sliding_two_sided": (mods.sliding_window(45, causal=False), 1),
    "prefix_lm": (mods.prefix_lm(40), 1),
    "document": (mods.document_mask(IDS), 1),
    "document_batch_causal": (mods.and_masks(mods.causal_mask, mods.document_mask(IDS2)), 2),
    "dilated": (mods.dilated(7), 1),
    "sinks_or_window": (
        mods.and_masks(mods.causal_mask, mods.or_masks(mods.sliding_window(64), lambda b, h, q, k: k < 8)),
        1,
    ),
}

SCORES = {
    "alibi": mods.alibi(mods.alibi_slopes(4)),
    "softcap": mods.softcap(1.5),
    "relative_bias": mods.relative_bias(np.random.default_rng(2).standard_normal((4, 101))),
    "alibi_softcap": mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(2.0)),
    "masking": lambda s, b, h, q, k: mods.where((q + h) % 7 == 0, float("-inf"), s * 1.5),
    "per_batch": lambda s, b, h, q, k: s + mods.exp(-abs(q - k) / 16.0) * (b + 1),
    "reciprocal": lambda s, b, h, q, k: (
        s + 0.1 * mods.tanh(1.0 / s)
    ),  # s as a bare divisor: the kernel must parenthesise it
}


def device(x, dtype: str):
    """float16 as CuPy arrays, bfloat16 as torch tensors (CuPy has no bfloat16): both frameworks run."""
    if dtype == "float16":
        import cupy

        return cupy.asarray(x)
    return to_device(x)


def host(x):
    return x.get() if type(x).__module__.startswith("cupy") else to_host(x)


def run_cuda(q, k, v, dout, layout, score_mod, dtype, scale):
    dq, dk, dv, ddo = (device(x, dtype) for x in (q, k, v, dout))
    out, lse = ca.attention_forward(dq, dk, dv, layout, scale=scale, score_mod=score_mod, backend="cuda")
    grads = ca.attention_backward(
        ddo, dq, dk, dv, out, lse, layout, scale=scale, score_mod=score_mod, backend="cuda"
    )
    return host(out), host(lse), tuple(host(g) for g in grads)


def references(q, k, v, dout, layout, score_mod, scale):
    """``(out, lse, (dq, dk, dv))`` of the float64 reference and of the reference in the kernels' precision
    (float32 softmax on the inputs' dtype), each backward fed by its own forward."""

    def run(arrays, **precision):
        q_, k_, v_, do_ = arrays
        kw = dict(scale=scale, score_mod=score_mod, **precision)
        out, lse = reference.forward(q_, k_, v_, layout, **kw)
        return out, lse, reference.backward(do_, q_, k_, v_, out, lse, layout, **kw)

    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    return run(wide, precision=np.float64), run((q, k, v, dout))


def assert_matches(q, k, v, layout, score_mod, dtype, rng, scale=0.2):
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse, grads = run_cuda(q, k, v, dout, layout, score_mod, dtype, scale)
    (out64, lse64, grads64), (out_lo, lse_lo, grads_lo) = references(q, k, v, dout, layout, score_mod, scale)
    check_close("out", out, out64, out_lo, dtype=dtype)
    check_close("lse", lse, lse64, lse_lo, dtype="float32")
    for name, got, want, want_lo in zip(("dq", "dk", "dv"), grads, grads64, grads_lo, strict=True):
        check_close(name, got, want, want_lo, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_mods(name, dtype):
    fn, batch = MASKS[name]
    rng = np.random.default_rng(1)
    layout = patterns.from_mask(fn, block=64, batch=batch if batch > 1 else None).layout(SEQ)
    assert plan.rule_mode(layout) == "expr", layout.rule
    q, k, v = random_qkv(rng, 2, 4, 2, SEQ, SEQ, 64, np_dtype(dtype))
    assert_matches(q, k, v, layout, None, dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCORES))
@pytest.mark.parametrize("kind", ["dense", "document"])
def test_score_mods(name, kind, dtype):
    rng = np.random.default_rng(2)
    layout = {
        "dense": patterns.dense(block=64).layout(SEQ),
        "document": patterns.document(IDS2, causal=True, block=64).layout(SEQ),
    }[kind]
    q, k, v = random_qkv(rng, 2, 4, 2, SEQ, SEQ, 128, np_dtype(dtype), "bshd")
    assert_matches(q, k, v, layout, mods.score_mod(SCORES[name]), dtype, rng)


def random_mods(count: int, seed: int):
    """Random traced expressions that the kernels take: a bounded score mod ``s + tanh(E)`` and a causal
    mask ``R & (k <= q)`` (E, R random, depth 2)."""
    rnd, out = random.Random(seed), []
    while len(out) < count:
        score_text = Expressions(rnd, "score_mod").top(2)
        mask_text = Expressions(rnd, "mask_mod").top(2)
        score = make_function(f"s + tanh({score_text})", "score_mod", direct=False)
        mask = make_function(f"({mask_text}) & (k <= q)", "mask_mod", direct=False)
        try:
            pattern = patterns.from_mask(mask, block=32, batch=3, heads=4)
            out.append((score_text, mask_text, mods.score_mod(score), pattern))
        except ValueError:  # more parameters than the kernels take: draw again
            continue
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_traced_mods(dtype):
    rng = np.random.default_rng(3)
    for score_text, mask_text, score_mod, pattern in random_mods(6, seed=11):
        layout = pattern.layout(200, 260)
        q, k, v = random_qkv(rng, 3, 4, 4, 200, 260, 64, np_dtype(dtype))
        try:
            assert_matches(q, k, v, layout, score_mod, dtype, rng)
        except AssertionError as err:
            raise AssertionError(
                f"score_mod s + tanh({score_text}), mask ({mask_text}) & (k <= q): {err}"
            ) from err


def test_window_layouts_see_global_positions():
    """A layout's window (context parallelism's shard): score mods and rules see whole-sequence positions."""
    rng = np.random.default_rng(4)
    mask = mods.and_masks(mods.causal_mask, mods.document_mask(IDS))
    score = mods.score_mod(mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(3.0)))
    layout = patterns.from_mask(mask, block=64).layout(SEQ)
    window = layout.window(128, SEQ, 0, 256)
    q, k, v = random_qkv(rng, 1, 2, 1, SEQ - 128, 256, 64, np.float16)
    assert_matches(q, k, v, window, score, "float16", rng)


def test_new_values_do_not_compile_new_kernels():
    """Same structure, new values: the second round of calls loads no new kernel. Prints the first call's
    compile time of each mod."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 4, 2, SEQ, SEQ, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)

    def rounds(window, slopes, cap, table):
        return [
            ("sliding_window", patterns.from_mask(mods.sliding_window(window), block=64).layout(SEQ), None),
            ("alibi", patterns.causal(block=64).layout(SEQ), mods.score_mod(mods.alibi(slopes))),
            ("softcap", patterns.causal(block=64).layout(SEQ), mods.score_mod(mods.softcap(cap))),
            (
                "relative_bias",
                patterns.causal(block=64).layout(SEQ),
                mods.score_mod(mods.relative_bias(table)),
            ),
        ]

    first = rounds(70, mods.alibi_slopes(4), 20.0, rng.standard_normal((4, 65)))
    second = rounds(150, mods.alibi_slopes(4) * 3, 7.0, rng.standard_normal((4, 129)))
    for (name, layout, score), (_, layout2, score2) in zip(first, second, strict=True):
        before = set(build.COMPILE_TIMES)
        start = time.perf_counter()
        run_cuda(q, k, v, dout, layout, score, "float16", 0.125)
        new = set(build.COMPILE_TIMES) - before
        seconds = sum(build.COMPILE_TIMES[n] for n in new)
        elapsed = time.perf_counter() - start
        print(f"{name}: first call {elapsed:.2f} s, {len(new)} kernels loaded in {seconds:.2f} s")
        if score is not None:
            assert (score.c_expr, score.structure) == (score2.c_expr, score2.structure)
        else:
            assert (
                layout.rule.structure == layout2.rule.structure and layout.rule.params != layout2.rule.params
            )
        before = set(build.COMPILE_TIMES)
        run_cuda(q, k, v, dout, layout2, score2, "float16", 0.125)
        assert set(build.COMPILE_TIMES) == before, f"{name}: compiled {set(build.COMPILE_TIMES) - before}"
        assert_matches(q, k, v, layout2, score2, "float16", rng, scale=0.125)


def test_traced_programs_evaluate_on_cupy():
    """The trace's evaluators take CuPy arrays (a GPU path for block classification): same values as NumPy."""
    import cupy

    rule = mods.mask_rule(mods.and_masks(mods.causal_mask, mods.document_mask(IDS2)))
    score = mods.score_mod(SCORES["alibi_softcap"])
    b, h = np.arange(2)[:, None, None, None], np.arange(4)[None, :, None, None]
    q, k = np.arange(SEQ + 20)[:, None], np.arange(SEQ + 20)[None, :]  # past the end: clamped lookups
    s = np.random.default_rng(6).standard_normal((2, 4, SEQ + 20, SEQ + 20)).astype(np.float32)
    on_gpu = [cupy.asarray(x) for x in (s, b, h, q, k)]
    assert np.array_equal(cupy.asnumpy(rule.fn(*on_gpu[1:])), rule(b, h, q, k))
    for method in ("evaluate", "grad"):
        got = cupy.asnumpy(getattr(score, method)(*on_gpu))
        np.testing.assert_allclose(got, getattr(score, method)(s, b, h, q, k), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_from_mask_classifies_blocks_on_the_gpu_like_numpy(monkeypatch):
    ids = np.repeat(np.arange(5), [1000, 3000, 200, 2900, 1092])
    fns = [
        mods.and_masks(mods.causal_mask, mods.sliding_window(3000)),
        mods.and_masks(mods.causal_mask, mods.document_mask(ids)),
        mods.dilated(3),
        mods.prefix_lm(777),
    ]
    for fn in fns:
        rule = mods.mask_rule(fn)
        gpu = user_patterns._classify_blocks(rule, 1, 1, 8192, 8192, (128, 64))
        with monkeypatch.context() as m:
            m.setattr(user_patterns, "GPU_CLASSIFY_PAIRS", 1 << 62)
            cpu = user_patterns._classify_blocks(rule, 1, 1, 8192, 8192, (128, 64))
        for g, c in zip(gpu, cpu, strict=True):
            assert np.array_equal(g, np.broadcast_to(c, g.shape)), rule.c_expr
    start = time.perf_counter()
    lay = patterns.from_mask(mods.sliding_window(4096)).layout(131072)
    seconds = time.perf_counter() - start
    print(f"from_mask of a 131072 x 131072 sliding window on the GPU: {seconds:.2f} s")
    assert lay.nnz == lay.num_blocks[0] * 33 - 33 * 32 // 2 and seconds < 10
