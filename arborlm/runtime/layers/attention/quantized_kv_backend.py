"""Attention over a KV pool stored in one byte per value (`kv_cache_dtype` fp8_e5m2 / fp8_e4m3 /
int8 with per-token, per-head scales).

The pool (`radix_cache/memory_pool.py`) stores K/V in one byte per value. On the CPU
the C++ kernels read it in place: DECODE steps through `NativeLayerOps.decode_attention`
(each K/V row widened in registers as it streams; an int8 row's scale folded into its
score and probability), EXTEND steps through `NativeLayerOps.extend_attention_tiled`
(each tile of 64 keys widened once into L1 and used by every new token of a block), so
no step copies the context. That is how SGLang's and vLLM's fp8 KV caches work on the
GPU (a plain cast on store, the upcast inside the attention kernel). Without the native
kernels (another device) a step reads a compact upcast copy: `init_forward_metadata`
lists the pool slots of every request's positions `[0, seq_len)` (padded to the longest
request, slot 0 past a request's end) and a compact `req_to_token` that numbers them
0, 1, ... request by request; per layer the listed slots are read upcast
(`TokenToKVPool.read_kv`) and `kernels/reference.py` attends over that copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.kernels import reference
from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend
from arborlm.runtime.layers.attention.torch_native_backend import (
    NativeDecodeMetadata,
    NativeExtendMetadata,
)


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
    """Any step over a one-byte KV pool: store cast, attend in place (native kernels)
    or over an upcast copy (module docstring).

    Parameters
    ----------
    native: the C++ CPU kernels, or None for `kernels/reference.py` only.
    """

    def __init__(self, native: NativeLayerOps | None = None):
        self.native = native
        # In place, each verify row reads its request's K/V as a decode row does (all rows
        # stored first); through the upcast copy every row would gather it again.
        self.takes_verify_rows = native is not None

    @classmethod
    def create(cls, device: torch.device, native: NativeLayerOps | None) -> QuantizedKVAttentionBackend:
        return cls(native if device.type == "cpu" else None)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.native is not None and forward_batch.forward_mode.is_decode():
            # The torch backend's metadata: over an int8 pool the fused decoder layer
            # (`layers/fused_decode.py`) takes the step as it does over a float pool.
            forward_batch.attn_metadata = NativeDecodeMetadata.of(forward_batch)
            return
        if self.native is not None and forward_batch.forward_mode.is_extend():
            forward_batch.attn_metadata = NativeExtendMetadata.of(forward_batch)
            return
        forward_batch.attn_metadata = compact_kv_metadata(forward_batch)

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        meta = forward_batch.attn_metadata
        if isinstance(meta, (NativeDecodeMetadata, NativeExtendMetadata)):
            out = self._in_place(q, layer_id, forward_batch, meta, scale, sliding_window, logit_cap)
            if out is not None:
                return out
            meta = forward_batch.attn_metadata = compact_kv_metadata(forward_batch)
        k_buffer, v_buffer = pool.read_kv(layer_id, meta.slots, q.dtype)  # (batch * max_len, Hkv, D)
        if forward_batch.forward_mode.is_decode():
            return reference.decode_attention(
                q, k_buffer, v_buffer, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                scale, sliding_window, logit_cap,
            )
        return reference.extend_attention(
            q, k_buffer, v_buffer, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, scale, sliding_window, logit_cap,
        )

    def _in_place(self, q, layer_id, forward_batch, meta, scale, sliding_window, logit_cap) -> torch.Tensor | None:
        """The step through the C++ kernel over the one-byte pool, K/V already stored:
        decode (`meta` a `NativeDecodeMetadata`) or tiled extend (`NativeExtendMetadata`);
        None where the kernels do not take these tensors."""
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        scales = pool.get_kv_scales(layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        if not (meta.checked or self.native.can_decode(q, k_buffer, v_buffer, req_to_token, kv_scales=scales)):
            return None
        meta.checked = True  # every layer has the same shapes, dtypes and layout
        args = (q, k_buffer, v_buffer, req_to_token, meta.req_pool_indices, meta.seq_lens)
        if isinstance(meta, NativeDecodeMetadata):
            return self.native.decode_attention(
                *args, scale, sliding_window, logit_cap, check=False, kv_scales=scales,
            )
        return self.native.extend_attention_tiled(
            *args, meta.extend_seq_lens, meta.extend_start_loc, scale, sliding_window, logit_cap,
            kv_scales=scales, check=False,
        )
