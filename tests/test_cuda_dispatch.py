"""What `cusparseattn.cuda` launches and with which parameters, without a GPU: CuPy and the compiled kernels
are stand-ins that record what they are given. The kernels themselves are tested on the GPU
(tests/test_kernels_*.py)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import threading
import types
import weakref

import numpy as np
import pytest

from cusparseattn import (
    BlockLayout,
    TokenRule,
    build,
    cuda,
    devices,
    gpu_tables,
    mods,
    patterns,
    plan,
    tma,
    tuning,
)
from cusparseattn import launches as kernel_launches


class FakeDeviceArray:
    def __init__(self, host):
        self.host = np.asarray(host)
        self.size, self.shape = self.host.size, self.host.shape
        self.data = types.SimpleNamespace(ptr=id(self))


class Holder:
    """The attributes of a cusparseattn.arrays holder that the launch code reads, of a [B, H, S, D] array
    (or a [B, H, S] one) with distinct strides and address."""

    def __init__(self, shape, dtype="bfloat16", address=0x10000000, pad=0):
        self.shape = tuple(shape)
        # A padded row (pad elements), so that every stride differs from the contiguous one.
        row = shape[-1] + pad
        self.strides = tuple(int(np.prod(shape[i + 1 : -1])) * row for i in range(len(shape) - 1)) + (1,)
        self.dtype, self.data_ptr, self.device, self.stream = dtype, address, ("cuda", 0), 0
        self.ndim = len(shape)
        self.made = []  # the arrays made through `empty`

    def empty(self, shape, dtype):
        self.made.append(Holder(shape, dtype, address=0x20000000))
        return self.made[-1]


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (spec name, grid, block, args, shared bytes, TMA maps' geometry), on a GPU of compute
    capability 8.0 (tests of the Hopper kernels set 9.0)."""
    fake = types.ModuleType("cupy")
    fake.asarray = FakeDeviceArray
    fake.cuda = types.SimpleNamespace(
        Device=lambda device: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(null=contextlib.nullcontext()),
        ExternalStream=lambda handle: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(setDevice=lambda device: bound.append(device)),
    )
    bound = []
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kernel_launches, "_bound", threading.local())
    fake.bound = bound  # the devices whose context a launch made current, in order
    kernel_launches.cupy_stream.cache_clear()
    monkeypatch.setattr(gpu_tables, "_tables", {})
    monkeypatch.setattr(cuda, "_wide", {})
    monkeypatch.setattr(gpu_tables, "_scores", {})
    monkeypatch.setattr(devices, "compute_capability", lambda device: 80)
    monkeypatch.setattr(devices, "max_shared", lambda device: 227 * 1024)
    monkeypatch.setattr(devices, "sm_count", lambda device: 132)
    monkeypatch.delenv("CUSPARSEATTN_HOPPER", raising=False)
    # The Hopper backward's two passes; the fused backward's test takes the default.
    monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", "0")
    geometry, record = {}, []  # a stand-in descriptor's bytes -> the geometry it was encoded for

    def encode(data_ptr, shape, strides, dtype, rows, panels):
        descriptor = np.zeros(1, tma.TENSOR_MAP)
        descriptor.view(np.uint64)[0] = len(geometry) + 1
        geometry[descriptor.tobytes()] = tma.geometry(shape, strides, build.DTYPES[dtype], rows, panels)
        return descriptor[0]

    monkeypatch.setattr(tma, "_tile_map", encode)

    names = {}  # a stand-in kernel handle -> its spec's name

    def load(spec, device):
        names[len(names) + 1] = spec.name
        return types.SimpleNamespace(name=spec.name, kernel=types.SimpleNamespace(ptr=len(names)))

    def launch(kernel, grid, block, shared, stream, table):
        # The arguments as the driver reads them: the parameter struct, then TMA descriptors.
        args = [ctypes.string_at(table[0], build.PARAMS.itemsize)]
        args += [ctypes.string_at(address, tma.TENSOR_MAP.itemsize) for address in table[1:]]
        params = np.frombuffer(args[0], build.PARAMS)[0]
        maps = [geometry[m] for m in args[1:]]
        record.append((names[kernel], grid, block, (params, *args[1:]), shared, maps))
        fake.streams.append(stream)

    fake.streams = []  # the stream of each launch
    monkeypatch.setattr(build, "load", load)
    monkeypatch.setattr(kernel_launches, "launch_kernel", launch)
    kernel_launches.loaded_kernel.cache_clear()
    yield record
    kernel_launches.loaded_kernel.cache_clear()
    kernel_launches.cupy_stream.cache_clear()


def fieldwise(tables, score, scale, **arrays) -> bytes:
    """The parameter struct as NumPy fills it field by field: what the launch's packed bytes must equal."""
    # A view of the bytes, not a copy: NumPy copies a struct field by field, and its padding would be garbage.
    struct = np.frombuffer(bytearray(tables.params), build.PARAMS)
    params = struct[0]
    names = {"out": ("o", "o"), "dout": ("dout", "do")}
    for name, holder in arrays.items():
        pointer, prefix = names.get(name, (name, name))
        params[pointer] = holder.data_ptr
        suffixes = ("sb", "sh", "sr") if name == "stats" else ("sb", "sh", "ss")
        for suffix, stride in zip(suffixes, holder.strides[:-1], strict=False):
            params[f"{prefix}_{suffix}"] = stride
    q, k = arrays["q"], arrays["k"]
    params["seq_q"], params["seq_k"] = q.shape[2], k.shape[2]
    params["heads_q"], params["group"] = q.shape[1], q.shape[1] // k.shape[1]
    params["scale"] = scale
    if score is not None:
        params["score_ip"][:] = np.frombuffer(score.fields[:64], np.int64)
        params["score_fp"][:] = np.frombuffer(score.fields[64:96], np.float32)
        params["score_a"][:] = np.frombuffer(score.fields[96:], np.uint64)
    return struct.tobytes()


