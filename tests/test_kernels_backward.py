"""The CUDA backward kernels (dQ pass, dK/dV pass) against the reference, on the GPU (``pytest -m gpu``).

Each case runs the forward kernel, then the backward kernels on its ``out`` and ``lse``, as training does.
Gradients are poisoned with NaN before the launch (`cusparseattn.testing.poisoned`); the tolerance is the
STYLE rule against the float64 reference backward (which the reference tests check against finite
differences).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from kernel_cases import (
    BANDS,
    DTYPES,
    FLOAT32_BOUNDS,
    _torch,
    band_pattern,
    cases,
    hopper_path,
    layout_for,
    np_dtype,
    run_backward,
    run_forward,
    to_host,
)

from cusparseattn import BlockLayout, patterns
from cusparseattn.testing import backward_refs, check_close, forward_refs, poisoned, random_qkv

pytestmark = pytest.mark.gpu


def assert_backward_matches(q, k, v, layout, dtype, rng, scale=None, precision="high"):
    """The kernels' gradients against the references; float32's at `precision`, bounded by the reference
    of FLOAT32_BOUNDS' dtype."""
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = run_forward(q, k, v, layout, scale, precision)
    dq, dk, dv, stats = run_backward(dout, q, k, v, out, lse, layout, scale, precision)
    bound = FLOAT32_BOUNDS[precision] if dtype == "float32" else None
    # Where the references cancel exactly (dP - delta of a row with one key: delta sums dO * O in float32)
    # the kernel's dP, a tensor-core product, is off by its rounding of the dot product's magnitudes: TF32's
    # 2^-11 ("high": the float16-rounded reference's inputs round alike in dP and delta, so it cancels),
    # 2.4e-3 seen on standard-normal inputs at head dim 96; split TF32's 2^-21 ("highest": the low halves'
    # product is dropped), 1.2e-5 at head dim 256.
    # That is a row's error; a key's dK sums it over the query rows of its group, with signs that vary from
    # row to row: its slack grows as the root of their count (8.5e-3 seen over 147 rows at head dim 32).
    atol = {"high": 8e-3, "highest": 4e-5}[precision] if dtype == "float32" else None
    rows = q.shape[2] * (q.shape[1] // k.shape[1])
    atols = {"dq": atol, "dk": atol and atol * math.sqrt(rows), "dv": atol}
    ref64, low = backward_refs(dout, q, k, v, layout, scale=scale, low=bound)
    for name, got, want, want_low in zip(("dq", "dk", "dv"), (dq, dk, dv), ref64, low, strict=True):
        assert got.dtype == q.dtype, name
        check_close(name, got, want, want_low, dtype=bound or dtype, atol=atols[name])
    # The dQ pass's statistics of the kernel's own out and lse: delta = rowsum(dout * out) and lse * log2(e),
    # +inf for rows that attend to nothing.
    seq_q = q.shape[2]
    want_delta = np.einsum("bhsd,bhsd->bhs", dout.astype(np.float64), out.astype(np.float64))
    np.testing.assert_allclose(stats[:, :, 1, :seq_q], want_delta, rtol=1e-4, atol=1e-4)
    want_lse2 = np.where(lse == -np.inf, np.inf, lse.astype(np.float64) * np.log2(np.e))
    np.testing.assert_allclose(stats[:, :, 0, :seq_q], want_lse2, rtol=1e-6)


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_seq=300))
def test_backward_matches_reference(case):
    dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, seed = case
    rng = np.random.default_rng(seed)
    batch = 2
    q, k, v = random_qkv(rng, batch, hkv * group, hkv, seq_q, seq_k, head_dim, np_dtype(dtype), order)
    layout = layout_for(kind, rng, batch, hkv * group, seq_q, seq_k, block)
    assert_backward_matches(q, k, v, layout, dtype, rng)


@pytest.mark.parametrize("precision", list(FLOAT32_BOUNDS))
@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_seq=300, dtypes=("float32",)))
def test_float32_backward_matches_reference(precision, case):
    dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, hkv * group, hkv, seq_q, seq_k, head_dim, np.float32, order)
    layout = layout_for(kind, rng, 2, hkv * group, seq_q, seq_k, block)
    assert_backward_matches(q, k, v, layout, dtype, rng, precision=precision)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_highest_stays_at_float32s_rounding_over_long_sums(head_dim):
    """Split TF32's output and gradients summed over thousands of keys (O, dQ) and queries (dK, dV) stay
    within a few dozen float32 roundings of float64 (2.7e-6 the largest seen, in dQ, where dP - delta
    cancels): each step's products are summed apart from the accumulators, which the tensor cores would
    otherwise add into without rounding to nearest (dK and dV then 4e-5 off at S = 4096)."""
    rng = np.random.default_rng(13)
    seq = 2048
    q, k, v = random_qkv(rng, 1, 2, 2, seq, seq, head_dim, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    layout = patterns.causal(block=128).layout(seq)
    out, lse = run_forward(q, k, v, layout, precision="highest")
    grads = run_backward(dout, q, k, v, out, lse, layout, precision="highest")[:3]
    (out64, _), _ = forward_refs(q, k, v, layout)
    ref64, _ = backward_refs(dout, q, k, v, layout)
    errors = {
        name: float(np.abs(got - want).max() / np.abs(want).max())
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out64, *ref64), strict=True)
    }
    assert max(errors.values()) < 5e-6, errors


