"""The kernels' tile tables and tuning choices: which tiles (TILE_M, TILE_N, warps) each pass takes for a head
dim and a GPU's shared memory, the wide tiles of the Hopper forward and what they cost, and the predicates
that switch a kernel's build (stages, buffers, the forward's split steps and scaled max). The builder
(`cusparseattn.build`) writes them into a spec's prelude; docs/tuning.md records the values tried.
"""

from __future__ import annotations

import functools


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
    # float32's Hopper passes: the transposed copies first, a CTA for each 32 rows of 32 of their head dims.
    "transpose": {128: [(32, 32, 8)]},
}
# float32 (TF32 tensor cores): its shared rows take twice the bytes of fp16's, so for the same head dim its
# tiles are a size smaller where fp16's would not fit (an H100's 227 KiB first, then an A100's 163 and
# sm_86/89's 99); its accumulators are fp16's, and its fragments kept in registers twice fp16's (the portable
# kernels keep them in shared memory past 256 bytes a row). At head dim 128 the Hopper forward takes key tiles
# of 64, where its Q tile alone is 64 KiB; the dQ pass key tiles of 32 beside Q and dO (128 KiB), in three
# rings (K, V and K's transposed copy); the dK/dV pass 32 queries a use beside K and V (128 KiB) and a ring of
# Q's and dO's transposed copies.
FLOAT32_TILES = {
    "forward_sm90": {64: [(128, 128, 12)], 128: [(128, 64, 12)]},
    "backward_dq_sm90": {64: [(128, 64, 12)], 128: [(128, 32, 12)]},
    "backward_dkdv_sm90": {64: [(64, 128, 12)], 128: [(32, 128, 12)]},
    "forward_combine": {64: [(128, 64, 8)], 128: [(128, 64, 8)]},
    "transpose": TILES["transpose"],
    "forward": {
        64: [(128, 64, 8), (64, 64, 4)],
        128: [(128, 64, 8), (128, 32, 8), (64, 32, 4)],
        256: [(64, 32, 4), (64, 16, 4), (32, 16, 2)],
    },
    "backward_dq": {
        64: [(128, 64, 8), (64, 32, 4)],
        128: [(128, 32, 8), (64, 32, 4), (64, 16, 4)],
        256: [(64, 16, 4), (32, 16, 2), (16, 16, 1)],
    },
    "backward_dkdv": {
        64: [(64, 128, 8), (32, 64, 4)],
        128: [(32, 128, 8), (32, 64, 4), (16, 32, 2)],
        256: [(16, 64, 4), (16, 32, 2), (16, 16, 1)],
    },
}
# float32 at precision "highest" (split TF32: each operand in two registers, and the products of each step
# summed in fresh accumulators, common.cuh's mma_AB), where FLOAT32_TILES' spill: smaller key tiles in the
# forward and dQ passes, fewer queries a step in the dK/dV pass.
HIGHEST_TILES = {
    "forward": {64: [(128, 32, 8), (64, 32, 4)], 128: [(128, 32, 8), (64, 32, 4)]},
    "backward_dq": {
        128: [(128, 32, 8), (64, 32, 4), (64, 16, 4)],
        256: [(64, 16, 4), (32, 16, 2), (16, 16, 1)],
    },
    "backward_dkdv": {64: [(32, 128, 8), (32, 64, 4)], 128: [(16, 128, 8), (16, 64, 4), (16, 32, 2)]},
}
# Passes that read no layout and no score mod: one kernel serves every layout (cuda.py builds them plain).
PLAIN = ("backward_stats", "backward_dq_convert", "forward_combine", "transpose")
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


def forward_q_buffers(head_dim: int, tiles: tuple[int, int, int], itemsize: int = 2) -> int:
    """The Hopper forward's Q buffers (its Q_BUFFERS): two, so that the next item's Q is copied while this one
    runs (short rows, a narrow window, notice), but one at head dim 128 with key tiles of 192, where two
    buffers of K and of V take the rest of the 227 KiB, and in float32, whose Q tile is 64 KiB there."""
    return 1 if head_dim > 64 and (tiles[1] > 128 or itemsize > 2) else 2


def hopper_stages(kernel: str, itemsize: int = 2) -> int:
    """The buffers of a Hopper pass's ring (its STAGES): `HOPPER_STAGES`', but two in float32's dK/dV pass,
    whose 227 KiB hold a ring of Q's and dO's transposed copies too."""
    return 2 if itemsize > 2 and kernel == "backward_dkdv_sm90" else HOPPER_STAGES[kernel]


