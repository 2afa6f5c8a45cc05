"""Backend selection: the registry, priorities, use_backends / activate_backend (nesting, threads), forcing,
every reason, and the fallback warning."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import numpy as np
import pytest

import cusparseattn
from cusparseattn import backends, call, devices, mods, native_backends, reference
from cusparseattn.arrays import NumpyTensor
from cusparseattn.backends import (
    Backend,
    Inputs,
    activate_backend,
    current_backend,
    list_backends,
    register_backend,
    select,
    unregister_backend,
    use_backends,
    why_not,
)
from cusparseattn.native_backends import ReferenceBackend

Q = np.random.default_rng(0).standard_normal((1, 2, 40, 16)).astype(np.float32)
DEFAULT = ["cuda", "reference", "flex", "sdpa"]


def inputs_of(q=Q, **kwargs):
    return call.prepare(q, q, q, None, causal=False, scale=None, **kwargs)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Every test starts from the initial registry and process default, and leaves them so."""
    monkeypatch.setattr(backends, "BACKENDS", backends.BACKENDS)
    monkeypatch.setattr(backends, "_default", backends._INITIAL)
    monkeypatch.setattr(backends, "_warned", set())


class Always(ReferenceBackend):
    """The reference under another name: it runs anything."""

    def __init__(self, name: str, slow: str | None = None):
        self.name, self.slow = name, slow

    def slow_path(self, inputs):
        return self.slow


