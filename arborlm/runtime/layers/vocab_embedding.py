"""The token embedding table: the first layer of every model.

A plain lookup today; the vocabulary-parallel split of tensor parallelism is to
replace it here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
