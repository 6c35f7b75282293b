"""Weights created empty, for a model's `load_weights` to fill from the checkpoint.

Used by every layer that owns a weight, so that building a model never spends time
on random initialisation of tensors that are overwritten at load.
"""

from __future__ import annotations

import torch
from torch import nn


def empty_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen weight of `shape` (values are garbage until loaded)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
