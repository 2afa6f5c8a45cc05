"""Plans (`cusparseattn.plans`): each path plans a signature once; a new address, value or tensor of the same
signature plans nothing, a new shape, layout or captured value plans anew. Counted with `plans.builds` and
the validations (`call.prepare`) each path makes."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import cusparseattn as ca
from cusparseattn import arrays, call, patterns, plans

PACKAGE = pathlib.Path(ca.__file__).parent


@pytest.fixture
def counted(monkeypatch):
    """``counted()`` -> (plans built, validations) since the last call."""
    validations, prepare = [0], call.prepare

    def validate(*args, **kwargs):
        validations[0] += 1
        return prepare(*args, **kwargs)

    monkeypatch.setattr(call, "prepare", validate)
    plans.clear()
    last = [plans.builds(), 0]

    def count():
        now = (plans.builds() - last[0], validations[0] - last[1])
        last[:] = [plans.builds(), validations[0]]
        return now

    return count


def random_arrays(shape=(1, 2, 48, 16), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(4)]


def test_numpy_calls_plan_once_per_signature(counted):
    layout = patterns.local(window=16, block=16)
    q, k, v, dout = random_arrays()
    out, lse = ca.attention_forward(q, k, v, layout)
    ca.attention_backward(dout, q, k, v, out, lse, layout)
    assert counted() == (2, 2)
    q2, k2, v2, dout2 = random_arrays(seed=1)  # new values at new addresses: the same signature
    out2, lse2 = ca.attention_forward(q2, k2, v2, layout)
    ca.attention_backward(dout2, q2, k2, v2, out2, lse2, layout)
    assert counted() == (0, 0)
    want = ca.reference.forward(q2, k2, v2, layout.layout(48))
    np.testing.assert_allclose(out2, want[0], rtol=1e-6, atol=1e-6)
    ca.attention_forward(*random_arrays((1, 2, 64, 16))[:3], layout)  # a new shape
    ca.attention_forward(q, k, v, patterns.causal(block=16))  # a new layout
    ca.attention_forward(q, k, v, layout, scale=0.5)
    ca.attention_forward(q.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3), k, v, layout)  # new strides
    assert counted() == (4, 4)


def test_bad_input_is_refused_by_every_call_not_only_the_first(counted):
    q, k, v, _ = random_arrays()
    ca.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="scale must be finite"):
        ca.attention_forward(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError):
        ca.attention_forward(q, k[:, :, :10], v)


def test_mask_functions_and_score_mods_are_planned_while_their_captures_hold(counted):
    torch = pytest.importorskip("torch")
    window = torch.tensor([16])

    def mask(b, h, q, k):
        return (q >= k) & (q - k < window[0])

    def softcap(score, b, h, q, k):
        return 20 * ca.mods.tanh(score / 20)

    q, k, v, _ = (torch.from_numpy(x) for x in random_arrays())
    first = ca.attention(q, k, v, mask, score_mod=softcap)
    counted()
    again = ca.attention(q, k, v, mask, score_mod=softcap)
    assert counted() == (0, 0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    window[0] = 32  # refilled in place: a new version, a new layout
    wider = ca.attention(q, k, v, mask, score_mod=softcap)
    assert counted() == (1, 1)
    want = ca.attention(q, k, v, patterns.local(window=32, block=16), score_mod=softcap)
    torch.testing.assert_close(wider, want)


def test_eager_torch_training_plans_once(counted):
    torch = pytest.importorskip("torch")
    layout = patterns.causal(block=16)
    for seed in range(3):
        q, k, v, dout = (torch.from_numpy(x).requires_grad_() for x in random_arrays(seed=seed))
        ca.attention(q, k, v, layout).backward(dout)
        if seed == 0:
            assert counted() == (2, 1)  # the forward's plan and its backward's, validated once
    assert counted() == (0, 0)


def test_compiled_torch_plans_once(counted, monkeypatch):
    """Also the first call of the process: nothing traced reads the holders' caches of torch devices."""
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    monkeypatch.setattr(arrays, "_TORCH_DEVICES", {})
    monkeypatch.setattr(arrays, "_TORCH_DTYPE_NAMES", {})
    layout = patterns.local(window=16, block=16)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, dout):
        return (ca.attention(q, k, v, layout) * dout).sum()

    for seed in range(3):
        q, k, v, dout = (torch.from_numpy(x) for x in random_arrays(seed=seed))
        for t in (q, k, v):
            t.requires_grad_()
        step(q, k, v, dout).backward()
        if seed == 0:
            counted()  # tracing and the first run
        want = torch.autograd.grad((ca.attention(q, k, v, layout) * dout).sum(), (q, k, v))
        for t, w in zip((q, k, v), want, strict=True):
            torch.testing.assert_close(t.grad, w)
        counted()  # the eager check's plans are their own
    step(q, k, v, dout).backward()
    assert counted() == (0, 0)


def test_jitted_jax_validates_once(counted):
    jax = pytest.importorskip("jax")
    layout = patterns.causal(block=16)

    def loss(q, k, v, dout):
        return (ca.attention(q, k, v, layout) * dout).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    q, k, v, dout = (jax.numpy.asarray(x) for x in random_arrays())
    first = step(q, k, v, dout)
    assert counted()[1] >= 1
    again = step(q, k, v, dout)
    assert counted() == (0, 0)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kept_plans_are_bounded(counted, monkeypatch):
    monkeypatch.setattr(plans._plans, "size", 3)
    q, k, v, _ = random_arrays()
    for scale in (0.1, 0.2, 0.3, 0.4):
        ca.attention_forward(q, k, v, scale=scale)
    assert counted() == (4, 4) and len(plans._plans) == 3
    ca.attention_forward(q, k, v, scale=0.4)
    ca.attention_forward(q, k, v, scale=0.1)  # forgotten: planned again
    assert counted() == (1, 1)


# ---- the package's imports ------------------------------------------------------------------------------


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imports(name: str, tree: ast.Module, modules) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in the module, at any depth (lazy ones too), within
    the package."""
    package = name if name in modules and _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, None) if sub in modules else (source, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return [(m, n) for m, n in found if m in modules]


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    private = [
        f"{name} imports {source}.{imported}"
        for name, tree in modules.items()
        for source, imported in _imports(name, tree, modules)
        if imported is not None and imported.startswith("_") and not imported.startswith("__")
    ]
    assert private == []


def test_the_package_has_no_import_cycle():
    """Every import counts, the lazy ones inside functions too; the package's ``__init__`` (which imports
    its public modules) is left out, as every module imports it first."""
    modules = _modules()
    packages = {"cusparseattn", "cusparseattn.distributed"}
    edges = {
        name: {m for m, _ in _imports(name, tree, modules) if m not in packages and m != name}
        for name, tree in modules.items()
        if name not in packages
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []
