"""Context parallelism's communication over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs); counters.

`Comm` wraps one process group: batched point-to-point sends and receives (``batch_isend_irecv``), an
all-gather into one tensor, and a plan-time check that every rank agrees on the call. Every transfer is
counted in `counters` (steps, kernel calls, bytes, messages) so tests and benchmarks can see what moved.

Arrays of other frameworks travel as torch tensors: `to_torch` and `from_torch` convert without a copy
(DLPack for CuPy, shared memory for NumPy).

>>> counters.reset()
>>> counters.as_dict()["bytes_sent"]
0
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Counters:
    """What this process's ring attention did since the last `reset` (forward and backward together).

    ``bytes_sent`` / ``bytes_received`` count payload bytes this rank sent to / received from peers
    (an all-gather counts the shard sent to, and the shards received from, each of the other ranks).
    """

    steps: int = 0  # steps with work or transfers for this rank
    calls: int = 0  # single-GPU attention calls (forward or backward windows)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0  # point-to-point sends
    collectives: int = 0  # all-gathers and agreement checks

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


counters = Counters()


class Pending:
    """Requests in flight; `wait` orders later work after them (the current CUDA stream waits on NCCL's)."""

    def __init__(self, works=()):
        self._works = [w for w in works if w is not None]

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


class Comm:
    """One process group: its size, this process's rank in it, and the transfers ring attention needs."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ring attention runs over torch.distributed, which is not initialised in this process: call "
                "torch.distributed.init_process_group('nccl') (GPUs) or ('gloo') (CPUs) first, e.g. under "
                "torchrun"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        self._peers = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]

    def exchange(self, sends, recvs) -> Pending:
        """Post ``sends`` and ``recvs`` (lists of ``(group rank, contiguous tensor)``) as one batch.

        Messages between two ranks in one direction match in the order posted: every rank posts in the
        order of the shared schedule.
        """
        ops = [dist.P2POp(dist.isend, t, self._peers[p], self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peers[p], self.group) for p, t in recvs]
        if not ops:
            return Pending()
        counters.messages += len(sends)
        counters.bytes_sent += sum(_nbytes(t) for _, t in sends)
        counters.bytes_received += sum(_nbytes(t) for _, t in recvs)
        return Pending(dist.batch_isend_irecv(ops))

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> Pending:
        """Post the gather of every rank's ``x`` into ``out`` (``world_size`` times ``x`` along dim 0)."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        counters.collectives += 1
        counters.bytes_sent += (self.world_size - 1) * _nbytes(x)
        counters.bytes_received += (self.world_size - 1) * _nbytes(x)
        return Pending([gather(out, x, group=self.group, async_op=True)])

    def gather_list(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape everywhere), in rank order; waits."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self.all_gather(out.view(self.world_size * x.shape[0], *x.shape[1:]), x).wait()
        return list(out.unbind(0))

    def agree(self, what: str, values: list[int], device) -> None:
        """Raise unless every rank passed the same ``values`` (one small collective; a host sync, so only
        when a plan is made). It also opens the group's communicator with every rank taking part, which
        NCCL needs before point-to-point batches that only some ranks join."""
        mine = torch.tensor(values, dtype=torch.int64)
        both = torch.cat([mine, -mine]).to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        counters.collectives += 1
        top, bottom = both.cpu().view(2, -1)
        if not torch.equal(top, -bottom):
            raise ValueError(
                f"the ranks of the process group disagree on {what}: this rank has {values}, the largest "
                f"values across ranks are {top.tolist()} and the smallest {(-bottom).tolist()}; every rank "
                "must pass shards of one shape and the same layout, causal, balance and scale"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def framework(x) -> str:
    """``'torch'``, ``'cupy'``, ``'numpy'`` or another top-level module name (refused by the callers)."""
    return type(x).__module__.split(".")[0]


def to_torch(x) -> torch.Tensor:
    """A torch tensor sharing ``x``'s memory (NumPy, CuPy or torch; NumPy bfloat16 through a 16-bit view)."""
    kind = framework(x)
    if kind == "torch":
        return x
    if kind == "numpy":
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def from_torch(t: torch.Tensor, kind: str):
    """``t`` as an array of framework ``kind`` (no copy)."""
    if kind == "torch":
        return t
    if kind == "numpy":
        t = t.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    import cupy

    return cupy.from_dlpack(t)
