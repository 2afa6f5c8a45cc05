"""The PyTorch adapter: its custom operators (opcheck), gradients by gradcheck (CPU, float64), empty rows,
recompute, the module, and ``torch.compile`` without graph breaks; on a GPU, the kernels through it."""

from __future__ import annotations

import gc
import math
import time
import warnings
import weakref

import numpy as np
import pytest
from kernel_cases import hopper_path, np_dtype, to_device, to_host

import cusparseattn
from cusparseattn import backends, native_backends, patterns, plans, reference
from cusparseattn.layout import BlockLayout
from cusparseattn.rules import TokenRule
from cusparseattn.testing import backward_refs, check_close, forward_refs, random_qkv

torch = pytest.importorskip("torch")
ca_torch = pytest.importorskip("cusparseattn.torch")
ops = torch.ops.cusparseattn


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


def test_eager_calls_skip_the_operators():
    """Outside torch.compile the passes run in an autograd.Function (the operators' dispatch is for graphs),
    with the operators' results."""
    q, k, v = tensors()
    layout = patterns.causal(block=16).layout(24)
    key = ca_torch._OBJECTS.key(layout)
    op_out = ops.attention_forward(q, k, v, key, -1, 0.5, None, False)[0]
    want = torch.autograd.grad(op_out.sum(), (q, k, v))
    for recompute in (False, True):
        out = ca_torch.attention(q, k, v, layout, recompute=recompute)
        assert type(out.grad_fn).__name__ == "_AttentionBackward"
        torch.testing.assert_close(out, op_out, rtol=0, atol=0)
        for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


class PreparingReference(native_backends.ReferenceBackend):
    """The reference under another name, which prepares its forward and backward (`Backend.prepare_forward`,
    `Backend.prepare_backward`); ``prepared`` counts the preparations, ``runs`` records which way each
    backward went."""

    name, description = "preparing", "the reference, with prepared passes"

    def __init__(self):
        self.runs, self.prepared, self.asked = [], {"forward": 0, "backward": 0}, []

    def prepare_forward(self, inputs):
        backend = self
        self.prepared["forward"] += 1

        class Ready(backends.PreparedForward):
            def run(self, inputs):
                return native_backends.ReferenceBackend.forward(backend, inputs)

        return Ready()

    def prepare_backward(self, inputs):
        backend, strides = self, inputs.out.strides
        self.prepared["backward"] += 1

        class Ready(backends.PreparedBackward):
            def accepts(self, dout):
                backend.asked.append(dout.strides)
                return dout.strides == strides

            def run(self, inputs):
                backend.runs.append("prepared")
                return native_backends.ReferenceBackend.backward(backend, inputs)

        return Ready()

    def backward(self, inputs):
        self.runs.append("usual")
        return super().backward(inputs)


@pytest.fixture
def preparing():
    backend = backends.register_backend(PreparingReference())
    yield backend
    backends.unregister_backend(backend.name)


