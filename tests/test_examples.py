"""The scripts outside the package run on a CPU: the training example learns with the NumPy reference, and the
benchmark's command line answers without a GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_tiny():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    # Tiny matrices: one thread, or torch's and NumPy's thread pools (the reference) fight over the cores.
    torch.set_num_threads(1)
    yield _load(ROOT / "examples" / "train_tiny.py")
    torch.set_num_threads(before)


def test_train_tiny_learns_on_cpu(train_tiny, tmp_path, capsys):
    result = train_tiny.main(["--device", "cpu", "--steps", "30", "--out", str(tmp_path)])
    assert result["device"] == "cpu" and result["config"]["window"] < result["config"]["seq"]
    for kind in ("sparse", "dense"):
        losses = result[kind]
        assert len(losses) == 30 and all(math.isfinite(x) for x in losses), losses
        # From about ln(16) = 2.8 at the start; the copy is found within some 20 steps.
        assert sum(losses[-4:]) / 4 < 0.7 * losses[0], losses
    # Same seed, same weights, same batch; the window hides little at the start, when attention is uniform.
    assert result["sparse"][0] == pytest.approx(result["dense"][0], rel=0.01)
    assert json.loads((tmp_path / "train_tiny.json").read_text())["sparse"] == result["sparse"]
    assert "final loss" in capsys.readouterr().out
    image = pytest.importorskip("PIL.Image", reason="the plot extra (Pillow) draws the plot")
    with image.open(tmp_path / "train_tiny.png") as img:
        assert img.size == train_tiny.PLOT_SIZE
        # Both curves are drawn in their colours.
        colours = {colour for _, colour in img.convert("RGB").getcolors(maxcolors=1 << 16)}
        assert {train_tiny.COLOURS["sparse"], train_tiny.COLOURS["dense"]} <= colours


def test_train_tiny_learns_with_the_layout_moba_chooses_each_step(train_tiny):
    result = train_tiny.main(["--device", "cpu", "--steps", "30", "--attention", "moba"])
    losses = result["sparse"]
    assert result["attention"] == "moba" and "MoBA" in result["labels"]["sparse"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-4:]) / 4 < 0.7 * losses[0], losses


def test_train_tiny_full_window_matches_dense(train_tiny):
    # A window as long as the sequence is plain causal attention: the two runs must coincide step by step.
    result = train_tiny.main(["--device", "cpu", "--steps", "6", "--window", "64"])
    assert result["config"]["window"] == result["config"]["seq"]
    assert result["sparse"] == pytest.approx(result["dense"], rel=1e-4)
    assert result["sparse"][0] == pytest.approx(result["dense"][0], rel=1e-6)


def test_train_tiny_batches_repeat_with_their_seed(train_tiny):
    cfg = train_tiny.CPU
    first, again = train_tiny.batches(cfg, "cpu"), train_tiny.batches(cfg, "cpu")
    for _ in range(2):
        (x1, y1), (x2, y2) = next(first), next(again)
        assert (x1 == x2).all() and (y1 == y2).all()
    x, y = next(first)
    assert x.shape == y.shape == (cfg.batch, cfg.seq) and (x[:, 1:] == y[:, :-1]).all()
    # Most tokens copy the one a period back; a fraction `mutation` is drawn afresh.
    copies = (x[:, cfg.period :] == x[:, : -cfg.period]).float().mean().item()
    assert abs(copies - (1 - cfg.mutation + cfg.mutation / cfg.vocab)) < 0.05
    assert 0 < train_tiny.loss_floor(cfg) < math.log(cfg.vocab)


def test_bench_help_runs_without_gpu():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--cases" in done.stdout and "train-memory" in done.stdout


def test_bench_without_a_gpu_says_so_in_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the benchmark would run")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"benchmarks/bench.py needs a CUDA GPU; PyTorch {torch.__version__} sees none "
        "(torch.cuda.is_available() is False)"
    ]


def test_bench_options_and_table(capsys):
    bench = _load(ROOT / "benchmarks" / "bench.py")
    for wrong in (["--cases", "dense,nonsense"], ["--dtype", "float64"]):
        with pytest.raises(SystemExit):
            bench.main(wrong)
    assert "precision" in bench.PARTS and "float32" in bench.DTYPES
    rows = [
        {
            "case": "causal",
            "S": 4096,
            "D": 128,
            "density": 0.516,
            "fwd": {"cusparseattn": 300.0, "flex": 350.0},
            "fwdbwd": {"flex": 334.0},
        }
    ]
    assert bench._ratio(rows[0], "fwd") == pytest.approx(300 / 350)
    assert math.isnan(bench._ratio(rows[0], "fwdbwd"))
    bench.summary(rows)
    line = capsys.readouterr().out.splitlines()[-1].split()
    # case, S, D, "|", one figure per peer, then ours / Flex.
    assert line[:3] == ["causal", "4096", "128"] and line[4 + len(bench.PEERS)] == "0.86" and line[-1] == "-"


def test_bench_times_peers_in_turn(capsys):
    bench = _load(ROOT / "benchmarks" / "bench.py")
    calls = []
    ms = {"ours": iter([9.0, 2.0, 4.0, 1.0]), "peer": iter([9.0, 1.0, 3.0, 2.0]), "broken": None}

    def time_ms(name, fn):
        calls.append(name)
        if ms[name] is None:
            raise RuntimeError("no kernel")
        return next(ms[name])

    medians, each = bench._in_turn(dict.fromkeys(ms), time_ms, 1e9, 3, "failed on case")
    # A first untimed call each (compiling), then the peers in turn; the broken one is tried once.
    assert calls == ["ours", "ours", "peer", "peer", "broken", "ours", "peer", "ours", "peer"]
    assert each == {"ours": [0.5, 0.25, 1.0], "peer": [1.0, 1 / 3, 0.5]}
    assert medians == {"ours": 0.5, "peer": 0.5}
    assert "broken failed on case: no kernel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])


def test_bench_peers_option():
    bench = _load(ROOT / "benchmarks" / "bench.py")
    with pytest.raises(SystemExit):
        bench.main(["--peers", "cusparseattn,nobody"])


def test_ab_compares_medians_of_alternating_runs(tmp_path, capsys):
    ab = _load(ROOT / "benchmarks" / "ab.py")

    def run(ours, flex):
        row = {
            "case": "causal",
            "S": 4096,
            "D": 64,
            "fwd": {"cusparseattn": ours, "flex": flex},
            "fwdbwd": {},
        }
        return {"cases": [row]}

    old, new = [run(100.0, 50.0), run(110.0, 52.0), run(90.0, 51.0)], [run(120.0, 50.0), run(99.0, 49.0)]
    lines = ab.table(old, new)
    assert len(lines) == 2 and lines[0].split()[:5] == ["fwd", "causal", "S=", "4096", "D="]
    ours = next(line for line in lines if "cusparseattn" in line)
    assert "old  100.0  110.0   90.0 | new  120.0   99.0" in ours and ours.endswith(f"x{109.5 / 100:.3f}")
    bad = (["--help"], [str(tmp_path)], [str(ROOT), "--only", "cases"], [str(ROOT), "--rounds", "0"])
    for argv in (*bad, [str(ROOT), "--new-env", "CUSPARSEATTN_FUSED_BACKWARD"]):
        with pytest.raises(SystemExit):
            ab.main(argv)
    err = capsys.readouterr().err
    assert "a tree must hold cusparseattn/ and kernels/" in err
    assert "an environment setting is NAME=VALUE, got 'CUSPARSEATTN_FUSED_BACKWARD'" in err


def test_ab_sets_each_sides_environment(monkeypatch, tmp_path, capsys):
    """--old-env and --new-env reach only their side's bench.py runs, which alternate in order."""
    ab = _load(ROOT / "benchmarks" / "ab.py")
    seen = []

    def fake_run(cmd, env, cwd):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        row = {"case": "dense", "S": 4096, "D": 128, "fwd": {"cusparseattn": 1.0}, "fwdbwd": {}}
        (out / "bench.json").write_text(json.dumps({"cases": [row]}))
        seen.append((out.name, env.get("CUSPARSEATTN_FUSED_BACKWARD"), env.get("X")))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    argv = [str(ROOT), str(ROOT), "--new-env", "CUSPARSEATTN_FUSED_BACKWARD=1", "--new-env", "X=a=b"]
    assert ab.main([*argv, "--old-env", "X=", "--out", str(tmp_path)]) == 0
    assert seen == [("old-0", None, ""), ("new-0", "1", "a=b"), ("new-1", "1", "a=b"), ("old-1", None, "")]
    assert "x1.000" in capsys.readouterr().out


