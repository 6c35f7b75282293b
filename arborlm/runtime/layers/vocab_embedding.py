"""The token embedding table (the first layer of every model) and, split over tensor-parallel
ranks, the embedding and the LM head by vocabulary rows.

`VocabEmbedding` is the plain lookup. Under tensor parallelism (SGLang's
`VocabParallelEmbedding` / `ParallelLMHead`, after Megatron-LM) each rank holds
ceil(vocab / tp_size) rows of the table (`ParallelState.vocab_range`, the last rank's
padded with zeros): the embedding looks up the ids in its range, zeroes the others and sums
over the ranks; the head computes the logits of its rows and gathers every rank's, then
drops the padding. A tied head shares the embedding's (identically split) table.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.distributed.communication import all_gather, all_reduce
from arborlm.runtime.distributed.parallel_state import ParallelState
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.parameter import empty_parameter


class VocabEmbedding(nn.Module):
    """`weight[input_ids]` for a (vocab_size, hidden_size) table in `dtype`.

    `forward(input_ids)`: (num_tokens,) int64 -> (num_tokens, hidden_size).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = empty_parameter((vocab_size, hidden_size), dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def _vocab_rows(full: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a (vocab, ...) checkpoint tensor, zero rows past its end."""
    part = full[start : start + size]
    if part.shape[0] == size:
        return part
    pad = full.new_zeros((size - part.shape[0], *full.shape[1:]))
    return torch.cat([part, pad])


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's `parallel.vocab_range(vocab_size)` rows of the table; lookups summed over ranks.

    `forward(input_ids)`: (num_tokens,) int64 -> (num_tokens, hidden_size), identical on every rank.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelState):
        self.vocab_range = parallel.vocab_range(vocab_size)
        super().__init__(self.vocab_range.size, hidden_size, dtype, device)
        self.parallel = parallel

    def checkpoint_slice(self, param: str, shard: Hashable | None, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(tensor, self.vocab_range.start, self.vocab_range.size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_range.start
        mine = (local >= 0) & (local < self.vocab_range.size)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce(self.parallel, out)


class ParallelLMHead(Linear):
    """The LM head over this rank's vocabulary rows; the logits of all ranks gathered.

    `forward(hidden)`: (num_tokens, hidden_size) -> (num_tokens, vocab_size), identical on every
    rank (the padding rows of the last rank dropped).
    """

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                 ops: LayerOps, parallel: ParallelState):
        self.vocab_range = parallel.vocab_range(vocab_size)
        super().__init__(hidden_size, self.vocab_range.size, False, dtype, device, ops)
        self.vocab_size = vocab_size
        self.parallel = parallel

    def checkpoint_slice(self, param: str, shard: Hashable | None, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(tensor, self.vocab_range.start, self.vocab_range.size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather(self.parallel, super().forward(hidden), dim=-1)[..., : self.vocab_size]


def make_vocab_embedding(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                         parallel: ParallelState | None) -> VocabEmbedding:
    """The embedding table: whole on a single rank, else a `VocabParallelEmbedding`."""
    if parallel is None or not parallel.is_parallel:
        return VocabEmbedding(vocab_size, hidden_size, dtype, device)
    return VocabParallelEmbedding(vocab_size, hidden_size, dtype, device, parallel)


def make_lm_head(hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device, ops: LayerOps,
                 parallel: ParallelState | None) -> Linear:
    """The LM head (no bias): a `Linear` on a single rank, else a `ParallelLMHead`."""
    if parallel is None or not parallel.is_parallel:
        return Linear(hidden_size, vocab_size, False, dtype, device, ops)
    return ParallelLMHead(hidden_size, vocab_size, dtype, device, ops, parallel)
