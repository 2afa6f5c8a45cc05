"""Context parallelism: block-sparse ring attention over a sequence sharded across ranks (torch.distributed).

Each rank holds a shard of q, k and v along the sequence; keys and values travel between ranks, each step runs
the single-GPU attention on (local queries, visiting keys) with the matching window of the layout, and partial
outputs merge by their log-sum-exp. Unlike a plain ring, the schedule comes from the layout: a rank receives
only the K/V rows its queries' layout rows touch, and steps with nothing to compute are skipped, so a sliding
window talks to its neighbour only.

Modules: `balance` (orderings of the sequence: contiguous, zigzag, work-balanced), `schedule` (windows and
transfers per step), `comm` (torch.distributed and counters), `ring` (forward and backward), `autograd`
(the PyTorch ``autograd.Function``), `api` (the functions below).

Under ``torchrun --nproc-per-node 4 train.py``, one process per GPU::

    import torch.distributed as dist
    from cusparseattn import patterns
    from cusparseattn.distributed import ring_attention, shard, unshard

    dist.init_process_group("nccl")
    lay = patterns.causal(block=128)
    q, k, v = (shard(x, lay, balance="zigzag") for x in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, lay, balance="zigzag")  # this rank's queries' output, differentiable
    out_all = unshard(out, lay, balance="zigzag")
"""

from .api import ring_attention, ring_attention_backward, ring_attention_forward, shard, unshard
from .balance import Ordering
from .comm import counters

__all__ = [
    "Ordering",
    "counters",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "shard",
    "unshard",
]
