"""Which kernels `cusparseattn.cuda` launches and with what arguments, without a GPU: CuPy, the compiled
kernels and the driver's TMA encoder are stand-ins that record what they are given. The kernels themselves are
tested on the GPU (tests/test_kernels_*.py)."""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

from cusparseattn import build, cuda, patterns, tma


class FakeDeviceArray:
    def __init__(self, host):
        self.host = np.asarray(host)
        self.data = types.SimpleNamespace(ptr=id(self))


class Holder:
    """The attributes of a cusparseattn.arrays holder that the launch code reads, of a [B, H, S, D] array."""

    def __init__(self, shape, strides=None, dtype="bfloat16", address=0x10000000):
        self.shape = tuple(shape)
        self.strides = strides or tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        self.dtype, self.data_ptr, self.device, self.stream = dtype, address, ("cuda", 0), 0
        self.ndim = len(shape)


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (kernel name, grid, threads, argument count, TMA maps' geometry, shared bytes)."""
    fake = types.ModuleType("cupy")
    fake.asarray = FakeDeviceArray
    fake.cuda = types.SimpleNamespace(
        Device=lambda device: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(null=contextlib.nullcontext()),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_streams", {})
    monkeypatch.setattr(cuda, "compute_capability", lambda device: 90)
    monkeypatch.setattr(cuda, "max_shared", lambda device: 227 * 1024)
    monkeypatch.setattr(cuda, "_tables", {})
    encoded = []

    def encode(data_ptr, shape, strides, dtype, rows):
        encoded.append(tma.geometry(shape, strides, tma.ITEMSIZE, rows))
        return np.zeros((), tma.TENSOR_MAP)[()]

    monkeypatch.setattr(tma, "_tile_map", encode)
    record = []

    def load(spec, device):
        def function(grid, block, args, shared_mem):
            maps, encoded[:] = list(encoded), []
            record.append((spec.name, grid, block[0], len(args), maps, shared_mem))

        return function

    monkeypatch.setattr(build, "load", load)
    monkeypatch.delenv("CUSPARSEATTN_HOPPER", raising=False)
    return record


def _forward(head_dim, seq=300, **kwargs):
    q, k, v = (
        Holder((2, 4, seq, head_dim), **kwargs),
        Holder((2, 2, seq, head_dim)),
        Holder((2, 2, seq, head_dim)),
    )
    out, lse = Holder((2, 4, seq, head_dim)), Holder((2, 4, seq), dtype="float32")
    cuda.forward(q, k, v, out, lse, patterns.causal(block=64).layout(seq), 0.1)


@pytest.mark.parametrize("head_dim", build.HOPPER_HEAD_DIMS)
def test_hopper_gpus_run_the_hopper_forward_with_three_tma_maps(launches, head_dim):
    _forward(head_dim)
    ((name, grid, threads, nargs, maps, shared),) = launches
    assert name.startswith(f"forward_sm90_bf16_d{head_dim}_q128k128w12") and threads == 384
    assert grid == (3, 4, 2) and nargs == 4  # 300 rows in tiles of 128; the parameters, then q, k, v maps
    assert shared == build.shared_bytes("forward_sm90", head_dim, (128, 128, 12))
    panels = head_dim // 64
    # q, k, v in that order: [B, H, S, D] as (64, S, D / 64, H, B), boxes of 128 rows.
    assert [m[0] for m in maps] == [(64, 300, panels, 4, 2), (64, 300, panels, 2, 2), (64, 300, panels, 2, 2)]
    assert all(m[2] == (64, 128, panels, 1, 1) for m in maps)


@pytest.mark.parametrize(
    ("head_dim", "kwargs", "env"),
    [(96, {}, None), (128, {"address": 0x10000008}, None), (128, {}, "0")],
    ids=["head-dim-96", "misaligned", "turned-off"],
)
def test_the_portable_forward_takes_what_tma_cannot(launches, monkeypatch, head_dim, kwargs, env):
    if env is not None:
        monkeypatch.setenv("CUSPARSEATTN_HOPPER", env)
    _forward(head_dim, **kwargs)
    ((name, _, threads, nargs, maps, _),) = launches
    assert name.startswith("forward_bf16") and nargs == 1 and maps == [] and threads == 256


def test_other_gpus_run_the_portable_kernels(launches, monkeypatch):
    monkeypatch.setattr(cuda, "compute_capability", lambda device: 80)
    _forward(128)
    assert launches[0][0].startswith("forward_bf16")
    assert cuda.hopper_device_reasons(0) == ["the Hopper kernels need compute capability 9.0, cuda:0 has 8.0"]


@pytest.mark.parametrize("head_dim", build.HOPPER_HEAD_DIMS)
def test_hopper_backward_passes_take_query_and_key_tiles_of_their_own(launches, head_dim):
    seq = 300
    q, dout, out, dq = (Holder((2, 4, seq, head_dim)) for _ in range(4))
    k, v, dk, dv = (Holder((2, 2, seq, head_dim)) for _ in range(4))
    lse, delta = Holder((2, 4, seq), dtype="float32"), Holder((2, 4, seq), dtype="float32")
    layout = patterns.causal(block=64).layout(seq)
    cuda.backward(dout, q, k, v, out, lse, dq, dk, dv, delta, layout, 0.1)
    (dq_name, dq_grid, _, dq_nargs, dq_maps, _), (kv_name, kv_grid, _, kv_nargs, kv_maps, _) = launches
    assert dq_name.startswith("backward_dq_sm90") and kv_name.startswith("backward_dkdv_sm90")
    assert dq_grid == (3, 4, 2) and kv_grid == (3, 2, 2) and dq_nargs == kv_nargs == 5
    # q, k, v, dout: the dQ pass reads 128 query rows and 64 keys a tile, the dK/dV pass 64 and 128.
    assert [m[2][1] for m in dq_maps] == [128, 64, 64, 128]
    assert [m[2][1] for m in kv_maps] == [64, 128, 128, 64]
