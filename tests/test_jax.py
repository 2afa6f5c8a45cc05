"""The JAX adapter: gradients by check_grads (CPU, float64), eagerly and under jit, vmap, empty rows."""

from __future__ import annotations

import numpy as np
import pytest

from cusparseattn import arrays, patterns, reference
from cusparseattn.layout import BlockLayout, TokenRule

jax = pytest.importorskip("jax")
ca_jax = pytest.importorskip("cusparseattn.jax")
jnp = jax.numpy
from jax.test_util import check_grads  # noqa: E402


@pytest.fixture(autouse=True)
def jax_on_cpu(request):
    """CPU tests keep JAX on the CPU also on a GPU host (where JAX's default device is a GPU)."""
    if request.node.get_closest_marker("gpu"):
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


@pytest.fixture
def x64():
    """JAX with float64 for the duration of one test (it is a process-wide switch)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def arrays_of(B=1, Hq=2, Hkv=2, Sq=24, Sk=24, D=4, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D)]
    return [jnp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


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
    "causal_sq_gt_sk": (dict(Sq=28, Sk=20), dict(causal=True)),
    "random_layout": (dict(Sq=40, Sk=48), dict(layout=sparse_layout(heads=2))),
    "gqa": (dict(Hq=4, Hkv=2, Sq=20, Sk=20), dict(layout=patterns.local(window=8, block=16))),
    "mqa_scaled": (dict(Hq=3, Hkv=1, Sq=18, Sk=30), dict(scale=0.7, causal=True)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_check_grads(name, jit, x64):
    sizes, kwargs = CASES[name]

    def f(q, k, v):
        return ca_jax.attention(q, k, v, **kwargs)

    check_grads(jax.jit(f) if jit else f, tuple(arrays_of(**sizes)), order=1, modes=["rev"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_values_and_gradients_match_reference(jit):
    q, k, v = arrays_of(Hq=4, Hkv=2, Sq=30, Sk=40, D=8, dtype=np.float32)
    lay = patterns.causal(block=16).layout(30, 40)
    dout = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape).astype(np.float32))

    def f(q, k, v):
        return ca_jax.attention(q, k, v, lay, return_lse=True)

    (out, lse), vjp = jax.vjp(jax.jit(f) if jit else f, q, k, v)
    grads = vjp((dout, jnp.zeros_like(lse)))
    host = [np.asarray(x) for x in (q, k, v)]
    want_out, want_lse = reference.forward(*host, lay)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse), want_lse)
    want = reference.backward(np.asarray(dout), *host, want_out, want_lse, lay)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_empty_rows_have_zero_gradients(x64):
    lay = sparse_layout()
    q, k, v = arrays_of(Sq=40, Sk=48, D=8)
    out = ca_jax.attention(q, k, v, lay)
    assert jnp.all(out[:, :, 16:32] == 0)
    grads = jax.grad(lambda q, k, v: (ca_jax.attention(q, k, v, lay) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert jnp.all(grads[0][:, :, 16:32] == 0)


def test_vmap_over_an_extra_axis():
    q, k, v = (jnp.stack([x, 2 * x]) for x in arrays_of(Sq=20, Sk=20, D=8, dtype=np.float32))
    batched = jax.vmap(lambda q, k, v: ca_jax.attention(q, k, v, causal=True))(q, k, v)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(batched[i]), np.asarray(ca_jax.attention(q[i], k[i], v[i], causal=True))
        )


def test_lse_is_a_constant_and_bfloat16_runs():
    q, k, v = arrays_of(dtype=np.float32)
    grad = jax.grad(lambda q: ca_jax.attention(q, k, v, return_lse=True)[1].sum())(q)
    assert not np.any(np.asarray(grad))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: ca_jax.attention(q, k, v, causal=True))(qb, kb, vb)
    assert out.dtype == jnp.bfloat16
    want = reference.forward(*(np.asarray(x) for x in (qb, kb, vb)), patterns.causal().layout(24))[0]
    np.testing.assert_array_equal(np.asarray(out), want)


def test_errors_are_raised_at_trace_time():
    q, k, v = arrays_of(dtype=np.float32)
    with pytest.raises(ValueError, match="k has 2 heads, and q's 3 heads are not a multiple of it"):
        jax.jit(lambda q, k, v: ca_jax.attention(q, k, v))(jnp.concatenate([q, q[:, :1]], axis=1), k, v)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run the forward"):
        jax.jit(lambda q, k, v: ca_jax.attention(q, k, v, backend="cuda"))(q, k, v)


def test_gpu_under_jit_says_what_to_do(monkeypatch):
    q, k, v = arrays_of(dtype=np.float32)
    want = np.asarray(ca_jax.attention(q, k, v))
    # No GPU here: make the arrays report one, as they would on a GPU host.
    monkeypatch.setattr(arrays.JaxTensor, "device", property(lambda self: ("cuda", 0)))
    with pytest.raises(
        NotImplementedError, match="cannot run on a GPU inside jax.jit; call it outside jit, or pass"
    ):
        jax.jit(lambda q, k, v: ca_jax.attention(q, k, v))(q, k, v)
    out = jax.jit(lambda q, k, v: ca_jax.attention(q, k, v, backend="reference"))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), want)


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_jax_gpu_eager_forward():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX sees no GPU")
    q, k, v = (
        jax.device_put(x.astype(jnp.float16), gpus[0])
        for x in arrays_of(Sq=128, Sk=128, D=64, dtype=np.float32)
    )
    out = ca_jax.attention(q, k, v, causal=True)
    assert out.devices() == {gpus[0]} and out.dtype == jnp.float16
    want = reference.forward(*(np.asarray(x) for x in (q, k, v)), patterns.causal().layout(128))[0]
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), want.astype(np.float32), atol=2e-3)
