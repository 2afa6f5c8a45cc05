"""The tracer against direct evaluation: the same Python function traced and called on NumPy arrays.

Random expression trees over every supported operation (`Expressions`) are traced and their NumPy programs
compared with the function called directly; their C text (and that of every ready-made mod) is compiled once
with g++ and run on the host against the NumPy program (floor division, precedence, clamping, casts), and
compiled once with nvcc for sm_80; derivatives are compared with finite differences. Then the no-recompile
property (values are parameters), the ways arrays and numbers are captured, and the errors.
"""

from __future__ import annotations

import doctest
import functools
import random
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cusparseattn import mods, patterns, trace
from cusparseattn.program import MASK_NAMES, SCORE_NAMES, WIDE
from cusparseattn.traced import NotCompilable, TraceError

_TABLES = np.random.default_rng(7)
T = _TABLES.integers(-20, 21, size=37)  # an int table
F = _TABLES.uniform(-2, 2, size=23)  # a float table
M = _TABLES.integers(-5, 6, size=(3, 40))  # a 2-D int table
GLOBAL_IDS = np.repeat(np.arange(4), [10, 25, 5, 24])  # read by `global_document` through its globals

FUNCTIONS = ("where", "minimum", "maximum", "abs", "exp", "log", "tanh", "sqrt")
ARGUMENTS = {"mask_mod": "b, h, q, k", "score_mod": "s, b, h, q, k"}


# ---- random expressions ------------------------------------------------------------------------------------
class Expressions:
    """Random expression texts over ``b, h, q, k`` (and ``s`` for score mods), every supported operation.

    Divisors are made safe (``abs(x) + 1`` with a random sign, ``abs(x) + 1.5``), ``exp`` sees at most 4,
    ``log`` and ``sqrt`` non-negative arguments, so both evaluations stay finite and free of NaN. ``~`` only
    negates comparisons that involve a variable (``~True`` is -2 in Python, not False), and table indices
    always involve one (a constant index is a concrete float32 lookup, computed on in float32).
    """

    def __init__(self, rnd: random.Random, role: str):
        self.rnd, self.floats = rnd, role == "score_mod"

    def top(self, depth: int) -> str:
        return self.float_(depth) if self.floats else self.bool_(depth)

    def int_(self, depth: int) -> str:
        r = self.rnd
        if depth <= 0 or r.random() < 0.2:
            return r.choice("bhqk") if r.random() < 0.7 else f"({r.randint(-40, 40)})"
        sub = functools.partial(self.int_, depth - 1)
        sign = r.choice(["", "-"])
        return r.choice(
            [
                lambda: f"({sub()} {r.choice('+-*')} {sub()})",
                lambda: f"({sub()} {r.choice(['//', '%'])} ({sign}(abs({sub()}) + 1)))",
                lambda: f"(-{sub()})",
                lambda: f"abs({sub()})",
                lambda: f"{r.choice(['minimum', 'maximum'])}({sub()}, {sub()})",
                lambda: f"where({self.bool_(depth - 1)}, {sub()}, {sub()})",
                lambda: f"T[{self.index_(depth - 1)}]",
                lambda: f"M[{self.index_(depth - 1)}, {self.index_(depth - 1)}]",
            ]
        )()

    def index_(self, depth: int) -> str:
        return f"({self.rnd.choice('bhqk')} {self.rnd.choice('+-')} {self.int_(depth)})"

    def bool_(self, depth: int) -> str:
        r = self.rnd
        op = r.choice(["<", "<=", ">", ">=", "==", "!="])
        if depth <= 0:
            return f"({r.choice('bhqk')} {op} {self.int_(0)})"
        options = [
            lambda: f"({self.int_(depth - 1)} {op} {self.int_(depth - 1)})",
            lambda: f"({self.bool_(depth - 1)} {r.choice('&|')} {self.bool_(depth - 1)})",
            lambda: f"(~({r.choice('bhqk')} {op} {self.int_(depth - 1)}))",
        ]
        if self.floats:
            options.append(lambda: f"({self.float_(depth - 1)} {op} {self.float_(depth - 1)})")
        return r.choice(options)()

    def float_(self, depth: int) -> str:
        r = self.rnd
        if depth <= 0 or r.random() < 0.15:
            return r.choice(
                [
                    lambda: "s",
                    lambda: f"({round(r.uniform(-3, 3), 3)!r})",
                    lambda: f"F[{self.index_(0)}]",
                    lambda: f"({self.int_(1)} / ({r.choice(['', '-'])}(abs({self.int_(0)}) + 1)))",
                ]
            )()
        sub = functools.partial(self.float_, depth - 1)
        return r.choice(
            [
                lambda: f"({sub()} {r.choice('+-*')} {sub()})",
                lambda: f"({sub()} {r.choice('+-*')} {self.int_(depth - 1)})",
                lambda: f"({sub()} / (abs({sub()}) + 1.5))",
                lambda: f"exp(minimum({sub()}, 4.0))",
                lambda: f"log(abs({sub()}) + 1.0)",
                lambda: f"tanh({sub()})",
                lambda: f"sqrt(abs({sub()}))",
                lambda: f"(-{sub()})",
                lambda: f"abs({sub()})",
                lambda: f"{r.choice(['minimum', 'maximum'])}({sub()}, {sub()})",
                lambda: f"where({self.bool_(depth - 1)}, {sub()}, {sub()})",
            ]
        )()