class Never(Backend):
    """Runs nothing, for the given reason."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def not_supported_reasons(self, inputs, op):
        return [self.reason]


def test_list_backends_in_priority_order():
    assert list_backends() == DEFAULT == list(backends.BACKENDS)


def test_the_reference_is_chosen_on_the_cpu():
    assert select(inputs_of(), "forward").name == "reference"
    assert select(inputs_of(), "backward").name == "reference"
    assert current_backend(Q, Q, Q) == current_backend(Q, Q, Q, op="backward", causal=True) == "reference"


def test_cuda_reasons_here_say_why():
    reasons = why_not(Q, Q, Q)["cuda"]
    assert reasons[0] == "the inputs are on cpu, not on a CUDA device"
    if devices.available():  # no GPU or no CuPy on this machine: the module's own words follow
        assert set(devices.available()) <= set(reasons)
        assert any("CuPy" in r or "CUDA" in r for r in devices.available())
    assert why_not(Q, Q, Q)["reference"] == []


def test_cuda_reasons_carry_the_kernels_limits():
    q = Q.astype(np.float64)
    assert set(devices.reasons("float64", 16)) <= set(why_not(q, q, q)["cuda"])
    # The backward asks the same questions of q, k, v as the forward.
    assert why_not(q, q, q, op="backward")["cuda"] == why_not(q, q, q)["cuda"]


def test_cuda_module_missing(monkeypatch):
    monkeypatch.delattr(cusparseattn, "cuda", raising=False)
    monkeypatch.setitem(sys.modules, "cusparseattn.cuda", None)  # the import fails as if the file were absent
    assert why_not(Q, Q, Q)["cuda"] == ["the CUDA kernels are not built into this version"]
    assert backends.BACKENDS["cuda"].available() == ["the CUDA kernels are not built into this version"]


def test_available_says_what_holds_for_any_inputs():
    assert backends.BACKENDS["cuda"].available() == devices.available()
    assert backends.BACKENDS["reference"].available() == []


def test_forcing_a_backend_that_cannot_run_lists_inputs_and_reasons():
    with pytest.raises(ValueError) as info:
        select(inputs_of(), "forward", "cuda")
    message = str(info.value)
    assert message.startswith(
        "backend 'cuda' cannot run the forward for q float32 [1, 2, 40, 16] (numpy, cpu)"
    )
    for reason in why_not(Q, Q, Q)["cuda"]:
        assert f"\n  - {reason}" in message


def test_forcing_the_reference_runs_it():
    out = cusparseattn.attention(Q, Q, Q, backend="reference")
    np.testing.assert_array_equal(out, reference.forward(Q, Q, Q, call.default_pattern(False).layout(40))[0])


def test_forcing_by_object_and_a_disabled_backend():
    ref = backends.BACKENDS["reference"]
    assert select(inputs_of(), "forward", ref) is ref
    with use_backends("cuda"):  # forcing does not ask use_backends: only whether the backend can run
        assert select(inputs_of(), "forward", "reference") is ref


@pytest.mark.parametrize(
    ("backend", "error", "message"),
    [
        ("flash", ValueError, "backend must be one of 'cuda', 'reference', 'flex', 'sdpa', got 'flash'"),
        (3, TypeError, "a backend is named by a string or a registered Backend, got builtins.int"),
        (
            Always("stray"),
            ValueError,
            "<backend 'stray'> is not registered: pass it to register_backend first",
        ),
    ],
)
def test_forcing_an_unknown_backend(backend, error, message):
    with pytest.raises(error, match=message):
        select(inputs_of(), "forward", backend)


@pytest.mark.parametrize("op", ["sideways", "Forward"])
def test_unknown_op(op):
    with pytest.raises(ValueError, match="op must be 'forward' or 'backward'"):
        select(inputs_of(), op)
    with pytest.raises(ValueError, match="op must be 'forward' or 'backward'"):
        why_not(Q, Q, Q, op=op)
    with pytest.raises(ValueError, match="op must be 'forward' or 'backward'"):
        current_backend(Q, Q, Q, op=op)


def test_why_not_covers_every_backend_in_priority_order():
    assert list(why_not(Q, Q, Q)) == DEFAULT
    with use_backends("sdpa", "reference", set_priority=True):
        assert list(why_not(Q, Q, Q)) == ["sdpa", "reference", "cuda", "flex"]


# ---- use_backends --------------------------------------------------------------------------------------


def test_use_backends_restricts_and_restores():
    with use_backends("reference"):
        assert list_backends() == ["reference"]
        assert why_not(Q, Q, Q)["cuda"][-1] == "disabled by use_backends('reference')"
        with use_backends("cuda", "reference"):
            assert list_backends() == ["cuda", "reference"]
        assert list_backends() == ["reference"]
    assert list_backends() == DEFAULT


def test_use_backends_keeps_the_priority_order_unless_told():
    with use_backends("sdpa", "reference", "cuda"):
        assert list_backends() == ["cuda", "reference", "sdpa"]
    with use_backends("sdpa", "reference", "cuda", set_priority=True):
        assert list_backends() == ["sdpa", "reference", "cuda"]
        assert why_not(Q, Q, Q)["flex"][-1] == (
            "disabled by use_backends('sdpa', 'reference', 'cuda', set_priority=True)"
        )
        # An inner block without set_priority keeps the enclosing block's order.
        with use_backends("cuda", "sdpa"):
            assert list_backends() == ["sdpa", "cuda"]
        # One with set_priority puts its names first, the others after them in the enclosing order.
        with use_backends("reference", set_priority=True):
            assert list_backends() == ["reference"]
            assert list(why_not(Q, Q, Q)) == ["reference", "sdpa", "cuda", "flex"]
        assert list_backends() == ["sdpa", "reference", "cuda"]


def test_use_backends_takes_backend_objects_and_ignores_repeats():
    ref = backends.BACKENDS["reference"]
    with use_backends(ref, "cuda", ref):
        assert list_backends() == ["cuda", "reference"]


def test_use_backends_restores_after_an_error():
    with pytest.raises(RuntimeError, match="inside"), use_backends("reference"):
        with use_backends("cuda"):
            raise RuntimeError("inside")
    assert list_backends() == DEFAULT
    with use_backends("sdpa"):
        with pytest.raises(RuntimeError, match="inside"), use_backends("cuda", set_priority=True):
            raise RuntimeError("inside")
        assert list_backends() == ["sdpa"]


def test_no_enabled_backend_raises_with_every_reason():
    with use_backends("cuda"), pytest.raises(ValueError) as info:
        cusparseattn.attention(Q, Q, Q)
    message = str(info.value)
    assert message.startswith("no enabled backend can run the forward for q float32 [1, 2, 40, 16]")
    assert "\n  cuda: the inputs are on cpu, not on a CUDA device" in message
    with use_backends("cuda"), pytest.raises(ValueError, match="no enabled backend can run the backward"):
        current_backend(Q, Q, Q, op="backward")


def test_when_every_enabled_backend_is_gone():
    register_backend(Always("mine"))
    with use_backends("mine"):
        unregister_backend("mine")
        assert list_backends() == []
        with pytest.raises(ValueError, match=r": none is enabled \(use_backends\('mine'\)\)$"):
            select(inputs_of(), "forward")


def test_use_backends_is_per_thread():
    seen = []
    with use_backends("reference"):
        thread = threading.Thread(target=lambda: seen.append(list_backends()))
        thread.start()
        thread.join()
    assert seen == [DEFAULT]


def test_two_threads_in_different_blocks_at_once():
    barrier = threading.Barrier(2, timeout=30)
    seen: dict[str, list] = {"a": [], "b": []}

    def worker(key, names, set_priority):
        barrier.wait()
        with use_backends(*names, set_priority=set_priority):
            barrier.wait()  # both blocks are open now
            seen[key].append(list_backends())
            seen[key].append(current_backend(Q, Q, Q))
            barrier.wait()
        barrier.wait()  # both blocks are closed now
        seen[key].append(list_backends())

    threads = [
        threading.Thread(target=worker, args=("a", ("reference",), False)),
        threading.Thread(target=worker, args=("b", ("sdpa", "cuda", "reference"), True)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] == [["reference"], "reference", DEFAULT]
    assert seen["b"] == [["sdpa", "cuda", "reference"], "reference", DEFAULT]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ((), "use_backends needs a backend name"),
        (("cuda", "flash"), "backend must be one of 'cuda', 'reference', 'flex', 'sdpa', got 'flash'"),
    ],
)
def test_use_backends_rejects_bad_names(names, message):
    with pytest.raises(ValueError, match=message), use_backends(*names):
        pass
    assert list_backends() == DEFAULT


# ---- activate_backend ----------------------------------------------------------------------------------


def test_activate_backend_sets_the_process_default_and_returns_the_previous():
    assert activate_backend("reference") == ()
    assert list_backends() == ["reference"]
    assert why_not(Q, Q, Q)["cuda"][-1] == "disabled by activate_backend('reference')"
    seen = []
    thread = threading.Thread(target=lambda: seen.append(list_backends()))  # every thread sees it
    thread.start()
    thread.join()
    assert seen == [["reference"]]
    with use_backends("cuda"):  # a block overrides it in its thread
        assert list_backends() == ["cuda"]
    previous = activate_backend("sdpa", "cuda", set_priority=True)
    assert previous == ("reference",)
    assert list_backends() == ["sdpa", "cuda"]
    with use_backends("cuda", "reference", "sdpa"):  # blocks keep the default's priority order
        assert list_backends() == ["sdpa", "cuda", "reference"]
    assert activate_backend(*previous, set_priority=True) == ("sdpa", "cuda")
    assert list_backends() == ["reference"]
    assert activate_backend() == ("reference",)  # no names: the initial state again
    assert list_backends() == DEFAULT


def test_activate_backend_without_set_priority_keeps_the_order():
    activate_backend("sdpa", "reference", set_priority=True)
    activate_backend("reference", "cuda", "sdpa")
    assert list_backends() == ["sdpa", "reference", "cuda"]


def test_activate_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must be one of .*, got 'flash'"):
        activate_backend("reference", "flash")
    assert list_backends() == DEFAULT


# ---- register_backend ----------------------------------------------------------------------------------


def test_register_backend_places_it_and_selection_uses_it():
    mine = register_backend(Always("mine"), priority=0)
    assert list(backends.BACKENDS) == ["mine", *DEFAULT]
    assert list_backends()[0] == "mine" and current_backend(Q, Q, Q) == "mine"
    out = cusparseattn.attention(Q, Q, Q)  # it runs the call: the reference's code, under its name
    np.testing.assert_array_equal(out, cusparseattn.attention(Q, Q, Q, backend="reference"))
    register_backend(Always("middle"), priority=2)
    register_backend(Always("last"))
    assert list(backends.BACKENDS) == ["mine", "cuda", "middle", "reference", "flex", "sdpa", "last"]
    assert unregister_backend("mine") is mine
    assert current_backend(Q, Q, Q) == "middle"


def test_a_backend_registered_after_activate_joins_once_named():
    activate_backend("cuda", "reference")
    register_backend(Always("mine"), priority=0)
    assert list_backends() == ["cuda", "reference"]
    assert why_not(Q, Q, Q)["mine"] == ["disabled by activate_backend('cuda', 'reference')"]
    with use_backends("mine", "reference"):
        assert list_backends() == ["mine", "reference"]


@pytest.mark.parametrize(
    ("backend", "priority", "error", "message"),
    [
        ("reference", None, TypeError, "backend must be an instance of a Backend subclass, got builtins.str"),
        (ReferenceBackend, None, TypeError, "got builtins.type"),
        (Always(""), None, ValueError, "backend.name must be a non-empty string, got ''"),
        (Always(None), None, ValueError, "backend.name must be a non-empty string, got None"),
        (Always("reference"), None, ValueError, "a backend named 'reference' is registered already"),
        (Always("mine"), -1, ValueError, r"priority must be None \(last\) or a place 0, 1, ... in the order"),
        (Always("mine"), 1.5, ValueError, "priority must be None"),
        (Always("mine"), True, ValueError, "priority must be None"),
    ],
)
def test_register_backend_errors(backend, priority, error, message):
    with pytest.raises(error, match=message):
        register_backend(backend, priority=priority)
    assert list(backends.BACKENDS) == DEFAULT


def test_unregister_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of .*, got 'mine'"):
        unregister_backend("mine")


def test_the_registry_is_read_only():
    with pytest.raises(TypeError):
        backends.BACKENDS["mine"] = Always("mine")


# ---- score mods ----------------------------------------------------------------------------------------


SOFTCAP = mods.score_mod(mods.softcap(30.0))


def test_inputs_carry_and_describe_the_score_mod():
    base = inputs_of()
    inputs = Inputs(base.q, base.k, base.v, base.layout, base.scale, score_mod=SOFTCAP)
    assert "; score_mod softcap_mod; layout BlockLayout(" in inputs.describe()
    assert "score_mod" not in base.describe()
    assert call.score_mod_name(type("M", (), {"fn": staticmethod(lambda s, b, h, q, k: s)})()) == "<lambda>"
    assert call.score_mod_name(object()) == "object"


def test_the_reference_backend_passes_the_score_mod_on(monkeypatch):
    calls = []

    def spy(name, result):
        def record(*args, **kwargs):
            calls.append((name, kwargs["score_mod"]))
            return result(*args)

        return record

    mod = SOFTCAP
    layout = call.default_pattern(False).layout(40)
    want_out, want_lse = reference.forward(Q, Q, Q, layout)
    monkeypatch.setattr(reference, "forward", spy("forward", lambda *a: (want_out, want_lse)))
    monkeypatch.setattr(reference, "backward", spy("backward", lambda *a: (Q, Q, Q)))
    base = inputs_of()
    ref = backends.BACKENDS["reference"]
    out, lse = ref.forward(Inputs(base.q, base.k, base.v, layout, base.scale, score_mod=mod))
    held = {name: NumpyTensor(x, name) for name, x in (("dout", Q), ("out", want_out), ("lse", want_lse))}
    ref.backward(Inputs(base.q, base.k, base.v, layout, base.scale, score_mod=mod, **held))
    assert calls == [("forward", mod), ("backward", mod)]
    np.testing.assert_array_equal(out.native, want_out)


def test_why_not_and_current_backend_take_a_score_mod():
    def bias(score, b, h, q_idx, kv_idx):  # traced on the way in, as in cusparseattn.attention
        return score + 1

    assert why_not(Q, Q, Q, score_mod=bias)["sdpa"][-1] == "SDPA takes no score_mod"
    assert why_not(Q, Q, Q, score_mod=SOFTCAP)["sdpa"][-1] == "SDPA takes no score_mod"
    with use_backends("sdpa", "reference", set_priority=True):
        assert current_backend(Q, Q, Q, score_mod=bias) == "reference"
    with pytest.raises(TypeError, match="score_mod"):
        why_not(Q, Q, Q, score_mod=lambda score, b, h, q_idx, kv_idx: float(score))


# ---- the fallback warning -------------------------------------------------------------------------------


class OnGpu(NumpyTensor):
    """A NumPy array that claims to live on a GPU: the selection logic cannot tell (no GPU here)."""

    device = property(lambda self: ("cuda", 0))


Q16 = Q.astype(np.float16)  # a dtype and head dim that the kernels take: only the missing GPU stops them


def gpu_inputs():
    base = inputs_of()
    return Inputs(OnGpu(Q16, "q"), OnGpu(Q16, "k"), OnGpu(Q16, "v"), base.layout, base.scale)


def test_gpu_inputs_fall_back_with_one_warning_per_reason(monkeypatch):
    monkeypatch.setattr(devices, "available", lambda: ["no CUDA GPU is visible"])
    with pytest.warns(RuntimeWarning) as record:
        chosen = select(gpu_inputs(), "forward")
    assert chosen.name == "reference"
    assert [str(w.message) for w in record] == [
        "cusparseattn: running the NumPy reference on the host because cuda: no CUDA GPU is visible"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(gpu_inputs(), "forward")  # the same reasons again: no second warning
        select(gpu_inputs(), "backward")
    monkeypatch.setattr(devices, "available", lambda: ["CuPy is not installed"])
    with pytest.warns(RuntimeWarning, match="because cuda: CuPy is not installed$"):
        select(gpu_inputs(), "forward")  # another reason: warned once more
    out, lse = chosen.forward(gpu_inputs())
    np.testing.assert_array_equal(out.native, reference.forward(Q16, Q16, Q16, gpu_inputs().layout)[0])


def test_the_warning_names_every_backend_passed_over(monkeypatch):
    monkeypatch.setattr(devices, "available", lambda: ["no CUDA GPU is visible"])
    register_backend(Never("fast", "it is too tired"), priority=0)
    with pytest.warns(RuntimeWarning) as record:
        select(gpu_inputs(), "forward")
    assert str(record[0].message) == (
        "cusparseattn: running the NumPy reference on the host because fast: it is too tired. "
        "cuda: no CUDA GPU is visible"
    )


def test_any_slow_backend_warns_when_faster_ones_cannot_run():
    register_backend(Never("fast", "it needs a TPU"), priority=0)
    register_backend(Always("slow", slow="the slow path"), priority=1)
    with pytest.warns(
        RuntimeWarning, match="^cusparseattn: running the slow path because fast: it needs a TPU$"
    ):
        assert select(inputs_of(), "forward").name == "slow"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_backends("slow"):  # nothing ahead of it: nothing to warn about
            select(inputs_of(), "forward")
        register_backend(Always("slow_but_not_here"), priority=0)  # its slow_path is None
        select(inputs_of(), "forward")


def test_no_warning_on_the_cpu_or_when_the_reference_is_asked_for():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(inputs_of(), "forward")
        select(gpu_inputs(), "forward", "reference")
        with use_backends("reference"):
            select(gpu_inputs(), "forward")
        current_backend(Q, Q, Q)


def test_fallback_warning_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(devices, "available", lambda: ["no CUDA GPU is visible"])
    with pytest.warns(RuntimeWarning) as record:
        select(gpu_inputs(), "forward")
    assert record[0].filename == __file__


class DeviceArrays(OnGpu):
    """A GPU holder whose "CuPy" view is an array_api_strict array, so that the reference's GPU branch runs
    here: any NumPy round trip (``numpy()``) fails the test."""

    def numpy(self):
        raise AssertionError(f"{self.name} was copied to the host")

    def cupy(self):
        return pytest.importorskip("array_api_strict").asarray(self.native)

    def from_cupy(self, arr):
        return DeviceArrays(np.asarray(arr), self.name)


def device_inputs(dtype=np.float32, **extra):
    """Q's inputs in ``dtype`` (and ``extra``: dout, out, lse) as `DeviceArrays`."""
    q = Q.astype(dtype)
    base = inputs_of(q)
    held = {name: DeviceArrays(x, name) for name, x in extra.items()}
    qkv = (DeviceArrays(q, name) for name in "qkv")
    return Inputs(*qkv, base.layout, base.scale, **held)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float32_and_float64_gpu_inputs_run_the_reference_on_the_gpu(monkeypatch, dtype):
    monkeypatch.setattr(devices, "available", lambda: ["no CUDA GPU is visible"])
    monkeypatch.setattr(native_backends, "_has_cupy", lambda: True)
    monkeypatch.setattr(native_backends, "cupy_stream", lambda holder: contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no copy to the host: nothing to warn about
        chosen = select(device_inputs(dtype), "forward")
    assert chosen.name == "reference"
    assert chosen.runs_on(device_inputs(dtype)) == "CuPy, on cuda:0"
    q = Q.astype(dtype)
    lay = device_inputs(dtype).layout
    want = reference.forward(q, q, q, lay, precision=dtype)
    got = chosen.forward(device_inputs(dtype))
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, DeviceArrays)
        np.testing.assert_array_equal(g.native, w)
    dout = np.ones_like(q)
    grads = chosen.backward(device_inputs(dtype, dout=dout, out=want[0], lse=want[1]))
    for g, w in zip(grads, reference.backward(dout, q, q, q, *want, lay, precision=dtype), strict=True):
        np.testing.assert_array_equal(g.native, w)


