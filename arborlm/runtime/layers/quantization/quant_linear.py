"""Linear layers and embedding tables whose weights stay in their GGUF quantization.

`QuantizedLinear` takes the place of a `Linear` / `MergedLinear` (`layers/linear.py`)
behind the same `forward(x)`: `y = x W^T (+ b)` through `QuantOps.linear`
(`kernels/quant_ops.py`: int8 VNNI dot products for decode steps, a dequantized
GEMM for prefills). `QuantizedEmbedding` takes the place of `VocabEmbedding` and
dequantizes only the looked-up rows; a tied lm_head is a `QuantizedLinear` over
the same packed table. Both are installed into a built model, and filled, by
`gguf_loader.py`; the model code does not change.

The packed tensors are buffers (not parameters): `load_weights` of the model only
sees the weights left in plain layers.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.quant_layout import QuantWeight, cat_rows
from arborlm.kernels.quant_ops import QuantOps
from arborlm.runtime.layers.linear import Linear, MergedLinear

# The shard id of a projection that is not stacked.
WHOLE = None


class QuantizedLinear(nn.Module):
    """`y = x [W_shard, ...]^T (+ b)` with each shard's W a `QuantWeight`.

    Parameters
    ----------
    in_features: input width (a multiple of 32).
    shard_sizes: shard id -> its output rows, in stacking order (`{WHOLE: out}` for
        a projection that is not stacked), as `MergedLinear`.
    bias_dtype: dtype of a (out_features,) bias, or None for no bias.
    ops: the quantized op implementations (`kernels.quant_ops.quant_ops`).

    `forward(x)`: x (num_tokens, in_features) -> (num_tokens, out_features), x's dtype.
    Fill with `load_shard` (and `load_bias`) for every shard, then call `finish`.
    """

    def __init__(
        self, in_features: int, shard_sizes: Mapping[Hashable, int], bias_dtype: torch.dtype | None,
        ops: QuantOps,
    ):
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = dict(shard_sizes)
        self.out_features = sum(self.shard_sizes.values())
        self.ops = ops
        bias = None if bias_dtype is None else torch.zeros(self.out_features, dtype=bias_dtype)
        self.register_buffer("bias", bias, persistent=False)
        self._shards: dict[Hashable, QuantWeight] = {}
        self.weights: Sequence[QuantWeight] = ()

    @classmethod
    def replacing(cls, linear: Linear, ops: QuantOps, whole: bool = False) -> QuantizedLinear:
        """An empty quantized layer of `linear`'s shape, shards and bias (`whole`: one
        shard of all rows, for a checkpoint that stores a fused projection as one tensor)."""
        if isinstance(linear, MergedLinear) and not whole:
            shards = {shard: rows.stop - rows.start for shard, rows in linear.shard_slices.items()}
        else:
            shards = {WHOLE: linear.weight.shape[0]}
        bias_dtype = None if linear.bias is None else linear.bias.dtype
        return cls(linear.weight.shape[1], shards, bias_dtype, ops)

    def shard_rows(self, shard: Hashable) -> slice:
        """The output rows shard `shard` fills (KeyError for a shard this layer does not stack)."""
        start = 0
        for other, size in self.shard_sizes.items():
            if other == shard:
                return slice(start, start + size)
            start += size
        raise KeyError(shard)

    def load_shard(self, shard: Hashable, weight: QuantWeight, name: str) -> None:
        """Take the packed weight of one shard (checkpoint tensor `name`, for errors).

        Raises
        ------
        ModelLoadError
            For a shard this layer does not stack or a weight of the wrong shape.
        """
        expected = (self.shard_sizes.get(shard, -1), self.in_features)
        if shard not in self.shard_sizes or (weight.out_features, weight.in_features) != expected:
            raise ModelLoadError(
                f"weight {name!r} has shape {(weight.out_features, weight.in_features)}, expected {expected}"
            )
        self._shards[shard] = weight

    def load_bias(self, shard: Hashable, values: torch.Tensor, name: str) -> None:
        """Copy one shard's bias (checkpoint tensor `name`).

        Raises
        ------
        ModelLoadError
            When the layer has no bias or the shape is wrong.
        """
        rows = self.shard_rows(shard)
        if self.bias is None or values.shape != (rows.stop - rows.start,):
            raise ModelLoadError(f"unexpected bias {name!r} of shape {tuple(values.shape)}")
        self.bias[rows].copy_(values)

    def finish(self, path: str) -> None:
        """Stack the loaded shards (one packed weight when they share a format).

        Raises
        ------
        ModelLoadError
            When a shard was not loaded (`path` names the layer).
        """
        missing = [shard for shard in self.shard_sizes if shard not in self._shards]
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for {path} (shards {missing})")
        shards = [self._shards[shard] for shard in self.shard_sizes]
        self.set_weights(tuple(shards) if len({w.fmt for w in shards}) > 1 else (cat_rows(shards),))
        self._shards.clear()

    def set_weights(self, weights: tuple[QuantWeight, ...]) -> None:
        """Serve `weights` (stacked by rows; a tied head passes the embedding's table)."""
        self.weights = self.ops.prepare(weights)
        for i, w in enumerate(weights):
            for kind, tensor in w.arrays().items():
                self.register_buffer(f"{kind}_{i}", tensor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weights, self.bias)

    def extra_repr(self) -> str:
        formats = "+".join(w.fmt for w in self.weights) or "unloaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, format={formats}"


class QuantizedEmbedding(nn.Module):
    """`table[input_ids]` for a (vocab_size, hidden_size) table kept quantized.

    `forward(input_ids)`: (num_tokens,) int64 -> (num_tokens, hidden_size) in `dtype`;
    only the looked-up rows are dequantized. Fill with `set_weight`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, ops: QuantOps):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.ops = ops
        self.weight: QuantWeight | None = None

    def set_weight(self, weight: QuantWeight, name: str) -> None:
        """Take the packed table (checkpoint tensor `name`, for errors).

        Raises
        ------
        ModelLoadError
            For a table of the wrong shape.
        """
        expected = (self.num_embeddings, self.embedding_dim)
        if (weight.out_features, weight.in_features) != expected:
            raise ModelLoadError(
                f"weight {name!r} has shape {(weight.out_features, weight.in_features)}, expected {expected}"
            )
        self.weight = weight
        for kind, tensor in weight.arrays().items():
            self.register_buffer(kind, tensor, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(self.weight, input_ids, self.dtype)

    def extra_repr(self) -> str:
        fmt = "unloaded" if self.weight is None else self.weight.fmt
        return f"{self.num_embeddings}, {self.embedding_dim}, format={fmt}"