def _relaid(t):
    """The same values laid out anew ([B, S, H, D] in memory; a [B, H, S] lse copied as it is): a saved-tensor
    hook's copy that the prepared backward was not made for."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t.clone()


@pytest.mark.parametrize("how", ["prepared", "hook_copy", "hook_relaid", "strided_dout", "recompute"])
def test_eager_backward_runs_what_the_forward_prepared(preparing, how):
    """The backward takes the prepared way when autograd hands back tensors described as the saved ones (a
    saved-tensor hook's copy is) and the backend accepts dout, or when the backward looks up a plan of its
    own (recompute) that the backend prepares; otherwise (a copy laid out anew, a dout it refuses) the usual
    way. The gradients are the same either way."""
    q, k, v = tensors(Sq=20, Sk=28)
    layout = patterns.causal(block=16).layout(20, 28)
    dout = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype).transpose(1, 2)
    if how != "strided_dout":  # a [B, S, H, D] view, which this backend refuses
        dout = dout.contiguous()
    want = torch.autograd.grad(cusparseattn.attention(q, k, v, layout), (q, k, v), dout)
    pack = {"hook_copy": torch.clone, "hook_relaid": _relaid}.get(how, lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ca_torch.attention(q, k, v, layout, backend="preparing", recompute=how == "recompute")
    for got, w in zip(torch.autograd.grad(out, (q, k, v), dout), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
    assert preparing.runs == ["prepared" if how in ("prepared", "hook_copy", "recompute") else "usual"]


def test_repeated_eager_calls_validate_and_prepare_once(preparing, monkeypatch):
    """Calls that repeat a signature (arguments, shapes, strides, dtypes, devices, enabled backends, the
    switches that choose kernels) reuse what the first one decided and prepared, on their own tensors; any
    change makes a call of its own."""
    layout = patterns.local(window=16, block=16)
    sizes = dict(Hq=4, Hkv=2, Sq=40, Sk=40)
    for seed in range(3):
        q, k, v = tensors(**sizes, seed=seed)
        dout = torch.randn(q.shape, dtype=q.dtype)
        got = torch.autograd.grad(ca_torch.attention(q, k, v, layout, backend="preparing"), (q, k, v), dout)
        want = torch.autograd.grad(cusparseattn.attention(q, k, v, layout), (q, k, v), dout)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert preparing.prepared == {"forward": 1, "backward": 1} and preparing.runs == ["prepared"] * 3
    q, k, v = tensors(**sizes)
    changes = [
        lambda: ca_torch.attention(*(_relaid(x) for x in (q, k, v)), layout, backend="preparing"),
        lambda: ca_torch.attention(q, k, v, layout, backend="preparing", scale=0.5),
        lambda: ca_torch.attention(q, k, v, layout, backend="preparing", causal=True),
        lambda: ca_torch.attention(q, k, v, patterns.local(window=16, block=16), backend="preparing"),
        lambda: ca_torch.attention(q.float(), k.float(), v.float(), layout, backend="preparing"),
    ]
    for count, change in enumerate(changes, start=2):
        change()
        assert preparing.prepared["forward"] == count
    with backends.use_backends("preparing"):
        ca_torch.attention(q, k, v, layout)
        ca_torch.attention(q, k, v, layout)
    assert preparing.prepared["forward"] == len(changes) + 2
    switches = ("CUSPARSEATTN_HOPPER", "CUSPARSEATTN_FUSED_BACKWARD", "CUSPARSEATTN_DETERMINISTIC")
    for count, switch in enumerate(switches, start=3):
        monkeypatch.setenv(switch, "0")
        ca_torch.attention(q, k, v, layout, backend="preparing")
        assert preparing.prepared["forward"] == len(changes) + count


def test_the_prepared_backward_asks_once_per_dout_layout(preparing):
    """Whether the backend takes a dout depends on its description alone: a repeated description is not asked
    again, a new one is (and a refused one takes the usual way)."""
    layout = patterns.causal(block=16)
    q, k, v = tensors(Sq=32, Sk=32)
    contiguous = torch.randn(q.shape, dtype=q.dtype)
    strided = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype).transpose(1, 2)
    for dout in (contiguous, contiguous.clone(), strided, strided):
        want = torch.autograd.grad(cusparseattn.attention(q, k, v, layout), (q, k, v), dout)
        got = torch.autograd.grad(ca_torch.attention(q, k, v, layout, backend="preparing"), (q, k, v), dout)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert preparing.runs == ["prepared", "prepared", "usual", "usual"]
    assert preparing.asked == [contiguous.stride(), strided.stride(), strided.stride()]


def test_a_kept_plan_holds_its_layout(preparing):
    """A kept plan holds the layout its key names by identity, so a later layout is never taken for it (its
    id cannot be reused while the plan is kept); `plans.clear` lets the layouts go."""
    q, k, v = tensors(Sq=40, Sk=48, requires_grad=False)
    layout = sparse_layout()
    ca_torch.attention(q, k, v, layout, backend="preparing")
    held = weakref.ref(layout)
    del layout
    gc.collect()
    assert held() is not None
    ca_torch.attention(q, k, v, sparse_layout(), backend="preparing")
    assert preparing.prepared["forward"] == 2
    plans.clear()
    gc.collect()
    assert held() is None


def test_no_torch_tensor_is_named():
    q, k, v = tensors(requires_grad=False)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got numpy.ndarray"):
        ca_torch.attention(q.numpy(), k, v)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        ca_torch.attention(q, k, v, scale=float("nan"))


# ---- the custom operators ---------------------------------------------------------------------------------

OP_CASES = {
    "dense": (dict(), lambda: patterns.dense().layout(24)),
    "causal_gqa": (dict(Hq=4, Hkv=2, Sq=20, Sk=28), lambda: patterns.causal(block=16).layout(20, 28)),
    "random_layout_with_rule": (dict(Sq=40, Sk=48, Hq=2), lambda: sparse_layout(heads=2)),
    # The first query rows attend to nothing, as does the random layout's second query block row.
    "empty_rows": (dict(Sq=28, Sk=20), lambda: patterns.causal(block=16).layout(28, 20)),
}


def bshd(*xs):
    """The same values as [B, S, H, D] arrays seen through a transpose."""
    return [x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in xs]


@pytest.mark.parametrize("name", list(OP_CASES))
def test_opcheck_forward(name):
    sizes, make_layout = OP_CASES[name]
    layout = make_layout()
    key = ca_torch._OBJECTS.key(layout)
    q, k, v = tensors(**sizes)
    for args in ((q, k, v, key, -1, 0.4, None, False), (*bshd(q, k, v), key, -1, 0.4, "reference", True)):
        result = torch.library.opcheck(ops.attention_forward, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("name", list(OP_CASES))
def test_opcheck_backward(name):
    sizes, make_layout = OP_CASES[name]
    layout = make_layout()
    key = ca_torch._OBJECTS.key(layout)
    q, k, v = tensors(**sizes, requires_grad=False)  # the backward is not differentiable itself
    out, lse = ops.attention_forward(q, k, v, key, -1, 0.4, None, False)
    dout = torch.randn(out.shape, dtype=out.dtype)
    result = torch.library.opcheck(ops.attention_backward, (dout, q, k, v, out, lse, key, -1, 0.4, None))
    assert set(result.values()) == {"SUCCESS"}, result
    # A stride-0 dout, as out.sum().backward() sends, gives the reference's gradients.
    dout = torch.randn((), dtype=out.dtype).expand(out.shape)
    arrays = [x.numpy() for x in (dout, q, k, v, out, lse)]
    want = reference.backward(*arrays, layout, scale=0.4, precision=np.float64)
    got = ops.attention_backward(dout, q, k, v, out, lse, key, -1, 0.4, None)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w)


def test_operators_check_their_arguments():
    q, k, v = tensors(requires_grad=False)
    layout = patterns.dense().layout(24)
    key = ca_torch._OBJECTS.key(layout)
    with pytest.raises(ValueError, match="k has 2 heads, and q's 3 heads"):
        ops.attention_forward(torch.randn(1, 3, 24, 4, dtype=q.dtype), k, v, key, -1, 0.5, None, False)
    with pytest.raises(ValueError, match="layout was built for seq_q=24"):
        ops.attention_forward(q[:, :, :20], k, v, key, -1, 0.5, None, False)


def test_layout_keys_are_stable_and_weak():
    lay = sparse_layout()
    key = ca_torch._OBJECTS.key(lay)
    assert ca_torch._OBJECTS.key(lay) == key and ca_torch._OBJECTS.get(key) is lay
    assert ca_torch._OBJECTS.key(sparse_layout()) != key  # equal contents, another object
    del lay
    gc.collect()
    with pytest.raises(RuntimeError, match=f"key {key} names no live layout or score mod"):
        ca_torch._OBJECTS.get(key)


def test_autograd_keeps_a_temporary_layout_alive():
    q, k, v = tensors(Sq=40, Sk=48)
    dout = torch.randn(q.shape, dtype=q.dtype)
    ca_torch.attention(q, k, v, sparse_layout()).backward(dout)  # nothing else holds this layout
    gc.collect()
    want = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = ca_torch.attention(q, k, v, sparse_layout())
    gc.collect()
    out.backward(dout)
    for t, w in zip((q, k, v), want, strict=True):
        torch.testing.assert_close(t.grad, w, rtol=0, atol=0)


# ---- torch.compile ----------------------------------------------------------------------------------------


@pytest.fixture
def dynamo():
    """A fresh dynamo cache: recompilations of the same test code do not count against its limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Model(torch.nn.Module):
    """``cusparseattn.attention`` (the function), a weight, then a `SparseAttention` (the module)."""

    def __init__(self, recompute=False):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)) / 3)
        self.attn = ca_torch.SparseAttention(
            patterns.local(window=16, block=16), causal=True, scale=0.4, recompute=recompute
        )
        self.layout = sparse_layout(Sq=40, Sk=40, heads=4)
        self.recompute = recompute

    def forward(self, q, k, v):
        h = cusparseattn.attention(q, k, v, self.layout, causal=True)
        h = ca_torch.attention(h @ self.mix, k, v, recompute=self.recompute) + h
        return self.attn(h, k, v)