def test_forward_packs_every_field(launches):
    seq, dim = 300, 64
    q, out = Holder((2, 4, seq, dim), address=0x1000, pad=8), Holder((2, 4, seq, dim), address=0x2000)
    k, v = Holder((2, 2, 333, dim), address=0x3000, pad=16), Holder((2, 2, 333, dim), address=0x4000, pad=24)
    lse = Holder((2, 4, seq), dtype="float32", address=0x5000)
    layout = patterns.causal(block=64).layout(seq, 333)
    cuda.forward(q, k, v, out, lse, layout, 0.125)
    ((name, grid, block, args, shared, maps),) = launches
    tiles = tuning.tile_config("forward", dim)
    assert name == build.KernelSpec("forward", "bfloat16", dim, tiles, "expr", layout.rule.kernel).name
    assert grid == (-(-seq // tiles[0]), 4, 2) and block == (tiles[2] * 32, 1, 1)
    assert shared == tuning.shared_bytes("forward", dim, tiles) and maps == []
    tables = gpu_tables.device_tables(layout, tiles[0], tiles[1], 0)
    assert args[0].tobytes() == fieldwise(tables, None, 0.125, q=q, k=k, v=v, out=out, lse=lse)


def test_device_tables_hold_one_entry_past_the_last_rows(launches):
    # The Hopper forward reads each row's next entry without a bound check.
    layout = patterns.causal(block=64).layout(300)
    tables = gpu_tables.device_tables(layout, 128, 128, 0)
    entries = tables.arrays["entries"].host
    assert np.array_equal(entries[:-1], tables.plan.entries) and entries[-1].tolist() == [0, -1]
    assert np.array_equal(tables.arrays["row_ptr"].host, tables.plan.row_ptr)


def test_backward_packs_both_passes_and_a_score_mod(launches):
    seq, dim = 200, 128
    q, dout, out, dq = (Holder((1, 4, seq, dim), address=0x1000 * (i + 1), pad=8 * i) for i in range(4))
    k, v, dk, dv = (Holder((1, 1, seq, dim), address=0x10000 * (i + 1), pad=8 * i) for i in range(4))
    lse = Holder((1, 4, seq), dtype="float32", address=0x100000)
    stats = Holder(cuda.stats_shape(q.shape, 0), dtype="float32", address=0x200000)
    layout = patterns.dense(block=64).layout(seq)
    score_mod = mods.score_mod(mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(30.0)))
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, layout, 0.5, score_mod=score_mod)
    (dq_name, *_, dq_args, _, _), (kv_name, *_, kv_args, _, _) = launches
    assert dq_name.startswith("backward_dq_") and kv_name.startswith("backward_dkdv_")
    score = gpu_tables.score_tables(score_mod, 0)
    assert np.frombuffer(score.fields[64:96], np.float32)[: len(score_mod.float_params)].tolist() == list(
        np.float32(score_mod.float_params)
    )
    assert np.frombuffer(score.fields[96:], np.uint64)[0] == score.arrays[0].data.ptr
    # Both passes take every array (each reads the ones it needs).
    arrays = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, stats=stats, dq=dq, dk=dk, dv=dv)
    for kernel, args in (("backward_dq", dq_args), ("backward_dkdv", kv_args)):
        tiles = tuning.tile_config(kernel, dim, score=True)
        tables = gpu_tables.device_tables(layout, tiles[0], tiles[1], 0)
        assert args[0].tobytes() == fieldwise(tables, score, 0.5, **arrays), kernel


def test_a_cached_launch_builds_no_spec(launches, monkeypatch):
    seq, dim = 128, 64
    q, k, v, out = (Holder((1, 2, seq, dim)) for _ in range(4))
    lse = Holder((1, 2, seq), dtype="float32")
    layout = patterns.dense(block=64).layout(seq)
    cuda.forward(q, k, v, out, lse, layout, 0.1)

    def refuse(*args, **kwargs):
        raise AssertionError("a cached launch built a KernelSpec")

    monkeypatch.setattr(build, "KernelSpec", refuse)
    cuda.forward(q, k, v, out, lse, layout, 0.2)
    assert len(launches) == 2


@pytest.mark.parametrize("hopper", [False, True], ids=["portable", "hopper"])
def test_a_second_call_reuses_the_passes_and_packs_its_own_arrays(launches, monkeypatch, hopper):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    seq, dim = 256, 64
    layout = patterns.causal(block=64).layout(seq)
    for call in range(2):
        base = 0x100000 * (call + 1)
        q, dout, out, dq = (Holder((1, 4, seq, dim), address=base + 0x1000 * i, pad=8 * i) for i in range(4))
        k, v, dk, dv = (Holder((1, 2, seq, dim), address=base + 0x10000 * (i + 1)) for i in range(4))
        lse = Holder((1, 4, seq), dtype="float32", address=base + 0x80000)
        stats = Holder(cuda.stats_shape(q.shape, 0), dtype="float32", address=base + 0x90000)
        q.stream, dout.stream = 0x71 + call, 0x81 + call  # the forward's stream is q's, the backward's dout's
        cuda.forward(q, k, v, out, lse, layout, 0.25)
        cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, layout, 0.25)
        assert sys.modules["cupy"].streams[3 * call :] == [q.stream, dout.stream, dout.stream]
        common = dict(q=q, k=k, v=v, out=out, lse=lse)
        backward = dict(common, dout=dout, stats=stats, dq=dq, dk=dk, dv=dv)
        expected = [common, backward, backward]
        for (name, *_, args, _, _), arrays in zip(launches[3 * call :], expected, strict=True):
            kernel = name.split("_bf16")[0]
            tiles = tuning.tile_config(kernel, dim)
            tables = gpu_tables.device_tables(layout, tiles[0], tiles[1], 0)
            packed = np.frombuffer(bytearray(args[0].tobytes()), build.PARAMS)[0]
            packed["work"], packed["work_count"] = 0, 0  # the forward's schedule: test_hopper_gpus_run...
            packed["parts"], packed["split_ptr"] = 0, 0
            assert packed.tobytes() == fieldwise(tables, None, 0.25, **arrays), name
    # One pass each, made in the first call, bound once to arrays laid out as these (addresses apart).
    passes = [p for entries in gpu_tables._tables[id(layout)].values() for p in entries.passes.values()]
    assert sorted(p.kernel for p in passes) == sorted(name.split("_bf16")[0] for name, *_ in launches[:3])
    assert [len(p._bound) for p in passes] == [1, 1, 1]


