"""The PyTorch adapter: gradients by gradcheck (CPU, float64), empty rows, recompute, the module."""

from __future__ import annotations

import numpy as np
import pytest

from cusparseattn import patterns, reference
from cusparseattn.layout import BlockLayout, TokenRule

torch = pytest.importorskip("torch")
ca_torch = pytest.importorskip("cusparseattn.torch")


def tensors(B=1, Hq=2, Hkv=2, Sq=24, Sk=24, D=4, dtype=torch.float64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(requires_grad) for s in shapes]


def sparse_layout(Sq=40, Sk=48, heads=1, seed=3):
    """A random block layout with a token rule in its partial blocks and an empty query block row."""
    rng = np.random.default_rng(seed)
    blocks = rng.random((1, heads, -(-Sq // 16), -(-Sk // 16))) < 0.6
    blocks[..., 1, :] = False
    partial = blocks & (rng.random(blocks.shape) < 0.5)
    rule = TokenRule("mod3", lambda b, h, q, k: (q + 2 * k) % 3 != 0)
    return BlockLayout(blocks, block_size=16, seq_q=Sq, seq_k=Sk, partial=partial, rule=rule)


CASES = {
    "dense": (dict(), dict()),
    "causal": (dict(Sq=20, Sk=28), dict(causal=True)),
    "causal_sq_gt_sk": (dict(Sq=28, Sk=20), dict(causal=True)),  # the first rows attend to nothing
    "random_layout": (dict(Sq=40, Sk=48, Hq=2), dict(layout=sparse_layout(heads=2))),
    "gqa": (dict(Hq=4, Hkv=2, Sq=20, Sk=20), dict(layout=patterns.local(window=8, block=16))),
    "mqa_scaled": (dict(Hq=3, Hkv=1, Sq=18, Sk=30), dict(scale=0.7, causal=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name):
    sizes, kwargs = CASES[name]
    q, k, v = tensors(**sizes)
    assert torch.autograd.gradcheck(lambda q, k, v: ca_torch.attention(q, k, v, **kwargs), (q, k, v))


def test_gradcheck_with_recompute():
    q, k, v = tensors(Hq=4, Hkv=2, Sq=20, Sk=24)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ca_torch.attention(q, k, v, causal=True, recompute=True), (q, k, v)
    )


def test_gradcheck_bshd_views():
    q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in tensors())
    assert q.stride(1) < q.stride(2)
    assert torch.autograd.gradcheck(lambda q, k, v: ca_torch.attention(q, k, v, causal=True), (q, k, v))


def test_empty_rows_have_zero_gradients():
    lay = sparse_layout()
    q, k, v = tensors(Sq=40, Sk=48, D=8)
    out = ca_torch.attention(q, k, v, lay)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.all(out[:, :, 16:32] == 0)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, 16:32] == 0)


def test_gradients_match_reference_backward():
    q, k, v = tensors(Hq=4, Hkv=2, Sq=30, Sk=40, D=8, dtype=torch.float32)
    lay = patterns.causal(block=16).layout(30, 40)
    dout = torch.randn(q.shape)
    out, lse = ca_torch.attention(q, k, v, lay, return_lse=True)
    out.backward(dout)
    arrays = [x.detach().numpy() for x in (dout, q, k, v, out, lse)]
    want = reference.backward(*arrays, lay)
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        np.testing.assert_array_equal(got.numpy(), ref)


def test_recompute_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        q, k, v = tensors(Hq=4, Hkv=2, Sq=30, Sk=30, D=8)
        ca_torch.attention(q, k, v, causal=True, recompute=recompute).sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lse_is_not_differentiable():
    q, k, v = tensors()
    out, lse = ca_torch.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float64


def test_no_grad_and_low_precision():
    q, k, v = tensors(dtype=torch.bfloat16, requires_grad=False)
    with torch.no_grad():
        out = ca_torch.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.grad_fn is None


def test_forcing_backends():
    q, k, v = tensors()
    with pytest.raises(ValueError, match="backend 'cuda' cannot run the forward"):
        ca_torch.attention(q, k, v, backend="cuda")
    out = ca_torch.attention(q, k, v, backend="reference")
    out.sum().backward()
    assert q.grad is not None


def test_sparse_attention_module():
    pattern = patterns.local(window=16, block=16)
    module = ca_torch.SparseAttention(pattern, scale=0.5)
    q, k, v = tensors(Hq=4, Hkv=2, Sq=40, Sk=40, D=8)
    out = module(q, k, v)
    torch.testing.assert_close(out, ca_torch.attention(q, k, v, pattern, scale=0.5), rtol=0, atol=0)
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert "recompute=False" in repr(module) and "causal=False" in repr(module)
    assert isinstance(module, torch.nn.Module) and list(module.parameters()) == []


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_forward_with_reference_backward_fallback(monkeypatch):
    from cusparseattn import backends

    monkeypatch.setattr(backends, "_warned", set())
    q, k, v = (t.detach().to("cuda", torch.float16).requires_grad_() for t in tensors(Sq=128, Sk=128, D=64))
    with pytest.warns(RuntimeWarning, match="no CUDA backward kernel yet"):
        out = ca_torch.attention(q, k, v, causal=True)
        out.float().sum().backward()
    assert out.device == q.device and q.grad.device == q.device and q.grad.dtype == torch.float16
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ca_torch.attention(*ref, causal=True).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref), strict=True):
        torch.testing.assert_close(got.double().cpu(), want.cpu(), atol=2e-2, rtol=2e-2)
