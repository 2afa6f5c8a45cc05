"""The kernel builder: specs, generated sources, and the compile check of every specialisation (no GPU)."""

from __future__ import annotations

import itertools
import shutil

import pytest

from cusparseattn import build, compile_check, tuning
from cusparseattn.analyses import KernelRule
from cusparseattn.mods import mask_rule

PORTABLE = [kernel for kernel in tuning.KERNELS if kernel not in tuning.ARCH and kernel not in tuning.PLAIN]
CAUSAL = compile_check.CAUSAL_RULE


def _rule(fn) -> KernelRule:
    return mask_rule(fn).kernel


def test_spec_name_lists_every_specialisation_argument():
    spec = build.KernelSpec.make("forward", "bfloat16", 128, "expr", CAUSAL)
    tm, tn, nw = spec.tiles
    assert spec.name.startswith(f"forward_bf16_d128_q{tm}k{tn}w{nw}_expr")
    other = build.KernelSpec.make(
        "forward", "bfloat16", 128, "expr", _rule(lambda b, h, q, k, off=0: k < q + off)
    )
    assert other.name != spec.name and other != spec


def test_rule_values_stay_out_of_the_source():
    """A new window size is a new P0 value, not new code: the source depends on the expression alone."""
    spec = build.KernelSpec.make("forward", "float16", 64, "expr", _rule(lambda b, h, q, k, w=7: q - k < w))
    assert "#define CSA_RULE(b, h, q, k) (((q - k) < P0))" in spec.source()
    assert '#include "' not in spec.source()  # the header is inlined: the source text is the whole cache key


def test_a_band_rule_defines_its_bounds():
    """A rule that is one run of keys a query (`cusparseattn.analyses.band`) gives its bounds, which the
    kernels mask a row of a partial tile by, and so does one that is a run of queries a key, for the
    backward's tiles whose rows are keys; any other rule says it has none."""
    two_sided = _rule(lambda b, h, q, k, w=9: (q - k < w) & (k - q < w))
    source = build.KernelSpec.make("backward_sm90", "bfloat16", 64, "expr", two_sided).source()
    assert "#define RULE_BAND 1" in source and "#define RULE_QBAND 1" in source
    assert "#define CSA_RULE_FIRST(b, h, q) (((q - P0) + 1))" in source
    assert "#define CSA_RULE_LAST(b, h, q) (((q + P0) - 1))" in source
    assert "#define CSA_RULE_QFIRST(b, h, k) (((k - P0) + 1))" in source
    assert "#define CSA_RULE_QLAST(b, h, k) (((k + P0) - 1))" in source
    causal = _rule(lambda b, h, q, k, off=0: k <= q + off)
    causal = build.KernelSpec.make("forward_sm90", "bfloat16", 64, "expr", causal).source()
    assert "#define CSA_RULE_LAST(b, h, q) ((q + P0))" in causal and "#define CSA_RULE_FIRST" not in causal
    assert "#define CSA_RULE_QFIRST(b, h, k) ((k - P0))" in causal and "#define CSA_RULE_QLAST" not in causal
    keys_only = _rule(lambda b, h, q, k, s=3: (k <= q) & (k >= s))
    keys_only = build.KernelSpec.make("forward", "bfloat16", 64, "expr", keys_only).source()
    assert "#define RULE_BAND 1" in keys_only and "#define RULE_QBAND 0" in keys_only
    other = _rule(lambda b, h, q, k, s=3: (k <= q) | (k < s))
    other = build.KernelSpec.make("forward_sm90", "bfloat16", 64, "expr", other).source()
    assert "#define RULE_BAND 0" in other and "#define CSA_RULE_LAST" not in other
    assert "#define RULE_QBAND 0" in other and "#define CSA_RULE_QFIRST" not in other