def test_ab_rotates_several_new_trees_and_compares_each_with_the_old(monkeypatch, tmp_path, capsys):
    ab = _load(ROOT / "benchmarks" / "ab.py")
    seen, speed = [], {}

    def fake_run(cmd, env, cwd):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        label = out.name.split("-")[0]
        row = {"case": "dense", "S": 4096, "D": 64, "fwd": {"cusparseattn": speed[label]}, "fwdbwd": {}}
        (out / "bench.json").write_text(json.dumps({"cases": [row]}))
        seen.append((out.name, env.get("X")))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    speed.update(old=100.0, new1=110.0, new2=90.0)
    argv = [str(ROOT), str(ROOT), str(ROOT), "--rounds", "3", "--new-env", "X=1", "--out", str(tmp_path)]
    assert ab.main(argv) == 0
    # Each round starts one tree further along; the new trees' runs get --new-env.
    names = [name for name, _ in seen]
    assert names == ["old-0", "new1-0", "new2-0", "new1-1", "new2-1", "old-1", "new2-2", "old-2", "new1-2"]
    assert all((x == "1") == name.startswith("new") for name, x in seen)
    lines = capsys.readouterr().out.splitlines()[-2:]
    assert "| new1  110.0  110.0  110.0 | x1.100" in lines[0] and lines[1].endswith("| x0.900")