def _forward(head_dim, seq=300, pattern=None, out_kwargs=None, **kwargs):
    q, k, v = (
        Holder((2, 4, seq, head_dim), **kwargs),
        Holder((2, 2, seq, head_dim)),
        Holder((2, 2, seq, head_dim)),
    )
    out, lse = Holder((2, 4, seq, head_dim), **(out_kwargs or {})), Holder((2, 4, seq), dtype="float32")
    layout = (pattern or patterns.causal(block=64)).layout(seq)
    cuda.forward(q, k, v, out, lse, layout, 0.1)
    return layout  # its device tables live as long as it does


@pytest.mark.parametrize(
    ("head_dim", "sms", "seq", "wide"),
    [
        (64, 132, 300, False),
        (128, 132, 300, False),
        (128, 5, 300, False),
        (64, 132, 384, True),
        (128, 132, 384, True),
        (64, 132, 400, True),
    ],
)
def test_hopper_gpus_run_the_hopper_forward_with_four_tma_maps(
    launches, monkeypatch, head_dim, sms, seq, wide
):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setattr(devices, "sm_count", lambda device: sms)
    if wide:  # as if wide tiles ran in half the time of 128 x 128: they pay wherever they may run
        monkeypatch.setattr(tuning, "WIDE_TILE_COST", dict.fromkeys(tuning.HOPPER_HEAD_DIMS, 0.5))
    layout = _forward(head_dim, seq, patterns.dense(block=128) if wide else patterns.causal(block=64))
    ((name, grid, (threads, _, _), args, shared, maps),) = launches
    nargs = len(args)
    # Where the wide tiles pay: three consumers (192 query rows) at head dim 64, key tiles of 192 at 128.
    tm, tn, nw = tuning.WIDE_TILES["forward_sm90"][head_dim] if wide else (128, 128, 12)
    assert name.startswith(f"forward_sm90_bf16_d{head_dim}_q{tm}k{tn}w{nw}") and threads == 32 * nw
    tiles_q = -(-seq // tm)
    items = 8 * tiles_q
    assert grid == (min(items, sms), 1, 1) and nargs == 5  # the parameters, then q, k, v and out maps
    (tables,) = gpu_tables._tables[id(layout)].values()
    work = tables.work(2, 4, min(items, sms), 2 * sms, min(items, sms))["work"]  # work_order deals it
    assert args[0]["work"] == work.data.ptr and args[0]["work_count"] == work.size
    assert sorted(work.host[work.host >= 0]) == list(range(items)) and work.size % grid[0] == 0
    if sms == 132 and not wide:  # one item per CTA in the order dealt: each line's last query tile first
        assert list(work.host % tiles_q) == [t for t in reversed(range(tiles_q)) for _ in range(8)]
    assert shared == tuning.shared_bytes("forward_sm90", head_dim, (tm, tn, nw))
    panels = head_dim // 64
    # q, k, v, out in that order: [B, H, S, D] as (64, S, D / 64, H, B), boxes of a key tile, of a consumer's
    # 64 rows, or (q, where out is not staged in its buffer) of a query tile
    q_dims, kv_dims = (64, seq, panels, 4, 2), (64, seq, panels, 2, 2)
    assert [m[0] for m in maps] == [q_dims, kv_dims, kv_dims, q_dims]
    q_rows = 64 if (head_dim, tn) == (128, 128) or tm == 192 else tm
    q_box, key_box, out_box = ((64, n, panels, 1, 1) for n in (q_rows, tn, 64))
    assert [m[2] for m in maps] == [q_box, key_box, key_box, out_box]


def test_a_hopper_forward_that_splits_rows_points_them_at_a_scratch_and_combines_them(launches, monkeypatch):
    """Where the deal splits rows (3 SMs, 136 equal rows of 17 key tiles: the last one in three parts), the
    forward is built with SPLIT_ROWS and both it and the combine pass (a warp for each query row of each split
    row) read the schedule's parts and a scratch that q's framework makes: a slot a part of TILE_M lse and
    TILE_M x D outputs in fp32. The backward's arrays stay unbound (0)."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setattr(devices, "sm_count", lambda device: 3)
    seq, dim = 2176, 128
    q, k, v = Holder((2, 4, seq, dim)), Holder((2, 2, seq, dim)), Holder((2, 2, seq, dim))
    out, lse = Holder((2, 4, seq, dim)), Holder((2, 4, seq), dtype="float32")
    cuda.forward(q, k, v, out, lse, patterns.dense(block=128).layout(seq), 0.1)
    (forward, grid, _, (params, *_), _, _), (combine, combine_grid, block, (combined,), _, maps) = launches
    assert (
        forward.startswith("forward_sm90_bf16_d128_q128") and forward.endswith("_split") and grid == (3, 1, 1)
    )
    assert combine == "forward_combine_bf16_d128_q128k64w8_none" and combine_grid == (1, 16, 1)
    assert block == (256, 1, 1) and maps == []
    (scratch,) = q.made
    assert scratch.shape == (3, 128, dim + 1) and scratch.dtype == "float32"
    for p in (params, combined):
        assert p["stats"] == scratch.data_ptr and p["o"] == out.data_ptr and p["lse"] == lse.data_ptr
        assert p["parts"] != 0 and p["split_ptr"] != 0
        assert [p[name] for name in ("dout", "dq", "dk", "dv")] == [0, 0, 0, 0]
    assert params["parts"] == combined["parts"] and params["split_ptr"] == combined["split_ptr"]


@pytest.mark.parametrize(
    ("pattern", "seq", "head_dim", "pays"),
    [
        (patterns.dense(block=128), 16384, 64, True),
        (patterns.dense(block=128), 4096, 64, True),  # 22 tiles of 192 rows for 21.3, the last round split
        (patterns.causal(block=128), 16384, 64, True),
        (patterns.causal(block=128), 4096, 64, True),  # x1.04 since the row max lags on them
        (patterns.local(window=1024, block=128), 16384, 64, False),  # a row of 192 visits 1.5 blocks more
        (patterns.local(window=1024, block=128), 4096, 64, False),
        (patterns.causal(block=16), 16384, 64, False),  # 96 cells of 16 x 16 in a 192 x 128 tile
        (patterns.strided_blocks(stride_blocks=8, block=128), 16384, 64, True),  # x1.01: 241 of 1327 partial
        (patterns.strided_blocks(stride_blocks=8, block=128), 4096, 64, False),
        (patterns.dense(block=128), 16384, 128, True),  # key tiles of 192
        (patterns.dense(block=128), 4096, 128, False),  # 22 key tiles of 192 for 21.3
        (patterns.causal(block=128), 16384, 128, False),  # 171 of 5547 partial: within 1 % either way
        (patterns.local(window=1024, block=128), 16384, 128, False),  # 331 of 827 partial
    ],
)
def test_the_hopper_forward_takes_wide_tiles_where_its_schedule_ends_sooner(
    monkeypatch, pattern, seq, head_dim, pays
):
    """cuda._wide_pays weighs the makespans of both tilings (B = 2, H = 16 on an H100's 132 SMs): the cases
    measured on an H100 against 128 x 128 tiles (docs/tuning.md: WIDE_TILE_COST) come out as they ran."""
    monkeypatch.setattr(devices, "sm_count", lambda device: 132)
    monkeypatch.setattr(devices, "max_shared", lambda device: 227 * 1024)
    assert cuda._wide_pays("forward_sm90", pattern.layout(seq), head_dim, 2, 16, 0) is pays
    assert not cuda._wide_pays("forward", pattern.layout(seq), head_dim, 2, 16, 0)  # the portable pass


def test_a_rule_without_a_band_keeps_the_hopper_forwards_default_tiles(monkeypatch):
    """Packed documents from a captured table of ids (8 documents cut at random tokens, causal in each, as
    bench.py's case) are evaluated at each element of a partial tile: on the wide tiles that spills (the
    compile check, NVRTC and nvcc alike, at 144 to 636 bytes), so `_wide_pays` declines them where their
    schedule alone would take them (before, at head dim 64); a band (causal) still may."""
    monkeypatch.setattr(devices, "sm_count", lambda device: 132)
    monkeypatch.setattr(devices, "max_shared", lambda device: 227 * 1024)
    seq = 16384
    cuts = np.sort(np.random.default_rng(seq).choice(np.arange(1, seq), size=7, replace=False))
    ids = np.repeat(np.arange(8, dtype=np.int32), np.diff([0, *cuts, seq]))
    documents = patterns.document(ids, causal=True, block=128).layout(seq)
    causal = patterns.causal(block=128).layout(seq)
    assert plan.elementwise_rule(documents) and not plan.elementwise_rule(causal)
    assert not cuda._wide_pays("forward_sm90", documents, 64, 2, 16, 0)
    assert cuda._wide_pays("forward_sm90", causal, 64, 2, 16, 0)


@pytest.mark.parametrize(
    ("head_dim", "kwargs", "env"),
    [
        (96, {}, None),
        (128, {"address": 0x10000008}, None),
        (128, {"out_kwargs": {"address": 0x10000008}}, None),  # the Hopper forward stores out by TMA
        (128, {}, "0"),
    ],
    ids=["head-dim-96", "misaligned", "misaligned-out", "turned-off"],
)
def test_the_portable_forward_takes_what_tma_cannot(launches, monkeypatch, head_dim, kwargs, env):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    if env is not None:
        monkeypatch.setenv("CUSPARSEATTN_HOPPER", env)
    _forward(head_dim, **kwargs)
    ((name, _, (threads, _, _), args, _, maps),) = launches
    assert name.startswith("forward_bf16") and len(args) == 1 and maps == [] and threads == 256


def test_other_gpus_run_the_portable_kernels(launches):
    _forward(128)
    assert launches[0][0].startswith("forward_bf16")
    assert devices.hopper_device_reasons(0) == [
        "the Hopper kernels need compute capability 9.0, cuda:0 has 8.0"
    ]


@pytest.mark.parametrize("head_dim", tuning.HOPPER_HEAD_DIMS)
def test_hopper_backward_passes_take_query_and_key_tiles_of_their_own(launches, monkeypatch, head_dim):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    seq = 300
    q, dout, out, dq = (Holder((2, 4, seq, head_dim)) for _ in range(4))
    k, v, dk, dv = (Holder((2, 2, seq, head_dim)) for _ in range(4))
    lse, stats = Holder((2, 4, seq), dtype="float32"), Holder(cuda.stats_shape(q.shape, 0), dtype="float32")
    layout = patterns.causal(block=64).layout(seq)
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, layout, 0.1)
    (dq_name, dq_grid, _, dq_args, _, dq_maps), (kv_name, kv_grid, _, kv_args, _, kv_maps) = launches
    assert dq_name.startswith("backward_dq_sm90") and kv_name.startswith("backward_dkdv_sm90")
    assert dq_grid == (3, 4, 2) and kv_grid == (3, 2, 2) and len(dq_args) == len(kv_args) == 5
    # q, k, v, dout: the dQ pass reads 128 query rows and 128 keys (64 at head dim 128) a tile, the dK/dV
    # pass 64 and 128.
    keys = 128 if head_dim == 64 else 64
    assert [m[2][1] for m in dq_maps] == [128, keys, keys, 128]
    assert [m[2][1] for m in kv_maps] == [64, 128, 128, 64]
    # The same rule with no C expression: the partial tiles carry bit masks, and the dQ pass keys of 64.
    launches.clear()
    rule = TokenRule("causal", lambda b, h, q, k: k <= q)
    bits = BlockLayout(layout.blocks, block_size=64, seq_q=seq, partial=layout.partial, rule=rule)
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, bits, 0.1)
    assert "_bits" in launches[0][0] and [m[2][1] for m in launches[0][-1]] == [128, 64, 64, 128]


# Visits of 128 queries at head dim 64, 64 at 128.
@pytest.mark.parametrize(("head_dim", "tm"), [(64, 128), (128, 64)])
def test_the_fused_backward_launches_three_passes_over_a_larger_scratch(launches, monkeypatch, head_dim, tm):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setattr(devices, "sm_count", lambda device: 5)
    seq = 300
    assert cuda.stats_shape((2, 4, seq, head_dim), 0) == (2, 4, 2, 384)  # CUSPARSEATTN_FUSED_BACKWARD=0
    monkeypatch.delenv("CUSPARSEATTN_FUSED_BACKWARD")  # the default
    # The statistics, then the dQ sums (D rows of the padded length: whole tiles) and a row of counters.
    assert cuda.stats_shape((2, 4, seq, head_dim), 0) == (2, 4, 2 + head_dim + 1, 384)
    # Not on a GPU without the Hopper kernels, nor at a head dim they do not take.
    monkeypatch.setattr(devices, "compute_capability", lambda device: [90, 80][device])
    assert cuda.stats_shape((2, 4, seq, head_dim), 1) == (2, 4, 2, 384)
    assert cuda.stats_shape((2, 4, seq, 96), 0) == (2, 4, 2, 384)
    held = _arrays(seq, head_dim, 0x1000000)
    layout = patterns.causal(block=64).layout(seq)
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")
    cuda.backward(*(held[n] for n in names), layout, 0.1)
    (stats_name, stats_grid, _, _, _, stats_maps), fused, (dq_name, dq_grid, _, _, _, dq_maps) = launches
    # The first and last pass read no rule (one kernel for every layout) and no TMA copies, over the fused
    # pass's query tiles.
    edges = f"q{tm}k64w{tm // 16}_none"
    assert stats_name.startswith(f"backward_stats_bf16_d{head_dim}_{edges}") and stats_maps == []
    assert dq_name.startswith(f"backward_dq_convert_bf16_d{head_dim}_{edges}") and dq_maps == []
    tiles_q = -(-seq // tm)  # 300 rows: 3 query tiles of 128, or 5 of 64
    assert stats_grid == (384 // tm, 4, 2) and dq_grid == (tiles_q, 4, 2)
    name, grid, (threads, _, _), args, shared, maps = fused
    assert name.startswith(f"backward_sm90_bf16_d{head_dim}_q{tm}k128w12") and threads == 384
    assert grid == (5, 1, 1) and shared == tuning.shared_bytes("backward_sm90", head_dim, (tm, 128, 12))
    # q, k, v and dout copied in; dK and dV written out, 64 keys (a consumer warpgroup's) a copy.
    assert [m[2][1] for m in maps] == [tm, 128, 128, tm, 64, 64]
    (tables,) = (t for key, t in gpu_tables._tables[id(layout)].items() if key[:2] == (tm, 128))
    # 2 x 2 kv heads x 3 key tiles: 12 items on 5 CTAs, dealt in groups of four items per SM
    columns = tables.columns(2, 4, 2, 5, 4 * 5)
    for field in ("work", "col_start", "rank_ptr", "ranks"):
        assert args[0][field] == columns[field].data.ptr, field
    assert args[0]["work_count"] == columns["work"].size
    assert [launch[3][0]["dq_unordered"] for launch in launches] == [0, 0, 0]  # adds in the ranks' order
    # CUSPARSEATTN_DETERMINISTIC=0: the statistics pass zeroes the sums, the fused pass adds as it goes.
    launches.clear()
    monkeypatch.setenv("CUSPARSEATTN_DETERMINISTIC", "0")
    cuda.backward(*(held[n] for n in names), layout, 0.1)
    assert [launch[3][0]["dq_unordered"] for launch in launches] == [1, 1, 1]
    monkeypatch.delenv("CUSPARSEATTN_DETERMINISTIC")
    # A dK that TMA cannot write (its rows 8 bytes off 16) takes the two Hopper passes, which store it
    # element by element.
    launches.clear()
    odd = dict(held, dk=Holder(held["dk"].shape, address=held["dk"].data_ptr + 8, pad=8))
    cuda.backward(*(odd[n] for n in names), layout, 0.1)
    assert [launch[0].split("_bf16")[0] for launch in launches] == ["backward_dq_sm90", "backward_dkdv_sm90"]
    # A scratch made under CUSPARSEATTN_FUSED_BACKWARD=0 is too short for the fused pass: refused before any
    # launch.
    launches.clear()
    short = Holder((2, 4, 2, 384), dtype="float32")
    with pytest.raises(ValueError, match=r"must have the shape stats_shape\(q.shape, device\) = \(2, 4, "):
        cuda.backward(*(held[n] for n in names[:-1]), short, layout, 0.1)
    assert launches == []


def _arrays(seq: int, dim: int, base: int) -> dict:
    """The holders of one call's forward and backward at addresses from `base` (k, v and their gradients
    with padded rows)."""
    names = ("q", "dout", "out", "dq")
    held = {n: Holder((2, 4, seq, dim), address=base + 0x100000 * i) for i, n in enumerate(names)}
    for i, n in enumerate(("k", "v", "dk", "dv")):
        held[n] = Holder((2, 2, seq, dim), address=base + 0x1000000 * (i + 1), pad=8)
    held["lse"] = Holder((2, 4, seq), dtype="float32", address=base + 0x10000000)
    held["stats"] = Holder(cuda.stats_shape((2, 4, seq, dim), 0), dtype="float32", address=base + 0x20000000)
    return held


@pytest.mark.parametrize("hopper", [True, False])
def test_passes_prepared_once_launch_what_each_call_launches(launches, monkeypatch, hopper):
    """A Forward and a Backward made for one call's arrays launch, on another call's arrays described alike
    (addresses apart), exactly what `forward` and `backward` launch on those."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    seq, dim = 300, 64
    layout = patterns.causal(block=64).layout(seq)
    first, second = _arrays(seq, dim, 0x40000000), _arrays(seq, dim, 0x80000000)
    fwd = tuple(second[n] for n in ("q", "k", "v", "out", "lse"))
    bwd = tuple(second[n] for n in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats"))
    cuda.forward(*fwd, layout, 0.1)
    cuda.backward(*bwd, layout, 0.1)
    direct = [(name, grid, bytes(args[0]), maps) for name, grid, _, args, _, maps in launches]
    launches.clear()
    forward = cuda.Forward(
        first["q"], first["k"], first["v"], layout, 0.1, out=first["out"], lse=first["lse"]
    )
    others = {n: first[n] for n in ("dout", "out", "lse", "dq", "dk", "dv", "stats")}
    backward = cuda.Backward(first["q"], first["k"], first["v"], layout, 0.1, **others)
    assert launches == [] and backward.hopper == hopper and backward.accepts(second["dout"])
    forward.run(*fwd)
    backward.run(*bwd)
    assert [(name, grid, bytes(args[0]), maps) for name, grid, _, args, _, maps in launches] == direct
    # What it refuses goes the usual way: another shape or dtype, an address the copies cannot read.
    assert not backward.accepts(Holder((2, 4, seq + 1, dim)))
    assert not backward.accepts(Holder((2, 4, seq, dim), dtype="float16"))
    assert not backward.accepts(Holder((2, 4, seq, dim), address=0x100008))


@pytest.mark.parametrize("hopper", [True, False])
def test_a_prepared_backward_takes_each_dout_layout_as_it_comes(launches, monkeypatch, hopper):
    """A Backward made before dout exists runs on douts of any strides (a transposed view of the output's
    gradient is common): each launch packs that dout's strides and, on Hopper, describes it for TMA."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    seq, dim = 256, 64
    layout = patterns.causal(block=64).layout(seq)
    arrays = _arrays(seq, dim, 0x40000000)
    others = {n: arrays[n] for n in ("out", "lse", "dq", "dk", "dv", "stats")}  # dout: not yet
    backward = cuda.Backward(arrays["q"], arrays["k"], arrays["v"], layout, 0.1, **others)
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")
    for pad in (0, 8, 0):
        arrays["dout"] = Holder((2, 4, seq, dim), address=0x50000000 + 0x1000 * pad, pad=pad)
        assert backward.accepts(arrays["dout"])
        launches.clear()
        cuda.backward(*(arrays[n] for n in names), layout, 0.1)
        direct = [(name, bytes(args[0]), maps) for name, _, _, args, _, maps in launches]
        launches.clear()
        backward.run(*(arrays[n] for n in names))
        assert [(name, bytes(args[0]), maps) for name, _, _, args, _, maps in launches] == direct
    assert len(backward._bound) == 2


@pytest.mark.parametrize("hopper", [True, False])
def test_prepared_passes_keep_no_array(launches, monkeypatch, hopper):
    """A Forward or Backward kept for later calls holds descriptions, not the arrays it was made from (PyTorch
    keeps them per call signature: the first call's tensors must not live as long)."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    seq, dim = 256, 64
    layout = patterns.causal(block=64).layout(seq)
    arrays = _arrays(seq, dim, 0x40000000)
    made = [
        cuda.Forward(
            arrays["q"], arrays["k"], arrays["v"], layout, 0.1, out=arrays["out"], lse=arrays["lse"]
        ),
        cuda.Backward(
            arrays["q"], arrays["k"], arrays["v"], layout, 0.1, out=arrays["out"], dout=arrays["dout"]
        ),
    ]
    made[1].run(*(arrays[n] for n in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")))
    refs = [weakref.ref(a) for a in arrays.values()]
    del arrays
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs) and len(made) == 2


def test_each_thread_makes_the_device_context_current_before_its_first_launch(launches):
    """A thread that PyTorch starts (its autograd threads) may have no current context: the first launch on
    each thread binds the device's, once."""
    thread = threading.Thread(target=lambda: (_forward(64), _forward(64)))
    thread.start()
    thread.join()
    _forward(64)
    assert sys.modules["cupy"].bound == [0, 0] and len(launches) == 3


def _launched(launches) -> list:
    """The launches recorded since the last clear, as (name, grid, argument bytes, TMA maps' geometry)."""
    made = [(name, grid, [bytes(a) for a in args], maps) for name, grid, _, args, _, maps in launches]
    launches.clear()
    return made


@pytest.mark.parametrize("sms", [132, 3])
def test_a_float32_hopper_forward_makes_vs_transposed_copy_after_its_other_scratch(
    launches, monkeypatch, sms
):
    """float32's Hopper forward lists V's transposed copy last among what a caller makes (after split rows'
    scratch), and its launch over raw addresses (the copy's pass, the forward, the combine) is what `run`
    launches on holders, which make both scratches through q's framework in that order."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setattr(devices, "sm_count", lambda device: sms)
    seq, dim = (2176 if sms == 3 else 256), 128
    layout = patterns.dense(block=128).layout(seq)
    q = Holder((2, 4, seq, dim), "float32", address=0x40000000)
    k, v = (Holder((2, 2, seq, dim), "float32", address=0x50000000 + 0x1000000 * i) for i in range(2))
    out, lse = (
        Holder(q.shape, "float32", address=0x60000000),
        Holder((2, 4, seq), "float32", address=0x70000000),
    )
    forward = cuda.Forward(q, k, v, layout, 0.1)
    split = [(forward.scratches[0], "float32")] if sms == 3 else []
    assert forward.scratches == (*(shape for shape, _ in split), cuda.transposed_shape(k.shape))
    assert forward.made == (
        (q.shape, "float32"),
        ((2, 4, seq), "float32"),
        *split,
        (cuda.transposed_shape(k.shape), "float32"),
    )
    forward.run(q, k, v, out, lse)
    on_holders = _launched(launches)
    assert [name.split("_tf32")[0] for name, *_ in on_holders] == [
        "transpose",
        "forward_sm90",
        *(["forward_combine"] if split else []),
    ]
    assert [m.shape for m in q.made] == [shape for shape, _ in split] + [cuda.transposed_shape(k.shape)]
    forward.launch(
        0, (q.data_ptr, k.data_ptr, v.data_ptr, out.data_ptr, lse.data_ptr, *(m.data_ptr for m in q.made))
    )
    assert _launched(launches) == on_holders


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize("sms", [132, 3])
def test_direct_launches_over_addresses_are_what_runs_on_holders_launch(launches, monkeypatch, hopper, sms):
    """A Forward and a Backward prepared without outputs list what a caller that makes the arrays itself
    makes (`made`: outputs, then scratch, C-contiguous) and launch over raw addresses (`Forward.launch`,
    `Backward.launcher`) exactly what `run` launches on holders at those addresses. On 3 SMs the Hopper
    forward splits rows: its scratch is the third array made."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    monkeypatch.setattr(devices, "sm_count", lambda device: sms)
    seq, dim = (2176 if sms == 3 else 256), 128
    layout = patterns.dense(block=128).layout(seq)
    held = _arrays(seq, dim, 0x40000000)
    for name in ("out", "dout", "dq", "dk", "dv", "lse", "stats"):  # C-contiguous, as the caller makes them
        held[name] = Holder(held[name].shape, held[name].dtype, address=held[name].data_ptr)
    q, k, v = held["q"], held["k"], held["v"]
    forward = cuda.Forward(q, k, v, layout, 0.1)
    backward = cuda.Backward(q, k, v, layout, 0.1)
    split = hopper and sms == 3
    scratch = ((3, 128, dim + 1), "float32") if split else None
    assert forward.made == ((q.shape, "bfloat16"), ((2, 4, seq), "float32"), *([scratch] if split else []))
    assert backward.made == (
        (q.shape, "bfloat16"),
        (k.shape, "bfloat16"),
        (k.shape, "bfloat16"),
        (cuda.stats_shape(q.shape, 0), "float32"),
    )
    forward.run(q, k, v, held["out"], held["lse"])
    names = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "stats")
    backward.run(*(held[n] for n in names))
    on_holders = _launched(launches)
    assert len(on_holders) == (2 if split else 1) + 2  # the dQ and dK/dV passes (the fixture's)
    made = [q.made[0].data_ptr] if split else []  # the scratch that run made
    forward.launch(0, tuple(held[n].data_ptr for n in ("q", "k", "v", "out", "lse")) + tuple(made))
    addresses = tuple(
        held[n].data_ptr for n in ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "stats")
    )
    backward.launcher(held["dout"])(0, addresses)
    assert _launched(launches) == on_holders
    # Given outputs bind the launches to theirs: nothing to make.
    assert cuda.Forward(q, k, v, layout, 0.1, out=held["out"]).made is None
    assert cuda.Backward(q, k, v, layout, 0.1, stats=held["stats"]).made is None


@pytest.mark.parametrize("hopper", [True, False])
def test_a_launch_builds_its_arguments_once_per_tuple_of_addresses(launches, monkeypatch, hopper):
    """The arguments (parameters with the addresses, TMA descriptors) of a launch at addresses seen before are
    the kept ones: no descriptor is encoded again. Past `_Bound.KEPT` tuples, all are forgotten."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90 if hopper else 80)
    monkeypatch.setattr(kernel_launches.Bound, "KEPT", 3)
    encoded, encode = [], tma._tile_map

    def counted(*args):
        encoded.append(args[0])
        return encode(*args)

    monkeypatch.setattr(tma, "_tile_map", counted)
    seq, dim = 256, 64
    layout = patterns.causal(block=64).layout(seq)
    held = _arrays(seq, dim, 0x40000000)
    forward = cuda.Forward(held["q"], held["k"], held["v"], layout, 0.1)
    maps = 4 if hopper else 0

    def launch(base: int) -> bytes:
        forward.launch(0, tuple(base + 0x100000 * i for i in range(5)))
        ((_, _, args, _),) = _launched(launches)
        assert np.frombuffer(args[0], build.PARAMS)[0]["q"] == base
        return args[0]

    first = launch(0x40000000)
    for base, new in ((0x40000000, 0), (0x50000000, maps), (0x40000000, 0), (0x60000000, maps)):
        before = len(encoded)
        params = launch(base)
        assert len(encoded) - before == new
        assert (params == first) == (base == 0x40000000)
    launch(0x70000000)  # a fourth tuple: the kept three go
    before = len(encoded)
    launch(0x40000000)
    assert len(encoded) - before == maps


class Reusing(Holder):
    """A holder whose `empty` hands out again the address of an array it made that has been dropped, as a
    caching allocator does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free, self.fresh = [], 0x30000000

    def empty(self, shape, dtype):
        if self.free:
            address = self.free.pop()
        else:
            address, self.fresh = self.fresh, self.fresh + 0x1000000
        made = Holder(shape, dtype, address=address)
        weakref.finalize(made, self.free.append, address)
        return made


def test_a_calls_scratches_live_until_its_launches_are_queued(launches, monkeypatch):
    """Each scratch of a call has its own memory: float32's Hopper backward makes three transposed copies
    (Q's and dO's of one shape), and its forward with split rows two scratches, from q's allocator."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setattr(devices, "sm_count", lambda device: 3)  # the forward's deal splits rows
    seq, dim = 2176, 128
    q, dout, out, dq = (Reusing((2, 4, seq, dim), "float32", address=0x1000 * (i + 1)) for i in range(4))
    k, v, dk, dv = (Holder((2, 2, seq, dim), "float32", address=0x10000 * (i + 1)) for i in range(4))
    lse = Holder((2, 4, seq), dtype="float32", address=0x100000)
    stats = Holder(cuda.stats_shape(q.shape, 0, "float32"), dtype="float32", address=0x200000)
    layout = patterns.dense(block=128).layout(seq)
    cuda.forward(q, k, v, out, lse, layout, 0.1)
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, layout, 0.1)
    names = [name.split("_tf32_d")[0] for name, *_ in launches]
    assert names == ["transpose", "forward_sm90", "forward_combine", "transpose", *names[-2:]]
    forward_args, backward_args = launches[0][3][0], launches[3][3][0]
    assert forward_args["stats"] != forward_args["vt"]
    assert len({int(backward_args[n]) for n in ("kt", "qt", "dot")}) == 3


@pytest.mark.parametrize("precision", ["high", "highest"])
def test_float32_on_hopper_runs_in_tf32_after_the_transposed_copies(launches, monkeypatch, precision):
    """At "high" the Hopper forward and two-pass backward multiply in TF32, each after a pass that copies
    what its products read transposed into scratches that q's framework makes ([B, H, D, S padded to 32]: V
    for the forward; K, Q and dO for the backward), read by TMA a tile's panels of 32 rows at a time; at
    "highest" the portable passes run."""
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.setenv("CUSPARSEATTN_FUSED_BACKWARD", "1")
    seq, dim = 200, 128
    q, dout, out, dq = (Holder((1, 4, seq, dim), "float32", address=0x1000 * (i + 1)) for i in range(4))
    k, v, dk, dv = (Holder((1, 2, seq, dim), "float32", address=0x10000 * (i + 1)) for i in range(4))
    lse = Holder((1, 4, seq), dtype="float32", address=0x100000)
    # No fused backward for float32: the two passes' scratch, two statistics rows.
    stats = Holder(cuda.stats_shape(q.shape, 0, "float32"), dtype="float32", address=0x200000)
    assert stats.shape == (1, 4, 2, 256) and cuda.stats_shape(q.shape, 0)[2] == 2 + dim + 1
    layout = patterns.causal(block=64).layout(seq)
    cuda.forward(q, k, v, out, lse, layout, 0.1, precision=precision)
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, layout, 0.1, precision=precision)
    tag = {"high": "tf32", "highest": "tf32x3"}[precision]
    names = [name for name, *_ in launches]
    high = precision == "high"
    forward = ["transpose", "forward_sm90"] if high else ["forward"]
    backward = ["transpose", "backward_dq_sm90", "backward_dkdv_sm90"] if high else []
    backward = backward or ["backward_dq", "backward_dkdv"]
    assert [name.split(f"_{tag}_d")[0] for name in names] == [*forward, *backward]
    for (name, _, _, _, shared, _), kernel in zip(launches, [*forward, *backward], strict=True):
        tiles = tuning.tile_config(kernel, dim, itemsize=4, highest=not high and kernel not in tuning.ARCH)
        assert f"q{tiles[0]}k{tiles[1]}w{tiles[2]}" in name
        assert shared == tuning.shared_bytes(kernel, dim, tiles, 4) <= 227 * 1024
    # The kernels read every float32 row as the half ones do: strides in elements.
    assert launches[len(forward) - 1][3][0]["q_ss"] == dim
    if not high:
        assert q.made == []
        return
    (_, copy_grid, _, (copied,), _, _), (_, _, _, (params, *_), _, maps) = launches[:2]
    vt, kt, qt, dot = q.made
    assert vt.shape == cuda.transposed_shape(k.shape) == (1, 2, dim, 224) and vt.dtype == "float32"
    assert copy_grid == (224 // 32 * (dim // 32), 2, 1)  # 32 keys of 32 head dims a CTA, heads on y
    assert copied["vt"] == params["vt"] == vt.data_ptr and copied["v"] == v.data_ptr
    assert (copied["vt_sh"], copied["vt_ss"]) == (dim * 224, 224)
    tiles = tuning.tile_config("forward_sm90", dim, itemsize=4)
    # q, k, then V's copy (its head dims are the rows, a key tile's panels the box), then out
    assert [m[0] for m in maps] == [
        (32, seq, dim // 32, 4, 1),
        (32, seq, dim // 32, 2, 1),
        (32, dim, 7, 2, 1),
        (32, seq, dim // 32, 4, 1),
    ]
    assert maps[2][2] == (32, dim, tiles[1] // 32, 1, 1) and maps[0][2] == (32, tiles[0], dim // 32, 1, 1)
    # The backward's copies: K's, Q's and dO's, every head of each in one launch, V's not made.
    assert (kt.shape, qt.shape, dot.shape) == ((1, 2, dim, 224), (1, 4, dim, 224), (1, 4, dim, 224))
    (_, copy_grid, _, (copied,), _, _), dq_pass, dkdv_pass = launches[2:]
    assert copy_grid == (224 // 32 * (dim // 32), 2 + 4 + 4, 1) and copied["vt"] == 0
    assert (copied["kt"], copied["qt"], copied["dot"]) == (kt.data_ptr, qt.data_ptr, dot.data_ptr)
    assert (copied["k"], copied["q"], copied["dout"]) == (k.data_ptr, q.data_ptr, dout.data_ptr)
    # q, k, v, dout as the half passes read them, then the copies: K's a key tile's panels, Q's and dO's a
    # query tile's
    dq_tiles, dkdv_tiles = (tuning.tile_config(n, dim, itemsize=4) for n in backward[1:])
    for (*_, maps), (tm, tn, _), copies in ((dq_pass, dq_tiles, "k"), (dkdv_pass, dkdv_tiles, "qd")):
        query, key = (tm, dim // 32), (tn, dim // 32)
        boxes = [(dim, (tn if c == "k" else tm) // 32) for c in copies]
        assert [m[2][1:3] for m in maps] == [query, key, key, query, *boxes]
    assert [m[0][3] for m in dkdv_pass[5]] == [4, 2, 2, 4, 4, 4]


def test_float32_takes_the_hopper_kernels_at_high_and_the_portable_ones_at_highest(monkeypatch):
    monkeypatch.setattr(devices, "compute_capability", lambda device: 90)
    monkeypatch.delenv("CUSPARSEATTN_HOPPER", raising=False)
    q = Holder((1, 2, 128, 64), "float32")
    assert devices.reasons("float32", 64) == []
    assert devices.hopper_reasons(q, q, q) == [] == devices.hopper_reasons(q, q, q, dout=q)
    assert devices.hopper_reasons(q, q, q, q, precision="highest") == [devices.FLOAT32_HIGHEST_ON_HOPPER]
    assert devices.hopper_reasons(Holder((1, 2, 128, 64)), q, q) == []
    assert "float64" in devices.reasons("float64", 64)[0]
