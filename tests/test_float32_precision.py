"""float32's precision on the kernels, without a GPU: which one a call takes (the library's switch,
PyTorch's, JAX's), that plans key it, and the specs it builds (tf32 or split tf32, the portable passes
only, tiles that fit)."""

from __future__ import annotations

import numpy as np
import pytest

from cusparseattn import build, call, plans, tuning


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv("CUSPARSEATTN_FLOAT32_PRECISION", raising=False)


def test_the_library_switch_sets_the_precision(unset, monkeypatch):
    assert call.float32_precision("numpy") == call.float32_precision("cupy") == "high"
    monkeypatch.setenv("CUSPARSEATTN_FLOAT32_PRECISION", "highest")
    assert call.float32_precision("cupy") == call.float32_precision("jax") == "highest"
    monkeypatch.setenv("CUSPARSEATTN_FLOAT32_PRECISION", "fast")
    with pytest.raises(ValueError, match="must be 'high' or 'highest', got 'fast'"):
        call.float32_precision("numpy")


@pytest.mark.parametrize(
    ("jax_precision", "ours"),
    [
        (None, "high"),
        ("default", "high"),
        ("tensorfloat32", "high"),
        ("float32", "highest"),
        ("highest", "highest"),
    ],
)
def test_jax_arrays_follow_jaxs_switch(unset, monkeypatch, jax_precision, ours):
    jax = pytest.importorskip("jax")
    with jax.default_matmul_precision(jax_precision):
        assert call.float32_precision("jax") == ours
        q = jax.numpy.ones((1, 2, 16, 8), np.float32)
        assert call.prepare(q, q, q, None, causal=False, scale=None).precision == ours
        monkeypatch.setenv("CUSPARSEATTN_FLOAT32_PRECISION", "high")  # set, the library's switch wins
        assert call.float32_precision("jax") == "high"


@pytest.mark.parametrize(
    ("torch_precision", "ours"), [("highest", "highest"), ("high", "high"), ("medium", "high")]
)
def test_torch_tensors_follow_torchs_switch(unset, monkeypatch, torch_precision, ours):
    torch = pytest.importorskip("torch")
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(torch_precision)
        assert call.float32_precision("torch") == ours
        q = torch.ones(1, 2, 16, 8)
        assert call.prepare(q, q, q, None, causal=False, scale=None).precision == ours
        q64 = q.double()
        assert call.prepare(q64, q64, q64, None, causal=False, scale=None).precision == "high"
        monkeypatch.setenv("CUSPARSEATTN_FLOAT32_PRECISION", "high")  # set, the library's switch wins
        assert call.float32_precision("torch") == "high"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_plans_key_the_precision(unset, monkeypatch):
    q = np.ones((1, 2, 16, 8), np.float32)
    first = plans.forward(q, q, q)
    assert plans.forward(q, q, q) is first
    monkeypatch.setenv("CUSPARSEATTN_FLOAT32_PRECISION", "highest")
    assert plans.forward(q, q, q) is not first


def test_float32_specs_name_their_precision():
    high = build.KernelSpec.make("forward", "float32", 64)
    highest = build.KernelSpec.make("forward", "float32", 64, precision="highest")
    assert high.name.startswith("forward_tf32_d64_") and highest.name.startswith("forward_tf32x3_d64_")
    assert "#define CSA_DTYPE_F32 1" in high.prelude() and "#define CSA_TF32X3 0" in high.prelude()
    assert "#define CSA_TF32X3 1" in highest.prelude()
    assert "#define CSA_DTYPE_F32 0" in build.KernelSpec.make("forward", "bfloat16", 64).prelude()
    assert high.shared_bytes == tuning.shared_bytes("forward", 64, high.tiles, 4) == 272 * (128 + 2 * 2 * 64)
    with pytest.raises(ValueError, match="float32 runs the passes"):
        build.KernelSpec.make("backward_sm90", "float32", 64, tiles=(128, 128, 12))
    with pytest.raises(ValueError, match="multiplies float32 in TF32"):
        build.KernelSpec.make("forward_sm90", "float32", 64, precision="highest")
    with pytest.raises(ValueError, match="takes float32 only"):
        build.KernelSpec.make("transpose", "bfloat16", 64)
    with pytest.raises(ValueError, match="precision 'highest' is float32's"):
        build.KernelSpec.make("forward", "bfloat16", 64, precision="highest")
    with pytest.raises(ValueError, match="precision must be one of"):
        build.KernelSpec.make("forward", "float32", 64, precision="medium")


PORTABLE = [k for k in build.FLOAT32_KERNELS if k not in tuning.ARCH and k not in tuning.PLAIN]


@pytest.mark.parametrize("highest", [False, True])
@pytest.mark.parametrize("kernel", PORTABLE)
def test_float32_tiles_fit_every_device(kernel, highest):
    """An H100's 227 KiB, an A100's 163 and sm_86/89's 99: each takes tiles of its table that fit, each head
    dim, and the largest device the first fitting ones."""
    for head_dim in (8, 32, 64, 96, 128, 200, 256):
        for max_shared in (227 * 1024, 163 * 1024, 99 * 1024):
            tiles = tuning.tile_config(kernel, head_dim, max_shared, itemsize=4, highest=highest)
            assert tuning.shared_bytes(kernel, head_dim, tiles, 4) <= max_shared
            tm, tn, warps = tiles
            assert (tm if kernel != "backward_dkdv" else tn) == 16 * warps
    with pytest.raises(ValueError, match="takes 2-byte elements"):
        tuning.tile_config("backward_sm90", 64, itemsize=4)


@pytest.mark.parametrize(("head_dim", "q_buffers", "v_stages"), [(64, 2, 2), (128, 1, 3)])
def test_float32s_hopper_forward_multiplies_in_tf32_and_reads_v_transposed(head_dim, q_buffers, v_stages):
    """TF32's wgmma is m64nNk8 with both shared operands K-major: no transpose operand and no MN-major B;
    out goes from registers (the staging stores are 16-bit), and one Q buffer of 64 KiB at head dim 128
    leaves room for a third V buffer."""
    spec = build.KernelSpec.make("forward_sm90", "float32", head_dim)
    prelude = spec.prelude()
    tm, tn, _ = spec.tiles
    assert spec.name.startswith(f"forward_sm90_tf32_d{head_dim}_")
    assert f"wgmma.mma_async.sync.aligned.m64n{tn}k8.f32.tf32.tf32" in prelude
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k8.f32.tf32.tf32" in prelude
    assert "k16" not in prelude and "void wgmma_ss_bmn<" not in prelude and "p, 1, 1;" in prelude
    assert "#define STAGE_OUT 0" in prelude and f"#define Q_BUFFERS {q_buffers}" in prelude
    assert f"#define V_STAGES {v_stages}" in prelude and f"#define Q_ROWS {tm}" in prelude
    assert spec.shared_bytes == tuning.shared_bytes("forward_sm90", head_dim, spec.tiles, 4) <= 227 * 1024
    copy = build.KernelSpec.make("transpose", "float32", head_dim)
    assert copy.tiles == (32, 32, 8) and copy.shared_bytes == 0 and copy.arch is None