def test_gpu_inputs_go_to_host_copies_without_cupy_or_in_half_precision(monkeypatch):
    monkeypatch.setattr(devices, "available", lambda: ["no CUDA GPU is visible"])
    reference_backend = backends.BACKENDS["reference"]
    monkeypatch.setattr(native_backends, "_has_cupy", lambda: True)
    assert reference_backend.runs_on(gpu_inputs()) == "NumPy, on the host, copied from cuda:0 and back"
    monkeypatch.setattr(native_backends, "_has_cupy", lambda: False)
    f32 = Inputs(*(OnGpu(Q, name) for name in "qkv"), gpu_inputs().layout, gpu_inputs().scale)
    assert reference_backend.runs_on(f32) == "NumPy, on the host, copied from cuda:0 and back"
    with pytest.warns(RuntimeWarning, match="running the NumPy reference on the host because cuda: "):
        select(f32, "forward")
    assert reference_backend.runs_on(inputs_of()) == "NumPy, on the host"
    assert backends.runs_on(Q, Q, Q) == "reference (NumPy, on the host)"


def test_cuda_takes_positive_scales_only():
    assert devices.reasons("float16", 64, 0.5) == []
    for scale in (0.0, -1.0):
        assert devices.reasons("float16", 64, scale) == [
            f"the CUDA kernels take a positive scale, got {scale}"
        ]