class Clamped:
    """A table looked up with clamped indices in float64 / int64: the direct evaluation's view of a table
    (the trace holds floats as float32 values and computes in the requested precision)."""

    def __init__(self, table: np.ndarray):
        self.table = table.astype(np.float64 if table.dtype.kind == "f" else np.int64)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        return self.table[tuple(np.clip(i, 0, n - 1) for i, n in zip(key, self.table.shape, strict=True))]


def make_function(text: str, role: str, *, direct: bool):
    """``lambda <arguments>: text`` over the mods functions and the tables: raw NumPy arrays in its globals
    when traced (capture through globals), clamped lookups when called directly."""
    namespace = {name: getattr(mods, name) for name in FUNCTIONS}
    for name, table in (("T", T), ("F", F.astype(np.float32)), ("M", M)):
        namespace[name] = Clamped(table) if direct else table
    return eval(f"lambda {ARGUMENTS[role]}: {text}", namespace)


def grid(rng, n: int = 300) -> dict[str, np.ndarray]:
    """Random points: q, k past the tables' lengths (clamped lookups), scores of both signs."""
    return dict(
        s=(rng.standard_normal(n) * 3).astype(np.float32),
        b=rng.integers(0, 3, n),
        h=rng.integers(0, 4, n),
        q=rng.integers(0, 70, n),
        k=rng.integers(0, 70, n),
    )


def direct(fn, role: str, env: dict, dtype=np.float64) -> np.ndarray:
    args = [env[n] for n in "bhqk"]
    if role == "score_mod":
        args.insert(0, env["s"].astype(dtype))
    return np.broadcast_to(np.asarray(fn(*args)), env["q"].shape)


def traced(program: trace.Program, output: str, env: dict, dtype=np.float64) -> np.ndarray:
    out = program.evaluate(output, env, dtype)
    return np.broadcast_to(np.asarray(out), env["q"].shape)


@settings(max_examples=60, deadline=None)
@given(role=st.sampled_from(["mask_mod", "score_mod"]), rnd=st.randoms(use_true_random=False))
def test_trace_matches_direct_evaluation(role, rnd):
    text = Expressions(rnd, role).top(3)
    env = grid(np.random.default_rng(rnd.randint(0, 2**32)))
    program = trace.trace(make_function(text, role, direct=False), role)
    want = direct(make_function(text, role, direct=True), role, env)
    got = traced(program, "value", env)
    if role == "mask_mod":
        assert np.array_equal(got, want.astype(bool)), text
    else:
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=text)


# ---- derivatives -------------------------------------------------------------------------------------------
def assert_grad_matches_finite_differences(program: trace.Program, env: dict, label: str) -> None:
    """The ``grad`` output against central differences of ``value`` in float64 where it is finite, away
    from kinks and jumps (where two step sizes disagree, the point straddles one: skipped, at most half)."""
    s = env["s"].astype(np.float64)

    def run(output, scores):
        return traced(program, output, {**env, "s": scores})

    def central(step):
        return (run("value", s + step) - run("value", s - step)) / (2 * step)

    step = 1e-5 * (1 + np.abs(s))
    with np.errstate(invalid="ignore"):  # inf - inf where the value is -inf
        fd, fd_fine = central(step), central(step / 8)
    value = run("value", s)
    finite = np.isfinite(value)
    roundoff = 1e-9 * (1 + np.abs(np.where(finite, value, 0))) / step  # of the differences, generously
    smooth = finite & (np.abs(fd - fd_fine) <= 1e-4 * (1 + np.abs(fd)) + 8 * roundoff)
    assert smooth.sum() >= 0.5 * finite.sum(), f"{label}: too few smooth points"
    grad = run("grad", s)
    bad = np.flatnonzero(smooth & (np.abs(grad - fd) > 1e-4 * (1 + np.abs(fd)) + roundoff))
    assert bad.size == 0, f"{label}: grad {grad[bad[:3]]}, differences {fd[bad[:3]]}"


