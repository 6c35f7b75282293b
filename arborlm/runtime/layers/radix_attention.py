"""One decoder layer's attention over the paged KV pool (SGLang's `RadixAttention`).

A model's attention block computes q, k, v (rotary applied) and calls this layer,
which holds what is fixed per layer (heads, head_dim, layer id, softmax scale,
sliding window, soft cap) and hands the step to the model's `AttentionBackend`:
the backend stores the new K/V at `forward_batch.out_cache_loc` and attends over
each request's K/V found through `req_to_token`, prefix shared through the radix
cache included.
"""

from __future__ import annotations

import torch
from torch import nn

from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend


class RadixAttention(nn.Module):
    """Paged attention of layer `layer_id` through `backend`.

    Parameters
    ----------
    num_heads, num_kv_heads, head_dim: query heads, K/V heads (GQA groups when
        fewer), and their width.
    layer_id: the layer's index in the KV pool.
    backend: the attention backend shared by the model's layers.
    scale: softmax scale; default `head_dim ** -0.5`.
    sliding_window: attend to the last `sliding_window` positions only; None = all.
    logit_cap: if > 0, tanh soft-capping of the scores (Gemma 2).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, layer_id: int, backend: AttentionBackend,
        scale: float | None = None, sliding_window: int | None = None, logit_cap: float = 0.0,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.backend = backend
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Store this step's K/V of the layer, then attend.

        Parameters
        ----------
        q: (num_tokens, num_heads, head_dim), rotary applied.
        k: (num_tokens, num_kv_heads, head_dim), rotary applied.
        v: (num_tokens, num_kv_heads * head_dim) or (num_tokens, num_kv_heads, head_dim).
        forward_batch: the step; its pool's layer `layer_id` is written.

        Returns
        -------
        (num_tokens, num_heads * head_dim) tensor in q's dtype.
        """
        num_tokens = q.shape[0]
        o = self.backend.forward(
            q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.layer_id, forward_batch, self.scale, self.sliding_window, self.logit_cap,
        )
        return o.reshape(num_tokens, self.num_heads * self.head_dim)
