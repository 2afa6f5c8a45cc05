"""The Hopper primitives one at a time (tests/hopper_probe.cu), on an H100/H200: the TMA copy's swizzled
shared tile, S = Q K^T from shared memory, O = P V with P from registers, a staged tile's TMA store, and a
transposed store followed by a product with B read MN-major. When a Hopper kernel fails, these say which
piece is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_cases import _torch, np_dtype, to_device, to_host

from cusparseattn import build, env, tuning
from cusparseattn.testing import poisoned

pytestmark = pytest.mark.gpu

SOURCE = env.kernels_dir().parent / "tests" / "hopper_probe.cu"


def _module(dtype: str, head_dim: int):
    import cupy

    from cusparseattn import devices

    if devices.compute_capability(0) != 90:
        pytest.skip("the Hopper primitives need compute capability 9.0")
    spec = build.KernelSpec.make("backward_dkdv_sm90", dtype, head_dim)
    source = spec.prelude() + build._inline("hopper.cuh") + SOURCE.read_text()
    return cupy.RawModule(code=source, options=build.nvrtc_options(spec.arch))


def _probe(dtype: str, head_dim: int):
    function = _module(dtype, head_dim).get_function("csa_probe")
    shared = (64 + 2 * 128) * head_dim * 2 + 64 * 64 * 2 + 1024 + 1024
    function.max_dynamic_shared_size_bytes = shared
    return function, shared


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", tuning.HOPPER_HEAD_DIMS)
def test_tma_and_both_warpgroup_products(dtype, head_dim):
    torch = _torch()
    from cusparseattn import arrays, tma

    function, shared = _probe(dtype, head_dim)
    rng = np.random.default_rng(0)
    # Q has 50 rows: its 64-row box reads 14 rows past the end, which TMA fills with zeros.
    q, k, v = (rng.standard_normal((1, 1, n, head_dim)).astype(np_dtype(dtype)) for n in (50, 128, 128))
    tq, tk, tv = (to_device(x) for x in (q, k, v))
    # The TMA store's target: 50 rows of a 64-row buffer, so that the 14 rows past them must stay untouched.
    o_stored = poisoned(tk, (1, 1, 64, head_dim))
    maps = [
        tma.tile_map(arrays.wrap(t, name), rows)
        for t, name, rows in ((tq, "q", 64), (tk, "k", 128), (tv, "v", 128), (o_stored[:, :, :50], "out", 64))
    ]
    k_raw, x_raw = poisoned(tk, (128 * head_dim,)), poisoned(tk, (64 * 64,))
    s_out = poisoned(tk, (64, 128), "float32")
    o_out, xk_out = (poisoned(tk, (64, head_dim), "float32") for _ in "ox")
    outs = (k_raw, s_out, o_out, x_raw, xk_out)
    function((1,), (128,), (*maps, *(t.data_ptr() for t in outs)), shared_mem=shared)
    torch.cuda.synchronize()

    # TMA: panel p, row r, 16-byte chunk c of the tile sits at chunk c ^ (r % 8) of its 128-byte row.
    raw = to_host(k_raw).reshape(head_dim // 64, 128, 8, 8)
    for p in range(head_dim // 64):
        for r in range(128):
            for c in range(8):
                expected = k[0, 0, r, p * 64 + c * 8 : p * 64 + c * 8 + 8]
                where = f"TMA tile: panel {p} row {r} chunk {c}"
                assert np.array_equal(raw[p, r, c ^ (r % 8)], expected), where

    q64 = np.zeros((64, head_dim))
    q64[:50] = q[0, 0].astype(np.float64)
    s = q64 @ k[0, 0].astype(np.float64).T
    # Exact products of 16-bit inputs, summed in fp32.
    np.testing.assert_allclose(to_host(s_out), s, rtol=1e-4, atol=1e-3, err_msg="S = Q K^T (shared A and B)")
    p = to_host(s_out).astype(np_dtype(dtype)).astype(np.float64)  # P rounded as the kernel packs it
    o = p @ v[0, 0].astype(np.float64)
    bound = 1e-4 * np.abs(p) @ np.abs(v[0, 0].astype(np.float64)) + 1e-4
    assert np.all(np.abs(to_host(o_out) - o) <= bound), "O = P V (register A, MN-major B)"
    # Halving is exact: the stored rows are the kernel's own O, halved and rounded once.
    halved = (to_host(o_out) / 2).astype(np_dtype(dtype))
    o_tile = to_host(o_stored)[0, 0]
    assert np.array_equal(o_tile[:50], halved[:50]), "O / 2: staged tile, TMA store"
    assert np.isnan(o_tile[50:].astype(np.float32)).all(), "the TMA store wrote past the rows"

    # X = (K[:64] Q^T)^T = Q K[:64]^T rounded, stored by stmatrix .trans in the swizzled layout of a TMA tile.
    stored = to_host(x_raw).reshape(64, 8, 8)  # row, 16-byte chunk, element
    x = np.stack([stored[r, [c ^ (r % 8) for c in range(8)]].reshape(64) for r in range(64)]).astype(
        np.float64
    )
    np.testing.assert_allclose(x, s[:, :64], rtol=1e-2, atol=1e-2, err_msg="X: transposed swizzled store")
    xk = x @ k[0, 0, :64].astype(np.float64)
    bound = 1e-4 * np.abs(x) @ np.abs(k[0, 0, :64].astype(np.float64)) + 1e-4
    assert np.all(np.abs(to_host(xk_out) - xk) <= bound), "X K (shared K-major A, MN-major B)"


@pytest.mark.parametrize("ordered", [True, False])
def test_add_share_sums_in_rank_order_to_the_bit(ordered):
    """Eight CTAs add their parts into one tile, each at its rank (not in launch order): ordered, the tile
    holds the float32 sum in rank order, bit for bit, every run, and the counter counts the adds; unordered
    (the tile zeroed), the sum in some order, and the counter says the tile was visited."""
    torch = _torch()
    function = _module("bfloat16", 64).get_function("csa_probe_add_share")
    rng = np.random.default_rng(0)
    scales = 10.0 ** rng.integers(-3, 4, (8, 1, 1))
    parts = (rng.standard_normal((8, 64, 64)) * scales).astype(np.float32)
    ranks = rng.permutation(8).astype(np.int32)
    want = np.zeros((64, 64), np.float32)
    for c in np.argsort(ranks):
        want = want + parts[c]  # float32, in rank order
    for _ in range(3):
        tile = torch.full((64, 64), float("nan") if ordered else 0.0, device="cuda")
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        args = (torch.from_numpy(parts).cuda(), torch.from_numpy(ranks).cuda(), tile, counter)
        function((8,), (128,), (*(t.data_ptr() for t in args), np.int32(ordered)))
        torch.cuda.synchronize()
        if ordered:
            assert np.array_equal(to_host(tile), want) and counter.item() == 8
        else:
            bound = 1e-6 * np.abs(parts).sum(axis=0)
            assert np.all(np.abs(to_host(tile) - want) <= bound) and counter.item() == 1
