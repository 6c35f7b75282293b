"""Attention over a KV pool stored in one byte per value (`kv_cache_dtype` fp8_e5m2 / fp8_e4m3 /
int8 with per-token, per-head scales).

The pool (`radix_cache/memory_pool.py`) stores K/V in one byte per value; the
attention kernels take K/V in q's dtype. Per step, `init_forward_metadata` lists
the pool slots of every request's positions `[0, seq_len)` (padded to the longest
request, slot 0 past a request's end) and a compact `req_to_token` that numbers
them 0, 1, ... request by request. Per layer, `forward` stores the new K/V (cast to
fp8), reads the listed slots upcast (`TokenToKVPool.read_kv`: the upcast on read
touches only the step's tokens) and runs the usual kernels over that compact copy:
the C++ decode kernel (`NativeLayerOps.decode_attention`) where it takes the
tensors, `kernels/reference.py` otherwise and for EXTEND steps. The same pattern
as SGLang's and vLLM's fp8 KV cache without scales (a plain cast on store, an
upcast in the attention kernel); here the upcast is a gather because the C++
kernels read one dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.kernels import reference
from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend


@dataclass
class CompactKVMetadata:
    """One step's view of the pool as a compact buffer.

    slots: (batch * max_len,) int64 pool slots, request after request, position order
        (slot 0 past a request's seq_len). req_to_token: (batch, max_len) int32, row b
        = b * max_len + [0, max_len): where each position sits in the compact buffer.
    req_pool_indices, seq_lens: (batch,) int64, rows of the compact req_to_token and
        each request's length.
    """

    slots: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


def compact_kv_metadata(forward_batch: ForwardBatch) -> CompactKVMetadata:
    """The step's slot list and compact index (see `CompactKVMetadata`)."""
    batch = int(forward_batch.req_pool_indices.shape[0])
    max_len = max(int(n) for n in forward_batch.seq_lens_cpu)
    device = forward_batch.req_pool_indices.device
    rows = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), :max_len]
    seq_lens = forward_batch.seq_lens.to(torch.int64)
    valid = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
    slots = torch.where(valid, rows.long(), 0).reshape(-1)
    compact = torch.arange(batch * max_len, dtype=torch.int32, device=device).view(batch, max_len)
    return CompactKVMetadata(slots, compact, torch.arange(batch, device=device), seq_lens.contiguous())


class QuantizedKVAttentionBackend(AttentionBackend):
    """Any step over an fp8 KV pool: store cast, read upcast, attend (module docstring).

    Parameters
    ----------
    native: the C++ CPU kernels (decode steps), or None for `kernels/reference.py` only.
    """

    # Each decode row gets its own upcast copy of its request's K/V: as decode rows a
    # verify chain of 1 + k tokens would gather that K/V 1 + k times per layer.
    takes_verify_rows = False

    def __init__(self, native: NativeLayerOps | None = None):
        self.native = native

    @classmethod
    def create(cls, device: torch.device, native: NativeLayerOps | None) -> QuantizedKVAttentionBackend:
        return cls(native if device.type == "cpu" else None)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = compact_kv_metadata(forward_batch)

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        meta = forward_batch.attn_metadata
        k_buffer, v_buffer = pool.read_kv(layer_id, meta.slots, q.dtype)  # (batch * max_len, Hkv, D)
        if forward_batch.forward_mode.is_decode():
            if self.native is not None and self.native.can_decode(q, k_buffer, v_buffer, meta.req_to_token):
                return self.native.decode_attention(
                    q, k_buffer, v_buffer, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                    scale, sliding_window, logit_cap, check=False,
                )
            return reference.decode_attention(
                q, k_buffer, v_buffer, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                scale, sliding_window, logit_cap,
            )
        return reference.extend_attention(
            q, k_buffer, v_buffer, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, scale, sliding_window, logit_cap,
        )
