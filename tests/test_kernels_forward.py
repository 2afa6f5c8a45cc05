"""The CUDA forward kernel against the reference, on the GPU (``python -m pytest -m gpu``).

Outputs are poisoned with NaN before each launch (`cusparseattn.testing.poisoned`) so that an element the
kernel forgets to write shows. The tolerance is the STYLE rule: at most twice the error of the reference run
in the inputs' precision.
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
    run_forward,
    to_device,
    to_host,
)

from cusparseattn import BlockLayout, patterns, tuning
from cusparseattn.testing import check_close, forward_refs, poisoned, random_qkv

pytestmark = pytest.mark.gpu


def assert_matches(q, k, v, layout, dtype, scale=None):
    out, lse = run_forward(q, k, v, layout, scale)
    (out64, lse64), (out_lo, lse_lo) = forward_refs(q, k, v, layout, scale=scale)
    check_close("out", out, out64, out_lo, dtype=dtype)
    check_close("lse", lse, lse64, lse_lo, dtype="float32")


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_forward_matches_reference(case):
    dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, seed = case
    rng = np.random.default_rng(seed)
    batch = 2
    q, k, v = random_qkv(rng, batch, hkv * group, hkv, seq_q, seq_k, head_dim, np_dtype(dtype), order)
    layout = layout_for(kind, rng, batch, hkv * group, seq_q, seq_k, block)
    assert_matches(q, k, v, layout, dtype)


@pytest.mark.parametrize("precision", list(FLOAT32_BOUNDS))
@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(cases(dtypes=("float32",)))
def test_float32_forward_matches_reference(precision, case):
    """float32 on TF32 tensor cores ("high": within twice the error of float16-rounded inputs, TF32's 10 bits
    of mantissa) and in split TF32 ("highest": within twice the float32 reference's error)."""
    dtype, head_dim, hkv, group, seq_q, seq_k, block, kind, order, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, hkv * group, hkv, seq_q, seq_k, head_dim, np.float32, order)
    layout = layout_for(kind, rng, 2, hkv * group, seq_q, seq_k, block)
    out, lse = run_forward(q, k, v, layout, precision=precision)
    assert out.dtype == np.float32
    bound = FLOAT32_BOUNDS[precision]
    (out64, lse64), (out_lo, lse_lo) = forward_refs(q, k, v, layout, low=bound)
    check_close("out", out, out64, out_lo, dtype=bound)
    check_close("lse", lse, lse64, lse_lo, dtype="float32")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_float32_highest_is_float32s_rounding_and_high_is_tf32s(head_dim):
    """The two precisions are what they say: "highest" within 1e-5 of float64 where TF32 is a thousand times
    further (its 10 bits of mantissa)."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 4, 2, 333, 333, head_dim, np.float32)
    layout = patterns.causal(block=64).layout(333)
    (out64, _), _ = forward_refs(q, k, v, layout)
    errors = {p: np.abs(run_forward(q, k, v, layout, precision=p)[0] - out64).max() for p in FLOAT32_BOUNDS}
    assert errors["highest"] < 1e-5 < 1e-4 < errors["high"] < 1e-2, errors


@pytest.mark.parametrize("precision", list(FLOAT32_BOUNDS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "random", "random_rule"])
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
def test_float32_on_both_kernels_of_a_hopper_gpu(hopper, kind, head_dim, precision, monkeypatch):
    """At "high" the Hopper forward takes float32 in TF32, after the pass that copies V transposed; at
    "highest", or with CUSPARSEATTN_HOPPER=0, the portable one runs. Against the reference on ragged lengths
    (keys not a whole 32, the copy's padding), GQA and a [B, S, H, D] view."""
    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np.float32, "bshd")
    layout = layout_for(kind, rng, 2, 4, 300, 333, 64)
    out, lse = run_forward(q, k, v, layout, precision=precision)
    tf32 = hopper and precision == "high"
    assert launched == (["transpose", "forward_sm90"] if tf32 else ["forward"])
    bound = FLOAT32_BOUNDS[precision]
    (out64, lse64), (out_lo, lse_lo) = forward_refs(q, k, v, layout, low=bound)
    check_close("out", out, out64, out_lo, dtype=bound)
    check_close("lse", lse, lse64, lse_lo, dtype="float32")