def test_score_mod_specialises_the_source_not_its_values():
    spec = build.KernelSpec.make("backward_dq", "bfloat16", 64, score=compile_check.SAMPLE_SCORE)
    source = spec.source()
    assert f"#define CSA_SCORE(s, b, h, q, k) ({compile_check.SAMPLE_SCORE[0]})" in source
    assert f"#define CSA_SCORE_GRAD(s, b, h, q, k) ({compile_check.SAMPLE_SCORE[1]})" in source
    assert "#define SCORE_MOD 1" in source and "#define SF0 (p.score_fp[0])" in source
    plain = build.KernelSpec.make("backward_dq", "bfloat16", 64)
    assert "#define SCORE_MOD 0" in plain.source() and "CSA_SCORE(" not in plain.prelude()
    assert "_score" in spec.name and spec.name != plain.name
    assert spec.tiles[1] <= tuning.MAX_TILES["backward_dq"]["score"][1] < plain.tiles[1]


def test_bit_masks_and_score_mods_take_the_hopper_dq_pass_to_smaller_key_tiles():
    plain = build.KernelSpec.make("backward_dq_sm90", "bfloat16", 64, "expr", CAUSAL)
    bits = build.KernelSpec.make("backward_dq_sm90", "bfloat16", 64, "bits")
    assert bits.tiles[1] <= tuning.MAX_TILES["backward_dq_sm90"]["bits"][1] < plain.tiles[1]
    score = build.KernelSpec.make(
        "backward_dq_sm90", "bfloat16", 64, "expr", CAUSAL, score=compile_check.SAMPLE_SCORE
    )
    assert score.tiles[1] <= tuning.MAX_TILES["backward_dq_sm90"]["score"][1] < plain.tiles[1]
    portable = build.KernelSpec.make("backward_dq", "bfloat16", 64, "bits")
    assert portable.tiles == tuning.tile_config("backward_dq", 64)  # the portable pass has room for them


def test_the_fused_backward_visits_64_queries_at_head_dim_64_with_a_score_mod():
    plain = build.KernelSpec.make("backward_sm90", "bfloat16", 64, "expr", CAUSAL)
    score = build.KernelSpec.make(
        "backward_sm90", "bfloat16", 64, "expr", CAUSAL, score=compile_check.SAMPLE_SCORE
    )
    assert plain.tiles == (128, 128, 12) and score.tiles == (64, 128, 12)
    assert "#define KV_BUFFERS 1" in plain.prelude() and "#define KV_BUFFERS 2" in score.prelude()
    at_128 = build.KernelSpec.make("backward_sm90", "bfloat16", 128, score=compile_check.SAMPLE_SCORE)
    assert at_128.tiles == (64, 128, 12)


@pytest.mark.parametrize(("head_dim", "wide"), [(64, (192, 128, 16)), (128, (128, 192, 12))])
def test_the_hopper_forward_may_take_wide_tiles(head_dim, wide):
    """Three consumers (192 query rows) at head dim 64, 192 keys at 128, where cuda._wide_pays asks."""
    assert tuning.WIDE_TILES["forward_sm90"][head_dim] == wide
    assert tuning.tile_config("forward_sm90", head_dim, wide=True) == wide
    assert tuning.tile_config("forward_sm90", head_dim) == (128, 128, 12)  # unless cuda._wide_pays asks
    # Not with a score mod (it would spill) nor with a layout's bit masks.
    assert tuning.tile_config("forward_sm90", head_dim, score=True, wide=True) == (128, 128, 12)
    assert tuning.tile_config("forward_sm90", head_dim, bits=True, wide=True) == (128, 128, 12)
    # Nor with a rule evaluated at each element (no band): it spills there (test_cuda_dispatch).
    assert tuning.tile_config("forward_sm90", head_dim, elementwise=True, wide=True) == (128, 128, 12)
    assert tuning.tile_config("forward", head_dim, wide=True) == tuning.tile_config("forward", head_dim)
    names = [s.name for s in compile_check.all_specs()]
    shape = f"q{wide[0]}k{wide[1]}w{wide[2]}"
    assert any(n.startswith(f"forward_sm90_f16_d{head_dim}_{shape}_none") for n in names)
    assert any(n.startswith(f"forward_sm90_bf16_d{head_dim}_{shape}_expr") for n in names)
    # The next item's Q in a second buffer, but beside key tiles of 192 (head dim 128), whose two K and two V
    # buffers leave room for one; a third V buffer with key tiles of 128 at 128. Out staged in the Q buffer
    # where there are two, but on the 128-row tiles at head dim 64.
    narrow = tuning.tile_config("forward_sm90", head_dim)
    for tiles in (wide, narrow):
        q_buffers = 1 if head_dim == 128 and tiles[1] == 192 else 2
        v_stages = 3 if head_dim == 128 and tiles[1] == 128 else 2
        staged = q_buffers == 2 and (head_dim == 128 or tiles[0] == 192)
        q_rows = 64 if staged else tiles[0]  # a Q copy: a consumer's rows where out is staged from them
        assert tuning.forward_q_buffers(head_dim, tiles) == q_buffers
        assert tuning.forward_v_stages(head_dim, tiles) == v_stages
        assert tuning.forward_stage_out(head_dim, tiles) == staged
        assert tuning.forward_q_rows(head_dim, tiles) == q_rows
        prelude = build.KernelSpec.make("forward_sm90", "bfloat16", head_dim, tiles=tiles).prelude()
        defines = (f"Q_BUFFERS {q_buffers}", "STAGES 2", f"V_STAGES {v_stages}", f"STAGE_OUT {int(staged)}")
        defines += (f"Q_ROWS {q_rows}",)
        for define in defines:
            assert f"#define {define}\n" in prelude
        # A full tile's step in its own copy at head dim 128 and on the 192-row tiles at 64 (two copies ran
        # slower on the 128-row ones), which also step their descriptors with 64-bit adds.
        three_consumers = tiles[0] == 192
        assert f"#define SPLIT_STEPS {int(head_dim == 128 or three_consumers)}" in prelude
        assert f"#define DESC_ADD64 {int(three_consumers)}" in prelude
        # The row max of the raw scores, scaled once, but on the narrow tiles at head dim 64.
        assert f"#define SCALED_MAX {int(head_dim == 64 and tiles == narrow)}" in prelude
        # A row's max lags its scores by up to 2^8 on the 192-row tiles alone.
        assert f"#define LAGGING_MAX {int(three_consumers)}" in prelude
        assert tuning.shared_bytes("forward_sm90", head_dim, tiles) <= 227 * 1024  # an H100 holds it


