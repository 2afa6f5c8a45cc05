"""PyTorch's own attention as backends, to compare with: ``"flex"`` (FlexAttention, the layout as its
``BlockMask``) and ``"sdpa"`` (``scaled_dot_product_attention`` with the layout as a dense boolean mask).

Both run on torch tensors, on the CPU or a CUDA device, and give torch tensors on that device (nothing is
copied to the host). They are registered always and come after the NumPy reference in the priority order, so
automatic selection never picks them: ask for them by name (``backend="flex"``, ``use_backends("sdpa")``).
Where PyTorch is missing, or the inputs are not torch tensors, their reasons say so.

The forward returns ``lse`` too, the natural-log log-sum-exp of each row (float32; float64 for float64
inputs), and a row that attends to nothing gives ``out = 0`` and ``lse = -inf`` as everywhere in
cusparseattn. The backward recomputes the forward under autograd and takes PyTorch's own gradients of it.

>>> import torch
>>> from cusparseattn import attention_forward, patterns
>>> q = k = v = torch.randn(1, 2, 100, 16)
>>> out, lse = attention_forward(q, k, v, patterns.local(window=32, block=16), backend="sdpa")
>>> out.shape, lse.dtype
(torch.Size([1, 2, 100, 16]), torch.float32)
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import weakref

import numpy as np

from .arrays import wrap
from .backends import Backend, register_backend
from .call import Inputs
from .dynamic import DynamicLayout

#: Bytes of the ``scale * q @ k^T`` band that SDPA's log-sum-exp computes at once (query rows in bands).
CHUNK_BYTES = 64 << 20
#: The block size of the BlockMasks given to FlexAttention: its default, a multiple of every layout's.
FLEX_BLOCK = 128
#: The smallest head dim that FlexAttention's compiled (Triton) kernels take.
MIN_COMPILED_HEAD_DIM = 16


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _torch_reasons(inputs: Inputs) -> list[str]:
    if _torch() is None:
        return ["PyTorch is not installed"]
    if inputs.framework != "torch":
        return [f"the inputs are not torch tensors (they are {inputs.framework} arrays)"]
    return []


def _natives(inputs: Inputs, *names: str):
    return [getattr(inputs, name).native.detach() for name in names]


def _work_dtype(torch, dtype):
    """The dtype of softmax statistics: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


class SdpaBackend(Backend):
    """``torch.nn.functional.scaled_dot_product_attention`` with the layout as a dense boolean mask.

    The mask ``[B or 1, H or 1, Sq, Sk]`` is built from ``layout.to_dense()`` on the inputs' device and kept
    for the next call on the same layout; ``max_mask_bytes`` bounds it (calls past the bound are refused,
    with the numbers). Grouped-query inputs repeat the k, v heads, so that SDPA's kernels that take a mask
    run. SDPA has no score mods. The log-sum-exp is computed apart, over bands of query rows.

    >>> SdpaBackend().max_mask_bytes // 2**20
    1024
    """

    name = "sdpa"
    description = "PyTorch's scaled_dot_product_attention with a dense boolean mask (to compare with)"
    max_mask_bytes = 1 << 30

    def __init__(self):
        self._lock = threading.Lock()
        self._cached = None  # (weakref to the layout, device, mask, rows): the last call's mask

    def available(self):
        return [] if _torch() is not None else ["PyTorch is not installed"]

    def not_supported_reasons(self, inputs, op):
        reasons = _torch_reasons(inputs)
        if inputs.score_mod is not None:
            reasons.append("SDPA takes no score_mod")
        layout = inputs.layout
        if isinstance(layout, DynamicLayout):
            return [*reasons, "this backend takes static layouts, not a DynamicLayout's index arrays"]
        shape = (layout.batch, layout.heads, layout.seq_q, layout.seq_k)
        size = math.prod(shape)
        if size > self.max_mask_bytes:
            reasons.append(
                f"the dense mask would take {_mib(size)} ({' x '.join(map(str, shape))} booleans), over "
                f"SDPA's limit of {_mib(self.max_mask_bytes)} (SdpaBackend.max_mask_bytes)"
            )
        return reasons

    def _mask(self, layout, device):
        """The dense mask, with every row that attends to nothing set to attend everything (so no kernel
        sees an empty row and gives NaN; `forward` zeroes those rows), and ``rows``: which rows attend."""
        torch = _torch()
        with self._lock:
            cached = self._cached
        if cached is not None and cached[0]() is layout and cached[1] == device:
            return cached[2], cached[3]
        mask = torch.from_numpy(layout.to_dense()).to(device)
        rows = mask.any(dim=-1)
        mask |= ~rows[..., None]
        with self._lock:
            self._cached = (weakref.ref(layout), device, mask, rows)
        return mask, rows

    @staticmethod
    def _attend(q, k, v, mask, scale):
        import torch.nn.functional as F

        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def forward(self, inputs):
        torch = _torch()
        q, k, v = _natives(inputs, "q", "k", "v")
        mask, rows = self._mask(inputs.layout, q.device)
        with torch.no_grad():
            out = self._attend(q, k, v, mask, inputs.scale).masked_fill(~rows[..., None], 0)
            lse = _lse(q, k, mask, inputs.scale).masked_fill(~rows, -math.inf)
        return wrap(out, "out"), wrap(lse, "lse")

    def backward(self, inputs):
        dout, q, k, v = _natives(inputs, "dout", "q", "k", "v")
        mask, rows = self._mask(inputs.layout, q.device)
        # Rows that attend to nothing get no gradient: their dout is zeroed, and the keys they were made to
        # attend to (see _mask) then receive nothing from them either.
        dout = dout.masked_fill(~rows[..., None], 0)
        dq, dk, dv = _gradients(lambda q, k, v: self._attend(q, k, v, mask, inputs.scale), dout, q, k, v)
        return wrap(dq, "dq"), wrap(dk, "dk"), wrap(dv, "dv")


