"""The reference attention backend: `kernels/reference.py`, the oracle, on any device.

Simple rather than fast: it recomputes its gather indices in every layer. Tests
compare the other backends with it; `attention_backend="reference"` serves with it.
"""

from __future__ import annotations

from arborlm.kernels import reference
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend


class ReferenceAttentionBackend(AttentionBackend):
    """The oracle path (`kernels/reference.py`): simple, per-layer index work; any device."""

    takes_verify_rows = True  # stores the step's K/V first; `reference.decode_attention` is per row

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
