"""The sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE).

In the decoder layers a family marks sparse, this block takes the gated MLP's place:
a router picks `top_k` of `num_experts` SwiGLU experts per token and the token's
output is the routing-weighted sum of theirs. The algorithm is transformers'
`MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` (router `MixtralTopKRouter` /
`Qwen3MoeTopKRouter`: linear -> float32 softmax -> `torch.topk` -> optional
renormalisation; experts `MixtralExperts` / `Qwen3MoeExperts`, stacked as
gate_up (E, 2 * I, H) and down (E, H, I)). The experts run grouped, as the
torch-native path of SGLang's and vLLM's fused MoE: the (token, expert)
assignments are sorted by expert once, and each expert's tokens go through one
matrix product per projection; there is no loop over tokens. A Triton fused-MoE
kernel is to plug in behind `FusedMoE.forward`.

`fold_expert_weights` turns a checkpoint's per-expert weights
(`...experts.{e}.gate_proj.weight` or Mixtral's `w1`/`w3`/`w2`) into the stacked
tensors while the model's `load_weights` streams them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps
from arborlm.runtime.layers.linear import Linear
from arborlm.runtime.layers.parameter import empty_parameter

# Which part of an expert a checkpoint tensor fills (the experts' `weight_view` shards).
GATE, UP, DOWN = "gate", "up", "down"


class TopKRouting(NamedTuple):
    """Each token's experts and their weights.

    weights: (num_tokens, top_k) float32, in `torch.topk`'s order (largest first).
    ids: (num_tokens, top_k) int64 expert ids.
    """

    weights: torch.Tensor
    ids: torch.Tensor


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> TopKRouting:
    """Top-k routing of transformers' `MixtralTopKRouter` / `Qwen3MoeTopKRouter`.

    Parameters
    ----------
    router_logits: (num_tokens, num_experts), any float dtype.
    top_k: experts per token.
    renormalize: divide the chosen probabilities by their sum (Mixtral always;
        Qwen3-MoE per `norm_topk_prob`).

    Returns
    -------
    TopKRouting with float32 weights. The softmax is taken in float32 and the ids come
    from `torch.topk` on it, as transformers does, so ties break the same way.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKRouting(weights, ids)


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: TopKRouting, ops: LayerOps
) -> torch.Tensor:
    """The routed experts' SwiGLU outputs, weighted and summed per token.

    Parameters
    ----------
    x: (num_tokens, hidden) activations.
    gate_up: (num_experts, 2 * inter, hidden), gate rows then up rows; x's dtype.
    down: (num_experts, hidden, inter); x's dtype.
    routing: from `select_experts`.
    ops: `silu_and_mul` and `linear` implementations.

    Returns
    -------
    (num_tokens, hidden) in x's dtype: `sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`,
    accumulated in float32 (transformers' `MixtralExperts.forward` computes the same
    sum expert by expert).
    """
    num_tokens, top_k = routing.ids.shape
    flat_ids = routing.ids.reshape(-1)  # (num_tokens * top_k,) one entry per assignment
    # A stable sort keeps each expert's tokens in token order; one host sync for the counts.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    token_of = order // top_k  # the token of each sorted assignment
    sorted_x = x[token_of]  # (num_tokens * top_k, hidden), grouped by expert
    out = torch.empty((num_tokens * top_k, down.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            hidden = ops.silu_and_mul(ops.linear(sorted_x[rows], gate_up[expert], None, None))
            out[rows] = ops.linear(hidden, down[expert], None, None)
            start += count
    out *= routing.weights.reshape(-1)[order].unsqueeze(1)
    summed = torch.zeros((num_tokens, down.shape[1]), dtype=torch.float32, device=x.device)
    return summed.index_add_(0, token_of, out).to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one sparse block, as two stacked weights.

    Parameters
    ----------
    num_experts, hidden_size, intermediate_size: E, H, I.
    dtype, device, ops: as the other layers.

    Weights: `gate_up_proj` (E, 2 * I, H), gate rows then up rows; `down_proj`
    (E, H, I) (transformers 5's in-memory names, so a checkpoint that stores them
    stacked loads by name). `forward(x, routing)`: x (num_tokens, H) ->
    (num_tokens, H), x's dtype (see `grouped_experts`).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
        device: torch.device, ops: LayerOps,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.ops = ops
        self.gate_up_proj = empty_parameter((num_experts, 2 * intermediate_size, hidden_size), dtype, device)
        self.down_proj = empty_parameter((num_experts, hidden_size, intermediate_size), dtype, device)

    def forward(self, x: torch.Tensor, routing: TopKRouting) -> torch.Tensor:
        return grouped_experts(x, self.gate_up_proj, self.down_proj, routing, self.ops)

    def weight_view(self, expert: int, shard: str) -> tuple[str, torch.Tensor]:
        """`(parameter name, the view of it)` that one expert's `GATE` / `UP` / `DOWN`
        checkpoint weight fills.

        Raises
        ------
        ModelLoadError
            For an expert id out of range or an unknown shard.
        """
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"expert {expert} out of range: the model has {self.num_experts} experts")
        inter = self.intermediate_size
        if shard == GATE:
            return "gate_up_proj", self.gate_up_proj.data[expert, :inter]
        if shard == UP:
            return "gate_up_proj", self.gate_up_proj.data[expert, inter:]
        if shard == DOWN:
            return "down_proj", self.down_proj.data[expert]
        raise ModelLoadError(f"unknown expert shard {shard!r}")

    def views_per_parameter(self, name: str) -> int:
        """How many `weight_view`s fill parameter `name` ("gate_up_proj": 2 per expert)."""
        return self.num_experts * (2 if name == "gate_up_proj" else 1)


class SparseMoeBlock(nn.Module):
    """Router plus experts: transformers' `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`.

    Parameters
    ----------
    hidden_size, intermediate_size: H and each expert's I.
    num_experts, top_k: E and experts per token.
    renormalize: renormalise the top-k weights (see `select_experts`).
    dtype, device, ops: as the other layers.

    Weights: `gate` (the router, (E, H), no bias) and `experts` (`FusedMoE`).
    `forward(x)`: x (num_tokens, H) -> (num_tokens, H), x's dtype. Router jitter
    (Mixtral's training-time noise) does not apply at inference.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
        dtype: torch.dtype, device: torch.device, ops: LayerOps,
    ):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, False, dtype, device, ops)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, dtype, device, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.route(x))

    def route(self, x: torch.Tensor) -> TopKRouting:
        """Each token's experts: x (num_tokens, H) -> `TopKRouting`."""
        return select_experts(self.gate(x), self.top_k, self.renormalize)


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names its per-expert weights.

    pattern: full-matches one expert weight's name, with groups `block` (our
        `SparseMoeBlock`'s module path), `expert` (the id) and `proj`.
    projections: `proj` -> `GATE` / `UP` / `DOWN`.
    """

    pattern: re.Pattern
    projections: Mapping[str, str]


def fold_expert_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], names: ExpertNames
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass `weights` through, copying per-expert ones into the stacked `FusedMoE` weights.

    For `load_stacked_weights`: once every expert's share of a stacked parameter has
    been copied in, yields `(its name, the parameter itself)`, so the loader checks
    its shape and counts it as loaded (copying a tensor onto itself is a no-op); one
    left incomplete is never yielded, and the loader reports it missing. No second copy
    of a layer's experts is held.

    Raises
    ------
    ModelLoadError
        For an expert weight of no sparse block, an unknown projection, an expert id
        out of range or a shape mismatch.
    """
    filled: dict[str, set[tuple[int, str]]] = {}
    for name, tensor in weights:
        match = names.pattern.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        experts = _experts_of(model, match["block"], name)
        shard = names.projections.get(match["proj"])
        if shard is None:
            raise ModelLoadError(f"unexpected expert weight {name!r} in the checkpoint")
        param, view = experts.weight_view(int(match["expert"]), shard)
        if view.shape != tensor.shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
        view.copy_(tensor)
        full_name = f"{match['block']}.experts.{param}"
        done = filled.setdefault(full_name, set())
        done.add((int(match["expert"]), shard))
        if len(done) == experts.views_per_parameter(param):
            yield full_name, getattr(experts, param).data


def _experts_of(model: nn.Module, block: str, name: str) -> FusedMoE:
    """The `FusedMoE` of the sparse block at module path `block`, for weight `name`."""
    try:
        experts = model.get_submodule(f"{block}.experts")
    except AttributeError:
        experts = None
    if not isinstance(experts, FusedMoE):
        raise ModelLoadError(f"expert weight {name!r} belongs to no sparse MoE layer of this model")
    return experts
