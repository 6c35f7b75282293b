"""The process groups of one tensor-parallel rank and how a dimension splits over the ranks.

`init_parallel_state` joins the rank to its group once, over a TCP rendezvous on loopback
(`tcp://127.0.0.1:<nccl_port>`, SGLang's `nccl_port`): NCCL carries the activations on
CUDA, gloo on the CPU, and a gloo group always carries the step broadcasts (CPU objects),
as SGLang's `GroupCoordinator` keeps a `device_group` and a `cpu_group`. The returned
`ParallelState` is passed down to the model and its layers as an argument.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective may wait for the other ranks (seconds). Rank 0 broadcasts a keep-alive
# while idle (`step_sync.KEEP_ALIVE_S`), and a dead peer closes its sockets (the collective then
# fails at once), so this bounds only a rank that is alive but stuck, or a slow first load.
COLLECTIVE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ShardRange:
    """The part of a dimension one rank holds: `size` entries from `start`."""

    start: int
    size: int

    def narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full (checkpoint) tensor along `dim`, a view."""
        return tensor.narrow(dim, self.start, self.size)


@dataclass(frozen=True)
class ParallelState:
    """One rank's place in the tensor-parallel group.

    Attributes
    ----------
    tp_rank, tp_size: this rank and the number of ranks (1: no parallelism, no groups).
    device_group: the group of the activation collectives (NCCL on CUDA, gloo on the CPU).
    cpu_group: a gloo group for CPU objects (the step broadcasts).
    device: the device this rank runs on.
    """

    tp_rank: int = 0
    tp_size: int = 1
    device_group: object | None = None
    cpu_group: object | None = None
    device: torch.device = torch.device("cpu")

    @property
    def is_parallel(self) -> bool:
        return self.tp_size > 1

    def split(self, total: int, name: str) -> ShardRange:
        """This rank's equal share of a dimension of `total` entries (heads, MLP columns).

        Raises
        ------
        ValueError
            When `tp_size` does not divide `total`, naming `name` and both numbers.
        """
        if total % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} does not divide {name}={total}")
        size = total // self.tp_size
        return ShardRange(self.tp_rank * size, size)

    def kv_head_range(self, num_kv_heads: int) -> ShardRange:
        """The K/V heads this rank holds: an equal share when there are at least `tp_size`, else
        the one head its query heads read (replicated over `tp_size // num_kv_heads` ranks).

        Rank r's query heads [r H/tp, (r+1) H/tp) all read K/V head `r * num_kv_heads // tp_size`
        when num_kv_heads < tp_size (the GQA groups align with the ranks' blocks), as SGLang's
        `QKVParallelLinear` replicates them.

        Raises
        ------
        ValueError
            When neither divides the other, naming num_key_value_heads and tp_size.
        """
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(f"tp_size={self.tp_size} is not a multiple of num_key_value_heads={num_kv_heads} "
                             "(K/V heads are replicated when there are fewer than ranks)")
        return ShardRange(self.tp_rank * num_kv_heads // self.tp_size, 1)

    def vocab_range(self, vocab_size: int) -> ShardRange:
        """This rank's rows of the vocabulary: ceil(vocab_size / tp_size) rows from
        `tp_rank * that`, the last rank's partly past the vocabulary (padding, as SGLang's
        `VocabParallelEmbedding` pads)."""
        size = -(-vocab_size // self.tp_size)
        return ShardRange(self.tp_rank * size, size)


def init_parallel_state(tp_rank: int, tp_size: int, nccl_port: int, device: torch.device,
                        timeout_s: float = COLLECTIVE_TIMEOUT_S) -> ParallelState:
    """Join this process to the tensor-parallel group (blocks until every rank has joined).

    Parameters
    ----------
    tp_rank, tp_size: this rank (0 = the scheduler's process) and the group size.
    nccl_port: the loopback TCP port of the rendezvous (rank 0 listens on it).
    device: cuda uses NCCL for the activations (and sets this rank's current device), cpu gloo.
    timeout_s: the longest a collective waits, seconds.

    Raises
    ------
    ValueError
        For a rank outside 0..tp_size-1, or fewer CUDA devices than ranks.
    RuntimeError
        From torch.distributed when the rendezvous fails or times out.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside 0..{tp_size - 1}")
    if tp_size == 1:
        return ParallelState(device=device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        num_gpus = torch.cuda.device_count()
        if tp_size > num_gpus:  # NCCL refuses two ranks on one GPU
            raise ValueError(f"tp_size={tp_size} needs a CUDA device per rank; {num_gpus} visible")
        device = torch.device("cuda", tp_rank)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{nccl_port}", rank=tp_rank,
                            world_size=tp_size, timeout=timeout)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelState(tp_rank, tp_size, world, cpu_group, device)


def destroy_parallel_state(state: ParallelState) -> None:
    """Leave the group (a no-op for a single rank or when already left)."""
    if state.is_parallel and dist.is_initialized():
        dist.destroy_process_group()