def transposed_stages(head_dim: int) -> int:
    """float32's dK/dV pass's buffers of Q's and dO's transposed copies (its T_STAGES): two at head dim 64,
    one at 128, where K and V take 128 KiB and two buffers of Q and dO another 64. A buffer goes back once
    dV and dK have landed; Q's and dO's own go back once the scores have, so the next use's copies start
    early."""
    return 1 if head_dim > 64 else 2


def dkdv_splits(head_dim: int) -> int:
    """The portable dK/dV pass's CTAs per key tile (backward_dkdv.cu's SPLITS, which it derives alike):
    halves of the head dim past 128, where one CTA's dK and dV accumulators would not fit its registers."""
    return 2 if head_dim > 128 else 1


def forward_v_stages(head_dim: int, tiles: tuple[int, int, int]) -> int:
    """The Hopper forward's buffers of V (its V_STAGES; K takes HOPPER_STAGES'): three with key tiles of 128
    at head dim 128, two elsewhere. V_i is held a step longer than K_i (until O += P_i V_i lands, in step
    i + 1), so a third V buffer keeps the in-order copies a tile further ahead, where a third K buffer would
    not; with two K buffers the 227 KiB hold a second Q buffer too (docs/tuning.md: forward_v_stages)."""
    return 3 if head_dim > 64 and tiles[1] <= 128 else HOPPER_STAGES["forward_sm90"]


def forward_stage_out(head_dim: int, tiles: tuple[int, int, int], itemsize: int = 2) -> bool:
    """Whether the Hopper forward writes a row's output through its Q buffer and a TMA store (its STAGE_OUT)
    instead of from registers: with two Q buffers at head dim 128 and on the 192-row tiles at 64. From
    registers, a row's end costs nearly two tiles' time at head dim 128, most of it the stores; the 128-row
    tiles at head dim 64 gain nothing overall from staging and keep the stores from registers. The consumers
    issue their own stores: a storer thread of the producer warpgroup is slower (docs/tuning.md:
    forward_stage_out). 16-bit elements only: the staging stores are stmatrix's."""
    return itemsize == 2 and forward_q_buffers(head_dim, tiles) > 1 and (head_dim > 64 or tiles[0] > 128)


def forward_q_rows(head_dim: int, tiles: tuple[int, int, int], itemsize: int = 2) -> int:
    """The rows of each of the Hopper forward's Q copies (its Q_ROWS, and the box of cuda.Forward's q map):
    a consumer's 64 where out is staged (forward_stage_out), so that its rows of the tile, all panels, are
    the contiguous 64-row tile that the out map's stores read; the whole query tile elsewhere (two copies of
    64 are slower on the 128-row tiles at head dim 64, one panel)."""
    return 64 if forward_stage_out(head_dim, tiles, itemsize) else tiles[0]


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


def switches(kernel: str, head_dim: int, tiles: tuple[int, int, int], itemsize: int = 2) -> dict[str, int]:
    """The tuning switches of a Hopper pass's build at this (padded) head dim, tiles and element size, by the
    define the prelude writes, in its order: the one table of which predicate above sets what for which pass.

    >>> switches("backward_sm90", 128, tile_config("backward_sm90", 128))
    {'STAGES': 2, 'DESC_ADD64': 1, 'BARRIER_SLEEPS': 0, 'KV_BUFFERS': 1}
    """
    table = {
        "STAGES": hopper_stages(kernel, itemsize),
        "DESC_ADD64": int(descriptor_add64(kernel, tiles)),
        "BARRIER_SLEEPS": int(barrier_sleeps(kernel)),
    }
    if kernel == "backward_sm90":
        table["KV_BUFFERS"] = fused_kv_buffers(head_dim, tiles)
    if kernel == "backward_dkdv_sm90" and itemsize > 2:
        table["T_STAGES"] = transposed_stages(head_dim)
    if kernel == "forward_sm90":
        table |= {
            "Q_BUFFERS": forward_q_buffers(head_dim, tiles, itemsize),
            "V_STAGES": forward_v_stages(head_dim, tiles),
            "STAGE_OUT": int(forward_stage_out(head_dim, tiles, itemsize)),
            "Q_ROWS": forward_q_rows(head_dim, tiles, itemsize),
            "SPLIT_STEPS": int(forward_split_steps(head_dim, tiles)),
            "SCALED_MAX": int(forward_scaled_max(head_dim, tiles)),
            "LAGGING_MAX": int(forward_lagging_max(head_dim, tiles)),
        }
    return table