def _gradients(forward, dout, *inputs):
    """The gradients of ``forward(*inputs)`` (one tensor) given ``dout``: PyTorch's own backward of it."""
    torch = _torch()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        if not _autograd_records():
            stack.enter_context(_autograd_dispatch())
        leaves = [x.detach().requires_grad_() for x in inputs]
        return torch.autograd.grad(forward(*leaves), leaves, dout)


def _autograd_records() -> bool:
    torch = _torch()
    return (torch.ones((), requires_grad=True) * 1).grad_fn is not None


def _autograd_dispatch():
    """Autograd's dispatch keys back on, in this thread, inside the implementation of a custom operator:
    PyTorch takes them off there (cusparseattn.torch runs the backends in its operators), and ``torch.func``,
    which would not need them, cannot trace FlexAttention. PyTorch has no public switch for this."""
    torch = _torch()
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (
        keys.AutogradFunctionality,
        keys.AutogradOther,
        keys.AutogradNestedTensor,
        keys.ADInplaceOrView,
    ):
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _lse(q, k, mask, scale: float):
    """``logsumexp(scale * q @ k^T masked)`` per row, in float32 (float64 for float64 inputs), over bands of
    query rows so that no band's scores exceed `CHUNK_BYTES`."""
    torch = _torch()
    batch, heads_q, seq_q, dim = q.shape
    heads_k, seq_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    work = _work_dtype(torch, q.dtype)
    # [B, Hkv, 1, D, Sk] against bands [B, Hkv, group, rows, D]: query head h reads key head h // group.
    kt = k.to(work).transpose(-1, -2)[:, :, None]
    lse = torch.empty((batch, heads_q, seq_q), dtype=work, device=q.device)
    itemsize = torch.finfo(work).bits // 8
    rows = max(1, CHUNK_BYTES // (batch * heads_q * seq_k * itemsize))
    for start in range(0, seq_q, rows):
        stop = min(seq_q, start + rows)
        band = q[:, :, start:stop].to(work).reshape(batch, heads_k, group, stop - start, dim)
        scores = torch.matmul(band, kt).reshape(batch, heads_q, stop - start, seq_k) * scale
        scores.masked_fill_(~mask[:, :, start:stop], -math.inf)
        lse[:, :, start:stop] = torch.logsumexp(scores, dim=-1)
    return lse


class FlexBackend(Backend):
    """PyTorch's FlexAttention with the layout as its ``BlockMask`` (full blocks stay full, partial blocks
    apply the layout's rule, which must run on torch tensors) and the score mod's function as its
    ``score_mod`` (called on torch tensors, with global positions).

    ``compiled``: run ``torch.compile(flex_attention)`` (fused kernels; head dims of 16 and more) or
    FlexAttention's eager implementation, which materialises the scores; None (the default) compiles on CUDA
    devices only. FlexAttention has no backward on the CPU. The compiled function is compiled again for each
    new shape, dtype and grad mode, up to dynamo's recompile limit (then it runs eagerly).

    >>> FlexBackend().compiled is None
    True
    """

    name = "flex"
    description = "PyTorch's FlexAttention with the layout as its BlockMask (to compare with)"

    def __init__(self, compiled: bool | None = None):
        self.compiled = compiled
        self._compiled_fn = None
        self._lock = threading.Lock()
        self._cached = None  # (weakref to the layout, device, BlockMask): the last call's block mask

    def available(self):
        torch = _torch()
        if torch is None:
            return ["PyTorch is not installed"]
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            return [f"FlexAttention needs torch 2.5 or newer, found torch {torch.__version__}"]
        return []

    def not_supported_reasons(self, inputs, op):
        reasons = _torch_reasons(inputs) or self.available()
        if reasons:
            return reasons
        torch = _torch()
        if op == "backward" and not inputs.on_gpu:
            reasons.append(f"FlexAttention has no backward on the CPU (torch {torch.__version__})")
        if self._compiles(inputs.device[0]) and inputs.head_dim < MIN_COMPILED_HEAD_DIM:
            reasons.append(
                f"FlexAttention's compiled kernels take a head dim of at least {MIN_COMPILED_HEAD_DIM}, "
                f"got {inputs.head_dim}"
            )
        layout = inputs.layout
        if isinstance(layout, DynamicLayout):
            return [*reasons, "this backend takes static layouts, not a DynamicLayout's index arrays"]
        if layout.rule is not None and layout.partial.any():
            reasons += _rule_reasons(layout)
        return reasons

    def _block_mask(self, layout, device):
        with self._lock:
            cached = self._cached
        if cached is not None and cached[0]() is layout and cached[1] == device:
            return cached[2]
        block_mask = _block_mask(layout, device)
        with self._lock:
            self._cached = (weakref.ref(layout), device, block_mask)
        return block_mask

    def _compiles(self, device_type: str) -> bool:
        return self.compiled if self.compiled is not None else device_type == "cuda"

    def _function(self, device):
        from torch.nn.attention.flex_attention import flex_attention

        if not self._compiles(device.type):
            return flex_attention
        if self._compiled_fn is None:
            self._compiled_fn = _torch().compile(flex_attention, dynamic=False)
        return self._compiled_fn

    def _attend(self, q, k, v, block_mask, inputs: Inputs):
        """``(out, lse)`` of FlexAttention on these tensors (differentiable in q, k, v)."""
        from torch.nn.attention import flex_attention as flex

        kwargs = {"block_mask": block_mask, "scale": inputs.scale, "enable_gqa": q.shape[1] != k.shape[1]}
        if inputs.score_mod is not None:
            score_mod = kwargs["score_mod"] = _at_origin(inputs.score_mod.fn, inputs.layout.origin)
            _first_call(score_mod, q.device, score=True)
        function = self._function(q.device)
        if self._compiles(q.device.type):
            # Flex picks a decoding kernel for fewer than 128 queries, which found no configuration for some
            # grouped-query shapes (torch 2.11): the main kernel always.
            kwargs["kernel_options"] = _main_kernel()
        if "return_aux" in inspect.signature(flex.flex_attention).parameters:
            out, aux = function(q, k, v, return_aux=flex.AuxRequest(lse=True), **kwargs)
            lse = aux.lse
        else:  # torch before return_aux
            out, lse = function(q, k, v, return_lse=True, **kwargs)
        return out, lse

    def forward(self, inputs):
        torch = _torch()
        q, k, v = _natives(inputs, "q", "k", "v")
        block_mask = self._block_mask(inputs.layout, q.device)
        with torch.no_grad():
            out, lse = self._attend(q, k, v, block_mask, inputs)
            lse = lse.to(_work_dtype(torch, q.dtype))
            empty = lse == -math.inf
            out = out.masked_fill(empty[..., None], 0)
        return wrap(out, "out"), wrap(lse, "lse")

    def backward(self, inputs):
        dout, q, k, v, lse = _natives(inputs, "dout", "q", "k", "v", "lse")
        block_mask = self._block_mask(inputs.layout, q.device)
        dout = dout.masked_fill((lse == -math.inf)[..., None], 0)  # rows that attend to nothing: no gradient
        dq, dk, dv = _gradients(lambda q, k, v: self._attend(q, k, v, block_mask, inputs)[0], dout, q, k, v)
        return wrap(dq, "dq"), wrap(dk, "dk"), wrap(dv, "dv")


def _main_kernel() -> dict:
    """FlexAttention's kernel options that select its main Triton kernel (never the decoding one)."""
    from torch.nn.attention.flex_attention import FlexKernelOptions

    if "BACKEND" in FlexKernelOptions.__annotations__:
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}  # torch before the BACKEND option