@pytest.mark.parametrize("narrow", [True, False], ids=["int", "long_long"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["causal", "local", "strided", "strided_blocks", "document"])
def test_builtin_rules_compile_as_expressions(name, dtype, narrow, monkeypatch):
    """The built-in patterns' rules reach the kernel as C expressions (no bit masks), and are right, in the
    32-bit arithmetic that their values allow (TokenRule.narrow) and in 64-bit."""
    from cusparseattn import TokenRule, gpu_tables, plan

    monkeypatch.setattr(gpu_tables, "_tables", {})  # the device tables hold the choice: make them again
    if not narrow:
        monkeypatch.setattr(TokenRule, "narrow", lambda self, positions: False)

    rng = np.random.default_rng(7)
    seq = 777
    pattern = {
        "causal": patterns.causal(block=64),
        "local": patterns.local(window=150, block=32),
        "strided": patterns.strided(stride=64, block=64),
        "strided_blocks": patterns.strided_blocks(3, block=64),
        "document": patterns.document(seq_lens=[[300, 77, 400], [777]], block=64),
    }[name]
    layout = pattern.layout(seq)
    assert plan.rule_mode(layout) == "expr", layout.rule
    # A batch of documents indexes its ids by b * length + q: a product, bounded by analyses.largest.
    assert layout.rule.narrow(seq + 256) == narrow
    q, k, v = random_qkv(rng, 2, 2, 1, seq, seq, 64, np_dtype(dtype))
    assert_matches(q, k, v, layout, dtype)


def test_empty_rows_give_zero_and_minus_inf():
    rng = np.random.default_rng(3)
    blocks = np.zeros((4, 4), bool)
    blocks[1, 2] = True
    layout = BlockLayout(blocks, block_size=64, seq_q=256)
    q, k, v = random_qkv(rng, 1, 2, 2, 256, 256, 64, np.float16)
    out, lse = run_forward(q, k, v, layout)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, :, :64] == 0).all() and np.isneginf(lse[:, :, :64]).all()
    assert np.isfinite(lse[:, :, 64:128]).all()


def test_forward_is_deterministic():
    rng = np.random.default_rng(5)
    layout = patterns.causal(block=128).layout(1000)
    q, k, v = random_qkv(rng, 1, 4, 2, 1000, 1000, 128, np.float16)
    first = run_forward(q, k, v, layout)
    second = run_forward(q, k, v, layout)
    assert np.array_equal(first[0].view(np.uint16), second[0].view(np.uint16))


def test_64bit_offsets():
    """B * H * S * D above 2**31: the last head's rows sit past 32-bit element offsets."""
    torch = _torch()
    from cusparseattn import arrays, cuda

    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of GPU memory")
    batch, heads, seq, dim = 64, 32, 8192, 128  # 2**31 elements per tensor
    layout = patterns.local(window=128, block=128).layout(seq)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.float16, generator=gen) for _ in "qkv"
    )
    out, lse = poisoned(q), poisoned(q, q.shape[:3], "float32")
    wrapped = [arrays.wrap(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
    cuda.forward(*wrapped, layout, 1 / math.sqrt(dim))
    torch.cuda.synchronize()
    one = [to_host(t[-1:, -1:]) for t in (q, k, v)]
    (out64, lse64), (out_lo, lse_lo) = forward_refs(*one, layout)
    check_close("out", to_host(out[-1:, -1:]), out64, out_lo, dtype="float16")
    check_close("lse", to_host(lse[-1:, -1:]), lse64, lse_lo, dtype="float32")
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "random", "random_rule"])
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "portable"])
def test_both_kernels_of_a_hopper_gpu(hopper, kind, head_dim, dtype, monkeypatch):
    """On an H100/H200 the forward takes the TMA/wgmma kernel; CUSPARSEATTN_HOPPER=0 gives the portable one.
    Both against the reference, on ragged lengths, GQA and a [B, S, H, D] view."""
    launched = hopper_path(monkeypatch, hopper)
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np_dtype(dtype), "bshd")
    assert_matches(q, k, v, layout_for(kind, rng, 2, 4, 300, 333, 64), dtype)
    assert launched == ["forward_sm90" if hopper else "forward"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("seq_q", "seq_k"), [(384, 333), (400, 512)])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "local", "random", "random_rule"])