def test_float32_runs_the_hopper_two_pass_backward(monkeypatch):
    """The Hopper dQ and dK/dV passes in TF32 after the transposed copies of K, Q and dO, not the fused
    backward (half precision), after the Hopper forward in TF32."""
    launched = hopper_path(monkeypatch, hopper=True)
    monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", "1")
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 1, 4, 2, 300, 300, 64, np.float32)
    assert_backward_matches(q, k, v, patterns.causal(block=64).layout(300), "float32", rng)
    assert launched == ["transpose", "forward_sm90", "transpose", "backward_dq_sm90", "backward_dkdv_sm90"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["causal", "local", "strided", "strided_blocks", "document"])
def test_builtin_rules(name, dtype):
    rng = np.random.default_rng(11)
    seq = 555
    pattern = {
        "causal": patterns.causal(block=64),
        "local": patterns.local(window=150, block=32),
        "strided": patterns.strided(stride=64, block=64),
        "strided_blocks": patterns.strided_blocks(3, block=64),
        "document": patterns.document(seq_lens=[[300, 55, 200], [555]], block=64),
    }[name]
    q, k, v = random_qkv(rng, 2, 4, 2, seq, seq, 128, np_dtype(dtype))
    assert_backward_matches(q, k, v, pattern.layout(seq), dtype, rng, scale=0.1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_unvisited_rows_and_columns_get_zero_gradients(head_dim):
    """A query block that sees nothing, a key block that nobody sees, and two more (keys 256-383: a whole key
    tile of the Hopper backward, an item it walks without visits): zero gradients there, no NaN."""
    rng = np.random.default_rng(3)
    blocks = np.ones((8, 8), bool)
    blocks[1, :] = False  # queries 64-127 attend to nothing
    blocks[:, 2] = False  # keys 128-191 are attended by nobody
    blocks[:, 4:6] = False  # nor are keys 256-383
    layout = BlockLayout(blocks, block_size=64, seq_q=512)
    q, k, v = random_qkv(rng, 1, 2, 1, 512, 512, head_dim, np.float16)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = run_forward(q, k, v, layout)
    dq, dk, dv, _ = run_backward(dout, q, k, v, out, lse, layout)
    for g in (dq, dk, dv):
        assert not np.isnan(g.astype(np.float32)).any()
    assert (dq[:, :, 64:128] == 0).all()
    for keys in (slice(128, 192), slice(256, 384)):
        assert (dk[:, :, keys] == 0).all() and (dv[:, :, keys] == 0).all()
    assert (dq[:, :, :64] != 0).any() and (dk[:, :, :128] != 0).any() and (dv[:, :, 384:] != 0).any()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_is_deterministic(head_dim):
    """No atomics: the same inputs give the same bits, GQA sums over its group in a fixed order."""
    rng = np.random.default_rng(5)
    layout = patterns.causal(block=128).layout(1000)
    q, k, v = random_qkv(rng, 1, 8, 2, 1000, 1000, head_dim, np.float16)
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = run_forward(q, k, v, layout)
    first = run_backward(dout, q, k, v, out, lse, layout)
    second = run_backward(dout, q, k, v, out, lse, layout)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_64bit_offsets():
    """B * H * S * D above 2**31: the last head's rows sit past 32-bit element offsets."""
    torch = _torch()
    from cusparseattn import arrays, cuda

    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs 70 GiB of GPU memory")
    batch, heads, seq, dim = 64, 32, 8192, 128  # 2**31 elements per tensor
    layout = patterns.local(window=128, block=128).layout(seq)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn():
        return torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.float16, generator=gen)

    q, k, v, dout = randn(), randn(), randn(), randn()
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    names = dict(q=q, k=k, v=v, out=out, lse=lse)
    h = {n: arrays.wrap(t, n) for n, t in names.items()}
    cuda.forward(h["q"], h["k"], h["v"], h["out"], h["lse"], layout, 1 / math.sqrt(dim))
    dq, dk, dv = (poisoned(t) for t in (q, k, v))
    stats = torch.empty(cuda.stats_shape(q.shape, q.device.index), device="cuda")
    g = {n: arrays.wrap(t, n) for n, t in dict(dout=dout, dq=dq, dk=dk, dv=dv, stats=stats).items()}
    cuda.backward(
        g["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"], g["dq"], g["dk"], g["dv"], g["stats"],
        layout, 1 / math.sqrt(dim),
    )  # fmt: skip
    torch.cuda.synchronize()
    last = [to_host(t[-1:, -1:]) for t in (dout, q, k, v)]
    ref64, low = backward_refs(*last, layout)
    for name, got, want, want_low in zip(("dq", "dk", "dv"), (dq, dk, dv), ref64, low, strict=True):
        check_close(name, to_host(got[-1:, -1:]), want, want_low, dtype="float16")
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "random", "random_rule"])
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
def test_both_kernels_of_a_hopper_gpu(hopper, kind, head_dim, dtype, monkeypatch):
    """On an H100/H200 the backward takes the TMA/wgmma kernels (their two passes under
    CUSPARSEATTN_FUSED_BACKWARD=0), with CUSPARSEATTN_HOPPER=0 the portable ones.
    Both against the reference, on ragged lengths, GQA (dK/dV sum two query heads) and a [B, S, H, D] view."""
    launched = hopper_path(monkeypatch, hopper)
    monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", "0")
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np_dtype(dtype), "bshd")
    assert_backward_matches(q, k, v, layout_for(kind, rng, 2, 4, 300, 333, 64), dtype, rng)
    suffix = "_sm90" if hopper else ""
    assert launched == [f"forward{suffix}", f"backward_dq{suffix}", f"backward_dkdv{suffix}"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "random", "random_rule"])
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
def test_float32_on_both_kernels_of_a_hopper_gpu(hopper, kind, head_dim, monkeypatch):
    """float32 at "high" on an H100/H200: the Hopper forward and two backward passes in TF32, each after the
    transposed copies it reads (V's; K's, Q's and dO's), with CUSPARSEATTN_HOPPER=0 the portable ones. Both
    against the reference, on ragged lengths (the copies padded past them), GQA and a [B, S, H, D] view."""
    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(14)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np.float32, "bshd")
    assert_backward_matches(q, k, v, layout_for(kind, rng, 2, 4, 300, 333, 64), "float32", rng)
    passes = ["transpose", "forward_sm90", "transpose", "backward_dq_sm90", "backward_dkdv_sm90"]
    assert launched == (passes if hopper else ["forward", "backward_dq", "backward_dkdv"])


