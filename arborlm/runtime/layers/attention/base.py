"""The contract every attention backend keeps (`AttentionBackend`).

A model layer computes q, k, v for the step's new tokens and hands them, through
`layers/radix_attention.py`, to its backend, which stores k, v at
`forward_batch.out_cache_loc` and attends over each request's K/V found through
`req_to_token`. The model calls `init_forward_metadata` once per step, before its
layers, so that per-step index work is not redone per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Attention over the paged KV layout for one model step.

    `takes_verify_rows`: whether a speculative verify step may run on this backend as
    decode rows (`ForwardMode.TARGET_VERIFY`, several rows per request,
    `speculative/verify_batch.py`): true where the decode path stores every row's new
    K/V before attending and attends each row on its own over its `req_to_token` row
    and `seq_len`. False (the default) keeps verify steps on the extend path.

    `reads_one_byte_kv`: whether the backend attends over a pool stored in one byte per
    value (`kv_cache_dtype` fp8 / int8, `TokenToKVPool.quantized`) itself; the loader puts
    `QuantizedKVAttentionBackend` in the place of those that do not.
    """

    takes_verify_rows: bool = False
    reads_one_byte_kv: bool = False

    @classmethod
    def create(cls, device: torch.device, native: NativeLayerOps | None) -> AttentionBackend:
        """This backend for a model on `device`; `native` are the C++ CPU kernels, if built.

        The default ignores both; a backend that uses them, or that cannot run
        everywhere, overrides this.

        Raises
        ------
        ValueError
            Where the backend cannot run on `device`.
        """
        return cls()

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
