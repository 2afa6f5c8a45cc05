"""The kernel builder: one `KernelSpec` per compiled unit, compiled with NVRTC through CuPy and cached.

A spec names everything that changes the machine code (pass, dtype, head dim, tiles, mask kind and the rule's
C expression; never a rule's parameter values or a sequence length). Its source is a generated prelude of
``#define`` lines followed by the unchanged kernel file with its header inlined, so CuPy's disk cache, keyed
on the whole source text, the options, the architecture and the NVRTC version, never serves a stale binary.

Numerics: CuPy appends ``-ftz=true`` to NVRTC's options, so fp32 denormals flush to zero. Softmax terms that
small (< 2^-126) are far below what an fp16/bf16 output or an fp32 sum can show, and the tests compare every
kernel with the float64 reference, so the kernels accept it. No ``-use_fast_math``: exp2f/logf are the precise
single-precision functions.

``python -m cusparseattn.build --check sm_80 sm_90`` compiles every specialisation with nvcc and fails on
register spills (a step of ``.ci/run`` where nvcc is installed; no GPU needed).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from dataclasses import dataclass

import numpy as np

from . import env
from .rules import key_band, narrowable, query_band

log = logging.getLogger("cusparseattn")

DTYPES = {"float16": 0, "bfloat16": 1}
RULE_MODES = {"none": 0, "expr": 1, "bits": 2}


def edge_tiles(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """The tiles of a PLAIN pass beside a Hopper pass of `tiles` whose scratch it reads by that pass's query
    tiles (the fused backward's first and last passes, the forward's combine pass): its query tiles, a warp
    for each 16."""
    return tiles[0], 64, tiles[0] // 16


# The fused backward (dK, dV and dQ in one pass, dQ summed in a fixed order): two consumers of 64 keys, 128
# queries a visit at head dim 64 (64 with a score mod: MAX_TILES), 64 at 128.
FUSED_BACKWARD_TILES = {64: [(128, 128, 12), (64, 128, 12)], 128: [(64, 128, 12)]}

# Kernel tiles (TILE_M queries, TILE_N keys, NWARPS) per pass and padded head dim, in order of preference: a
# device takes the first whose shared memory fits (an H100 has 227 KiB per block, an A100 163, sm_86/89 99).
# Forward and dQ: one warp per 16 query rows; dK/dV: one warp per 16 keys. Each list puts the fastest tile
# first, then smaller ones for devices with less shared memory (docs/tuning.md: TILES).
TILES = {
    "forward": {
        64: [(128, 128, 8), (64, 64, 4)],
        128: [(128, 128, 8), (128, 64, 8), (64, 64, 4)],
        256: [(64, 32, 4), (64, 16, 4)],
    },
    "backward_dq": {
        64: [(128, 128, 8), (128, 64, 8), (64, 64, 4)],
        128: [(128, 64, 8), (64, 32, 4)],
        256: [(64, 32, 4), (32, 16, 2)],
    },
    "backward_dkdv": {
        64: [(64, 128, 8), (32, 64, 4)],
        # 32 queries per step: 64 would be faster but spill 16 bytes of the accumulators.
        128: [(32, 128, 8), (32, 64, 4)],
        256: [(32, 64, 4), (16, 32, 2)],
    },
    # One producer and two consumer warpgroups of 64 query rows (64 keys in the dK/dV pass). The dQ pass keeps
    # S, dP and dQ in registers: key tiles of 128 fit at head dim 64 only, where they beat key tiles of 64.
    "forward_sm90": {128: [(128, 128, 12)]},
    "backward_dq_sm90": {64: [(128, 128, 12), (128, 64, 12)], 128: [(128, 64, 12)]},
    "backward_dkdv_sm90": {128: [(64, 128, 12)]},
    # The fused backward, and its first and last passes over query tiles of its size.
    "backward_sm90": FUSED_BACKWARD_TILES,
    **{
        kernel: {d: [edge_tiles(t) for t in ts] for d, ts in FUSED_BACKWARD_TILES.items()}
        for kernel in ("backward_stats", "backward_dq_convert")
    },
    # The Hopper forward's split rows (schedule.work_order), by its query tiles: edge_tiles of its own and
    # of its WIDE_TILES.
    "forward_combine": {64: [(128, 64, 8), (192, 64, 12)], 128: [(128, 64, 8)]},
}
# Passes that read no layout and no score mod: one kernel serves every layout (cuda.py builds them plain).
PLAIN = ("backward_stats", "backward_dq_convert", "forward_combine")
# Hopper kernels (sm_90a: TMA, wgmma, a producer warpgroup) take head dims of whole 64-element panels.
HOPPER_HEAD_DIMS = (64, 128)
# Buffers of each Hopper pass's ring (hopper.cuh's STAGES; the forward's of K, forward_v_stages gives V's):
# the dK/dV pass holds a (Q, dO) slot until the next use's scores are issued, so it takes more to keep its
# loads ahead. The forward keeps two of K: at head dim 128 a third buffer of V alone (forward_v_stages) keeps
# its loads ahead beside the second Q buffer, and at head dim 64 a third buffer does not pay.
HOPPER_STAGES = {"forward_sm90": 2, "backward_dq_sm90": 2, "backward_dkdv_sm90": 3, "backward_sm90": 2}
ARCH = dict.fromkeys(HOPPER_STAGES, "sm_90a")
KERNELS = tuple(TILES)
# Wider tiles that a pass may take over a layout (cuda.py weighs them against its default tiles), for each
# head dim: the forward at 64 with three consumers (192 query rows), as FlashAttention-3/4, whose softmax is
# as long as its products, which two consumers cannot both hide; at 128 with key tiles of 192
# (FlashAttention-3 takes 176), fewer steps of fixed cost (waits, turns, the row maxima's shuffles, the
# output's rescale) for the same products. They lose where the query length pads to a wide tile or a row
# visits more keys than it needs, so the deal weighs them: WIDE_TILE_COST is a wide tile's time against a
# default one's, fitted on the forward's runs (docs/tuning.md: WIDE_TILE_COST). Not with a score mod (it
# spills: 160 registers a consumer of three, and beside 192 columns of scores at 128) nor with a layout's bit
# masks.
WIDE_TILES = {"forward_sm90": {64: (192, 128, 16), 128: (128, 192, 12)}}
WIDE_TILE_COST = {64: 1.34, 128: 1.44}
# What a partial wide tile (one that crosses the layout's blocks, or its rule) costs more than a full one,
# in full tiles, fitted on runs of every layout on wide tiles (docs/tuning.md: WIDE_PARTIAL_COST). It is
# larger at 128: key tiles of 192 cross blocks of 128 in two of every three tiles, and with one Q buffer a
# short row waits for its Q.
WIDE_PARTIAL_COST = {64: 0.2, 128: 1.0}
# The largest (TILE_M, TILE_N) of a pass with a score mod or a layout's bit masks, which keep more beside the
# scores: the dQ passes' key tiles of 128 spill at head dim 64 with the mod's derivative or the masks' words,
# and the fused backward's visits of 128 queries (head dim 64) with a score mod.
MAX_TILES = {
    "backward_dq": {"score": (256, 64)},
    "backward_dq_sm90": {"bits": (256, 64), "score": (256, 64)},
    "backward_sm90": {"score": (64, 256)},
}


def pad_head_dim(head_dim: int) -> int:
    """The head dim the kernels run at, and the key of the tables by head dim: the next multiple of 16 (an
    MMA's reduction step)."""
    return -(-head_dim // 16) * 16


def fused_kv_buffers(head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The fused backward's buffers of K and V (its KV_BUFFERS): two at head dim 64 with visits of 64
    queries, so that an item's copies, and its first visits' Q and dO behind them, start while the item before
    runs (short columns, local1024, wait for them otherwise); one at 128, or with visits of 128 queries, where
    its shared memory holds no more."""
    return 2 if head_dim <= 64 and tiles[0] <= 64 else 1


def forward_q_buffers(head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The Hopper forward's Q buffers (its Q_BUFFERS): two, so that the next item's Q is copied while this one
    runs (short rows, a narrow window, notice), but one with key tiles of 192 at head dim 128, where two
    buffers of K and of V take the rest of the 227 KiB."""
    return 1 if head_dim > 64 and tiles[1] > 128 else 2


def forward_v_stages(head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The Hopper forward's buffers of V (its V_STAGES; K takes HOPPER_STAGES'): three with key tiles of 128
    at head dim 128, two elsewhere. V_i is held a step longer than K_i (until O += P_i V_i lands, in step
    i + 1), so a third V buffer keeps the in-order copies a tile further ahead, where a third K buffer would
    not; with two K buffers the 227 KiB hold a second Q buffer too (docs/tuning.md: forward_v_stages)."""
    return 3 if head_dim > 64 and tiles[1] <= 128 else HOPPER_STAGES["forward_sm90"]


def forward_stage_out(head_dim: int, tiles: tuple[int, int, int]) -> bool:
    """Whether the Hopper forward writes a row's output through its Q buffer and a TMA store (its STAGE_OUT)
    instead of from registers: with two Q buffers at head dim 128 and on the 192-row tiles at 64. From
    registers, a row's end costs nearly two tiles' time at head dim 128, most of it the stores; the 128-row
    tiles at head dim 64 gain nothing overall from staging and keep the stores from registers. The consumers
    issue their own stores: a storer thread of the producer warpgroup is slower (docs/tuning.md:
    forward_stage_out)."""
    return forward_q_buffers(head_dim, tiles) > 1 and (head_dim > 64 or tiles[0] > 128)


def forward_q_rows(head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The rows of each of the Hopper forward's Q copies (its Q_ROWS, and the box of cuda.Forward's q map):
    a consumer's 64 where out is staged (forward_stage_out), so that its rows of the tile, all panels, are
    the contiguous 64-row tile that the out map's stores read; the whole query tile elsewhere (two copies of
    64 are slower on the 128-row tiles at head dim 64, one panel)."""
    return 64 if forward_stage_out(head_dim, tiles) else tiles[0]


def forward_split_steps(head_dim: int, tiles: tuple[int, int, int]) -> bool:
    """Whether the Hopper forward runs a full tile's step in its own copy without the mask (its SPLIT_STEPS):
    at head dim 128, and on the 192-row tiles at 64 (three consumers), where ptxas then waits for O += P V
    partway through the softmax instead of at its top. The 128-row tiles at head dim 64 are slower in two
    copies and keep one (docs/tuning.md: forward_split_steps)."""
    return head_dim > 64 or tiles[0] > 128


def forward_scaled_max(head_dim: int, tiles: tuple[int, int, int]) -> bool:
    """Whether the Hopper forward scales its scores before the row max (its SCALED_MAX: a pair at a time,
    TILE_N / 4 more FMULs a step) instead of scaling the max of the raw scores once, as FlashAttention-4
    does: on the narrow tiles at head dim 64 only, which are slower with the max scaled once (there a shorter
    softmax lets the two consumers' exponentials stall on each other); elsewhere scaling once is as fast or
    faster (docs/tuning.md: forward_scaled_max)."""
    return head_dim == 64 and tiles[0] == 128


def forward_lagging_max(head_dim: int, tiles: tuple[int, int, int]) -> bool:
    """Whether the Hopper forward lets a row's max lag its scores by up to 2^8 (its LAGGING_MAX: common.cuh's
    OnlineSoftmax, FlashAttention-4's rescale threshold), rescaling the output only where a row of the warp
    moved it: on the 192-row tiles at head dim 64, where ptxas then waits for the running P V after the first
    exponentials rather than right after the row max. Head dim 128 and the 128-row tiles at 64 gain nothing
    from it and keep the exact max, whose row's largest probability rounds exactly (docs/tuning.md,
    forward_lagging_max: the error it costs)."""
    return head_dim == 64 and tiles[0] > 128


def descriptor_add64(kernel: str, tiles: tuple[int, int, int]) -> bool:
    """Whether a Hopper pass steps its wgmma descriptors with one 64-bit add (its DESC_ADD64), which ptxas
    issues as one uniform UIADD3.64, instead of adding to the low word and joining the high word back in
    (a UMOV of that word before every HGMMA): the fused backward, whose loops it makes 48 instructions
    shorter, and the forward's 192-row tiles. The forward's 128-row tiles keep joined halves, which are faster
    there although longer (docs/tuning.md: descriptor_add64)."""
    return kernel == "backward_sm90" or (kernel == "forward_sm90" and tiles[0] > 128)


def barrier_sleeps(kernel: str) -> bool:
    """Whether a Hopper pass's threads sleep between tries of a barrier wait until the barrier moves (its
    BARRIER_SLEEPS: mbarrier.try_wait's suspend-time hint) rather than try again at once: the forward, whose
    producer thread would otherwise spin many tries a key tile waiting for a free buffer, all of its threads.
    The backward passes keep trying: they are slower asleep (docs/tuning.md: barrier_sleeps)."""
    return kernel == "forward_sm90"


def shared_bytes(kernel: str, head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The dynamic shared memory of one pass (each kernel static_asserts the same figure)."""
    tm, tn, _ = tiles
    if kernel in PLAIN:
        return 0
    row = 2 * (pad_head_dim(head_dim) + 8)  # bytes per padded shared row (SMEM_ROW elements)
    if kernel == "forward":  # Q, two stages of K and V
        return row * (tm + 2 * 2 * tn)
    if kernel in ARCH:  # the kernel's Shared struct (1024-aligned), and 1024 bytes to align it (not the fused
        # backward's, which fills the 227 KiB at head dim 64 and starts where dynamic shared memory does)
        stages, barrier = HOPPER_STAGES[kernel], 8  # an mbarrier is 8 bytes
        q_buffers, v_stages = forward_q_buffers(head_dim, tiles), forward_v_stages(head_dim, tiles)
        payload = {
            # Q buffers; stages of K and V; full/empty barriers for each buffer of the three rings
            "forward_sm90": 2 * head_dim * (q_buffers * tm + (stages + v_stages) * tn)
            + barrier * 2 * (q_buffers + stages + v_stages),
            # Q and dO; stages of K and V; barriers as the forward's
            "backward_dq_sm90": 2 * head_dim * (2 * tm + 2 * stages * tn) + barrier * (1 + 4 * stages),
            # K and V; stages of Q, dO and their two fp32 statistics; a barrier for K and V and the ring's
            "backward_dkdv_sm90": 2 * head_dim * (2 * tn + 2 * stages * tm)
            + stages * 2 * 4 * tm
            + barrier * (1 + 2 * stages),
            # as the dK/dV pass's (K and V fused_kv_buffers times), and two dS tiles, two fp32 dQ shares,
            # eight 16-byte Visits; barriers: K and V full and empty, the shares' full and empty, the
            # Visits', the ring's
            "backward_sm90": 2 * head_dim * (2 * fused_kv_buffers(head_dim, tiles) * tn + 2 * stages * tm)
            + 2 * 2 * tm * tn
            + 2 * 4 * tm * head_dim
            + stages * 2 * 4 * tm
            + 8 * 16
            + barrier * (2 * fused_kv_buffers(head_dim, tiles) + 4 + 8 + 2 * stages),
        }[kernel]
        return -(-payload // 1024) * 1024 + (0 if kernel == "backward_sm90" else 1024)
    if kernel == "backward_dq":  # Q and dO, two stages of K and V
        return row * (2 * tm + 2 * 2 * tn)
    return row * (2 * tn + 2 * 2 * tm) + 2 * 2 * tm * 4  # K and V, two stages of Q, dO, lse and delta


@functools.cache
def tile_config(
    kernel: str,
    head_dim: int,
    max_shared: int = 227 * 1024,
    score: bool = False,
    bits: bool = False,
    wide: bool = False,
) -> tuple[int, int, int]:
    """The preferred tiles of `kernel` for this head dim whose shared memory fits `max_shared` bytes (and
    whose key tile a score mod, or a layout's bit masks, allow); its `WIDE_TILES` where `wide` asks."""
    if kernel not in TILES:
        raise ValueError(f"kernel must be one of {sorted(TILES)}, got {kernel!r}")
    padded = pad_head_dim(head_dim)
    tiles = WIDE_TILES.get(kernel, {}).get(padded)
    if wide and tiles and not (score or bits) and shared_bytes(kernel, head_dim, tiles) <= max_shared:
        return tiles
    needs = {"score": score, "bits": bits}
    limits = [limit for need, limit in MAX_TILES.get(kernel, {}).items() if needs[need]]
    max_m, max_n = (min((limit[i] for limit in limits), default=1 << 30) for i in (0, 1))
    for limit, candidates in sorted(TILES[kernel].items()):
        if padded <= limit:
            for tiles in candidates:
                fits = tiles[0] <= max_m and tiles[1] <= max_n
                if fits and shared_bytes(kernel, head_dim, tiles) <= max_shared:
                    return tiles
            raise ValueError(
                f"no {kernel} tiles for head dim {head_dim} fit {max_shared} bytes of shared memory per block"
            )
    raise ValueError(f"head dim {head_dim} is larger than the kernels' {max(TILES[kernel])}")


# The kernels' `Params` struct (kernels/common.cuh), field by field, in order. align=True gives C's layout.
PARAMS = np.dtype(
    [
        ("q", np.uint64), ("k", np.uint64), ("v", np.uint64), ("o", np.uint64), ("lse", np.uint64),
        ("dout", np.uint64), ("dq", np.uint64), ("dk", np.uint64), ("dv", np.uint64), ("stats", np.uint64),
        ("q_sb", np.int64), ("q_sh", np.int64), ("q_ss", np.int64),
        ("k_sb", np.int64), ("k_sh", np.int64), ("k_ss", np.int64),
        ("v_sb", np.int64), ("v_sh", np.int64), ("v_ss", np.int64),
        ("o_sb", np.int64), ("o_sh", np.int64), ("o_ss", np.int64),
        ("do_sb", np.int64), ("do_sh", np.int64), ("do_ss", np.int64),
        ("dq_sb", np.int64), ("dq_sh", np.int64), ("dq_ss", np.int64),
        ("dk_sb", np.int64), ("dk_sh", np.int64), ("dk_ss", np.int64),
        ("dv_sb", np.int64), ("dv_sh", np.int64), ("dv_ss", np.int64),
        ("lse_sb", np.int64), ("lse_sh", np.int64),
        ("stats_sb", np.int64), ("stats_sh", np.int64), ("stats_sr", np.int64),
        ("seq_q", np.int32), ("seq_k", np.int32), ("heads_q", np.int32), ("group", np.int32),
        ("layout_batch", np.int32), ("layout_heads", np.int32),
        ("tiles_q", np.int32), ("tiles_k", np.int32),
        ("sub_q_shift", np.int32), ("sub_k_shift", np.int32), ("sub_k_count", np.int32),
        ("scale", np.float32),
        ("row_ptr", np.uint64), ("entries", np.uint64), ("col_ptr", np.uint64), ("col_entries", np.uint64),
        ("sub_bits", np.uint64), ("bit_mask", np.uint64),
        ("rule_p", np.int64, (8,)), ("rule_a", np.uint64, (4,)),
        ("q_origin", np.int64), ("k_origin", np.int64),
        ("score_ip", np.int64, (8,)), ("score_fp", np.float32, (8,)), ("score_a", np.uint64, (4,)),
        ("work", np.uint64), ("work_count", np.int32), ("rule_narrow", np.int32),
        ("col_start", np.uint64), ("rank_ptr", np.uint64), ("ranks", np.uint64), ("dq_unordered", np.int32),
        ("parts", np.uint64), ("split_ptr", np.uint64),
    ],
    align=True,
)  # fmt: skip


@dataclass(frozen=True)
class KernelSpec:
    """One compiled unit. The name lists every specialisation argument; it shows in logs and errors."""

    kernel: str  # the pass: its source file in kernels/ without .cu, and its function's name after csa_
    dtype: str
    head_dim: int  # the real head dim; the kernel pads it to a multiple of 16
    tiles: tuple[int, int, int]  # TILE_M, TILE_N, NWARPS
    rule_mode: str = "none"
    rule_expr: str | None = None
    score: tuple[str, str] | None = None  # a score mod's C expression and its derivative
    split_rows: bool = False  # the Hopper forward: its deal splits rows (schedule.work_order), its SPLIT_ROWS

    @classmethod
    def make(
        cls,
        kernel: str,
        dtype: str,
        head_dim: int,
        rule_mode: str = "none",
        rule_expr: str | None = None,
        tiles: tuple[int, int, int] | None = None,
        max_shared: int = 227 * 1024,
        score: tuple[str, str] | None = None,
        split_rows: bool = False,
    ) -> KernelSpec:
        """The spec for these inputs, with the table's tiles for a device with `max_shared` bytes of shared
        memory per block (or `tiles`, for tuning)."""
        tiles = tiles or tile_config(kernel, head_dim, max_shared, score is not None, rule_mode == "bits")
        return cls(kernel, dtype, head_dim, tiles, rule_mode, rule_expr, score, split_rows)

    def __post_init__(self):
        if self.kernel not in TILES:
            raise ValueError(f"kernel must be one of {sorted(TILES)}, got {self.kernel!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"the kernels take {sorted(DTYPES)}, got dtype {self.dtype!r}")
        if self.rule_mode not in RULE_MODES:
            raise ValueError(f"rule_mode must be one of {sorted(RULE_MODES)}, got {self.rule_mode!r}")
        if (self.rule_mode == "expr") != (self.rule_expr is not None):
            raise ValueError("rule_expr is given exactly when rule_mode is 'expr'")
        if self.score is not None and (
            len(self.score) != 2 or not all(isinstance(x, str) for x in self.score)
        ):
            raise ValueError(f"score must be None or (C expression, its derivative), got {self.score!r}")
        if self.kernel in PLAIN and (self.rule_mode != "none" or self.score is not None):
            raise ValueError(f"{self.kernel} reads no layout rule or score mod")
        if self.split_rows and self.kernel != "forward_sm90":
            raise ValueError(f"only forward_sm90 splits rows, not {self.kernel}")
        if self.kernel in ARCH and self.head_dim not in HOPPER_HEAD_DIMS:
            raise ValueError(f"{self.kernel} takes head dims {HOPPER_HEAD_DIMS}, got {self.head_dim}")

    @property
    def padded_head_dim(self) -> int:
        return pad_head_dim(self.head_dim)

    @property
    def name(self) -> str:
        tm, tn, nw = self.tiles
        dt = {"float16": "f16", "bfloat16": "bf16"}[self.dtype]
        rule = self.rule_mode
        if self.rule_expr is not None:
            rule += hashlib.sha1(self.rule_expr.encode()).hexdigest()[:8]
        if self.score is not None:
            rule += "_score" + hashlib.sha1("\n".join(self.score).encode()).hexdigest()[:8]
        split = "_split" if self.split_rows else ""
        return f"{self.kernel}_{dt}_d{self.head_dim}_q{tm}k{tn}w{nw}_{rule}{split}"

    @property
    def shared_bytes(self) -> int:
        return shared_bytes(self.kernel, self.head_dim, self.tiles)

    @property
    def threads(self) -> int:
        return self.tiles[2] * 32

    @property
    def arch(self) -> str | None:
        """The architecture the kernel needs exactly (its instructions exist nowhere else), or None."""
        return ARCH.get(self.kernel)

    def prelude(self) -> str:
        tm, tn, nw = self.tiles
        lines = [
            f"// {self.name}: generated by cusparseattn.build",
            f"#define CSA_DTYPE_BF16 {DTYPES[self.dtype]}",
            f"#define HEAD_DIM {self.padded_head_dim}",
            f"#define HEAD_DIM_REAL {self.head_dim}",
            f"#define TILE_M {tm}",
            f"#define TILE_N {tn}",
            f"#define NWARPS {nw}",
            f"#define SHARED_BYTES {self.shared_bytes}",
            f"#define RULE_MODE {RULE_MODES[self.rule_mode]}",
        ]
        if self.rule_expr is not None:
            lines += _rule_defines(self.rule_expr)
        lines.append(f"#define SCORE_MOD {int(self.score is not None)}")
        if self.score is not None:
            lines += [f"#define SI{i} (p.score_ip[{i}])" for i in range(8)]
            lines += [f"#define SF{i} (p.score_fp[{i}])" for i in range(8)]
            lines += [f"#define SA{i} (p.score_a[{i}])" for i in range(4)]
            lines.append(f"#define CSA_SCORE(s, b, h, q, k) ({self.score[0]})")
            lines.append(f"#define CSA_SCORE_GRAD(s, b, h, q, k) ({self.score[1]})")
        if self.arch is not None:
            lines.append(f"#define STAGES {HOPPER_STAGES[self.kernel]}")
            lines.append(f"#define DESC_ADD64 {int(descriptor_add64(self.kernel, self.tiles))}")
            lines.append(f"#define BARRIER_SLEEPS {int(barrier_sleeps(self.kernel))}")
            if self.kernel == "backward_sm90":
                lines.append(f"#define KV_BUFFERS {fused_kv_buffers(self.padded_head_dim, self.tiles)}")
            if self.kernel == "forward_sm90":
                lines.append(f"#define Q_BUFFERS {forward_q_buffers(self.padded_head_dim, self.tiles)}")
                lines.append(f"#define V_STAGES {forward_v_stages(self.padded_head_dim, self.tiles)}")
                lines.append(f"#define STAGE_OUT {int(forward_stage_out(self.padded_head_dim, self.tiles))}")
                lines.append(f"#define Q_ROWS {forward_q_rows(self.padded_head_dim, self.tiles)}")
                split_steps = forward_split_steps(self.padded_head_dim, self.tiles)
                lines.append(f"#define SPLIT_STEPS {int(split_steps)}")
                scaled_max = forward_scaled_max(self.padded_head_dim, self.tiles)
                lines.append(f"#define SCALED_MAX {int(scaled_max)}")
                lagging = forward_lagging_max(self.padded_head_dim, self.tiles)
                lines.append(f"#define LAGGING_MAX {int(lagging)}")
                lines.append(f"#define SPLIT_ROWS {int(self.split_rows)}")
            types = {"float16": "f16.f16", "bfloat16": "bf16.bf16"}[self.dtype]
            lines += _wgmma_functions(sorted({tm, tn, self.padded_head_dim}), types)
        return "\n".join(lines) + "\n"

    def source(self) -> str:
        return self.prelude() + _inline(self.kernel + ".cu")


def _wgmma_functions(ns: list[int], types: str) -> list[str]:
    """kernels/hopper.cuh's wgmma_ss<N>, wgmma_ss_bmn<N> (B read MN-major) and wgmma_rs<N> for these N:
    m64nNk16, fp32 accumulators, the accumulator of N / 2 registers spelled out operand by operand (PTX takes
    no arrays)."""
    desc = "unsigned long long"
    lines = [
        f"template <int N> __device__ void wgmma_ss(float (&)[N / 8][4], {desc}, {desc}, int);",
        f"template <int N> __device__ void wgmma_ss_bmn(float (&)[N / 8][4], {desc}, {desc}, int);",
        f"template <int N> __device__ void wgmma_rs(float (&)[N / 8][4], const unsigned (&)[4], {desc});",
    ]
    for n in ns:
        regs = n // 2
        acc = ", ".join(f"%{i}" for i in range(regs))
        outs = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(regs))
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{types}"
        for name, trans_b in (("wgmma_ss", 0), ("wgmma_ss_bmn", 1)):
            lines += [
                f"template <> __device__ __forceinline__ void {name}<{n}>(float (&d)[{n // 8}][4], "
                "unsigned long long a, unsigned long long b, int accumulate) {",
                f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n'
                f'{op} {{{acc}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, {trans_b};\\n}}\\n"',
                f'                 : {outs} : "l"(a), "l"(b), "r"(accumulate));',
                "}",
            ]
        lines += [
            f"template <> __device__ __forceinline__ void wgmma_rs<{n}>(float (&d)[{n // 8}][4], "
            "const unsigned (&a)[4], unsigned long long b) {",
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n'
            f"{op} {{{acc}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, "
            f'p, 1, 1, 1;\\n}}\\n"',
            f'                 : {outs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));',
            "}",
        ]
    return lines


def _rule_defines(expr: str) -> list[str]:
    band, qband = key_band(expr), query_band(expr)
    first, last = band or (None, None)
    qfirst, qlast = qband or (None, None)
    return [
        f"#define RULE_NARROWABLE {int(narrowable(expr))}",
        *(f"#define P{i} (static_cast<RuleInt>(p.rule_p[{i}]))" for i in range(8)),
        *(f"#define A{i} (p.rule_a[{i}])" for i in range(4)),
        f"#define CSA_RULE(b, h, q, k) ({expr})",
        f"#define RULE_BAND {int(band is not None)}",
        *([f"#define CSA_RULE_FIRST(b, h, q) ({first})"] if first else []),
        *([f"#define CSA_RULE_LAST(b, h, q) ({last})"] if last else []),
        f"#define RULE_QBAND {int(qband is not None)}",
        *([f"#define CSA_RULE_QFIRST(b, h, k) ({qfirst})"] if qfirst else []),
        *([f"#define CSA_RULE_QLAST(b, h, k) ({qlast})"] if qlast else []),
    ]


@dataclass(frozen=True)
class RuleSpec:
    """The block classification kernel of one token rule's C expression (kernels/block_mask.cu)."""

    rule_expr: str
    kernel = "block_mask"
    shared_bytes = 0
    threads = 256
    arch = None

    @property
    def name(self) -> str:
        return f"block_mask_{hashlib.sha1(self.rule_expr.encode()).hexdigest()[:8]}"

    def source(self) -> str:
        lines = [f"// {self.name}: generated by cusparseattn.build", *_rule_defines(self.rule_expr)]
        return "\n".join(lines) + "\n" + _inline(self.kernel + ".cu")


# kernels/block_mask.cu's MaskParams.
MASK_PARAMS = np.dtype(
    [
        ("any", np.uint64), ("all", np.uint64), ("seq_q", np.int64), ("seq_k", np.int64),
        ("block_q", np.int32), ("block_k", np.int32), ("blocks_q", np.int32), ("blocks_k", np.int32),
        ("heads", np.int32), ("rule_p", np.int64, (8,)), ("rule_a", np.uint64, (4,)),
    ],
    align=True,
)  # fmt: skip


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


@functools.cache
def load(spec: KernelSpec | RuleSpec, device: int):
    """The compiled kernel of `spec` for one device (compiled once per process; CuPy caches it on disk)."""
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


def all_specs() -> list[KernelSpec | RuleSpec]:
    """The specialisations the CI compile check builds: every pass, head dim and mask kind in bfloat16,
    float16 without a mask, the smaller tiles that devices with less shared memory take, a score mod, and
    the block classification of a rule."""
    rules = [("none", None), ("bits", None), ("expr", "k <= q + P0")]
    specs = []
    for kernel, table in TILES.items():
        if kernel in PLAIN:
            specs += [
                KernelSpec.make(kernel, dt, d, tiles=t)
                for d, ts in table.items()
                for t in ts
                for dt in DTYPES
            ]
            continue
        for d in HOPPER_HEAD_DIMS if kernel in ARCH else (32, 64, 96, 128, 256):
            specs += [KernelSpec.make(kernel, "bfloat16", d, mode, expr) for mode, expr in rules]
            specs.append(KernelSpec.make(kernel, "float16", d))
        for d, candidates in table.items():
            if d >= 128:
                specs += [KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t) for t in candidates[1:]]
        specs += [KernelSpec.make(kernel, "bfloat16", d, *rules[2], score=SAMPLE_SCORE) for d in (64, 128)]
        for d, t in WIDE_TILES.get(kernel, {}).items():
            specs += [
                KernelSpec.make(kernel, "float16", d, tiles=t),
                KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t),
            ]
        if kernel == "forward_sm90":  # with split rows: its tiles, and the wide ones
            for d in HOPPER_HEAD_DIMS:
                for t in (tile_config(kernel, d), WIDE_TILES[kernel][d]):
                    specs.append(KernelSpec.make(kernel, "bfloat16", d, *rules[2], tiles=t, split_rows=True))
    return [*specs, RuleSpec("csa::floormod(k, P0) == 0 && A0[q] == A0[k]")]


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


def nvrtc_compile(lib, source: str, arch: str, include: str) -> str:
    """Compiles with NVRTC, as CuPy does at run time (no host headers, CuPy's -ftz=true); returns the log."""
    import ctypes

    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None)
    opts = [*nvrtc_options(), f"--gpu-architecture={arch}", f"-I{include}", "-ftz=true"]
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    status = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    if status != 0:
        raise RuntimeError(buf.value.decode(errors="replace"))
    return buf.value.decode(errors="replace")


def compile_targets(archs: list[str], specs=None) -> dict[KernelSpec | RuleSpec, list[str]]:
    """The architectures each spec compiles for in `check` (``specs`` defaults to `all_specs`): a kernel for
    one architecture (sm_90a) compiles for it alone, when any sm_9x is asked for; every other spec for each
    of ``archs``."""
    hopper = any(a.startswith("sm_9") for a in archs)
    return {
        spec: ([spec.arch] if hopper else []) if spec.arch else list(archs)
        for spec in (all_specs() if specs is None else specs)
    }


def check(archs: list[str], specs=None) -> int:
    """Compile every spec (or those of ``specs``) with nvcc for each arch (registers, spills) and with NVRTC
    where libnvrtc is installed (the run-time path); returns the number that failed. Fails on an error, a
    spill or warpgroup MMAs that ptxas serialized. Needs nvcc, no GPU."""
    import os
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("FAIL: nvcc is not on PATH")
        return 1
    lib, include = _nvrtc_library() or (None, None)
    print(f"nvcc: {nvcc}; NVRTC: {include or 'not installed, skipped'}")

    def compile_one(tmp: str, spec: KernelSpec | RuleSpec, arch: str, last: bool) -> tuple[str, list[str]]:
        src = Path(tmp) / f"{spec.name}_{arch}.cu"
        src.write_text(spec.source())
        # -ftz=true as CuPy gives NVRTC at run time: registers and spills of the code that runs.
        cmd = [
            nvcc,
            "-cubin",
            f"-arch={arch}",
            "-std=c++17",
            "-ftz=true",
            "-Xptxas",
            "-v",
            str(src),
            "-o",
            os.devnull,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", res.stderr)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
        problems = [res.stderr] if res.returncode else []
        if any(spills):
            problems.append(f"register spills {spills}")
        # ptxas waits for each warpgroup MMA where the code around one would read its registers in flight.
        problems += re.findall(r"\(C75\d\d\).*", res.stderr)
        if lib is not None and last:  # NVRTC's front end is the same for every arch: once per spec
            try:
                nvrtc_compile(lib, spec.source(), arch, include)
            except RuntimeError as err:
                problems.append(f"NVRTC: {err}")
        line = (
            f"{'FAIL' if problems else 'ok':4} {arch} {spec.name}: {regs.group(1) if regs else '?'} registers"
        )
        return line, problems

    failures = 0
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        jobs = [
            pool.submit(compile_one, tmp, spec, arch, arch == arches[-1])
            for spec, arches in compile_targets(archs, specs).items()
            for arch in arches
        ]
        for job in jobs:
            line, problems = job.result()
            failures += bool(problems)
            print("\n".join([line, *problems]))
    print(f"{len(jobs) - failures} of {len(jobs)} compiled for {', '.join(archs)}: {failures} failed")
    return failures


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=check.__doc__)
    parser.add_argument("--check", nargs="+", metavar="ARCH", default=["sm_80", "sm_90"])
    args = parser.parse_args(argv)
    return 1 if check(args.check) else 0


if __name__ == "__main__":
    raise SystemExit(main())