def test_the_fused_backward_and_the_wide_forward_step_their_descriptors_with_64_bit_adds():
    """tuning.descriptor_add64: the fused backward steps its wgmma descriptors with one 64-bit add (x1.00 to
    x1.02), as do the forward's 192-row tiles; the forward's default tiles (so stepped, x0.93 to x0.95 on
    the 128-row ones at head dim 64) and the two backward passes add to the low word and join the high word
    back in."""
    for kernel in tuning.ARCH:
        for head_dim in tuning.HOPPER_HEAD_DIMS:
            prelude = build.KernelSpec.make(kernel, "bfloat16", head_dim).prelude()
            assert f"#define DESC_ADD64 {int(kernel == 'backward_sm90')}" in prelude


def test_only_the_hopper_forward_sleeps_between_tries_of_a_barrier_wait():
    """tuning.barrier_sleeps: the forward's threads sleep until a barrier moves (its producer had spun 211
    tries a key tile); the backward passes, whose waits asleep ran x0.97 to x0.99, try again at once."""
    for kernel in tuning.ARCH:
        prelude = build.KernelSpec.make(kernel, "bfloat16", 128).prelude()
        assert f"#define BARRIER_SLEEPS {int(kernel == 'forward_sm90')}" in prelude
    assert "BARRIER_SLEEPS" not in build.KernelSpec.make("forward", "bfloat16", 128).prelude()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"rule_mode": "bogus"}, "rule_mode"),
        ({"rule_mode": "expr"}, "rule is given"),
        ({"kernel": "sideways"}, "kernel"),
        ({"score": ("s",)}, "derivative"),
    ],
)
def test_bad_specs_are_refused(kwargs, match):
    args = {"kernel": "forward", "dtype": "float16", "head_dim": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        build.KernelSpec.make(**args)


@pytest.mark.parametrize("kernel", PORTABLE)
def test_tile_table_covers_every_supported_head_dim(kernel):
    for head_dim in range(8, 257, 8):
        tm, tn, nw = tuning.tile_config(kernel, head_dim)
        # One warp per 16 query rows, or per 16 keys in the dK/dV pass.
        assert (tn if kernel == "backward_dkdv" else tm) == 16 * nw and tm % 16 == 0 and tn % 16 == 0
    with pytest.raises(ValueError, match="head dim"):
        tuning.tile_config(kernel, 264)


@pytest.mark.parametrize("kernel", PORTABLE)
@pytest.mark.parametrize("max_shared", [227 * 1024, 163 * 1024, 99 * 1024])  # H100, A100, sm_86/89
def test_every_device_gets_tiles_that_fit(kernel, max_shared):
    for head_dim in range(8, 257, 8):
        tiles = tuning.tile_config(kernel, head_dim, max_shared)
        assert tuning.shared_bytes(kernel, head_dim, tiles) <= max_shared
    with pytest.raises(ValueError, match="shared memory"):
        tuning.tile_config(kernel, 128, 16 * 1024)


def test_shared_memory_fits_a_hopper_sm():
    for spec in filter(lambda s: isinstance(s, build.KernelSpec), compile_check.all_specs()):
        assert spec.shared_bytes <= 227 * 1024, spec.name
        assert f"#define SHARED_BYTES {spec.shared_bytes}" in spec.prelude()


def test_the_compile_check_takes_every_specialisation_to_its_architectures():
    """`.ci/run`'s nvcc-sweep step (``python -m cusparseattn.compile_check --check sm_80 sm_90``) compiles
    each spec for both architectures, the Hopper ones for sm_90a alone, and only for sm_9x."""
    targets = compile_check.compile_targets(["sm_80", "sm_90"])
    assert list(targets) == compile_check.all_specs()
    for spec, archs in targets.items():
        assert archs == (["sm_90a"] if spec.arch else ["sm_80", "sm_90"]), spec.name
    for kernel in tuning.ARCH:
        assert any(spec.name.startswith(f"{kernel}_bf16_d128") for spec in targets)
    assert all(
        archs == ([] if spec.arch else ["sm_80"])
        for spec, archs in compile_check.compile_targets(["sm_80"]).items()
    )


def test_a_jobs_key_is_its_source_compiler_and_architecture():
    """A record holds a job by the hash of what decides its code: the same spec, compiler and arch give the
    same key in any process, and a change of any of them another."""
    specs = [build.KernelSpec.make("forward", "bfloat16", 64, "expr", CAUSAL), build.RuleSpec(CAUSAL)]
    first = compile_check.jobs(["sm_80", "sm_90"], specs, "nvcc 1")
    assert [(j.spec, j.arch) for j in first] == [(s, a) for s in specs for a in ("sm_80", "sm_90")]
    assert first == compile_check.jobs(["sm_80", "sm_90"], specs, "nvcc 1")
    keys = {j.key for j in first} | {j.key for j in compile_check.jobs(["sm_80", "sm_90"], specs, "nvcc 2")}
    assert len(keys) == 2 * len(first)


def test_a_record_compiles_what_it_lacks_and_checks_one_drawn_job_a_family(tmp_path):
    """With a record, the check compiles every job whose key the record lacks, and of the jobs it holds one
    per pass and architecture, whose registers must be the record's; the record reads back what it wrote."""
    import random

    specs = [
        build.KernelSpec.make("forward", dtype, d, "expr", CAUSAL)
        for dtype in build.HALF_DTYPES
        for d in (64, 128)
    ] + [build.KernelSpec.make("backward_dq", "bfloat16", 64)]
    all_jobs = compile_check.jobs(["sm_80", "sm_90"], specs, "nvcc test")
    held = {job: 100 + i for i, job in enumerate(all_jobs) if job.spec.head_dim == 64}
    path = tmp_path / "record.txt"
    compile_check.write_record(path, held, "the test", "nvcc test")
    record = compile_check.read_record(path)
    assert record == {job.key: registers for job, registers in held.items()}
    for seed in range(5):
        to_compile, drawn = compile_check.plan(all_jobs, record, random.Random(seed))
        assert {j for j in all_jobs if j.key not in record} == set(to_compile) - drawn
        assert sorted(j.family for j in drawn) == sorted({j.family for j in held})
        assert to_compile == [j for j in all_jobs if j in set(to_compile)]  # in the sweep's order
    assert compile_check.plan(all_jobs, {}, random.Random(0)) == (all_jobs, set())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_one_specialisation_compiles_without_spills_into_a_record_that_checks_it(tmp_path, capsys):
    """The path of the compile check on one spec; `.ci/run`'s nvcc-sweep step runs it on all of them. A
    passing sweep with ``update`` writes its record; a check against a record whose registers differ from
    what the compiler gives fails; an update compiles only what the record lacks (and the drawn jobs)."""
    spec = build.KernelSpec.make("forward", "bfloat16", 64, "expr", CAUSAL)
    path = tmp_path / "record.txt"
    failures = compile_check.check(["sm_80"], [spec], record=path, update=True)
    report = capsys.readouterr().out
    assert failures == 0, report
    assert f"ok   sm_80 {spec.name}: " in report and "1 of 1 compiled for sm_80: 1 not in" in report
    ((key, registers),) = compile_check.read_record(path).items()
    written = path.read_text()
    path.write_text(written.replace(f" {registers}\n", f" {registers + 1}\n"))
    assert compile_check.check(["sm_80"], [spec], record=path, seed=7) == 1
    report = capsys.readouterr().out
    assert f"{registers} registers where the record says {registers + 1}" in report
    assert "1 of 1 compiled for sm_80: 0 not in" in report and "1 drawn from it (seed 7)" in report
    path.write_text(written)
    rule = build.RuleSpec(CAUSAL)
    assert compile_check.check(["sm_80"], [spec, rule], record=path, update=True) == 0
    report = capsys.readouterr().out
    assert "2 of 2 compiled for sm_80: 1 not in" in report and "recorded 2 jobs" in report
    record = compile_check.read_record(path)
    assert len(record) == 2 and record[key] == registers


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_compile_check_takes_nvrtcs_code_on_request(capsys):
    """``--nvrtc``: NVRTC's PTX through ptxas, the registers and spills of the code the run time loads."""
    spec = build.KernelSpec.make("forward", "bfloat16", 64, "expr", CAUSAL)
    failures = compile_check.check(["sm_80"], [spec], nvrtc=True)
    report = capsys.readouterr().out
    if "--nvrtc needs libnvrtc" in report:
        pytest.skip("libnvrtc is not installed")
    assert failures == 0, report
    assert "registers of NVRTC's PTX" in report and f"ok   sm_80 {spec.name}: " in report


# The Hopper pass whose scratch each PLAIN pass reads by that pass's query tiles.
BESIDE = {
    "backward_stats": "backward_sm90",
    "backward_dq_convert": "backward_sm90",
    "forward_combine": "forward_sm90",
}


@pytest.mark.parametrize("kernel", sorted(BESIDE))
def test_plain_passes_take_the_query_tiles_of_the_pass_beside_them_and_no_layout(kernel):
    """The fused backward's first and last passes address its dQ sums and counters by its query tiles, the
    forward's combine pass its split rows' parts: a spec for each of that pass's tilings (with a score mod,
    wide)."""
    beside = BESIDE[kernel]
    for head_dim in tuning.HOPPER_HEAD_DIMS:
        assert tuning.tile_config(kernel, head_dim) == tuning.edge_tiles(tuning.tile_config(beside, head_dim))
        for score, wide in itertools.product((False, True), repeat=2):
            tiles = tuning.tile_config(beside, head_dim, score=score, wide=wide)
            tm, _, nw = tuning.edge_tiles(tiles)
            assert tm == tiles[0] == 16 * nw
            spec = build.KernelSpec.make(kernel, "float16", head_dim, tiles=(tm, 64, nw))
            assert spec.shared_bytes == 0 and spec in compile_check.all_specs()
    with pytest.raises(ValueError, match="no layout rule or score mod"):
        build.KernelSpec.make(kernel, "bfloat16", 128, "bits")
    with pytest.raises(ValueError, match="no layout rule or score mod"):
        build.KernelSpec.make(kernel, "bfloat16", 128, score=compile_check.SAMPLE_SCORE)


HOPPER = sorted(tuning.ARCH)


@pytest.mark.parametrize("kernel", HOPPER)
@pytest.mark.parametrize("head_dim", tuning.HOPPER_HEAD_DIMS)
def test_hopper_spec_needs_sm90a_and_carries_its_wgmma_functions(kernel, head_dim):
    spec = build.KernelSpec.make(kernel, "bfloat16", head_dim, "bits")
    assert spec.arch == "sm_90a" and spec.threads == 384
    assert "-arch=sm_90a" in build.nvrtc_options(spec.arch)
    prelude = spec.prelude()
    # Products with N = the key tile (scores), the query tile (transposed scores) and the head dim (outputs).
    for n in sorted({*spec.tiles[:2], head_dim}):
        assert f"void wgmma_ss<{n}>" in prelude and f"void wgmma_rs<{n}>" in prelude
        assert f"m64n{n}k16.f32.bf16.bf16 {{%0, " in prelude and f"%{n // 2 - 1}}}" in prelude
    assert "f16.f16" in build.KernelSpec.make(kernel, "float16", head_dim).prelude()
    if kernel.removesuffix("_sm90") in tuning.TILES:  # its portable counterpart
        assert build.KernelSpec.make(kernel.removesuffix("_sm90"), "bfloat16", head_dim).arch is None


def test_hopper_shared_memory_is_the_kernels_struct_and_its_alignment():
    # Forward, D = 128: two Q buffers, two of K and three of V (128 x 128 each: forward_v_stages), 14
    # barriers, padded to 1 KiB, and 1 KiB to align; D = 64: two Q buffers, two stages, 12 barriers.
    assert tuning.shared_bytes("forward_sm90", 128, (128, 128, 12)) == 7 * 32768 + 1024 + 1024
    assert tuning.shared_bytes("forward_sm90", 64, (128, 128, 12)) == 6 * 16384 + 1024 + 1024
    # Key tiles of 192 at D = 128: one Q buffer, two stages of K and V (192 x 128), 10 barriers.
    assert tuning.shared_bytes("forward_sm90", 128, (128, 192, 12)) == 32768 + 4 * 49152 + 1024 + 1024
    # dQ: Q and dO (128 x 128), two stages of K and V (64 x 128).
    assert tuning.shared_bytes("backward_dq_sm90", 128, (128, 64, 12)) == 4 * 32768 + 1024 + 1024
    # dK/dV: K and V (128 x 128), three stages of Q and dO (64 x 128) and of their lse and delta (1.5 KiB in
    # all), 7 barriers, padded to 1 KiB, and 1 KiB to align.
    assert tuning.shared_bytes("backward_dkdv_sm90", 128, (64, 128, 12)) == 5 * 32768 + 2048 + 1024
    # Fused, which starts where dynamic shared memory does (no 1 KiB to align): K and V, two stages of Q and
    # dO, two dS tiles (64 x 128), two fp32 dQ shares (64 x 128), 1 KiB of statistics, 128 bytes of Visits
    # and 18 barriers, padded.
    assert tuning.shared_bytes("backward_sm90", 128, (64, 128, 12)) == 226 * 1024
    # At D = 64, visits of 128 queries: one buffer of K and V (128 x 64), two stages of Q and dO (128 x 64),
    # two dS tiles (128 x 128), two fp32 dQ shares (128 x 64) and 2 KiB of statistics: 226 KiB, then the
    # Visits and barriers, padded: the most an H100 block may have.
    assert tuning.shared_bytes("backward_sm90", 64, (128, 128, 12)) == 227 * 1024
    for kernel in HOPPER:
        for head_dim in tuning.HOPPER_HEAD_DIMS:
            assert build.KernelSpec.make(kernel, "float16", head_dim).shared_bytes <= 227 * 1024


@pytest.mark.parametrize("kernel", HOPPER)
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_hopper_spec_refuses_partial_panels(kernel, head_dim):
    with pytest.raises(ValueError, match="head dim"):
        build.KernelSpec.make(kernel, "bfloat16", head_dim)


def test_rule_spec_source():
    spec = build.RuleSpec(_rule(lambda b, h, q, k, n=-4: q // n == k // n))
    source = spec.source()
    assert "#define CSA_RULE(b, h, q, k) ((csa::floordiv(q, P0) == csa::floordiv(k, P0)))" in source
    assert "long long floordiv" in source and '#include "' not in source
    assert spec.name != build.RuleSpec(_rule(lambda b, h, q, k: q >= k)).name
    assert build.MASK_PARAMS.isalignedstruct and "rule_a" in build.MASK_PARAMS.names
