"""The kernel builder: one `KernelSpec` per compiled unit, compiled with NVRTC through CuPy and cached.

A spec names everything that changes the machine code (pass, dtype, head dim, tiles, mask kind and the rule's
C expression; never a rule's parameter values or a sequence length). Its source is a generated prelude of
``#define`` lines followed by the unchanged kernel file with its header inlined, so CuPy's disk cache, keyed
on the whole source text, the options, the architecture and the NVRTC version, never serves a stale binary.

Numerics: CuPy appends ``-ftz=true`` to NVRTC's options, so fp32 denormals flush to zero. Softmax terms that
small (< 2^-126) are far below what an fp16/bf16 output or an fp32 sum can show, and the tests compare every
kernel with the float64 reference, so the kernels accept it. No ``-use_fast_math``: exp2f/logf are the precise
single-precision functions.

Its tile tables and tuning choices are `cusparseattn.tuning`'s; `cusparseattn.compile_check` compiles every
specialisation with nvcc.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import c_structs, env, tuning
from .analyses import KernelRule

log = logging.getLogger("cusparseattn")

# The kernels' element types: the bytes of each, and its name in specs' names (float32 runs on TF32 tensor
# cores: "tf32", or "tf32x3" at precision "highest").
DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
_DTYPE_NAMES = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}
#: The dtypes of every pass, the Hopper ones among them.
HALF_DTYPES = ("float16", "bfloat16")
#: The passes that take float32: the portable ones, and the Hopper forward (with its split rows' combine pass)
#: and two-pass backward, with the transposed copies that their TF32 products read (wgmma's TF32 reads both
#: operands K-major).
FLOAT32_KERNELS = (
    "forward",
    "backward_dq",
    "backward_dkdv",
    "forward_sm90",
    "forward_combine",
    "backward_dq_sm90",
    "backward_dkdv_sm90",
    "transpose",
)
#: The passes that take float32 only.
FLOAT32_ONLY = ("transpose",)
#: float32's precisions, as PyTorch names them: "high" multiplies in TF32 (10 bits of mantissa), "highest"
#: in split TF32 (three products a multiply, float32's rounding).
PRECISIONS = ("high", "highest")
RULE_MODES = {"none": 0, "expr": 1, "bits": 2}


#: The C structs the kernels take by value, as NumPy dtypes read from their definitions.
PARAMS = c_structs.mirror("params.cuh", "Params")
MASK_PARAMS = c_structs.mirror("block_mask.cu", "MaskParams")
TABLES_PARAMS = c_structs.mirror("dynamic_tables.cu", "TablesParams")
SELECT_PARAMS = c_structs.mirror("moba_select.cu", "SelectParams")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled unit. The name lists every specialisation argument; it shows in logs and errors."""

    kernel: str  # the pass: its source file in kernels/ without .cu, and its function's name after csa_
    dtype: str
    head_dim: int  # the real head dim; the kernel pads it to a multiple of 16
    tiles: tuple[int, int, int]  # TILE_M, TILE_N, NWARPS
    rule_mode: str = "none"
    rule: KernelRule | None = None  # for rule_mode "expr": what the kernel compiles of the layout's rule
    score: tuple[str, str] | None = None  # a score mod's C expression and its derivative
    split_rows: bool = False  # the Hopper forward: its deal splits rows (schedule.work_order), its SPLIT_ROWS
    precision: str = "high"  # float32's: PRECISIONS ("highest" is CSA_TF32X3)

    @classmethod
    def make(
        cls,
        kernel: str,
        dtype: str,
        head_dim: int,
        rule_mode: str = "none",
        rule: KernelRule | None = None,
        tiles: tuple[int, int, int] | None = None,
        max_shared: int = 227 * 1024,
        score: tuple[str, str] | None = None,
        split_rows: bool = False,
        precision: str = "high",
    ) -> KernelSpec:
        """The spec for these inputs, with the table's tiles for a device with `max_shared` bytes of shared
        memory per block (or `tiles`, for tuning)."""
        bits, itemsize = rule_mode == "bits", DTYPES.get(dtype, 2)
        highest = precision == "highest"
        tiles = tiles or tuning.tile_config(
            kernel, head_dim, max_shared, score is not None, bits, itemsize=itemsize, highest=highest
        )
        return cls(kernel, dtype, head_dim, tiles, rule_mode, rule, score, split_rows, precision)

    def __post_init__(self):
        if self.kernel not in tuning.TILES:
            raise ValueError(f"kernel must be one of {sorted(tuning.TILES)}, got {self.kernel!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"the kernels take {sorted(DTYPES)}, got dtype {self.dtype!r}")
        if self.rule_mode not in RULE_MODES:
            raise ValueError(f"rule_mode must be one of {sorted(RULE_MODES)}, got {self.rule_mode!r}")
        if (self.rule_mode == "expr") != (self.rule is not None):
            raise ValueError("rule is given exactly when rule_mode is 'expr'")
        if self.score is not None and (
            len(self.score) != 2 or not all(isinstance(x, str) for x in self.score)
        ):
            raise ValueError(f"score must be None or (C expression, its derivative), got {self.score!r}")
        if self.kernel in tuning.PLAIN and (self.rule_mode != "none" or self.score is not None):
            raise ValueError(f"{self.kernel} reads no layout rule or score mod")
        if self.split_rows and self.kernel != "forward_sm90":
            raise ValueError(f"only forward_sm90 splits rows, not {self.kernel}")
        if self.dtype == "float32" and self.kernel not in FLOAT32_KERNELS:
            raise ValueError(f"float32 runs the passes {FLOAT32_KERNELS}, not {self.kernel}")
        if self.dtype != "float32" and self.kernel in FLOAT32_ONLY:
            raise ValueError(f"{self.kernel} takes float32 only, not {self.dtype}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision != "high" and self.dtype != "float32":
            raise ValueError(f"precision {self.precision!r} is float32's; {self.dtype} takes 'high'")
        if self.precision != "high" and self.kernel in tuning.ARCH:
            raise ValueError(f"{self.kernel} multiplies float32 in TF32 (precision 'high') only")
        if self.kernel in tuning.ARCH and self.head_dim not in tuning.HOPPER_HEAD_DIMS:
            raise ValueError(f"{self.kernel} takes head dims {tuning.HOPPER_HEAD_DIMS}, got {self.head_dim}")

    @property
    def padded_head_dim(self) -> int:
        return tuning.pad_head_dim(self.head_dim)

    @property
    def name(self) -> str:
        tm, tn, nw = self.tiles
        dt = _DTYPE_NAMES[self.dtype] + ("x3" if self.precision == "highest" else "")
        rule = self.rule_mode + (_digest(self.rule) if self.rule is not None else "")
        if self.score is not None:
            rule += "_score" + hashlib.sha1("\n".join(self.score).encode()).hexdigest()[:8]
        split = "_split" if self.split_rows else ""
        return f"{self.kernel}_{dt}_d{self.head_dim}_q{tm}k{tn}w{nw}_{rule}{split}"

    @property
    def shared_bytes(self) -> int:
        return tuning.shared_bytes(self.kernel, self.head_dim, self.tiles, DTYPES[self.dtype])

    @property
    def threads(self) -> int:
        return self.tiles[2] * 32

    @property
    def arch(self) -> str | None:
        """The architecture the kernel needs exactly (its instructions exist nowhere else), or None."""
        return tuning.ARCH.get(self.kernel)

    def prelude(self) -> str:
        tm, tn, nw = self.tiles
        lines = [
            f"// {self.name}: generated by cusparseattn.build",
            f"#define CSA_DTYPE_BF16 {int(self.dtype == 'bfloat16')}",
            f"#define CSA_DTYPE_F32 {int(self.dtype == 'float32')}",
            f"#define CSA_TF32X3 {int(self.precision == 'highest')}",
            f"#define HEAD_DIM {self.padded_head_dim}",
            f"#define HEAD_DIM_REAL {self.head_dim}",
            f"#define TILE_M {tm}",
            f"#define TILE_N {tn}",
            f"#define NWARPS {nw}",
            f"#define SHARED_BYTES {self.shared_bytes}",
            f"#define RULE_MODE {RULE_MODES[self.rule_mode]}",
        ]
        if self.rule is not None:
            lines += _rule_defines(self.rule)
        lines.append(f"#define SCORE_MOD {int(self.score is not None)}")
        if self.score is not None:
            lines += [f"#define SI{i} (p.score_ip[{i}])" for i in range(8)]
            lines += [f"#define SF{i} (p.score_fp[{i}])" for i in range(8)]
            lines += [f"#define SA{i} (p.score_a[{i}])" for i in range(4)]
            lines.append(f"#define CSA_SCORE(s, b, h, q, k) ({self.score[0]})")
            lines.append(f"#define CSA_SCORE_GRAD(s, b, h, q, k) ({self.score[1]})")
        if self.arch is not None:
            switches = tuning.switches(self.kernel, self.padded_head_dim, self.tiles, DTYPES[self.dtype])
            lines += [f"#define {name} {value}" for name, value in switches.items()]
            if self.kernel == "forward_sm90":
                lines.append(f"#define SPLIT_ROWS {int(self.split_rows)}")
            lines += _wgmma_functions(sorted({tm, tn, self.padded_head_dim}), self.dtype)
        return "\n".join(lines) + "\n"

    def source(self) -> str:
        return self.prelude() + _inline(self.kernel + ".cu")


def _wgmma_functions(ns: list[int], dtype: str) -> list[str]:
    """kernels/hopper.cuh's wgmma_ss<N>, wgmma_ss_bmn<N> (B read MN-major) and wgmma_rs<N> for these N:
    m64nNk16 (m64nNk8 in TF32, for float32), fp32 accumulators, the accumulator of N / 2 registers spelled
    out operand by operand (PTX takes no arrays). TF32 reads its shared operands K-major only: no
    wgmma_ss_bmn, and no transpose operand."""
    desc = "unsigned long long"
    lines = [
        f"template <int N> __device__ void wgmma_ss(float (&)[N / 8][4], {desc}, {desc}, int);",
        f"template <int N> __device__ void wgmma_ss_bmn(float (&)[N / 8][4], {desc}, {desc}, int);",
        f"template <int N> __device__ void wgmma_rs(float (&)[N / 8][4], const unsigned (&)[4], {desc});",
    ]
    types, k = {"float16": ("f16.f16", 16), "bfloat16": ("bf16.bf16", 16), "float32": ("tf32.tf32", 8)}[dtype]
    # The immediates after scale-d: scale-a and scale-b, then for 16-bit elements the transposes (of A and B
    # from shared memory; of B alone beside A in registers).
    if dtype == "float32":
        shared, registers = [("wgmma_ss", "1, 1")], "1, 1"
    else:
        shared, registers = [("wgmma_ss", "1, 1, 0, 0"), ("wgmma_ss_bmn", "1, 1, 0, 1")], "1, 1, 1"
    for n in ns:
        regs = n // 2
        acc = ", ".join(f"%{i}" for i in range(regs))
        outs = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(regs))
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{types}"
        for name, scales in shared:
            lines += [
                f"template <> __device__ __forceinline__ void {name}<{n}>(float (&d)[{n // 8}][4], "
                "unsigned long long a, unsigned long long b, int accumulate) {",
                f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n'
                f'{op} {{{acc}}}, %{regs}, %{regs + 1}, p, {scales};\\n}}\\n"',
                f'                 : {outs} : "l"(a), "l"(b), "r"(accumulate));',
                "}",
            ]
        lines += [
            f"template <> __device__ __forceinline__ void wgmma_rs<{n}>(float (&d)[{n // 8}][4], "
            "const unsigned (&a)[4], unsigned long long b) {",
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n'
            f"{op} {{{acc}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, "
            f'p, {registers};\\n}}\\n"',
            f'                 : {outs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));',
            "}",
        ]
    return lines


def _digest(rule: KernelRule) -> str:
    return hashlib.sha1(repr(rule).encode()).hexdigest()[:8]


def _rule_defines(rule: KernelRule) -> list[str]:
    first, last = rule.key_band or (None, None)
    qfirst, qlast = rule.query_band or (None, None)
    return [
        f"#define RULE_NARROWABLE {int(rule.narrowable)}",
        *(f"#define P{i} (static_cast<RuleInt>(p.rule_p[{i}]))" for i in range(8)),
        *(f"#define A{i} (p.rule_a[{i}])" for i in range(4)),
        f"#define CSA_RULE(b, h, q, k) ({rule.expr})",
        f"#define RULE_BAND {int(rule.key_band is not None)}",
        *([f"#define CSA_RULE_FIRST(b, h, q) ({first})"] if first else []),
        *([f"#define CSA_RULE_LAST(b, h, q) ({last})"] if last else []),
        f"#define RULE_QBAND {int(rule.query_band is not None)}",
        *([f"#define CSA_RULE_QFIRST(b, h, k) ({qfirst})"] if qfirst else []),
        *([f"#define CSA_RULE_QLAST(b, h, k) ({qlast})"] if qlast else []),
    ]


@dataclass(frozen=True)
class RuleSpec:
    """The block classification kernel of one token rule (kernels/block_mask.cu)."""

    rule: KernelRule
    kernel = "block_mask"
    shared_bytes = 0
    threads = 256
    arch = None

    @property
    def name(self) -> str:
        return f"block_mask_{_digest(self.rule)}"

    def source(self) -> str:
        lines = [f"// {self.name}: generated by cusparseattn.build", *_rule_defines(self.rule)]
        return "\n".join(lines) + "\n" + _inline(self.kernel + ".cu")


@dataclass(frozen=True)
class TablesSpec:
    """The kernel that builds a dynamic layout's tile tables on the GPU (kernels/dynamic_tables.cu); its
    source asserts that `TABLES_PARAMS` is as large as the C struct it mirrors field by field."""

    kernel = "dynamic_tables"
    shared_bytes = 0
    threads = 1024  # its largest CTA (its scan's)
    arch = None
    name = "dynamic_tables"

    def source(self) -> str:
        size = f'static_assert(sizeof(TablesParams) == {TABLES_PARAMS.itemsize}, "TablesParams\' mirror");'
        return _inline(self.kernel + ".cu") + "\n" + size + "\n"


_C_ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


@dataclass(frozen=True)
class SelectSpec:
    """MoBA's gate for inputs of one dtype (kernels/moba_select.cu), loading `vec` elements at once while it
    pools (16 bytes' worth where the rows are aligned to it, else 1)."""

    dtype: str
    vec: int
    kernel = "moba_select"
    # Its scores' most: a warp's row of key blocks in float32, four warps a CTA; with the pooling step's 8 KiB
    # of static shared memory, within every device's 99 KiB (sm_86 and sm_89 have no more).
    shared_bytes = 64 * 1024
    threads = 256
    arch = None

    @property
    def name(self) -> str:
        return f"moba_select_{self.dtype}_v{self.vec}"

    def source(self) -> str:
        size = f'static_assert(sizeof(SelectParams) == {SELECT_PARAMS.itemsize}, "SelectParams\' mirror");'
        defines = [f"#define CSA_SELECT_T {_C_ELEMENTS[self.dtype]}", f"#define VEC {self.vec}"]
        return "\n".join(defines) + "\n" + _inline(self.kernel + ".cu") + "\n" + size + "\n"


_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


def _inline(filename: str, seen: frozenset = frozenset()) -> str:
    """The file's text with its local "..." includes inlined (once each), so the source is self-contained."""
    text = (env.kernels_dir() / filename).read_text()

    def include(match: re.Match) -> str:
        name = match.group(1)
        return "" if name in seen else _inline(name, seen | {name})

    return _INCLUDE.sub(include, text).replace("#pragma once", "")


def nvrtc_options(arch: str | None = None) -> tuple[str, ...]:
    """NVRTC's options; `arch` (sm_90a) for a kernel that needs it, where CuPy would pick the device's
    plain architecture (NVRTC takes the "a" variant when both are given)."""
    opts = ("--std=c++17",) + ((f"-arch={arch}",) if arch else ())
    return opts + (("-lineinfo",) if env.lineinfo() else ())


def load(spec: KernelSpec | RuleSpec | TablesSpec | SelectSpec, device: int):
    """The compiled kernel of `spec` for one device (compiled once per process, or by a `prefetch` that this
    waits for; CuPy caches it on disk)."""
    return _loading(spec, device, background=False).result()


def prefetch(spec: KernelSpec, device: int) -> None:
    """Starts compiling `spec` for a device on a background thread unless it is loaded or loading, so that
    a later `load` of it waits for that compile instead of starting its own: for kernels a caller will
    surely need after the one it compiles now (a training step's backward, beside its forward). NVRTC
    releases the GIL while it compiles."""
    _loading(spec, device, background=True)


# (spec, device) -> the Future of its compiled kernel: done, or being compiled by a thread.
_loads: dict[tuple, Future] = {}
_loads_lock = threading.Lock()


@functools.cache
def _compilers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="cusparseattn-compile")


