"""TMA descriptors: the geometry handed to the driver and the arrays TMA cannot describe (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from cusparseattn import tma


def test_a_contiguous_array_is_five_dimensions_of_64_element_panels():
    # [B=2, H=3, S=100, D=128] bf16: rows of 256 bytes, panels 128 bytes apart.
    dims, strides, box = tma.geometry((2, 3, 100, 128), (3 * 100 * 128, 100 * 128, 128, 1), 2, rows=128)
    assert dims == (64, 100, 2, 3, 2)
    assert strides == (256, 128, 100 * 128 * 2, 3 * 100 * 128 * 2)
    assert box == (64, 128, 2, 1, 1)


def test_float32_takes_panels_of_32_elements_and_a_box_may_take_some_of_them():
    # V's transposed copy [B=1, Hkv=2, D=128, Sk padded=224] in float32: its head dims are the rows, and a
    # key tile of 64 is two panels of 32 keys, the box that float32's Hopper forward copies.
    dims, strides, box = tma.geometry((1, 2, 128, 224), (2 * 128 * 224, 128 * 224, 224, 1), 4, 128, 2)
    assert dims == (32, 128, 7, 2, 1)
    assert strides == (224 * 4, 128, 128 * 224 * 4, 16)
    assert box == (32, 128, 2, 1, 1)
    assert tma.panel(4) == 32 and tma.panel(2) == 64
    assert "head dim 48 is not a multiple of 32" in tma.reasons((1, 1, 64, 48), (3072, 3072, 48, 1), 4, 0)[0]
    assert tma.reasons((1, 1, 64, 96), (6144, 6144, 96, 1), 4, 0) == ()


def test_a_bshd_view_keeps_its_strides():
    # x [B, S, H, D] seen as [B, H, S, D]: consecutive rows are H * D elements apart.
    x = np.empty((2, 50, 4, 64), np.float16).transpose(0, 2, 1, 3)
    strides = tuple(s // x.itemsize for s in x.strides)
    dims, byte_strides, box = tma.geometry(x.shape, strides, 2, rows=64)
    assert dims == (64, 50, 1, 4, 2)
    assert byte_strides[0] == 4 * 64 * 2 and byte_strides[2] == 64 * 2 and byte_strides[3] == 50 * 4 * 64 * 2
    assert box == (64, 64, 1, 1, 1)
    assert tma.reasons(x.shape, strides, 2, 0) == ()


def test_dimensions_of_size_one_get_a_legal_stride():
    _, strides, _ = tma.geometry((1, 1, 64, 64), (0, 0, 64, 1), 2, rows=64)
    assert all(s % 16 == 0 and s > 0 for s in strides)


@pytest.mark.parametrize(
    ("shape", "strides", "address", "match"),
    [
        ((1, 2, 64, 96), (12288, 6144, 96, 1), 0x1000, "head dim 96"),
        ((1, 2, 64, 64), (8192, 4096, 64, 1), 0x1008, "16-byte aligned"),
        ((1, 2, 64, 64), (8192, 4096, 68, 1), 0x1000, "16-byte steps"),
        ((1, 2, 64, 64), (8192, 4096, 1, 64), 0x1000, "16-byte steps"),
        ((1, 2, 64, 64), (8192, 0, 64, 1), 0x1000, "broadcast"),
    ],
)
def test_reasons_name_what_tma_cannot_describe(shape, strides, address, match):
    assert any(match in reason for reason in tma.reasons(shape, strides, 2, address % 16))


def test_descriptor_is_128_opaque_bytes():
    assert tma.TENSOR_MAP.itemsize == 128