def outputs_and_grads(fn, model, args):
    for t in [*args, *model.parameters()]:
        t.grad = None
    out = fn(*args)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), *(t.grad for t in [*args, *model.parameters()])]


class GraphRecorder:
    """A compiler backend that keeps AOT autograd's forward and backward graphs and runs them as they are."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs = {"forward": [], "backward": []}
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"))

    def _keep(self, which):
        def compiler(gm, example_inputs):
            from functorch.compile import make_boxed_func

            self.graphs[which].append(gm)
            return make_boxed_func(gm)

        return compiler

    def ops(self, which):
        return [str(n.target) for gm in self.graphs[which] for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_model_has_one_graph_and_matches_eager(recompute, dynamo):
    model = Model(recompute)
    args = tensors(Hq=4, Hkv=2, Sq=40, Sk=40, D=8, dtype=torch.float32)
    explained = torch._dynamo.explain(model)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(model, backend=recorder.backend, fullgraph=True)
    got, want = outputs_and_grads(compiled, model, args), outputs_and_grads(model, model, args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    forward, backward = recorder.ops("forward"), recorder.ops("backward")
    assert forward.count("cusparseattn.attention_forward.default") == 3
    assert backward.count("cusparseattn.attention_backward.default") == 3
    # recompute: the backward runs the forward of the two attentions that asked for it again.
    assert backward.count("cusparseattn.attention_forward.default") == (2 if recompute else 0)


def test_inductor_compiles_the_operators(dynamo):
    module = ca_torch.SparseAttention(patterns.causal(block=16), scale=0.3)
    args = tensors(Hq=4, Hkv=2, Sq=30, Sk=30, D=8, dtype=torch.float32)
    compiled = torch.compile(lambda q, k, v: module(q * 2, k, v).tanh(), fullgraph=True)
    got = outputs_and_grads(compiled, module, args)
    want = outputs_and_grads(lambda q, k, v: module(q * 2, k, v).tanh(), module, args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_compiling_with_a_new_layout_of_the_same_structure(dynamo):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v, lay: ca_torch.attention(q, k, v, lay), backend=counter, fullgraph=True)
    args = tensors(Sq=40, Sk=48)
    first, second = sparse_layout(), sparse_layout()
    for lay, compiles in ((first, 1), (first, 1), (second, 2)):
        got = fn(*args, lay)
        torch.testing.assert_close(got, ca_torch.attention(*args, lay), rtol=0, atol=0)
        assert counter.frame_count == compiles  # the same layout object: no recompilation


def test_compiled_dynamic_lengths_scales_and_lse(dynamo):
    pattern = patterns.local(window=16, block=16)

    def fn(q, k, v, scale):
        out, lse = ca_torch.attention(q, k, v, pattern, scale=scale, return_lse=True, recompute=True)
        return out, lse

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for seq, scale in ((40, 0.3), (56, 0.7), (56, 2)):
        args = tensors(Hq=4, Hkv=2, Sq=seq, Sk=seq, D=8, dtype=torch.float32)
        out, lse = compiled(*args, scale)
        assert not lse.requires_grad
        want_out, want_lse = fn(*(x.detach() for x in args), scale)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        out.sum().backward()


def test_compiled_errors_are_the_eager_ones(dynamo):
    compiled = torch.compile(lambda q, k, v, **kw: ca_torch.attention(q, k, v, **kw), backend="aot_eager")
    q, k, v = tensors(Hq=3)
    with pytest.raises(ValueError, match="k has 2 heads, and q's 3 heads are not a multiple of it"):
        compiled(q, k, v)
    q, k, v = tensors()
    with pytest.raises(ValueError, match="scale must be finite"):
        compiled(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="backend 'cuda' cannot run the forward"):
        compiled(q, k, v, backend="cuda")
    # An error while dynamo traces must not leave the function uncompilable: a valid call now compiles too.
    torch.testing.assert_close(compiled(q, k, v), ca_torch.attention(q, k, v), rtol=0, atol=0)


# ---- GPU ----------------------------------------------------------------------------------------------

GPU_CASES = {
    # (B, Hq, Hkv, Sq, Sk, D), memory order, layout(Sq, Sk)
    "gqa_causal": ((2, 8, 2, 200, 200, 64), "bhsd", patterns.causal(block=64).layout),
    "bshd_local": ((1, 4, 4, 160, 230, 128), "bshd", patterns.local(window=64, block=32).layout),
    "mqa_rule_empty_rows": ((2, 2, 1, 40, 48, 64), "bshd", lambda sq, sk: sparse_layout(sq, sk, heads=2)),
}


@pytest.fixture
def cuda_only(monkeypatch):
    """Fail if the NumPy reference runs or warns of a fallback: the CUDA kernels must run every pass."""

    def refuse(inputs):
        raise AssertionError(f"the NumPy reference ran for {inputs.describe()}; the CUDA kernels should have")

    reference_backend = backends.BACKENDS["reference"]
    monkeypatch.setattr(reference_backend, "forward", refuse)
    monkeypatch.setattr(reference_backend, "backward", refuse)
    monkeypatch.setattr(backends, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_forward_and_backward_match_the_reference(case, dtype, cuda_only):
    sizes, order, make_layout = GPU_CASES[case]
    layout = make_layout(*sizes[3:5])
    rng = np.random.default_rng(5)
    host = random_qkv(rng, *sizes, np_dtype(dtype), layout=order)
    dout = rng.standard_normal(host[0].shape).astype(host[0].dtype)
    q, k, v = (to_device(x).requires_grad_() for x in host)
    if order == "bshd":
        assert q.stride(1) < q.stride(2)
    out, lse = ca_torch.attention(q, k, v, layout, return_lse=True)
    out.backward(to_device(dout))
    assert out.device == q.device and lse.dtype == torch.float32
    assert [t.grad.dtype for t in (q, k, v)] == [q.dtype] * 3
    (out64, lse64), (out_low, lse_low) = forward_refs(*host, layout)
    check_close("out", to_host(out), out64, out_low, dtype=dtype)
    check_close("lse", to_host(lse), lse64, lse_low, dtype="float32")
    ref64, low = backward_refs(dout, *host, layout)
    for name, t, want, want_low in zip(("dq", "dk", "dv"), (q, k, v), ref64, low, strict=True):
        check_close(name, to_host(t.grad), want, want_low, dtype=dtype)


@pytest.mark.gpu
def test_cuda_float32_trains_in_tf32_eager_and_compiled(cuda_only, dynamo, monkeypatch):
    """float32 at torch's precision "high": on an H100/H200 the Hopper forward and two-pass backward in TF32,
    each after the transposed copies it reads, eager and under torch.compile (whose backward makes those
    copies' scratches itself) with the same bits, within TF32's error of the float64 reference."""
    launched = hopper_path(monkeypatch, True)
    layout = patterns.causal(block=64).layout(300)
    rng = np.random.default_rng(15)
    host = random_qkv(rng, 1, 4, 2, 300, 300, 64, np.float32)
    dout = rng.standard_normal(host[0].shape).astype(np.float32)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        grads = []

        def attend(q, k, v):
            return ca_torch.attention(q, k, v, layout)

        for call in (attend, torch.compile(attend)):
            q, k, v = (to_device(x).requires_grad_() for x in host)
            call(q, k, v).backward(to_device(dout))
            grads.append([to_host(t.grad) for t in (q, k, v)])
    finally:
        torch.set_float32_matmul_precision(precision)
    assert {"transpose", "backward_dq_sm90", "backward_dkdv_sm90"} <= set(launched)
    ref64, low = backward_refs(dout, *host, layout, low="float16")
    # TF32's slack, as test_kernels_backward's: a key's dK sums its rows' errors over the group's queries
    atols = {"dq": 8e-3, "dk": 8e-3 * math.sqrt(2 * 300), "dv": 8e-3}
    for i, (name, want, want_low) in enumerate(zip(("dq", "dk", "dv"), ref64, low, strict=True)):
        check_close(name, grads[0][i], want, want_low, dtype="float16", atol=atols[name])
        np.testing.assert_array_equal(grads[1][i], grads[0][i])


@pytest.mark.gpu
@pytest.mark.parametrize("hook", [False, True])
def test_cuda_backward_is_prepared_in_the_forward(cuda_only, monkeypatch, hook):
    """Eager training takes the backward that the forward prepared, or where a saved-tensor hook hands back
    copies laid out anew, a backward plan of their own; both passes launch directly on the tensors
    (`plans._Launch`), never through the backend's unprepared backward: the same kernels, so the same bits
    as the functional backward."""
    usual, backward = [], native_backends.CudaBackend.backward
    direct, launch = [], plans._Launch.__call__

    def record(self, inputs):
        usual.append(inputs)
        return backward(self, inputs)

    def counted(self, *tensors):
        direct.append(len(tensors))
        return launch(self, *tensors)

    monkeypatch.setattr(native_backends.CudaBackend, "backward", record)
    monkeypatch.setattr(plans._Launch, "__call__", counted)
    rng = np.random.default_rng(7)
    host = random_qkv(rng, 2, 4, 2, 300, 300, 64, np_dtype("bfloat16"), layout="bshd")
    q, k, v = (to_device(x).requires_grad_() for x in host)
    dout = torch.randn_like(q)
    layout = patterns.local(window=100, block=64)
    # q, k and v are [B, S, H, D] views: contiguous copies are laid out anew.
    pack = (lambda t: t.contiguous()) if hook else (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = ca_torch.attention(q, k, v, layout, return_lse=True)
    out.backward(dout)
    assert usual == [] and direct == [3, 6]  # q, k, v; then out, lse, dout too
    with torch.no_grad():
        want = cusparseattn.attention_backward(dout, q, k, v, out, lse, layout)
    for t, w in zip((q, k, v), want, strict=True):
        torch.testing.assert_close(t.grad, w, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_training_steps_first_forward_starts_its_backwards_compiles(cuda_only, monkeypatch, head_dim):
    """The first forward of a training step with an unseen rule starts compiling the backward's kernels in
    the background (`build.prefetch`) before its own: every backward kernel that the step compiled is one
    that the forward prefetched, and the gradients match the reference."""
    from cusparseattn import build

    prefetched, prefetch = [], build.prefetch

    def recorded(spec, device):
        prefetched.append(spec.name)
        prefetch(spec, device)

    monkeypatch.setattr(build, "prefetch", recorded)
    salt = time.time_ns() % 100000 + 3  # a literal of the rule's C text: no kernel cache holds it
    layout = patterns.from_mask(lambda b, h, q, k: (k <= q) & (q % salt < salt), block=64)
    rng = np.random.default_rng(11)
    host = random_qkv(rng, 1, 2, 2, 256, 256, head_dim, np_dtype("bfloat16"))
    dout = rng.standard_normal(host[0].shape).astype(host[0].dtype)
    q, k, v = (to_device(x).requires_grad_() for x in host)
    before = set(build.COMPILE_TIMES)
    out = ca_torch.attention(q, k, v, layout)
    out.backward(to_device(dout))
    compiled = {n for n in set(build.COMPILE_TIMES) - before if n.startswith("backward")}
    assert compiled and compiled <= set(prefetched), (compiled, prefetched)
    ref64, low = backward_refs(dout, *host, layout.layout(256))
    for name, t, want, want_low in zip(("dq", "dk", "dv"), (q, k, v), ref64, low, strict=True):
        check_close(name, to_host(t.grad), want, want_low, dtype="bfloat16")


@pytest.mark.gpu
def test_cuda_compiled_module_matches_eager(dynamo, cuda_only):
    module = ca_torch.SparseAttention(patterns.local(window=128, block=64), causal=True)
    rng = np.random.default_rng(6)
    args = [
        to_device(x).requires_grad_() for x in random_qkv(rng, 2, 8, 2, 300, 300, 64, np_dtype("bfloat16"))
    ]
    weight = torch.randn(64, device="cuda")

    def run(fn):
        for t in args:
            t.grad = None
        out = fn(*args)
        (out.float() * weight).sum().backward()
        return [out.detach(), *(t.grad for t in args)]

    want = run(module)
    got = run(torch.compile(module, fullgraph=True))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
def test_cuda_backward_is_deterministic(cuda_only):
    g = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(2, 16, 512, 128), (2, 2, 512, 128), (2, 2, 512, 128)]
    q, k, v = (
        torch.randn(s, generator=g, device="cuda", dtype=torch.float16).requires_grad_() for s in shapes
    )
    dout = torch.randn(q.shape, generator=g, device="cuda", dtype=torch.float16)
    runs = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        ca_torch.attention(q, k, v, causal=True, backend="cuda").backward(dout)
        runs.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_score_mod_gradients_match_torch_autograd():
    """A traced score mod through the custom operators, eager and compiled, against the same math in torch."""
    from cusparseattn import mods

    slopes = np.array([0.5, 0.25])

    def score(s, b, h, q_idx, kv_idx):
        return 3.0 * mods.tanh((s + slopes[h] * (kv_idx - q_idx)) / 3.0)

    q, k, v = tensors(Sq=40, Sk=40, D=8)
    lay = patterns.causal(block=16)
    dout = torch.randn(q.shape, dtype=q.dtype)
    got = []
    for fn in (ca_torch.attention, torch.compile(ca_torch.attention, backend="aot_eager", fullgraph=True)):
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, lay, score_mod=score).backward(dout)
        got.append([t.grad.clone() for t in (q, k, v)])
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = qq @ kk.transpose(-1, -2) / math.sqrt(8)
    pos = torch.arange(40, dtype=q.dtype)
    s = 3.0 * torch.tanh((s + torch.tensor(slopes)[:, None, None] * (pos[None, :] - pos[:, None])) / 3.0)
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    (torch.softmax(s, -1) @ vv).backward(dout)
    for grads in got:
        for g, want in zip(grads, (qq.grad, kk.grad, vv.grad), strict=True):
            torch.testing.assert_close(g, want)