def _at_origin(fn, origin: tuple[int, int]):
    """``fn`` as a FlexAttention score_mod that sees global positions: a layout's window (`origin`) starts
    at query ``q0`` and key ``k0``, and score mods see ``q + q0, k + k0`` everywhere in cusparseattn."""
    q0, k0 = origin
    if (q0, k0) == (0, 0):
        return fn

    def score_mod(score, b, h, q_idx, kv_idx):
        return fn(score, b, h, q_idx + q0, kv_idx + k0)

    return score_mod


def _mask_mod(layout, device):
    """The layout's token mask (`BlockLayout.token_mask`) as a FlexAttention ``mask_mod``: a block lookup in
    tables on ``device``, and the rule inside partial blocks. A closure over tensors and numbers only, not
    the layout: dynamo traces it (captured tensors included), and a cached block mask does not keep the
    layout alive."""
    torch = _torch()
    batch, heads, (n_q, n_k) = layout.batch, layout.heads, layout.num_blocks
    (bq, bk), seq_q, seq_k = layout.block_size, layout.seq_q, layout.seq_k
    rule = layout.rule.fn if layout.rule is not None and layout.partial.any() else None
    # Copies: the layout's arrays are read-only, torch tensors are not.
    blocks, partial = (
        torch.from_numpy(np.array(a).reshape(-1)).to(device) for a in (layout.blocks, layout.partial)
    )

    def mask_mod(b, h, q_idx, kv_idx):
        # FlexAttention also asks about the padding past each sequence's end: clamp, then mask it out.
        q, k = torch.clamp(q_idx, max=seq_q - 1), torch.clamp(kv_idx, max=seq_k - 1)
        row = (b if batch > 1 else b * 0) * heads + (h if heads > 1 else h * 0)
        flat = (row * n_q + q // bq) * n_k + k // bk
        mask = blocks[flat] & (q_idx < seq_q) & (kv_idx < seq_k)
        if rule is not None:
            mask = mask & (~partial[flat] | rule(b, h, q, k))
        return mask

    return mask_mod


def _block_mask(layout, device):
    """The layout as a FlexAttention ``BlockMask`` on ``device``, in blocks of `FLEX_BLOCK` (the compiled
    kernels' tiles must divide the block size, and a layout's blocks may be as small as 16): a block is full
    where every layout block inside it is full, masked by `_mask_mod` where some are set, skipped where none
    is. Layout blocks past the sequences' ends count as full: they hold no tokens."""
    torch = _torch()
    from torch.nn.attention.flex_attention import BlockMask

    (bq, bk), (n_q, n_k) = layout.block_size, layout.num_blocks
    fq, fk = FLEX_BLOCK // bq, FLEX_BLOCK // bk
    pad = ((0, 0), (0, 0), (0, -n_q % fq), (0, -n_k % fk))
    shape = (layout.batch, layout.heads, -(-n_q // fq), fq, -(-n_k // fk), fk)
    visited = np.pad(layout.blocks, pad, constant_values=False).reshape(shape).any(axis=(3, 5))
    full = np.pad(layout.full, pad, constant_values=True).reshape(shape).all(axis=(3, 5)) & visited
    lists = [torch.from_numpy(a).to(device) for m in (visited & ~full, full) for a in _kv_lists(m)]
    mask_mod = _mask_mod(layout, device)
    _first_call(mask_mod, device)
    return BlockMask.from_kv_blocks(
        *lists, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(layout.seq_q, layout.seq_k)
    )


def _first_call(fn, device, *, score: bool = False) -> None:
    """Call a mask_mod (or, with ``score``, a score_mod) once on indices on ``device``, outside FlexAttention.

    Functions may cache on their first call (the captured arrays of `cusparseattn.mods` keep a copy per
    device); FlexAttention traces them with dynamo, which refuses such side effects, so they happen here.
    """
    torch = _torch()
    zero = torch.zeros((), dtype=torch.int64, device=device)
    args = (zero, zero, zero, zero)
    fn(*((torch.zeros((), device=device), *args) if score else args))


def _kv_lists(mask):
    """FlexAttention's per-row block lists of a ``[B, H, nQ, nK]`` mask: counts, and indices (set first)."""
    counts = np.count_nonzero(mask, axis=-1).astype(np.int32)
    return counts, np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)


def _rule_reasons(layout) -> list[str]:
    """Why FlexAttention cannot apply the layout's rule: it must run on torch tensors (probed on a few
    token pairs on the CPU); empty when it can."""
    torch = _torch()
    idx = torch.arange(4)
    try:
        out = _mask_mod(layout, "cpu")(idx * 0, idx * 0, idx % layout.seq_q, idx % layout.seq_k)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or tuple(out.shape) != (4,):
            raise TypeError(
                f"it gave {type(out).__name__} {getattr(out, 'dtype', '')}, not a torch bool tensor"
            )
    except Exception as err:  # any failure of the user's rule on torch tensors is the reason
        return [
            f"the layout's rule {layout.rule.name!r} does not run on torch tensors, so FlexAttention cannot "
            f"apply it ({type(err).__name__}: {err})"
        ]
    return []


for _backend in (FlexBackend(), SdpaBackend()):
    register_backend(_backend)