@pytest.mark.parametrize("path", ["fused", "two_pass", "portable"])
@pytest.mark.parametrize("rule", BANDS)
def test_the_backward_masks_a_band_by_its_bounds(rule, path, monkeypatch):
    """The backward passes mask a partial tile that the rule alone decides from each row's two ends
    (masking.cuh's band_bits) where the rule is one run of queries a key (analyses.band: the dK/dV passes'
    and the fused pass's rows are keys) or of keys a query (the dQ passes'): the fused Hopper pass, the two
    Hopper passes and the portable ones, on kernel_cases.band_pattern's rules; ragged lengths, GQA."""
    launched = hopper_path(monkeypatch, path != "portable")
    monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", "0" if path == "two_pass" else "1")
    seed = BANDS.index(rule) * 3 + ["fused", "two_pass", "portable"].index(path)
    rng = np.random.default_rng(seed)
    head_dim, dtype = [64, 128][seed % 2], DTYPES[seed // 2 % 2]
    print(f"seed {seed}, D = {head_dim}, {dtype}")
    layout = band_pattern(rule, int(rng.integers(20, 300))).layout(300, 333)
    kernel = layout.rule.kernel
    assert kernel.key_band and kernel.query_band and layout.rule.narrow(333 + 256)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np_dtype(dtype))
    assert_backward_matches(q, k, v, layout, dtype, rng)
    backward = {"fused": "backward_sm90", "two_pass": "backward_dkdv_sm90", "portable": "backward_dkdv"}[path]
    assert backward in launched


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "random", "random_rule"])
def test_fused_backward(kind, head_dim, dtype, deterministic, monkeypatch):
    """The default backward on an H100/H200: the statistics pass, the fused pass (on three CTAs, so
    that each walks many items and their adds into a query tile wait on each other) and dQ's rounding, as
    test_both_kernels_of_a_hopper_gpu checks the two passes (CUSPARSEATTN_FUSED_BACKWARD=0); and the same bits
    from a second run (dK and dV only under CUSPARSEATTN_DETERMINISTIC=0, on 132 CTAs whose adds into dQ race:
    sums that start at zero in a scratch poisoned with NaN, zeros for the query tiles no key tile visits)."""
    from cusparseattn import devices

    launched = hopper_path(monkeypatch, True)
    monkeypatch.delenv("CUSPARSEATTN_FUSED_BACKWARD", raising=False)
    monkeypatch.setenv("CUSPARSEATTN_DETERMINISTIC", "1" if deterministic else "0")
    monkeypatch.setattr(devices, "sm_count", lambda device: 3 if deterministic else 132)
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np_dtype(dtype), "bshd")
    layout = layout_for(kind, rng, 2, 4, 300, 333, 64)
    assert_backward_matches(q, k, v, layout, dtype, rng)
    assert launched == ["forward_sm90", "backward_stats", "backward_sm90", "backward_dq_convert"]
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = run_forward(q, k, v, layout)
    first, second = (run_backward(dout, q, k, v, out, lse, layout) for _ in range(2))
    # dK and dV are each one thread's sums either way.
    for name, a, b in zip(("dq", "dk", "dv"), first[:3], second[:3], strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)) or (name == "dq" and not deterministic)
