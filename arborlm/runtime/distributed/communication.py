"""The collectives the tensor-parallel layers and the step broadcast use, over a `ParallelState`.

Each is the identity on a single rank, so layers call them unconditionally. Source of the
pattern: Megatron-LM's `mappings.py` / SGLang's `communication_op.py` (forward only: no grads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from arborlm.runtime.distributed.parallel_state import ParallelState


def all_reduce(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (every rank gets the sum); returns `x`."""
    if state.is_parallel:
        dist.all_reduce(x, group=state.device_group)
    return x


def all_gather(state: ParallelState, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on all) along `dim`, rank order: a new tensor."""
    if not state.is_parallel:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.device_group)
    return torch.cat(parts, dim=dim)


def all_reduce_min(state: ParallelState, value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV slots each rank's memory allows)."""
    if not state.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())


def broadcast_object(state: ParallelState, obj: Any = None, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank (pickled over the gloo group; CPU tensors travel in it).

    Raises
    ------
    RuntimeError
        From torch.distributed when a peer is gone or the group's timeout passes.
    """
    if not state.is_parallel:
        return obj
    box = [obj if state.tp_rank == src else None]
    dist.broadcast_object_list(box, src=src, group=state.cpu_group)
    return box[0]


def barrier(state: ParallelState) -> None:
    """Wait until every rank reaches this point (over the gloo group)."""
    if state.is_parallel:
        dist.barrier(group=state.cpu_group)
