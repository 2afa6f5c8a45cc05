"""benchmarks/paths.py's --smoke mode on the CPU: every path runs on the reference or says why it cannot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paths():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    spec = importlib.util.spec_from_file_location("_bench_paths", ROOT / "benchmarks" / "paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_runs_every_path_or_says_why(paths, tmp_path, capsys):
    # compile-train left out: Inductor's C++ build of the loss on the CPU takes some 20 s.
    chosen = [p for p in paths.PATHS if p != "compile-train"]
    out = tmp_path / "paths.json"
    rows = paths.main(["--smoke", "--cases", "causal", "--paths", ",".join(chosen), "--json", str(out)])
    assert [r["path"] for r in rows] == chosen
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r.get("traceback")
        if r["status"] == "skipped":
            assert r["reason"]
            continue
        assert r["ms"] > 0 and r["host_ms"] > 0 and r["tflops"] > 0 and r["first_s"] > 0
        # Every path runs the same NumPy reference on the same inputs as its baseline.
        assert r["ratio"] > 0 and r["max_diff"] == 0, r
    by_path = {r["path"]: r for r in rows}
    assert by_path["cupy"]["status"] == "skipped" and "CPU" in by_path["cupy"]["reason"]
    assert {by_path[p]["status"] for p in ("eager", "compile", "jax", "eager-train", "jax-train")} == {"ok"}
    table = capsys.readouterr().out
    for path in chosen:
        assert f"| causal | 256 | 32 | 0.750 | {path} |" in table
    assert [r["path"] for r in json.loads(out.read_text())["rows"]] == chosen


def test_unknown_paths_are_refused(paths, capsys):
    with pytest.raises(SystemExit):
        paths.main(["--paths", "eager,sdpa"])
    assert "--paths must be a comma-separated subset" in capsys.readouterr().err


def test_floor_rows_follow_their_paths(paths):
    """--floor: each path's row is followed by its floor's, the same machinery around an operator that
    computes nothing: no ratio, no TFLOP/s (it does no attention), a host time of its own."""
    rows = paths.main(["--smoke", "--cases", "causal", "--paths", "eager,jax-train", "--floor"])
    assert [r["path"] for r in rows] == ["eager", "eager floor", "jax-train", "jax-train floor"]
    for r in rows:
        assert r["status"] == "ok", r.get("traceback")
        assert r["host_ms"] > 0
    floors = [r for r in rows if r["path"].endswith(" floor")]
    assert all("ratio" not in r and "tflops" not in r for r in floors)
    assert floors[1]["train"]
