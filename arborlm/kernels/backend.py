"""Attention backends: how a layer's attention reads and writes the paged KV pool.

A model layer computes q, k, v for the step's new tokens and hands them to an
`AttentionBackend`, which stores k, v at `forward_batch.out_cache_loc` and attends
over each request's K/V found through `req_to_token`. The model calls
`init_forward_metadata` once per step, before its layers, so that per-step index
work is not redone per layer. The torch backend runs `torch_native.py` (the CPU
path); the reference backend runs `reference.py` (the oracle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from arborlm.kernels import reference, torch_native
from arborlm.runtime.batch import ForwardBatch

ATTENTION_BACKENDS = ("auto", "torch", "reference")


class AttentionBackend(ABC):
    """Attention over the paged KV layout for one model step."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute what every layer of this step shares (gather indices, masks).

        Called by the model once per step before its first layer; may set
        `forward_batch.attn_metadata` and mutates nothing else. Must be called
        again if `req_to_token` rows, `seq_lens` or the batch change.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """Store the new K/V of layer `layer_id`, then attend.

        Mutates `forward_batch.token_to_kv_pool` (layer `layer_id`, rows
        `forward_batch.out_cache_loc`) and nothing else. Reads the K/V of every
        request's positions `[0, seq_len)` through
        `req_to_token[req_pool_indices]`, which the caller has filled.

        Parameters
        ----------
        q: (num_tokens, num_q_heads, head_dim), rotary embedding applied.
        k, v: (num_tokens, num_kv_heads, head_dim), the new tokens' K (rotated) and V.
        layer_id: which layer of the pool.
        forward_batch: the step (EXTEND or DECODE).
        scale: softmax scale.
        sliding_window: attend only to the last `sliding_window` positions; None = all.
        logit_cap: if > 0, tanh soft-capping of the scores.

        Returns
        -------
        (num_tokens, num_q_heads, head_dim) tensor in q's dtype.
        """


class ReferenceAttentionBackend(AttentionBackend):
    """The oracle path (`kernels/reference.py`): simple, per-layer index work; any device."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing: the reference recomputes its indices in every layer."""

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            return reference.decode_attention(
                q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, scale, sliding_window, logit_cap,
            )
        return reference.extend_attention(
            q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            scale, sliding_window, logit_cap,
        )


class TorchAttentionBackend(AttentionBackend):
    """The torch CPU path (`kernels/torch_native.py`): per-step metadata, runs on any device."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        max_len = max(forward_batch.seq_lens_cpu)
        if forward_batch.forward_mode.is_decode():
            forward_batch.attn_metadata = torch_native.build_decode_metadata(
                req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, max_len,
                forward_batch.token_to_kv_pool.num_kv_heads,
            )
        else:
            forward_batch.attn_metadata = torch_native.build_extend_metadata(
                req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
                max(forward_batch.extend_seq_lens_cpu), max_len,
            )

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        if forward_batch.attn_metadata is None:
            self.init_forward_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            return torch_native.decode_attention(
                q, k_buffer, v_buffer, forward_batch.attn_metadata, scale, sliding_window, logit_cap
            )
        return torch_native.extend_attention(
            q, k_buffer, v_buffer, forward_batch.attn_metadata, scale, sliding_window, logit_cap
        )


def create_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The attention backend called `name` for `device`.

    Parameters
    ----------
    name: "auto" (torch on every device until the Triton kernels land), "torch" or "reference".
    device: where the model runs.

    Raises
    ------
    ValueError
        For an unknown name.
    """
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    if name == "reference":
        return ReferenceAttentionBackend()
    raise ValueError(f"attention_backend={name!r} is invalid: expected one of {ATTENTION_BACKENDS}")