@settings(max_examples=50, deadline=None)
@given(rnd=st.randoms(use_true_random=False))
def test_grad_matches_finite_differences(rnd):
    text = Expressions(rnd, "score_mod").top(3)
    program = trace.trace(make_function(text, "score_mod", direct=False), "score_mod")
    assert_grad_matches_finite_differences(program, grid(np.random.default_rng(rnd.randint(0, 2**32))), text)


def test_ready_made_grads_match_finite_differences():
    env = grid(np.random.default_rng(5))
    for label, fn in ready_made_scores().items():
        assert_grad_matches_finite_differences(mods.score_mod(fn).program, env, label)


def test_grad_simplifies():
    """Derivatives print simplified: constants folded, x * 1 and x + 0 gone, x / x cancelled."""
    cases = {
        "bias": (lambda s, b, h, q, k: s + F[h] * (k - q), "1.0f"),
        "scaled": (lambda s, b, h, q, k: s * 0.5 - 3.0, "SF0"),
        "masked": (lambda s, b, h, q, k: mods.where(q >= k, s, float("-inf")), "((q >= k) ? 1.0f : 0.0f)"),
        "constant": (lambda s, b, h, q, k: (q - k) * 1.0, "0.0f"),
        "negated": (lambda s, b, h, q, k: -(s - q), "(-1.0f)"),
        "softcap": (mods.softcap(30.0), "(1.0f - (tanhf((s / SF0)) * tanhf((s / SF0))))"),
        "exp": (lambda s, b, h, q, k: mods.exp(s), "expf(s)"),
    }
    for label, (fn, want) in cases.items():
        assert mods.score_mod(fn).c_grad == want, label


# ---- C: host execution and device compilation --------------------------------------------------------------
def layout_algebra_rules() -> dict:
    ids2 = np.stack([np.repeat([0, 1, 2], [20, 30, 20]), np.repeat([0, 2, 3], [10, 10, 50])])
    documents = patterns.from_mask(mods.document_mask(ids2), block=16, batch=2).layout(70)
    window = patterns.from_mask(mods.sliding_window(9, causal=False), block=16).layout(70)
    return {
        "traced & causal": (documents & patterns.causal(block=16).layout(70)).rule,
        "traced | traced": (window | patterns.from_mask(mods.dilated(6), block=16).layout(70)).rule,
        "traced & pattern document": (window & patterns.document(ids2[0], block=16).layout(70)).rule,
        "traced[1, 0]": documents[1, 0].rule,
    }


def narrowable(program, output="value") -> bool:
    """Whether the C text of a program's output is exact in 32-bit integers where its values fit."""
    return not program.c_form(program.outputs[output], MASK_NAMES)[1] & WIDE


@dataclass
class CCase:
    """One C expression set (value, and grad for score mods) with its parameter and array values."""

    label: str
    role: str
    program: trace.Program
    texts: tuple[str, ...]
    ints: tuple[int, ...]
    floats: tuple[float, ...]
    arrays: tuple[np.ndarray, ...]


