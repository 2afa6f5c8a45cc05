"""Every code block of README.md runs: the Python ones here (on the CPU, or on a GPU where a ``<!-- gpu -->``
comment marks them; the context-parallel one under ``torchrun``, as its first line says, with gloo on the
CPU), the cheap shell ones too. The install and test commands (``<!-- ci -->``) are the ones `.ci/run` runs.

A block is marked by an HTML comment on the line before its fence: ``<!-- gpu -->`` (needs a CUDA GPU and
CuPy), ``<!-- ci -->`` (run by `.ci/run`). An unmarked ``bash`` block runs line by line, but for the
commands `.ci/run` runs itself.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?:<!-- (?P<mark>[\w-]+) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)^```$", re.S | re.M)
_TORCHRUN = re.compile(r"# (torchrun .*)\n")


class Block(NamedTuple):
    line: int
    lang: str
    mark: str | None
    code: str

    @property
    def torchrun(self) -> list[str] | None:
        """The ``torchrun`` command of a block whose first line is ``# torchrun ...``, else None."""
        found = _TORCHRUN.match(self.code)
        return shlex.split(found.group(1)) if found else None


def blocks(text: str) -> list[Block]:
    return [
        Block(text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["mark"], m["code"])
        for m in _BLOCK.finditer(text)
    ]


BLOCKS = blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _ids(selected: list[Block]) -> list[str]:
    return [f"README.md:{b.line}" for b in selected]


def _run(block: Block) -> None:
    exec(compile(block.code, f"README.md:{block.line}", "exec"), {"__name__": "__main__"})


def test_blocks_are_found_and_marked_with_known_marks():
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}
    assert {b.mark for b in BLOCKS} <= {None, "gpu", "ci"}
    # Every framework's example, the context-parallel one, and a GPU one.
    for needle in ("import numpy", "import torch", "import jax", "import cupy", "ring_attention"):
        assert any(needle in b.code for b in PYTHON), needle
    assert sum(b.torchrun is not None for b in PYTHON) == 1


def test_blocks_parse_as_these_patterns():
    text = "intro\n<!-- gpu -->\n```python\nx = 1\n```\n\n```bash\necho hi\n```\n"
    assert blocks(text) == [Block(3, "python", "gpu", "x = 1\n"), Block(7, "bash", None, "echo hi\n")]


CPU = [b for b in PYTHON if b.mark is None and b.torchrun is None]


@pytest.mark.parametrize("block", CPU, ids=_ids(CPU))
def test_python_block_runs_on_cpu(block, capsys):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    # One thread: torch's and NumPy's thread pools (the reference) would fight over the cores.
    torch.set_num_threads(1)
    try:
        _run(block)
    finally:
        torch.set_num_threads(before)


GPU = [b for b in PYTHON if b.mark == "gpu"]


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU, ids=_ids(GPU))
def test_python_block_runs_on_gpu(block):
    _run(block)


TORCHRUN = [b for b in PYTHON if b.torchrun is not None]


@pytest.mark.parametrize("block", TORCHRUN, ids=_ids(TORCHRUN))
def test_torchrun_block_runs_its_command(block, tmp_path):
    """The block's own ``torchrun`` line, run as ``python -m torch.distributed.run --standalone``: its
    processes on the CPU with gloo, on any host (no GPU is visible to them; tests/test_distributed.py has
    the GPU tests of ring attention)."""
    pytest.importorskip("torch")
    command = block.torchrun
    assert command[0] == "torchrun" and command[-1].endswith(".py"), command
    script = tmp_path / command[-1]
    script.write_text(block.code)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", *command[1:-1], str(script)]
    env = {**_env(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    if done.returncode and GLOO_ABORT in done.stderr:
        # A rank's gloo threads abort now and then as the process ends, inside this suite only (2 of 4 full
        # runs on 2026-12-07, none of 55 runs of the block alone): said, and run once more.
        warnings.warn(f"{block.line}: a rank aborted in gloo's teardown; running it again", stacklevel=1)
        done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


# What a rank prints when gloo's threads meet std::terminate (SIGABRT).
GLOO_ABORT = "terminate called without an active exception"


def _env() -> dict[str, str]:
    """This environment with the checkout first on the path, so that a subprocess imports this cusparseattn;
    one thread per process (the ranks share the machine's cores)."""
    import os

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _ci_steps() -> set[str]:
    """The commands `.ci/run` runs as steps (``step NAME COMMAND``)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return {" ".join(shlex.split(line, comments=True)[2:]) for line in lines if line.startswith("step ")}


SHELL = [
    (b, i, line)
    for b in BLOCKS
    if b.lang == "bash" and b.mark is None
    for i, line in enumerate(b.code.splitlines())
]


@pytest.mark.parametrize(
    ("block", "i", "line"), SHELL, ids=[f"README.md:{b.line + 1 + i}" for b, i, _ in SHELL]
)
def test_shell_line_runs(block, i, line):
    command = shlex.split(line, comments=True)
    assert command[:3] == ["python", "-m", "cusparseattn"], f"{line!r} is not a cheap command: mark its block"
    if " ".join(command) in _ci_steps():
        pytest.skip(f"{' '.join(command)!r} is a step of .ci/run")
    done = subprocess.run(
        [sys.executable, *command[1:]], capture_output=True, text=True, cwd=ROOT, timeout=300, env=_env()
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_install_and_test_commands_are_those_ci_runs():
    """`.ci/run` runs the README's install command, the demo and the test command, each as a step."""
    (ci,) = [b for b in BLOCKS if b.mark == "ci"]
    commands = [" ".join(shlex.split(c)) for line in ci.code.splitlines() for c in line.split("&&")]
    assert commands == ["pip install .[test]", "python -m cusparseattn demo", "python -m pytest"]
    assert set(commands) <= _ci_steps(), _ci_steps()