def test_the_hopper_forward_takes_wide_tiles(kind, block, seq_q, seq_k, head_dim, monkeypatch):
    """tuning.WIDE_TILES, taken here wherever they may run: 192 query rows a tile at head dim 64 (three
    consumers), 192 keys at 128 (96 mask bits a thread, one Q buffer). Tiles that cross the layout's blocks,
    whose warps each mask their own rows (masking.cuh's TileMask: whole, empty, by rule or bits); ragged
    keys (333) or whole key tiles (512), padded query tiles (400), GQA, a [B, S, H, D] view, CTAs that walk
    many items in turn (3 SMs) or one each. A layout's bit masks keep 128 x 128."""
    from cusparseattn import cuda, devices, gpu_tables

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(cuda, "_wide_pays", lambda *args: True)
    seed = ["dense", "causal", "local", "random", "random_rule"].index(kind) * 8 + block // 64 + seq_q % 7
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(devices, "sm_count", lambda device: [3, 132][seed % 2])
    dtype = DTYPES[seed // 2 % 2]
    print(f"seed {seed}, {dtype}")
    q, k, v = random_qkv(rng, 2, 4, 2, seq_q, seq_k, head_dim, np_dtype(dtype), "bshd")
    layout = layout_for(kind, rng, 2, 4, seq_q, seq_k, block)
    assert_matches(q, k, v, layout, dtype)
    tiles = (128, 128) if kind == "random_rule" else tuning.WIDE_TILES["forward_sm90"][head_dim][:2]
    assert launched[0] == "forward_sm90" and list(gpu_tables._tables[id(layout)]) == [(*tiles, 0)]
    assert launched[1:] in ([], ["forward_combine"])  # split rows (test_the_hopper_forward_splits_...)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "causal"])
def test_the_wide_hopper_forward_lets_a_row_max_lag(kind, dtype, monkeypatch):
    """The 192-row tiles at head dim 64 keep a row's max until a tile's passes it by more than 2^8
    (tuning.forward_lagging_max): keys scaled tile by tile so that the max rises by less than that and by
    more, and falls, from one key tile to the next; probabilities up to 2^8, as close as the reference."""
    from cusparseattn import cuda, gpu_tables

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(cuda, "_wide_pays", lambda *args: True)
    assert tuning.forward_lagging_max(64, tuning.WIDE_TILES["forward_sm90"][64])
    rng = np.random.default_rng(["dense", "causal"].index(kind) * 2 + DTYPES.index(dtype))
    q, k, v = random_qkv(rng, 2, 4, 2, 1000, 1000, 64, np_dtype(dtype))
    gains = np.repeat([1.0, 1.3, 5.0, 5.5, 0.5, 12.0, 12.5, 3.0], 128)[:1000]
    k = (k.astype(np.float32) * gains[:, None]).astype(k.dtype)
    layout = layout_for(kind, rng, 2, 4, 1000, 1000, 64)
    assert_matches(q, k, v, layout, dtype)
    assert launched[0] == "forward_sm90" and list(gpu_tables._tables[id(layout)]) == [(192, 128, 0)]


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rule", BANDS)
def test_the_hopper_forward_masks_a_band_by_its_bounds(rule, head_dim, wide, monkeypatch):
    """Rules that are one run of keys a query (analyses.band: kernel_cases.band_pattern) mask the rows of a
    tile that the rule alone decides from their first and last keys (masking.cuh's hide_outside_band); key
    tiles of 128 and 192 (two words a row), ragged lengths, GQA."""
    from cusparseattn import cuda

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(cuda, "_wide_pays", lambda *args: wide)
    seed = BANDS.index(rule) * 4 + head_dim // 64 + 2 * wide
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % 2]
    print(f"seed {seed}, {dtype}")
    layout = band_pattern(rule, int(rng.integers(20, 300))).layout(300, 333)
    assert layout.rule.kernel.key_band is not None and layout.rule.narrow(333 + 256)
    q, k, v = random_qkv(rng, 2, 4, 2, 300, 333, head_dim, np_dtype(dtype))
    assert_matches(q, k, v, layout, dtype)
    assert launched[0] == "forward_sm90"