def ready_made_rules() -> dict:
    ids2 = np.stack([np.repeat([0, 1, 2], [20, 30, 20]), np.repeat([0, 2, 3], [10, 10, 50])])
    return {
        "causal": mods.causal_mask,
        "sliding": mods.sliding_window(17),
        "sliding_two_sided": mods.sliding_window(9, causal=False),
        "prefix_lm": mods.prefix_lm(12),
        "document_1d": mods.document_mask(np.repeat([0, 1, 2, 3], [9, 20, 1, 30])),
        "document_2d": mods.document_mask(ids2),
        "dilated": mods.dilated(5),
        "dilated_two_sided": mods.dilated(4, causal=False),
        "and_or": mods.or_masks(mods.and_masks(mods.causal_mask, mods.sliding_window(8)), mods.prefix_lm(3)),
        "floor_negative": lambda b, h, q, k: ((q - k) // 3 == -2) | ((k - q) % 5 == 3) | ((q - k) % -4 == -1),
        "global_document": global_document,
    }


def ready_made_scores() -> dict:
    return {
        "alibi": mods.alibi(mods.alibi_slopes(3)),
        "softcap": mods.softcap(7.5),
        "relative_bias_1d": mods.relative_bias(np.linspace(-1, 1, 31)),
        "relative_bias_2d": mods.relative_bias(np.random.default_rng(1).standard_normal((4, 21))),
        "alibi_softcap": mods.compose(mods.alibi(mods.alibi_slopes(4)), mods.softcap(5.0)),
        "masked": lambda s, b, h, q, k: mods.where(q >= k, s, float("-inf")),
        "float_floor": lambda s, b, h, q, k: s // 0.75 + s % 0.75 + (q - k) / 7,
    }


def global_document(b, h, q_idx, kv_idx):
    return GLOBAL_IDS[q_idx] == GLOBAL_IDS[kv_idx]


@functools.cache
def c_cases() -> tuple[CCase, ...]:
    """Every ready-made mod, and seeded random expressions of both roles (the same ones on every run)."""
    cases = []
    for label, fn in ready_made_rules().items():
        rule = mods.mask_rule(fn)
        cases.append(CCase(label, "mask_mod", rule.fn.program, (rule.c_expr,), rule.params, (), rule.arrays))
    for label, rule in layout_algebra_rules().items():
        assert rule.c_expr is not None, label
        cases.append(CCase(label, "mask_mod", rule.program, (rule.c_expr,), rule.params, (), rule.arrays))
    for label, fn in ready_made_scores().items():
        sm = mods.score_mod(fn)
        texts = (sm.c_expr, sm.c_grad)
        cases.append(CCase(label, "score_mod", sm.program, texts, sm.int_params, sm.float_params, sm.arrays))
    rnd = random.Random(20241)
    for role, count in (("mask_mod", 40), ("score_mod", 60)):
        for i in range(count):
            text = Expressions(rnd, role).top(3)
            program = trace.trace(make_function(text, role, direct=False), role)
            names = SCORE_NAMES if role == "score_mod" else MASK_NAMES
            texts = tuple(program.c_text(out, names) for out in program.outputs)
            label = f"{role} {i}: {text}"
            cases.append(
                CCase(label, role, program, texts, program.int_params, program.float_params, program.arrays)
            )
    return tuple(cases)


# The lead's kernels/common.cuh helpers, verbatim from the interface.
CSA_HELPERS = """namespace csa {
__device__ __forceinline__ long long floordiv(long long a, long long b) { long long q = a / b;
return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
__device__ __forceinline__ long long floormod(long long a, long long b) { return a - floordiv(a, b) * b; }
}
"""


def _c_float(x) -> str:
    x = float(np.float32(x))
    if np.isnan(x):
        return "NAN"
    if np.isinf(x):
        return "INFINITY" if x > 0 else "(-INFINITY)"
    return f"{x.hex()}f"


def _c_list(values, form) -> str:
    return "{" + ", ".join(form(v) for v in values) + "}" if len(values) else "{0}"


def _slot_lines(i: int, case: CCase) -> list[str]:
    lines = [
        f"static const long long p{i}[] = {_c_list(case.ints, lambda v: f'{v}LL')};",
        f"static const float f{i}[] = {_c_list(case.floats, _c_float)};",
    ]
    pointers = []
    for j, a in enumerate(case.arrays):
        if a.dtype == np.int32:
            lines.append(f"static const int a{i}_{j}[] = {_c_list(a, lambda v: str(int(v)))};")
        else:
            lines.append(f"static const float a{i}_{j}[] = {_c_list(a, _c_float)};")
        pointers.append(f"a{i}_{j}")
    pointers += ["nullptr"] * (ARRAY_SLOTS - len(pointers))
    ints = ", ".join(f"(const int*){p}" for p in pointers)
    lines.append(f"static const Slots sl{i} = {{p{i}, f{i}, {{{', '.join(pointers)}}}, {{{ints}}}}};")
    return lines


# Random expressions may need more slots than the kernels take (8, 8, 4): the harnesses have room for them.
SLOTS, ARRAY_SLOTS = 32, 8
_SLOT_DEFINES = (
    [f"#define P{i} (sl.p[{i}])" for i in range(SLOTS)]
    + [f"#define SI{i} (sl.p[{i}])" for i in range(SLOTS)]
    + [f"#define SF{i} (sl.f[{i}])" for i in range(SLOTS)]
    + [f"#define A{i} (sl.a[{i}])" for i in range(ARRAY_SLOTS)]
    + [f"#define SA{i} (sl.sa[{i}])" for i in range(ARRAY_SLOTS)]
)


def host_program(cases, env) -> str:
    """A C++ program printing every case's value (and grad) at every grid point, as hex floats."""
    n = env["q"].size
    lines = [
        "#include <math.h>",
        "#include <stdio.h>",
        "#define __device__",
        "#define __forceinline__ inline",
        "typedef long long RuleInt;  // the kernels' 64-bit form of a mask",
        "static inline long long min(long long a, long long b) { return a < b ? a : b; }",
        "static inline long long max(long long a, long long b) { return a > b ? a : b; }",
        CSA_HELPERS,
        "struct Slots { const long long* p; const float* f; const void* sa[8]; const int* a[8]; };",
        *_SLOT_DEFINES,
        f"static const float S[] = {_c_list(env['s'], _c_float)};",
    ]
    lines += [
        f"static const long long {n.upper()}[] = {_c_list(env[n], lambda v: f'{v}LL')};" for n in "bhqk"
    ]
    for i, case in enumerate(cases):
        lines += _slot_lines(i, case)
        prints = " ".join(
            f'printf("%a ", (double)({t}));' if case.role == "score_mod" else f'printf("%d ", (int)({t}));'
            for t in case.texts
        )
        lines += [
            f"static void run{i}(const Slots& sl) {{",
            f"  for (int i = 0; i < {n}; ++i) {{",
            "    const float s = S[i]; const long long b = B[i], h = H[i], q = Q[i], k = K[i];",
            "    (void)s; (void)b; (void)h; (void)q; (void)k;",
            f'    {prints} printf("\\n");',
            "  }",
            "}",
        ]
    lines += ["int main() {", *(f"  run{i}(sl{i});" for i in range(len(cases))), "  return 0;", "}"]
    return "\n".join(lines) + "\n"


def device_source(cases) -> str:
    """One kernel per case, the slots as kernel arguments, as the lead's kernels see them."""
    lines = [CSA_HELPERS]
    lines += [f"#define P{i} (static_cast<RuleInt>(p_[{i}]))" for i in range(SLOTS)] + [
        f"#define SI{i} (p_[{i}])" for i in range(SLOTS)
    ]
    lines += [f"#define SF{i} (f_[{i}])" for i in range(SLOTS)]
    lines += [f"#define A{i} (a_[{i}])" for i in range(ARRAY_SLOTS)]
    lines += [f"#define SA{i} (sa_[{i}])" for i in range(ARRAY_SLOTS)]
    args = "const float* S, const long long* I, float* out, const long long* p_, const float* f_, "
    args += "const void* const* sa_, const int* const* a_"
    for i, case in enumerate(cases):
        body = " ".join(f"out[{j} * 256 + n] = (float)({t});" for j, t in enumerate(case.texts))
        # A mask in long long, and in int where the kernels take it so (RuleInt); a score mod in long long.
        narrow = case.role == "mask_mod" and all(
            narrowable(case.program, out) for out in case.program.outputs
        )
        types = ("int", "long long") if narrow else ("long long",)
        lines += [
            f"template <typename RuleInt> __global__ void case{i}({args}) {{",
            "  const int n = threadIdx.x; const float s = S[n];",
            "  const RuleInt b = I[n], h = I[256 + n], q = I[512 + n], k = I[768 + n];",
            f"  (void)s; (void)b; (void)h; (void)q; (void)k; {body}",
            "}",
            *(f"template __global__ void case{i}<{t}>({args});" for t in types),
        ]
    return "\n".join(lines) + "\n"


GXX = shutil.which("g++")
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(GXX is None, reason="no g++ to run the generated C on the host")
def test_c_text_runs_like_numpy(tmp_path):
    """Every case's C, compiled once with g++ and run, against its NumPy program: masks exactly; floats
    within twice the float32 program's own error against float64, plus a few ulps (transcendentals)."""
    cases = c_cases()
    env = grid(np.random.default_rng(3), 200)
    src = tmp_path / "mods.cpp"
    src.write_text(host_program(cases, env))
    exe = tmp_path / "mods"
    subprocess.run(
        [GXX, "-std=c++17", "-O0", "-w", str(src), "-o", str(exe)], check=True, capture_output=True
    )
    rows = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    n = env["q"].size
    assert len(rows) == n * len(cases)
    for i, case in enumerate(cases):
        block = [r.split() for r in rows[i * n : (i + 1) * n]]
        for j, output in enumerate(case.program.outputs):
            if case.role == "mask_mod":
                got = np.array([int(r[j]) for r in block], dtype=bool)
                assert np.array_equal(got, traced(case.program, output, env)), case.label
                continue
            got = np.array([float.fromhex(r[j]) for r in block])
            want64 = traced(case.program, output, env, np.float64)
            want32 = traced(case.program, output, env, np.float32).astype(np.float64)
            finite = np.isfinite(want64)
            assert np.array_equal(np.isfinite(got), finite), f"{case.label} [{output}]: inf/NaN differ"
            got, want64, want32 = got[finite], want64[finite], want32[finite]
            allowed = 2 * np.abs(want32 - want64) + 1e-5 * (1 + np.abs(want64))
            bad = np.flatnonzero(np.abs(got - want64) > allowed)
            assert bad.size == 0, f"{case.label} [{output}]: C {got[bad[:3]]}, NumPy {want64[bad[:3]]}"


@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the generated C for the GPU")
def test_c_text_compiles_for_the_gpu(tmp_path):
    """Every case as a kernel of one .cu file: one nvcc call for sm_80."""
    src = tmp_path / "mods.cu"
    src.write_text(device_source(c_cases()))
    result = subprocess.run(
        [NVCC, "-arch=sm_80", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "mods.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# ---- parameters, not values, in the C text ----------------------------------------------------------------
def test_new_values_keep_the_structure():
    rng = np.random.default_rng(0)
    pairs = {
        "window": (mods.sliding_window(64), mods.sliding_window(1000)),
        "literal": (lambda b, h, q, k: q - k < 128, lambda b, h, q, k: q - k < 7),
        "documents": (
            mods.document_mask(np.repeat([0, 1], [5, 9])),
            mods.document_mask(np.repeat([0, 1, 2, 3], [50, 90, 3, 1])),
        ),
        "prefix": (mods.prefix_lm(3), mods.prefix_lm(300)),
    }
    for label, (a, b) in pairs.items():
        ra, rb = mods.mask_rule(a), mods.mask_rule(b)
        assert ra.c_expr == rb.c_expr and ra.structure == rb.structure, label
        assert ra.params != rb.params or any(
            x.shape != y.shape for x, y in zip(ra.arrays, rb.arrays, strict=True)
        ), label
    score_pairs = {
        "softcap": (mods.softcap(20.0), mods.softcap(50.0)),
        "alibi": (mods.alibi(mods.alibi_slopes(4)), mods.alibi(mods.alibi_slopes(16))),
        "bias": (
            mods.relative_bias(rng.standard_normal((4, 63))),
            mods.relative_bias(rng.standard_normal((8, 9))),
        ),
        "composed": (
            mods.compose(mods.alibi(np.ones(2)), mods.softcap(3.0)),
            mods.compose(mods.alibi(np.ones(9)), mods.softcap(30.0)),
        ),
    }
    for label, (a, b) in score_pairs.items():
        sa, sb = mods.score_mod(a), mods.score_mod(b)
        assert (sa.c_expr, sa.c_grad, sa.structure) == (sb.c_expr, sb.c_grad, sb.structure), label
        assert (sa.int_params, sa.float_params) != (sb.int_params, sb.float_params), label


def test_structure_follows_dtype_and_rank():
    flat, flat_ints, square = np.zeros(8), np.zeros(8, np.int64), np.zeros((2, 4))
    one = mods.score_mod(lambda s, b, h, q, k: s + flat[q])
    ints = mods.score_mod(lambda s, b, h, q, k: s + flat_ints[q])
    assert one.structure != ints.structure
    two = mods.score_mod(lambda s, b, h, q, k: s + square[h, q])
    assert one.structure != two.structure and two.int_params == (2, 4)


def test_captured_numbers_are_one_parameter_each():
    w = 100
    rule = mods.mask_rule(lambda b, h, q, k: (q - k < w) & (k - q < w))
    assert rule.params == (100,) and rule.c_expr == "(((q - k) < P0) && ((k - q) < P0))"
    literal = mods.mask_rule(lambda b, h, q, k: (q - k < 100) & (k - q < 100))
    assert literal.params == (100, 100)


# ---- capture -----------------------------------------------------------------------------------------------
def test_arrays_are_captured_from_closures_defaults_globals_and_wrappers():
    ids = np.repeat(np.arange(4), [10, 25, 5, 24])
    q, k = np.arange(64)[:, None], np.arange(64)[None, :]
    want = ids[q] == ids[k]
    tensor = torch.from_numpy(ids)
    holder = {"ids": mods.captured(ids)}

    def with_default(b, h, q_idx, kv_idx, table=ids):
        return table[q_idx] == table[kv_idx]

    rules = {
        "closure": lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx],
        "torch": lambda b, h, q_idx, kv_idx: tensor[q_idx] == tensor[kv_idx],
        "default": with_default,
        "global": global_document,
        "wrapper": lambda b, h, q_idx, kv_idx: holder["ids"][q_idx] == holder["ids"][kv_idx],
        "nested": mods.and_masks(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]),
    }
    for label, fn in rules.items():
        rule = mods.mask_rule(fn)
        assert rule.c_expr is not None and len(rule.arrays) == 1, label
        assert np.array_equal(rule(0, 0, q, k), want), label
    with pytest.raises(TraceError, match="captured"):
        mods.mask_rule(lambda b, h, q_idx, kv_idx: [0, 1, 2][q_idx] == 0)


def test_indices_are_clamped():
    ids = np.array([3, 1, 4, 1, 5])
    sm = mods.score_mod(lambda s, b, h, q, k: s + ids[q - k])
    got = sm.evaluate(np.zeros(4, np.float32), 0, 0, np.array([0, 2, 9, 30]), np.array([3, 0, 1, 0]))
    assert got.tolist() == [3.0, 4.0, 5.0, 5.0]
    assert "min(max((q - k), 0LL), (SI0 - 1LL))" in sm.c_expr


def test_numbers_needed_concretely_are_traced_concretely():
    """A captured number used by Python itself (range) makes the first, symbolic trace fail: the second
    traces with captured numbers concrete, each use then its own parameter."""
    n = 3

    def any_shift(b, h, q, k):
        out = q == k
        for i in range(1, n):
            out = out | (q - k == i)
        return out

    rule = mods.mask_rule(any_shift)
    assert rule.params == (1, 2)
    q, k = np.arange(6)[:, None], np.arange(6)[None, :]
    assert np.array_equal(rule(0, 0, q, k), (q - k >= 0) & (q - k < 3))


def test_variables_floor_semantics_and_booleans():
    program = trace.trace(lambda b, h, q, k: ((q - k) // 4 == -1) & ~(h == 2), "mask_mod")
    assert program.variables == {"h", "q", "k"}
    d = np.arange(-9, 10)
    got = program.evaluate("value", dict(b=0, h=np.array([[0], [2]]), q=d, k=0))
    assert np.array_equal(got, np.array([[x // 4 == -1 for x in d], [False] * d.size]))
    assert program.c_text("value", MASK_NAMES) == "((csa::floordiv((q - k), 4) == P0) && (!(h == P1)))"


def test_docstring_examples():
    result = doctest.testmod(trace, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- errors ------------------------------------------------------------------------------------------------
def test_errors():
    nine = tuple(range(10, 19))
    cases = [
        (lambda b, h, q, k: q if q > k else k, TraceError, "truth value"),
        (lambda b, h, q, k: np.logical_and(q >= k, q < k + 3), TraceError, "cannot be traced"),
        (lambda b, h, q, k: q**2 > k, TraceError, r"\*\*"),
        (lambda b, h, q, k: q * 0.5 < k, NotCompilable, "integers only"),
        (lambda b, h, q, k: q / 2, NotCompilable, "returns a float"),
        (lambda b, h, q: q > 0, TypeError, "4 positional arguments"),
        (lambda b, h, q, k: sum(q * c for c in nine) > k, NotCompilable, "10 integer parameters"),
        (lambda b, h, q, k: M[q] > 0, TraceError, "one integer index per dimension"),
        (lambda b, h, q, k: T[q * 1.5] > 0, TraceError, "indexed with a float"),
        (lambda b, h, q, k: T[q:k] > 0, TraceError, "integer indices"),
        (lambda b, h, q, k: (q & 1.5) > 0, TraceError, "booleans or integers"),
        (lambda b, h, q, k: None, TraceError, "returned a NoneType"),
        (lambda b, h, q, k: float(q) > 1, TraceError, "converted to a Python number"),
    ]
    for fn, error, message in cases:
        with pytest.raises(error, match=message):
            mods.mask_rule(fn)
    arrays = [np.arange(3) + i for i in range(5)]
    with pytest.raises(NotCompilable, match="5 captured arrays"):
        mods.score_mod(lambda s, b, h, q, k: s + sum(a[q] for a in arrays))
    floats = tuple(0.5 + i for i in range(9))
    with pytest.raises(NotCompilable, match="9 float parameters"):
        mods.score_mod(lambda s, b, h, q, k: sum(s * c for c in floats))
    with pytest.raises(TypeError, match=r"score_mod must take 5 positional arguments"):
        mods.score_mod(lambda s, b, h, q: s)
    with pytest.raises(TypeError, match="must be a function"):
        mods.score_mod(3)
    for bad in (np.zeros(0), np.array(["a"]), np.array([2**40])):
        with pytest.raises((ValueError, TraceError)):
            mods.score_mod(lambda s, b, h, q, k, t=bad: s + t[q])
    with pytest.raises(ValueError, match="32-bit"):
        mods.captured(np.array([2**40]))
    with pytest.raises(TraceError, match="two different traces"):
        leaked = []
        mods.mask_rule(lambda b, h, q, k: leaked.append(q) or q > 0)
        mods.mask_rule(lambda b, h, q, k: leaked[0] > k)


def test_untraceable_from_mask_keeps_numpy_rules():
    fn = lambda b, h, q, k: np.logical_and(q >= k, q - k < 40)  # noqa: E731
    lay = patterns.from_mask(fn, block=16).layout(100)
    assert lay.rule.c_expr is None and lay == patterns.local(40, block=16).layout(100)
    floats = patterns.from_mask(lambda b, h, q, k: q / 2 >= k / 2, block=16).layout(64)
    assert floats.rule.c_expr is None and floats == patterns.causal(block=16).layout(64)


def test_division_of_values_known_non_negative_is_cs_own():
    """``//`` and ``%`` of a value >= 0 by one > 0 (indices, sums of them, positive parameters) print as C's
    ``/`` and ``%``, which agree with floor's there and keep the rule narrowable to 32 bits; where a sign is
    unknown (a difference, a negative parameter) they stay floor's ``csa::floordiv`` / ``csa::floormod``. A
    divisor known > 0 is spelled as a literal (a multiply and a shift, not a division at every element)."""

    def c(fn):
        return trace.trace(fn, "mask_mod").c_text("value", MASK_NAMES)

    assert c(lambda b, h, q, k: q // 64 >= k // 64) == "((q / 64) >= (k / 64))"
    assert c(lambda b, h, q, k: (q + 3) % 8 < (k % 8) + h) == "(((q + P0) % 8) < ((k % 8) + h))"
    assert narrowable(
        trace.trace(lambda b, h, q, k: (q // 128 - k // 128 < 8) | (k // 128 % 8 == 7), "mask_mod")
    )
    assert c(lambda b, h, q, k: (q - k) // 4 == 0) == "(csa::floordiv((q - k), 4) == P0)"
    assert c(lambda b, h, q, k: q // -4 == k) == "(csa::floordiv(q, P0) == k)"
    assert c(lambda b, h, q, k: (q - k) % 4 == 0) == "(csa::floormod((q - k), 4) == P0)"
    # A remainder of a divisor > 0 is >= 0, whatever its dividend: dividing it again is C's.
    assert c(lambda b, h, q, k: (q - k) % 8 // 2 == 1) == "((csa::floormod((q - k), 8) / 2) == P0)"


def test_a_comparison_anded_with_a_division_bounds_its_sign():
    """In ``a & b`` each operand counts only where the other holds, so a comparison there bounds a difference:
    ``(q - k) % d`` beside ``k <= q`` is C's ``%`` (a dilated causal window, narrowable to 32 bits). Beside
    ``|``, or outside the ``&``, nothing is known."""

    def c(fn):
        return trace.trace(fn, "mask_mod").c_text("value", MASK_NAMES)

    dilated = lambda b, h, q, k: ((q - k) % 3 == 0) & (k <= q)  # noqa: E731
    assert c(dilated) == "((((q - k) % 3) == P0) && (k <= q))" and narrowable(
        trace.trace(dilated, "mask_mod")
    )
    assert (
        c(lambda b, h, q, k: (k < q) & ((q - k - 1) // 2 == 0))
        == "((k < q) && (csa::floordiv(((q - k) - P0), 2) == P1))"
    )
    assert (
        c(lambda b, h, q, k: (k <= q) | ((q - k) % 3 == 0))
        == "((k <= q) || (csa::floormod((q - k), 3) == P0))"
    )


def test_a_where_choice_counts_only_where_its_condition_holds():
    """``torch.where(q >= n, (q - n) // 8, q // 8)`` (block diffusion's halves): the first choice is evaluated
    only where ``q >= n``, so its division is C's (narrowable); the second choice knows nothing more."""
    n = 40
    program = trace.trace(
        lambda b, h, q, k: torch.where(q >= n, (q - n) // 8, (q - n) // 8 + 9) == k, "mask_mod"
    )
    text = program.c_text("value", MASK_NAMES)
    assert text == "(((q >= P0) ? ((q - P0) / 8) : (csa::floordiv((q - P0), 8) + P1)) == k)", text
    assert not narrowable(program)


def test_flexattention_rules_narrow_to_32_bits_as_the_builtin_patterns():
    """A FlexAttention user's documents, windows and clamped neighbourhoods, written with torch, reach the
    kernels as expressions in their RuleInt, exact in 32-bit integers at these lengths as the built-in
    patterns' (`patterns.document`, `patterns.local`)."""
    doc = torch.as_tensor(np.repeat(np.arange(4), 1024))
    rules = {
        "document": lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k),
        "window": lambda b, h, q, k: (q - k).abs() <= 100,
        "clamped": lambda b, h, q, k: (k - q.clamp(64, 4000)).abs() <= 64,
    }
    for name, fn in rules.items():
        rule = patterns.from_mask(fn, block=128).layout(4096).rule
        assert "long long" not in rule.kernel_expr and "LL" not in rule.kernel_expr, name
        assert rule.narrow(4096 + 256) and not rule.narrow(1 << 31), name
    assert patterns.document(np.repeat(np.arange(4), 1024)).layout(4096).rule.narrow(4096 + 256)