def test_cuda_refuses_shapes_past_its_grids_axes(monkeypatch):
    assert devices.grid_reasons((65535, 16, 128, 64), (65535, 16, 128, 64), "bfloat16") == []
    assert devices.grid_reasons((65536, 2, 128, 64), (65536, 2, 128, 64), "bfloat16") == [
        "the CUDA kernels take at most 65535 batch elements (a grid axis), got 65536"
    ]
    # float32's copy pass lays every head of K, Q and dO along one axis (30000 + 2 * 30000 blocks).
    assert devices.grid_reasons((1, 30000, 128, 64), (1, 30000, 128, 64), "float16") == []
    assert devices.grid_reasons((1, 30000, 128, 64), (1, 30000, 128, 64), "float32") == [
        "the CUDA kernels' grids take at most 65535 blocks along the axis of heads; 30000 query heads with "
        "30000 key/value heads of float32 take 90000"
    ]
    # A dynamic layout's builder lays every (batch element, query head) along one axis.
    assert devices.grid_reasons((4096, 16, 128, 64), (4096, 16, 128, 64), "bfloat16") == []
    assert devices.grid_reasons((4096, 16, 128, 64), (4096, 16, 128, 64), "bfloat16", dynamic=True) == [
        "a dynamic layout's tables take at most 65535 (batch element, query head) pairs (a grid axis), got "
        "4096 x 16"
    ]
    # The Hopper forward in half precision is persistent: any batch.
    assert devices.grid_reasons((65536, 2, 128, 64), (65536, 2, 128, 64), "bfloat16", persistent=True) == []
    for name in ("available", "device_reasons", "tensor_reasons"):
        monkeypatch.setattr(devices, name, lambda *_: [])
    big = np.broadcast_to(Q16[:1], (65536, *Q16.shape[1:]))  # no memory behind the batch axis
    base = inputs_of()
    inputs = Inputs(*(OnGpu(big, name) for name in "qkv"), base.layout, base.scale)
    too_many = ["the CUDA kernels take at most 65535 batch elements (a grid axis), got 65536"]
    # A GPU without the Hopper kernels, then one with them: the forward takes any batch there (head dim 16 is
    # not one of theirs, so the reasons stand until they say it is).
    monkeypatch.setattr(devices, "hopper_device_reasons", lambda device: ["not a Hopper GPU"])
    assert backends.BACKENDS["cuda"].not_supported_reasons(inputs, "forward") == too_many
    monkeypatch.setattr(devices, "hopper_device_reasons", lambda device: [])
    assert backends.BACKENDS["cuda"].not_supported_reasons(inputs, "forward") == too_many
    monkeypatch.setattr(devices, "hopper_reasons", lambda *arrays, precision: [])
    assert backends.BACKENDS["cuda"].not_supported_reasons(inputs, "forward") == []
    assert backends.BACKENDS["cuda"].not_supported_reasons(inputs, "backward") == too_many


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_is_chosen_for_supported_gpu_inputs():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
    assert why_not(q, q, q)["cuda"] == []
    assert select(inputs_of(q), "forward").name == "cuda" == current_backend(q, q, q)
    assert why_not(q, q, q, op="backward")["cuda"] == []
    assert select(inputs_of(q), "backward").name == "cuda" == current_backend(q, q, q, op="backward")