@pytest.mark.parametrize("sms", [1, 5])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_the_persistent_hopper_forward_walks_many_items_per_cta(sms, kind, monkeypatch):
    """On a GPU of few SMs (sm_count patched), each CTA of the Hopper forward takes many items in turn, with
    empty rows among them: its rings, Q buffer and turns carry on from item to item."""
    from cusparseattn import devices

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(devices, "sm_count", lambda device: sms)
    rng = np.random.default_rng(sms)
    q, k, v = random_qkv(rng, 2, 4, 2, 700, 650, 128, np_dtype("bfloat16"), "bhsd")
    # Blocks of 128, the kernel's tiles: the random layout's empty row of blocks is an empty item.
    layout = layout_for(kind, rng, 2, 4, 700, 650, 128)
    assert_matches(q, k, v, layout, "bfloat16")
    assert launched[0] == "forward_sm90" and launched[1:] in ([], ["forward_combine"])


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal", "bits"])
def test_the_hopper_forward_splits_its_last_rows(kind, head_dim, wide, monkeypatch):
    """Rows that would start once the first CTA is idle split into parts (schedule.work_order; sm_count
    patched to the first number of SMs, from 2, whose deal splits some): each part's fp32 output and lse go
    to a scratch, and a combine pass writes the rows, every element of them (the outputs are poisoned). No
    mask, a rule's C expression (causal) and bit masks (a rule without one, in every block: 128 x 128
    tiles); ragged query and key lengths, GQA, a [B, S, H, D] view, a layout of one batch element or of
    every head."""
    from cusparseattn import TokenRule, cuda, devices, gpu_tables, schedule

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(cuda, "_wide_pays", lambda *args: wide)
    seed = ["dense", "causal", "bits"].index(kind) * 4 + head_dim // 64 + 2 * wide
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % 2]
    print(f"seed {seed}, {dtype}")
    batch, heads, seq_q, seq_k = 2, 4, 1000, 3000
    q, k, v = random_qkv(rng, batch, heads, 2, seq_q, seq_k, head_dim, np_dtype(dtype), "bshd")
    if kind == "bits":
        blocks = np.ones((1, heads, -(-seq_q // 128), -(-seq_k // 128)), bool)
        rule = TokenRule("mod3", lambda b, h, q, k: (q + 2 * k + h) % 3 != 0)
        layout = BlockLayout(blocks, block_size=128, seq_q=seq_q, seq_k=seq_k, partial=blocks, rule=rule)
    else:
        layout = layout_for(kind, rng, batch, heads, seq_q, seq_k, 128)
    tiles = tuning.tile_config("forward_sm90", head_dim, wide=wide and kind != "bits")
    tables = gpu_tables.device_tables(layout, tiles[0], tiles[1], 0)
    items = batch * heads * tables.plan.tiles_q

    def splits(sms: int) -> bool:
        ctas = min(items, sms)
        dealt = schedule.work_order(tables.plan, *tables.layout_lines, batch, heads, ctas, 2 * sms, ctas)
        return len(dealt.parts) > 0

    sms = next(n for n in range(2, items) if splits(n))
    monkeypatch.setattr(devices, "sm_count", lambda device: sms)
    assert_matches(q, k, v, layout, dtype)
    assert launched == ["forward_sm90", "forward_combine"]


def test_split_rows_of_holders_that_cannot_allocate(monkeypatch):
    """XLA's buffers (FixedTensor holders here, over PyTorch's memory and stream) cannot make the split rows'
    scratch: it comes from CuPy's pool, on their stream, and the outputs are the same bits as through
    PyTorch's holders."""
    torch = _torch()
    from cusparseattn import arrays, cuda, devices

    launched = hopper_path(monkeypatch, True)
    monkeypatch.setattr(
        devices, "sm_count", lambda device: 3
    )  # 136 rows of 17 key tiles: the last one splits
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 2, 4, 2, 2176, 2176, 128, np_dtype("bfloat16"), "bhsd")
    layout = patterns.dense(block=128).layout(2176)
    out, lse = run_forward(q, k, v, layout)
    assert launched == ["forward_sm90", "forward_combine"]
    stream = torch.cuda.current_stream().cuda_stream
    tensors = [to_device(x) for x in (q, k, v)]
    tensors += [
        poisoned(tensors[0]),
        poisoned(tensors[0], q.shape[:3], "float32"),
    ]
    held = [
        arrays.FixedTensor(t, name, t.shape, t.stride(), dtype, ("cuda", 0), t.data_ptr(), stream)
        for t, name, dtype in zip(
            tensors, ("q", "k", "v", "out", "lse"), [*["bfloat16"] * 4, "float32"], strict=True
        )
    ]
    cuda.forward(*held, layout, 1 / math.sqrt(128))
    torch.cuda.synchronize()
    assert np.array_equal(to_host(tensors[3]).view(np.uint16), out.view(np.uint16))
    assert np.array_equal(to_host(tensors[4]), lse)