def _loading(spec, device: int, background: bool) -> Future:
    key = (spec, device)
    with _loads_lock:
        future = _loads.get(key)
        mine = future is None
        if mine:
            future = _loads[key] = Future()
    if mine:
        if background:
            _compilers().submit(_compile_into, future, key)
        else:
            _compile_into(future, key)
    return future


def _compile_into(future: Future, key: tuple) -> None:
    try:
        future.set_result(_compile(*key))
    except BaseException as err:
        with _loads_lock:  # a failed compile is not kept: the next load tries again, and raises there
            del _loads[key]
        future.set_exception(err)


def _compile(spec, device: int):
    import cupy

    source = spec.source()
    if (dump := env.dump_dir()) is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{spec.name}.cu").write_text(source)
    start = time.perf_counter()
    with cupy.cuda.Device(device):
        try:
            module = cupy.RawModule(code=source, options=nvrtc_options(spec.arch))
            function = module.get_function("csa_" + spec.kernel)
        except cupy.cuda.compiler.CompileException as err:
            raise RuntimeError(
                f"cusparseattn: NVRTC failed to compile {spec.name} "
                f"(set CUSPARSEATTN_DUMP_SOURCE=DIR to keep the source):\n{err}"
            ) from err
        function.max_dynamic_shared_size_bytes = spec.shared_bytes
    seconds = time.perf_counter() - start
    COMPILE_TIMES[spec.name] = seconds
    (log.info if env.verbose() else log.debug)("cusparseattn: loaded %s in %.2f s", spec.name, seconds)
    return function


# Seconds each spec took to load in this process (compile, or read from CuPy's disk cache).
COMPILE_TIMES: dict[str, float] = {}
