"""Two versions of cusparseattn timed against each other: bench.py's cases, in alternating processes.

    git archive main cusparseattn kernels | tar -x -C /tmp/old      # the version to compare against
    python benchmarks/ab.py /tmp/old --cases causal,local1024 --seqs 4096 --no-backward
    python benchmarks/ab.py /tmp/old /tmp/new --rounds 3 --peers cusparseattn,flex
    python benchmarks/ab.py . . --old-env CUSPARSEATTN_FUSED_BACKWARD=0 --seqs 16384   # one tree, a switch

Each tree holds ``cusparseattn/`` and ``kernels/``; the second defaults to this checkout. A round runs this
checkout's bench.py once per tree (``--only cases``, the tree first on PYTHONPATH), the order flipping from
round to round so that a drift of the GPU's clocks weighs on both. bench.py's options pass through (``--peers
cusparseattn`` by default: a peer timed beside them shows that drift). Prints each figure of every round and
new / old of their medians; writes each run's bench.json under ``--out``. ``--old-env`` and ``--new-env``
(``NAME=VALUE``, repeatable) set environment variables for one side's runs only: a switch against itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).with_name("bench.py")


def _tree(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "cusparseattn" / "__init__.py").is_file() or not (path / "kernels").is_dir():
        raise argparse.ArgumentTypeError(f"a tree must hold cusparseattn/ and kernels/, got {text!r}")
    return path


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"an environment setting is NAME=VALUE, got {text!r}")
    return name, value


def figures(runs: list[dict]) -> dict:
    """``{(case, S, D, pass, name): [TFLOP/s of each run]}`` from bench.json results, in run order."""
    out: dict = {}
    for results in runs:
        for row in results["cases"]:
            for pass_ in ("fwd", "fwdbwd"):
                for name, value in row[pass_].items():
                    out.setdefault((row["case"], row["S"], row["D"], pass_, name), []).append(value)
    return out


def table(old: list[dict], new: list[dict]) -> list[str]:
    """One line per case, pass and name: the old figures, the new ones, and new / old of their medians."""
    before, after = figures(old), figures(new)
    lines = []
    for key in sorted(before.keys() & after.keys(), key=lambda k: (k[3], k[2], k[1], k[0], k[4])):
        a, b = before[key], after[key]
        ratio = statistics.median(b) / statistics.median(a)
        case, seq, dim, pass_, name = key
        lines.append(
            f"{pass_:6} {case:10} S={seq:6} D={dim:4} {name:12} old {' '.join(f'{x:6.1f}' for x in a)}"
            f" | new {' '.join(f'{x:6.1f}' for x in b)} | x{ratio:.3f}"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=_tree)
    parser.add_argument("new", type=_tree, nargs="?", default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rounds", type=int, default=2)
    for which in ("old", "new"):
        parser.add_argument(
            f"--{which}-env",
            type=_setting,
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"an environment variable for the {which} side's runs only (repeatable)",
        )
    parser.add_argument(
        "--out", type=Path, help="where each run's bench.json goes (default: a temporary folder)"
    )
    args, passed = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if "--only" in passed or "--out" in passed:
        parser.error("ab.py runs bench.py's cases itself: leave out --only and --out")
    if not any(a.startswith("--peers") for a in passed):
        passed += ["--peers", "cusparseattn"]
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for r in range(args.rounds):
            for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
                tree = getattr(args, which)
                path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
                settings = dict(getattr(args, f"{which}_env"))
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **settings}
                where = out / f"{which}{r}"
                print(f"== round {r}: {which} ({tree})", flush=True)
                cmd = [sys.executable, str(BENCH), "--only", "cases", "--out", str(where), *passed]
                done = subprocess.run(cmd, env=env, cwd=tree)
                if done.returncode:
                    print(f"bench.py failed on the {which} tree (exit {done.returncode})")
                    return done.returncode
                runs[which].append(json.loads((where / "bench.json").read_text()))
    print("\n".join(table(runs["old"], runs["new"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
