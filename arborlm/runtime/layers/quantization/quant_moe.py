"""A sparse block's experts with their weights kept quantized (GGUF's stacked expert tensors).

`QuantizedFusedMoE` takes the place of `layers/moe.py`'s `FusedMoE` behind the same
`forward(x, routing)`: each expert's gate/up and down projections are `QuantWeight`s
(one per expert, packed from the expert's rows of llama.cpp's 3-D `ffn_*_exps`
tensors) and run through `QuantOps.linear`, so a decode step streams only the
routed experts' quantized bytes. The grouping is `moe.grouped_experts`'s (the
(token, expert) assignments sorted by expert once, one projection call per expert
and its tokens); only the per-expert products differ. Installed and filled by
`gguf_loader.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps
from arborlm.kernels.quant_layout import QuantWeight, cat_rows
from arborlm.kernels.quant_ops import QuantOps, StackedWeights
from arborlm.runtime.layers.moe import DOWN, GATE, UP, FusedMoE, TopKRouting


class QuantizedFusedMoE(nn.Module):
    """The E experts of one sparse block, each projection a packed quantized weight.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size: E, H, I.
    layer_ops: `silu_and_mul` (the replaced `FusedMoE`'s ops).
    ops: the quantized ops.

    Fill with `load_shard(GATE | UP | DOWN, [one QuantWeight per expert], name)`, then
    `finish`. `forward(x, routing)`: x (num_tokens, H) -> (num_tokens, H) in x's dtype,
    `sum_j weights[t, j] * down_e(silu(gate_e x) * up_e x)` accumulated in float32.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layer_ops: LayerOps,
                 ops: QuantOps):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.layer_ops, self.ops = layer_ops, ops
        self._shards: dict[str, list[QuantWeight]] = {}
        self.gate_up: list[StackedWeights] = []
        self.down: list[StackedWeights] = []

    @classmethod
    def replacing(cls, experts: FusedMoE, ops: QuantOps) -> QuantizedFusedMoE:
        """An empty quantized block of `experts`' sizes."""
        return cls(experts.num_experts, experts.down_proj.shape[1], experts.intermediate_size, experts.ops, ops)

    def load_shard(self, shard: str, weights: list[QuantWeight], name: str) -> None:
        """Take one projection of every expert (checkpoint tensor `name`, for errors).

        Raises
        ------
        ModelLoadError
            For an unknown projection, another number of experts, or a wrong shape.
        """
        shapes = {GATE: (self.intermediate_size, self.hidden_size), UP: (self.intermediate_size, self.hidden_size),
                  DOWN: (self.hidden_size, self.intermediate_size)}
        if shard not in shapes:
            raise ModelLoadError(f"unknown expert projection {shard!r} for {name!r}")
        got = {(w.out_features, w.in_features) for w in weights}
        if len(weights) != self.num_experts or got != {shapes[shard]}:
            raise ModelLoadError(
                f"weight {name!r} holds {len(weights)} experts of shape {sorted(got)}, "
                f"expected {self.num_experts} of {shapes[shard]}"
            )
        self._shards[shard] = weights

    def finish(self, path: str) -> None:
        """Stack each expert's gate and up rows (one weight when their formats agree).

        Raises
        ------
        ModelLoadError
            When a projection was not loaded (`path` names the block).
        """
        missing = [shard for shard in (GATE, UP, DOWN) if shard not in self._shards]
        if missing:
            raise ModelLoadError(f"checkpoint lacks expert weights for {path} ({missing})")
        for e, (gate, up, down) in enumerate(zip(*(self._shards[s] for s in (GATE, UP, DOWN)))):
            pair = (cat_rows([gate, up]),) if gate.fmt == up.fmt else (gate, up)
            self.gate_up.append(self.ops.prepare(pair))
            self.down.append(self.ops.prepare((down,)))
            for kind, w in (("gate_up", pair), ("down", (down,))):
                for i, part in enumerate(w):
                    for array, tensor in part.arrays().items():
                        self.register_buffer(f"{kind}_{e}_{i}_{array}", tensor, persistent=False)
        self._shards.clear()

    def forward(self, x: torch.Tensor, routing: TopKRouting) -> torch.Tensor:
        num_tokens, top_k = routing.ids.shape
        flat_ids = routing.ids.reshape(-1)  # (num_tokens * top_k,) one entry per assignment
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k
        sorted_x = x[token_of]  # (num_tokens * top_k, H), grouped by expert
        out = torch.empty((num_tokens * top_k, self.hidden_size), dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                hidden = self.layer_ops.silu_and_mul(self.ops.linear(sorted_x[rows], self.gate_up[expert]))
                out[rows] = self.ops.linear(hidden, self.down[expert])
                start += count
        out *= routing.weights.reshape(-1)[order].unsqueeze(1)
        summed = torch.zeros((num_tokens, self.hidden_size), dtype=torch.float32, device=x.device)
        return summed.index_add_(0, token_of, out).to(x.dtype)

    def extra_repr(self) -> str:
        formats = sorted({w.fmt for stacked in (*self.gate_up, *self.down) for w in stacked}) or ["unloaded"]
        return f"num_experts={self.num_experts}, format={'+'.join(formats)}"
