"""The linear layers of a model: the one seam every projection goes through.

`Linear` computes `y = x W^T (+ b)` through `LayerOps.linear` (`kernels/cpu_ops.py`),
which takes a copy of W prepacked once after loading: AMX tiles for decode-sized
inputs on CPUs with AMX, oneDNN's blocked layout for bf16 on the CPU, nothing
elsewhere. `MergedLinear` stacks several projections of one input by rows (q/k/v,
gate/up, as SGLang's `QKVParallelLinear` / `MergedColumnParallelLinear`) and says
which rows each checkpoint shard fills. Quantized linears plug in here, behind the
same `forward` and `pack`.

Tensor parallelism (Megatron-LM's split, SGLang's names): `MergedColumnParallelLinear`
keeps this rank's rows of every stacked shard (gate/up by MLP columns; `QKVParallelLinear`
q by heads and k/v by K/V heads, replicated when fewer than ranks), so the fused output
splits per rank exactly as the full one does; `RowParallelLinear` keeps this rank's input
columns and sums the partial products over the ranks (o_proj, down_proj). Each takes its
slice of a full checkpoint tensor in `checkpoint_slice` at load. The `make_*` functions
build the plain layers for a single rank, so that path stays as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from torch import nn

from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.distributed.communication import all_reduce
from arborlm.runtime.distributed.parallel_state import ParallelState, ShardRange
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

    def checkpoint_slice(self, param: str, shard: Hashable | None, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor this layer holds: all of it on a single rank.

        param: "weight" or "bias"; shard: the stacked shard id (None for an unstacked layer).
        """
        return tensor


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


class MergedColumnParallelLinear(MergedLinear):
    """A `MergedLinear` of which this rank holds `shard_ranges[shard]` of each shard's rows.

    Parameters
    ----------
    in_features: input width (whole on every rank).
    shard_ranges: shard id -> this rank's rows of that shard in the checkpoint, in stacking
        order; the local weight stacks them, (sum of sizes, in_features).
    bias, dtype, device, ops: as `Linear`.

    `forward(x)`: (num_tokens, in_features) -> (num_tokens, local rows), no communication.
    """

    def __init__(
        self, in_features: int, shard_ranges: Mapping[Hashable, ShardRange], bias: bool, dtype: torch.dtype,
        device: torch.device, ops: LayerOps,
    ):
        super().__init__(in_features, {k: r.size for k, r in shard_ranges.items()}, bias, dtype, device, ops)
        self.shard_ranges = dict(shard_ranges)

    def checkpoint_slice(self, param: str, shard: Hashable | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of checkpoint shard `shard` (weight rows or bias entries)."""
        return self.shard_ranges[shard].narrow(tensor, 0)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection split by attention heads: shards "q", "k", "v".

    Rank r holds query heads `parallel.split(num_heads)` and K/V heads
    `parallel.kv_head_range(num_kv_heads)` (one head replicated over several ranks when
    num_kv_heads < tp_size), each `head_dim` rows of the checkpoint's q_proj / k_proj / v_proj.

    Raises
    ------
    ValueError
        When tp_size divides neither the heads nor (either way) the K/V heads.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
        dtype: torch.dtype, device: torch.device, ops: LayerOps, parallel: ParallelState,
    ):
        heads = parallel.split(num_heads, "num_attention_heads")
        kv_heads = parallel.kv_head_range(num_kv_heads)
        q = ShardRange(heads.start * head_dim, heads.size * head_dim)
        kv = ShardRange(kv_heads.start * head_dim, kv_heads.size * head_dim)
        super().__init__(hidden_size, {"q": q, "k": kv, "v": kv}, bias, dtype, device, ops)


class RowParallelLinear(Linear):
    """`y = sum over ranks of x_r W_r^T (+ b)`: this rank holds `in_range` of W's input columns.

    Parameters
    ----------
    in_range: this rank's columns of the checkpoint weight (its input is those features).
    out_features, bias, dtype, device, ops: as `Linear`; the bias is whole on every rank and
        added once, after the sum.
    parallel: the group the partial products are summed over (`all_reduce`).

    `forward(x)`: (num_tokens, in_range.size) -> (num_tokens, out_features), identical on every rank.
    """

    def __init__(
        self, in_range: ShardRange, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        ops: LayerOps, parallel: ParallelState,
    ):
        super().__init__(in_range.size, out_features, bias, dtype, device, ops)
        self.in_range = in_range
        self.parallel = parallel

    def checkpoint_slice(self, param: str, shard: Hashable | None, tensor: torch.Tensor) -> torch.Tensor:
        return self.in_range.narrow(tensor, 1) if param == "weight" else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.parallel, self.ops.linear(x, self.weight, None, self.packed_weight))
        return y if self.bias is None else y + self.bias


def make_qkv_linear(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, dtype: torch.dtype,
    device: torch.device, ops: LayerOps, parallel: ParallelState | None,
) -> MergedLinear:
    """The fused q/k/v projection: a `MergedLinear` on a single rank, else `QKVParallelLinear`."""
    if parallel is None or not parallel.is_parallel:
        shards = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        return MergedLinear(hidden_size, shards, bias, dtype, device, ops)
    return QKVParallelLinear(hidden_size, num_heads, num_kv_heads, head_dim, bias, dtype, device, ops, parallel)


def make_merged_column_linear(
    in_features: int, shard_sizes: Mapping[Hashable, int], bias: bool, dtype: torch.dtype, device: torch.device,
    ops: LayerOps, parallel: ParallelState | None, name: str,
) -> MergedLinear:
    """Stacked projections split by output rows (gate/up): a `MergedLinear` on a single rank,
    else a `MergedColumnParallelLinear` with `1 / tp_size` of each shard.

    Raises
    ------
    ValueError
        When tp_size does not divide a shard's size (`name`, e.g. intermediate_size).
    """
    if parallel is None or not parallel.is_parallel:
        return MergedLinear(in_features, shard_sizes, bias, dtype, device, ops)
    ranges = {shard: parallel.split(size, name) for shard, size in shard_sizes.items()}
    return MergedColumnParallelLinear(in_features, ranges, bias, dtype, device, ops)


def make_row_linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device, ops: LayerOps,
    parallel: ParallelState | None, name: str,
) -> Linear:
    """A projection split by input columns (o_proj, down_proj): a `Linear` on a single rank, else a
    `RowParallelLinear` holding `1 / tp_size` of `in_features` (ValueError naming `name` unless divisible)."""
    if parallel is None or not parallel.is_parallel:
        return Linear(in_features, out_features, bias, dtype, device, ops)
    return RowParallelLinear(parallel.split(in_features, name), out_features, bias, dtype, device, ops, parallel)


def pack_linears(module: nn.Module) -> None:
    """`pack()` every `Linear` inside `module` (call once its weights are loaded)."""
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.pack()