def test_host_time_wraps_every_stage_and_puts_it_back():
    """The host-time breakdown names stages by path: a renamed stage fails here, not on the GPU machine."""
    pytest.importorskip("torch")
    import collections

    from cusparseattn import backends, call, launches, native_backends

    host_time = _load(ROOT / "benchmarks" / "host_time.py")
    backward = native_backends.CudaBackend.backward
    before = (call.prepare, backends.select, backward, launches.Bound.launch)
    totals = collections.defaultdict(float)
    saved = host_time.instrument(totals)
    assert len(saved) == len(host_time.STAGES) and call.prepare is not before[0]
    q = np.ones((1, 1, 8, 4))
    call.prepare(q, q, q, None, causal=True, scale=None)
    host_time.restore(saved)
    assert set(totals) == {"call.prepare"} and totals["call.prepare"] > 0
    after = (call.prepare, backends.select, native_backends.CudaBackend.backward, launches.Bound.launch)
    assert after == before


@pytest.mark.parametrize("seq", [4096, 16384])
def test_bench_mask_spellings_reach_the_kernels_as_their_patterns(seq):
    """bench.py's "mask" peer: each case as the mask function Flex gets (documents from a captured tensor of
    ids) gives its built-in pattern's blocks, and inside partial tiles a rule the kernels take as they take
    the pattern's: a band of keys where the pattern has one, in 32-bit arithmetic."""
    from cusparseattn import patterns

    bench = _load(ROOT / "benchmarks" / "bench.py")
    assert bench.token_rule("dense", seq) is None  # Flex and the mask peer take dense without a mask
    for case in ("causal", "local1024", "strided8", "documents"):
        spelled = patterns.from_mask(bench.token_rule(case, seq), block=128).layout(seq)
        built_in = bench.pattern(case, seq).layout(seq)
        assert np.array_equal(spelled.blocks, built_in.blocks), case
        assert np.array_equal(spelled.partial, built_in.partial), case
        mine, theirs = spelled.rule.kernel, built_in.rule.kernel
        assert (mine.key_band is None) == (theirs.key_band is None) == (case == "documents"), case
        assert spelled.rule.narrow(seq) and built_in.rule.narrow(seq), case
