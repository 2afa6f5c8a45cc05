"""Versions of cusparseattn timed against one: bench.py's cases, in alternating processes.

    git archive main cusparseattn kernels | tar -x -C /tmp/old      # the version to compare against
    python benchmarks/ab.py /tmp/old --cases causal,local1024 --seqs 4096 --no-backward
    python benchmarks/ab.py /tmp/old /tmp/new --rounds 3 --peers cusparseattn,flex
    python benchmarks/ab.py /tmp/old /tmp/a /tmp/b --rounds 4       # two candidates in the same rounds
    python benchmarks/ab.py . . --old-env CUSPARSEATTN_FUSED_BACKWARD=0 --seqs 16384   # one tree, a switch

Each tree holds ``cusparseattn/`` and ``kernels/``; the new ones default to this checkout. A round runs this
checkout's bench.py once per tree (``--only cases``, the tree first on PYTHONPATH), each round starting one
tree further along (two trees: the order flips), so that a drift of the GPU's clocks weighs on all. bench.py's
options pass through (``--peers cusparseattn`` by default: a peer timed beside them shows that drift). Prints
each figure of every round and new / old of their medians, for each new tree; writes each run's bench.json
under ``--out``. ``--old-env`` and ``--new-env`` (``NAME=VALUE``, repeatable) set environment variables for
the old tree's runs or the new ones' only: a switch against itself.
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


def table(old: list[dict], new: list[dict], label: str = "new") -> list[str]:
    """One line per case, pass and name: the old figures, the new ones (named `label`), and new / old of
    their medians."""
    before, after = figures(old), figures(new)
    lines = []
    for key in sorted(before.keys() & after.keys(), key=lambda k: (k[3], k[2], k[1], k[0], k[4])):
        a, b = before[key], after[key]
        ratio = statistics.median(b) / statistics.median(a)
        case, seq, dim, pass_, name = key
        lines.append(
            f"{pass_:6} {case:10} S={seq:6} D={dim:4} {name:12} old {' '.join(f'{x:6.1f}' for x in a)}"
            f" | {label} {' '.join(f'{x:6.1f}' for x in b)} | x{ratio:.3f}"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", type=_tree)
    parser.add_argument(
        "new", type=_tree, nargs="*", help="the trees to time against old (default: this one)"
    )
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
    news = args.new or [Path(__file__).resolve().parents[1]]
    # Each tree by its label: "old", then "new", or "new1", "new2", ... for several.
    trees = {"old": args.old} | {("new" if len(news) == 1 else f"new{i + 1}"): t for i, t in enumerate(news)}
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for r in range(args.rounds):
            labels = list(trees)[r % len(trees) :] + list(trees)[: r % len(trees)]
            for label in labels:
                tree = trees[label]
                path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
                settings = dict(args.old_env if label == "old" else args.new_env)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **settings}
                where = out / f"{label}-{r}"
                print(f"== round {r}: {label} ({tree})", flush=True)
                cmd = [sys.executable, str(BENCH), "--only", "cases", "--out", str(where), *passed]
                done = subprocess.run(cmd, env=env, cwd=tree)
                if done.returncode:
                    print(f"bench.py failed on the {label} tree (exit {done.returncode})")
                    return done.returncode
                runs[label].append(json.loads((where / "bench.json").read_text()))
    print("\n".join(line for label in list(trees)[1:] for line in table(runs["old"], runs[label], label)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