def shared_bytes(kernel: str, head_dim: int, tiles: tuple[int, int, int], itemsize: int = 2) -> int:
    """The dynamic shared memory of one pass for elements of `itemsize` bytes (each kernel static_asserts the
    same figure)."""
    tm, tn, _ = tiles
    if kernel in PLAIN:
        return 0
    row = itemsize * pad_head_dim(head_dim) + 16  # bytes per padded shared row (SMEM_ROW elements)
    if kernel == "forward":  # Q, two stages of K and V
        return row * (tm + 2 * 2 * tn)
    if kernel in ARCH:  # the kernel's Shared struct (1024-aligned), and 1024 bytes to align it (not the fused
        # backward's, which fills the 227 KiB at head dim 64 and starts where dynamic shared memory does)
        stages, barrier = hopper_stages(kernel, itemsize), 8  # an mbarrier is 8 bytes
        q_buffers, v_stages = forward_q_buffers(head_dim, tiles, itemsize), forward_v_stages(head_dim, tiles)
        # float32's backward passes stream transposed copies in rings of their own (K's in the dQ pass)
        t_stages = transposed_stages(head_dim) if kernel == "backward_dkdv_sm90" else stages
        t_stages *= itemsize > 2
        payload = {
            # Q buffers; stages of K and V; full/empty barriers for each buffer of the three rings
            "forward_sm90": itemsize * head_dim * (q_buffers * tm + (stages + v_stages) * tn)
            + barrier * 2 * (q_buffers + stages + v_stages),
            # Q and dO; stages of K, V (and K's copy); a barrier for Q and dO, the rings' full and empty
            "backward_dq_sm90": itemsize * head_dim * (2 * tm + (2 * stages + t_stages) * tn)
            + barrier * (1 + 4 * stages + 2 * t_stages),
            # K and V; stages of Q, dO (and their copies) and their two fp32 statistics; a barrier for K and
            # V and the rings'
            "backward_dkdv_sm90": itemsize * head_dim * (2 * tn + 2 * (stages + t_stages) * tm)
            + stages * 2 * 4 * tm
            + barrier * (1 + 2 * stages + 2 * t_stages),
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
    itemsize: int = 2,
    highest: bool = False,
    elementwise: bool = False,
) -> tuple[int, int, int]:
    """The preferred tiles of `kernel` for this head dim whose shared memory fits `max_shared` bytes (and
    whose key tile a score mod, or a layout's bit masks, allow); its `WIDE_TILES` where `wide` asks, unless
    a score mod, bit masks or a rule evaluated at each element (`elementwise`: no band) come with the call:
    the wide tiles' consumers have 128 (head dim 64) or 168 registers, and such a rule spills there. Elements
    of `itemsize` 4 (float32) take `FLOAT32_TILES`, and at precision "highest" `HIGHEST_TILES` where it has
    some."""
    if kernel not in TILES:
        raise ValueError(f"kernel must be one of {sorted(TILES)}, got {kernel!r}")
    table = TILES[kernel] if itemsize == 2 else FLOAT32_TILES.get(kernel)
    if table is None:
        raise ValueError(f"{kernel} takes 2-byte elements, not {itemsize}-byte ones")
    if highest:
        table = {**table, **HIGHEST_TILES.get(kernel, {})}
    padded = pad_head_dim(head_dim)
    tiles = WIDE_TILES.get(kernel, {}).get(padded)
    plain = not (score or bits or elementwise)
    if wide and tiles and plain and itemsize == 2 and shared_bytes(kernel, head_dim, tiles) <= max_shared:
        return tiles  # the Hopper forward's: half precision
    needs = {"score": score, "bits": bits}
    limits = [limit for need, limit in MAX_TILES.get(kernel, {}).items() if needs[need]]
    max_m, max_n = (min((limit[i] for limit in limits), default=1 << 30) for i in (0, 1))
    for limit, candidates in sorted(table.items()):
        if padded <= limit:
            for tiles in candidates:
                fits = tiles[0] <= max_m and tiles[1] <= max_n
                if fits and shared_bytes(kernel, head_dim, tiles, itemsize) <= max_shared:
                    return tiles
            raise ValueError(
                f"no {kernel} tiles for head dim {head_dim} and {itemsize}-byte elements fit {max_shared} "
                "bytes of shared memory per block"
            )
    raise ValueError(f"head dim {head_dim} is larger than the kernels' {max(table)}")


# The kernels' `Params` struct (kernels/params.cuh), field by field, in order. align=True gives C's layout.
