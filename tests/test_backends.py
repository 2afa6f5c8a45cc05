"""Backend selection: priorities, forcing, reasons, the use_backends context and the fallback warning."""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np
import pytest

import cusparseattn
from cusparseattn import api, backends, cuda, reference
from cusparseattn.arrays import NumpyTensor
from cusparseattn.backends import Inputs, list_backends, select, use_backends, why_not

Q = np.random.default_rng(0).standard_normal((1, 2, 40, 16)).astype(np.float32)


def inputs_of(q=Q, **kwargs):
    return api._prepare(q, q, q, None, causal=False, scale=None, **kwargs)


def test_list_backends_in_priority_order():
    assert list_backends() == ["cuda", "reference"] == list(backends.BACKENDS)


def test_reference_is_chosen_on_the_cpu():
    assert select(inputs_of(), "forward").name == "reference"
    assert select(inputs_of(), "backward").name == "reference"


def test_cuda_reasons_here_say_why():
    reasons = why_not(Q, Q, Q)["cuda"]
    assert reasons[0] == "the inputs are on cpu, not on a CUDA device"
    if cuda.available():  # no GPU or no CuPy on this machine: the module's own words follow
        assert set(cuda.available()) <= set(reasons)
        assert any("CuPy" in r or "CUDA" in r for r in cuda.available())
    assert why_not(Q, Q, Q)["reference"] == []


def test_cuda_reasons_carry_the_kernels_limits():
    q = Q.astype(np.float64)
    assert set(cuda.reasons("float64", 16)) <= set(why_not(q, q, q)["cuda"])
    # The backward asks the same questions of q, k, v as the forward.
    assert why_not(q, q, q, op="backward")["cuda"] == why_not(q, q, q)["cuda"]


def test_cuda_module_missing(monkeypatch):
    monkeypatch.delattr(cusparseattn, "cuda", raising=False)
    monkeypatch.setitem(sys.modules, "cusparseattn.cuda", None)  # the import fails as if the file were absent
    assert why_not(Q, Q, Q)["cuda"] == ["the CUDA kernels are not built into this version"]


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
    np.testing.assert_array_equal(out, reference.forward(Q, Q, Q, api._default_pattern(False).layout(40))[0])


@pytest.mark.parametrize("op", ["sideways", "Forward"])
def test_unknown_op(op):
    with pytest.raises(ValueError, match="op must be 'forward' or 'backward'"):
        select(inputs_of(), op)
    with pytest.raises(ValueError, match="op must be 'forward' or 'backward'"):
        why_not(Q, Q, Q, op=op)


# ---- use_backends --------------------------------------------------------------------------------------


def test_use_backends_restricts_and_restores():
    with use_backends("reference"):
        assert list_backends() == ["reference"]
        assert why_not(Q, Q, Q)["cuda"][-1] == "disabled by use_backends('reference')"
        with use_backends("cuda", "reference"):
            assert list_backends() == ["cuda", "reference"]
        assert list_backends() == ["reference"]
    assert list_backends() == ["cuda", "reference"]


def test_use_backends_restores_after_an_error():
    with pytest.raises(RuntimeError, match="inside"), use_backends("reference"):
        raise RuntimeError("inside")
    assert list_backends() == ["cuda", "reference"]


def test_no_enabled_backend_raises_with_every_reason():
    with use_backends("cuda"), pytest.raises(ValueError) as info:
        cusparseattn.attention(Q, Q, Q)
    message = str(info.value)
    assert message.startswith("no enabled backend can run the forward for q float32 [1, 2, 40, 16]")
    assert "\n  cuda: the inputs are on cpu, not on a CUDA device" in message


def test_use_backends_is_per_thread():
    seen = []
    with use_backends("reference"):
        thread = threading.Thread(target=lambda: seen.append(list_backends()))
        thread.start()
        thread.join()
    assert seen == [["cuda", "reference"]]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ((), "use_backends needs a backend name"),
        (("cuda", "flash"), "backend must be one of 'cuda', 'reference'"),
    ],
)
def test_use_backends_rejects_bad_names(names, message):
    with pytest.raises(ValueError, match=message), use_backends(*names):
        pass


# ---- the fallback warning -------------------------------------------------------------------------------


class OnGpu(NumpyTensor):
    """A NumPy array that claims to live on a GPU: the selection logic cannot tell (no GPU here)."""

    device = property(lambda self: ("cuda", 0))


Q16 = Q.astype(np.float16)  # a dtype and head dim that the kernels take: only the missing GPU stops them


def gpu_inputs():
    base = inputs_of()
    return Inputs(OnGpu(Q16, "q"), OnGpu(Q16, "k"), OnGpu(Q16, "v"), base.layout, base.scale)


def test_gpu_inputs_fall_back_with_one_warning_per_reason(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(cuda, "available", lambda: ["no CUDA GPU is visible"])
    with pytest.warns(RuntimeWarning) as record:
        chosen = select(gpu_inputs(), "forward")
    assert chosen.name == "reference"
    assert [str(w.message) for w in record] == [
        "cusparseattn: running the NumPy reference on the host because cuda: no CUDA GPU is visible"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(gpu_inputs(), "forward")  # the same reasons again: no second warning
    out, lse = chosen.forward(gpu_inputs())
    np.testing.assert_array_equal(out.native, reference.forward(Q16, Q16, Q16, gpu_inputs().layout)[0])


def test_no_warning_on_the_cpu_or_when_the_reference_is_asked_for(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(inputs_of(), "forward")
        select(gpu_inputs(), "forward", "reference")
        with use_backends("reference"):
            select(gpu_inputs(), "forward")


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_is_chosen_for_supported_gpu_inputs():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
    assert why_not(q, q, q)["cuda"] == []
    assert select(inputs_of(q), "forward").name == "cuda"
    assert why_not(q, q, q, op="backward")["cuda"] == []
    assert select(inputs_of(q), "backward").name == "cuda"


def test_fallback_warning_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(cuda, "available", lambda: ["no CUDA GPU is visible"])
    with pytest.warns(RuntimeWarning) as record:
        select(gpu_inputs(), "forward")
    assert record[0].filename == __file__


def test_cuda_takes_positive_scales_only():
    assert cuda.reasons("float16", 64, 0.5) == []
    for scale in (0.0, -1.0):
        assert cuda.reasons("float16", 64, scale) == [f"the CUDA kernels take a positive scale, got {scale}"]
