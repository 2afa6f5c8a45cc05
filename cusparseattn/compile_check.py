"""The compile check: every specialisation the kernels can be built as, compiled with nvcc for the given
architectures, failing on an error or a register spill. A step of ``.ci/run`` where nvcc is installed (no
GPU needed), against a record of the full sweep that it compiles only the changes to (`check`)::

    python -m cusparseattn.compile_check --check sm_80 sm_90
    python -m cusparseattn.compile_check --check sm_80 sm_90 --nvrtc   # NVRTC's code, as the run time's
    python -m cusparseattn.compile_check --check sm_80 sm_90 --record .ci/compile_record.txt [--update]
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import numpy as np

from . import build, tuning
from .analyses import KernelRule
from .build import HALF_DTYPES, KernelSpec, RuleSpec, SelectSpec, TablesSpec
from .mods import mask_rule
from .traced import CapturedArray


def all_specs() -> list[KernelSpec | RuleSpec]:
    """The specialisations the CI compile check builds: every pass, head dim and mask kind in bfloat16,
    float16 without a mask, the smaller tiles that devices with less shared memory take, a score mod, the
    same in float32 at both precisions for the passes that take it (`float32_specs`), the block
    classification of a rule, the builder of dynamic layouts' tables and MoBA's gate."""
    rules = [("none", None), ("bits", None), ("expr", CAUSAL_RULE)]
    specs = []
    for kernel, table in tuning.TILES.items():
        if kernel in build.FLOAT32_ONLY:
            continue  # float32_specs
        if kernel in tuning.PLAIN:
            specs += [
                KernelSpec.make(kernel, dt, d, tiles=t)
                for d, ts in table.items()
                for t in ts
                for dt in HALF_DTYPES
            ]
            continue
        for d in tuning.HOPPER_HEAD_DIMS if kernel in tuning.ARCH else (32, 64, 96, 128, 256):
            specs += [KernelSpec.make(kernel, "bfloat16", d, mode, expr) for mode, expr in rules]
            specs.append(KernelSpec.make(kernel, "float16", d))
        for d, candidates in table.items():
            if d >= 128:
                specs += [KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t) for t in candidates[1:]]
        specs += [KernelSpec.make(kernel, "bfloat16", d, *rules[2], score=SAMPLE_SCORE) for d in (64, 128)]
        for d, t in tuning.WIDE_TILES.get(kernel, {}).items():
            specs += [
                KernelSpec.make(kernel, "float16", d, tiles=t),
                KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t),
            ]
        if kernel == "forward_sm90":  # with split rows: its tiles, and the wide ones
            for d in tuning.HOPPER_HEAD_DIMS:
                for t in (tuning.tile_config(kernel, d), tuning.WIDE_TILES[kernel][d]):
                    specs.append(KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t, split_rows=True))
    # A traced rule as cusparseattn.trace prints it (a table clamped at its length, casts to RuleInt): the
    # kernels take it in 32-bit integers too.
    specs += [
        KernelSpec.make(kernel, "bfloat16", 128, "expr", TRACED_RULE)
        for kernel in ("forward", "backward_dq", "backward_dkdv", *tuning.ARCH)
    ]
    specs += float32_specs(rules)
    rule_specs = [RuleSpec(FLOORED_RULE), RuleSpec(TRACED_RULE)]
    selectors = [SelectSpec(dtype, 16 // build.DTYPES[dtype]) for dtype in build.DTYPES]
    return [*specs, *rule_specs, TablesSpec(), *selectors, SelectSpec("bfloat16", 1)]


def float32_specs(rules) -> list[KernelSpec]:
    """float32's specialisations, at each precision it takes: every pass that takes it
    (`build.FLOAT32_KERNELS`; the Hopper passes at "high", the forward with split rows, its combine and the
    transposed copies), head dim and mask kind, every smaller tile of its table (devices with less shared
    memory) with a rule, and a score mod."""
    specs = []
    for kernel in build.FLOAT32_KERNELS:
        if kernel in tuning.PLAIN:
            table = tuning.FLOAT32_TILES[kernel]
            specs += [KernelSpec.make(kernel, "float32", d, tiles=t) for d, ts in table.items() for t in ts]
            continue
        hopper = kernel in tuning.ARCH
        for precision in ("high",) if hopper else build.PRECISIONS:
            spec = functools.partial(KernelSpec.make, kernel, "float32", precision=precision)
            dims = tuning.HOPPER_HEAD_DIMS if hopper else (32, 64, 96, 128, 256)
            specs += [spec(d, mode, expr) for d in dims for mode, expr in rules]
            table = tuning.FLOAT32_TILES[kernel]
            if precision == "highest":
                table = {**table, **tuning.HIGHEST_TILES.get(kernel, {})}
            specs += [spec(d, *rules[2], tiles=t) for d, candidates in table.items() for t in candidates[1:]]
            specs += [spec(d, *rules[2], score=SAMPLE_SCORE) for d in (64, 128)]
            if kernel == "forward_sm90":
                specs += [spec(d, *rules[2], split_rows=True) for d in dims]
    return specs


def _kernel_rule(fn) -> KernelRule:
    return mask_rule(fn).kernel


_DOCUMENTS = CapturedArray(np.repeat(np.arange(4, dtype=np.int32), 32))
# Causal, bottom-right aligned (a band); the documents rule of a FlexAttention user (a table clamped at its
# length, casts to RuleInt: the kernels take it in 32-bit integers too); and Python's floor modulo.
CAUSAL_RULE = _kernel_rule(lambda b, h, q, k, off=0: k <= q + off)
TRACED_RULE = _kernel_rule(lambda b, h, q, k: (_DOCUMENTS[q] == _DOCUMENTS[k]) & (q >= k))
FLOORED_RULE = _kernel_rule(lambda b, h, q, k: ((q - k) % 7 == 0) & (_DOCUMENTS[q] == _DOCUMENTS[k]))
# A score mod of every kind of term a traced one has (a float parameter, a captured table, tanh): ALiBi
# with soft-capping, for the compile check.
SAMPLE_SCORE = (
    "SF0 * tanhf((s + ((const float*)SA0)[h] * (float)(k - q)) / SF0)",
    "1.0f - tanhf((s + ((const float*)SA0)[h] * (float)(k - q)) / SF0)"
    " * tanhf((s + ((const float*)SA0)[h] * (float)(k - q)) / SF0)",
)


def _nvrtc_library():
    """libnvrtc and the CUDA headers beside it (CUDA wheels or the toolkit), for the compile check; None
    where there is none."""
    import ctypes
    import glob
    import site
    import sysconfig
    from pathlib import Path

    roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages(), "/usr/local/cuda/lib64"]
    for root in roots:
        for path in sorted(
            glob.glob(f"{root}/nvidia/cu1*/lib/libnvrtc.so*") + glob.glob(f"{root}/libnvrtc.so*")
        ):
            try:
                # NVRTC dlopens its builtins by name: load them first from the same folder.
                for builtins in glob.glob(str(Path(path).parent / "libnvrtc-builtins.so*")):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                include = Path(path).parent.parent / "include"
                if (include / "cuda_fp16.h").is_file():
                    return ctypes.CDLL(path), str(include)
            except OSError:
                continue
    return None


def nvrtc_compile(lib, source: str, arch: str, include: str, syntax_only: bool = False) -> str:
    """Compiles with NVRTC, as CuPy does at run time (no host headers, CuPy's -ftz=true), for a virtual
    architecture (compute_90); returns the PTX, or with `syntax_only` only checks the source (NVRTC's front
    end, a tenth of the time: its code generation is nvcc's) and returns "". Raises RuntimeError with
    NVRTC's log on an error."""
    import ctypes

    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None)
    try:
        opts = [*build.nvrtc_options(), f"--gpu-architecture={arch}", f"-I{include}", "-ftz=true"]
        opts += ["-fdevice-syntax-only"] if syntax_only else []
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        if lib.nvrtcCompileProgram(prog, len(opts), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.value.decode(errors="replace"))
        if syntax_only:
            return ""
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_targets(archs: list[str], specs=None) -> dict[KernelSpec | RuleSpec, list[str]]:
    """The architectures each spec compiles for in `check` (``specs`` defaults to `all_specs`): a kernel for
    one architecture (sm_90a) compiles for it alone, when any sm_9x is asked for; every other spec for each
    of ``archs``."""
    hopper = any(a.startswith("sm_9") for a in archs)
    return {
        spec: ([spec.arch] if hopper else []) if spec.arch else list(archs)
        for spec in (all_specs() if specs is None else specs)
    }


class Job(NamedTuple):
    """One compile of the check: a spec for one architecture, and the key of its result in a record."""

    spec: KernelSpec | RuleSpec
    arch: str
    key: str

    @property
    def family(self) -> tuple[str, str]:
        """The pass and architecture: a record's entries are sampled one per family."""
        return getattr(self.spec, "kernel", type(self.spec).__name__), self.arch


def jobs(archs: list[str], specs, compiler: str) -> list[Job]:
    """Every (spec, arch) that `check` compiles, keyed by the hash of the compiler's version and options and
    the spec's whole source (its headers inlined): a job of the same key compiles to the same code."""
    import hashlib

    made = []
    for spec, arches in compile_targets(archs, specs).items():
        source = spec.source()
        for arch in arches:
            digest = hashlib.sha256(f"{compiler}\n{arch}\n{source}".encode()).hexdigest()
            made.append(Job(spec, arch, digest[:20]))
    return made


def read_record(path) -> dict[str, int]:
    """A record's registers by job key (an absent file is an empty record)."""
    from pathlib import Path

    path = Path(path)
    if not path.exists():
        return {}
    lines = [line.split() for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {key: int(registers) for key, _arch, _name, registers in lines}


def write_record(path, results: dict[Job, int], command: str, compiler: str) -> None:
    """Writes the registers of every job of a passing check, one line a job: key, arch, name, registers."""
    from pathlib import Path

    head = [
        "# The compile check's record: each specialisation that compiled without a spill, by the hash of its",
        f"# source and compiler ({compiler}). Brought up to date by:",
        f"# {command}",
    ]
    body = sorted(f"{j.key} {j.arch} {j.spec.name} {r}" for j, r in results.items())
    Path(path).write_text("\n".join(head + body) + "\n")


def plan(all_jobs: list[Job], record: dict[str, int], rng) -> tuple[list[Job], set[Job]]:
    """The jobs a check with a record compiles: every job the record does not hold, and of those it holds
    one per family (`Job.family`) drawn by ``rng``, whose registers must be the record's. Returns (jobs to
    compile in `all_jobs`' order, the drawn ones)."""
    known: dict[tuple[str, str], list[Job]] = {}
    for job in all_jobs:
        if job.key in record:
            known.setdefault(job.family, []).append(job)
    drawn = {rng.choice(family) for family in known.values()}
    return [j for j in all_jobs if j.key not in record or j in drawn], drawn


def check(
    archs: list[str], specs=None, *, nvrtc: bool = False, record=None, update: bool = False, seed=None
) -> int:
    """Compile every spec (or those of ``specs``) for each arch, failing on an error, a register spill or
    warpgroup MMAs that ptxas serialized; returns the number that failed. nvcc compiles, and where libnvrtc
    is installed NVRTC's front end takes every source as the run time does; with ``nvrtc``, NVRTC's PTX goes
    to ptxas, as at run time: its registers and spills, which can differ from nvcc's. Needs nvcc's toolkit,
    no GPU.

    With ``record`` (a file `write_record` wrote), only what the record does not hold compiles, and one job
    per family of those it does, drawn with ``seed`` (printed), whose registers must match it: a source or
    compiler that changed compiles again, an unchanged one as recorded. With ``update`` as well, a passing
    check rewrites the record with every job of this sweep (a full sweep remakes it from no file)."""
    import os
    import random
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("FAIL: nvcc is not on PATH")
        return 1
    ptxas = shutil.which("ptxas") or str(Path(nvcc).resolve().parent / "ptxas")
    lib, include = _nvrtc_library() or (None, None)
    if nvrtc and lib is None:
        print("FAIL: --nvrtc needs libnvrtc (pip install nvidia-cuda-nvrtc)")
        return 1
    source = "NVRTC's PTX" if nvrtc else "nvcc"
    print(f"nvcc: {nvcc}; NVRTC: {include or 'not installed, skipped'}; registers of {source}")
    version = subprocess.run([ptxas if nvrtc else nvcc, "--version"], capture_output=True, text=True)
    options = " ".join(build.nvrtc_options()) if nvrtc else NVCC_OPTIONS
    compiler = f"{source} {(version.stdout.split() or ['?'])[-1]} {options}"
    all_jobs = jobs(archs, specs, compiler)
    recorded = {} if record is None else read_record(record)
    seed = random.SystemRandom().randrange(2**32) if seed is None else seed
    to_compile, drawn = plan(all_jobs, recorded, random.Random(seed))

    def front_end(spec: KernelSpec | RuleSpec, arch: str) -> tuple[str, list[str]]:
        # NVRTC's front end is the same for every arch: once per spec, for its last.
        try:
            nvrtc_compile(lib, spec.source(), arch.replace("sm_", "compute_"), include, syntax_only=True)
        except RuntimeError as err:
            return f"FAIL NVRTC {spec.name}", [f"NVRTC: {err}"]
        return "", []

    def compile_one(tmp: str, job: Job) -> tuple[str, list[str], int | None]:
        spec, arch = job.spec, job.arch
        src = Path(tmp) / f"{spec.name}_{arch}.cu"
        if nvrtc:
            try:
                ptx = nvrtc_compile(lib, spec.source(), arch.replace("sm_", "compute_"), include)
            except RuntimeError as err:
                return f"FAIL {arch} {spec.name}", [f"NVRTC: {err}"], None
            src = src.with_suffix(".ptx")
            src.write_text(ptx)
            cmd = [ptxas, f"-arch={arch}", "-v", str(src)]
        else:
            src.write_text(spec.source())
            cmd = [nvcc, "-cubin", f"-arch={arch}", *NVCC_OPTIONS.split(), str(src)]
        res = subprocess.run([*cmd, "-o", os.devnull], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", res.stderr)
        registers = int(regs.group(1)) if regs else None
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
        problems = [res.stderr] if res.returncode else []
        if any(spills):
            problems.append(f"register spills {spills}")
        # ptxas waits for each warpgroup MMA where the code around one would read its registers in flight.
        problems += re.findall(r"\(C75\d\d\).*", res.stderr)
        if job in drawn and registers != recorded[job.key]:
            problems.append(f"{registers} registers where the record says {recorded[job.key]}")
        line = f"{'FAIL' if problems else 'ok':4} {arch} {spec.name}: {registers or '?'} registers"
        return line, problems, registers

    failures, results = 0, {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        checks = (
            []
            if nvrtc or lib is None
            else [pool.submit(front_end, s, a) for s, a in {j.spec: j.arch for j in all_jobs}.items()]
        )
        compiles = {job: pool.submit(compile_one, tmp, job) for job in to_compile}
        for future in checks:
            line, problems = future.result()
            failures += bool(problems)
            if problems:
                print("\n".join([line, *problems]))
        for job, future in compiles.items():
            line, problems, results[job] = future.result()
            failures += bool(problems)
            print("\n".join([line, *problems]))
    where = ", ".join(archs)
    if record is None:
        print(f"{len(to_compile) - failures} of {len(to_compile)} compiled for {where}: {failures} failed")
    else:
        new = len(to_compile) - len(drawn)
        print(
            f"{len(to_compile)} of {len(all_jobs)} compiled for {where}: {new} not in {record}, {len(drawn)}"
            f" drawn from it (seed {seed}), the other {len(all_jobs) - len(to_compile)} as it records;"
            f" every source through NVRTC's front end; {failures} failed"
        )
        if new and not update:
            print(f"{new} jobs are not in the record: --update records them")
    if update and not failures:
        kept = {job: results[job] if job in results else recorded[job.key] for job in all_jobs}
        write_record(
            record,
            kept,
            f"python -m cusparseattn.compile_check --check {' '.join(archs)}"
            f"{' --nvrtc' * nvrtc} --record {record} --update",
            compiler,
        )
        print(f"recorded {len(kept)} jobs in {record}")
    return failures


# nvcc's options besides the architecture: -ftz=true as CuPy gives NVRTC at run time.
NVCC_OPTIONS = "-std=c++17 -ftz=true -Xptxas -v"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=check.__doc__)
    parser.add_argument("--check", nargs="+", metavar="ARCH", default=["sm_80", "sm_90"])
    parser.add_argument(
        "--nvrtc", action="store_true", help="registers and spills of NVRTC's code (run time's)"
    )
    parser.add_argument("--record", metavar="FILE", help="compile only what this record does not hold")
    parser.add_argument("--update", action="store_true", help="rewrite --record with this sweep's jobs")
    parser.add_argument("--seed", type=int, help="the seed of the jobs drawn from the record")
    args = parser.parse_args(argv)
    if args.update and args.record is None:
        parser.error("--update needs --record FILE")
    failures = check(args.check, nvrtc=args.nvrtc, record=args.record, update=args.update, seed=args.seed)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
