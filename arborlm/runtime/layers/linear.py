"""The linear layers of a model: the one seam every projection goes through.

`Linear` computes `y = x W^T (+ b)` through `LayerOps.linear` (`kernels/cpu_ops.py`),
which takes a copy of W prepacked once after loading: AMX tiles for decode-sized
inputs on CPUs with AMX, oneDNN's blocked layout for bf16 on the CPU, nothing
elsewhere. `MergedLinear` stacks several projections of one input by rows (q/k/v,
gate/up, as SGLang's `QKVParallelLinear` / `MergedColumnParallelLinear`) and says
which rows each checkpoint shard fills. Quantized and tensor-parallel linears are
to plug in here, behind the same `forward` and `pack`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.parameter import empty_parameter


class Linear(nn.Module):
    """`y = x W^T (+ b)` without random initialisation, through `ops.linear`.

    Parameters
    ----------
    in_features, out_features: W is (out_features, in_features) in `dtype`.
    bias: whether there is a (out_features,) bias.
    ops: the op implementations (`kernels.cpu_ops.layer_ops`).

    `forward(x)`: x (num_tokens, in_features) -> (num_tokens, out_features), x's dtype.
    After loading, `pack()` keeps a copy of W in the layout the ops' fastest kernel
    reads.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: LayerOps,
    ):
        super().__init__()
        self.weight = empty_parameter((out_features, in_features), dtype, device)
        self.bias = empty_parameter((out_features,), dtype, device) if bias else None
        self.ops = ops
        self.packed_weight: object | None = None

    def pack(self) -> None:
        """Prepack the loaded weight (`LayerOps.pack_linear`).

        Keeps `weight` beside it: a second copy of the weights in memory, a third
        on a CPU with AMX (its tile layout for decode steps and oneDNN's for
        prefills). Call again after changing `weight`.
        """
        self.packed_weight = self.ops.pack_linear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, self.packed_weight)


class MergedLinear(Linear):
    """Projections of the same input stacked by rows, loaded one checkpoint shard at a time.

    Parameters
    ----------
    in_features: input width.
    shard_sizes: shard id -> its output rows, in stacking order (e.g. {"q": 576,
        "k": 192, "v": 192} or {0: inter, 1: inter}).
    bias, dtype, device, ops: as `Linear`.
    """

    def __init__(
        self, in_features: int, shard_sizes: Mapping[Hashable, int], bias: bool, dtype: torch.dtype,
        device: torch.device, ops: LayerOps,
    ):
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, device, ops)
        self.shard_slices: dict[Hashable, slice] = {}
        start = 0
        for shard, size in shard_sizes.items():
            self.shard_slices[shard] = slice(start, start + size)
            start += size

    def shard_rows(self, shard: Hashable) -> slice:
        """The rows of `weight` (and `bias`) that shard `shard` fills.

        Raises
        ------
        KeyError
            For a shard id this layer does not stack.
        """
        return self.shard_slices[shard]


def pack_linears(module: nn.Module) -> None:
    """`pack()` every `Linear` inside `module` (call once its weights are loaded)."""
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.pack()
