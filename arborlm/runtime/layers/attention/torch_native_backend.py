"""The torch attention backend: the CPU path (`kernels/torch_native.py`), on any device.

Per step it builds the gather indices and masks every layer shares; with the C++
CPU kernels of `kernels/cpu_ops.py` (`NativeLayerOps`), DECODE steps instead go
through `decode_attention`, bf16 EXTEND steps on a CPU with AMX through
`extend_attention`, and every other EXTEND step through `decode_attention` too, one
decode row per new token, all reading K/V in the pool in place. Steps the native
kernels do not take (dtype, layout) fall back to `torch_native` (SDPA over a gather).

Why EXTEND as decode rows: the token at position p then attends exactly as a decode
step at seq_len p + 1 would, whatever else the step holds. SDPA's GEMMs round
differently with the number of query rows and where a prompt was cut (a cached
prefix, a prefill chunk), so the same greedy request could answer differently alone,
under load, with the cache warm or cold. Measured on an AVX2 EPYC (SmolLM2 Q4_1,
float32): 0.98x the prefill time at 300 tokens, 1.05-1.10x from 1024 to 4000
(`benchmarks/bench_extend_paths.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arborlm.kernels import torch_native
from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend


@dataclass
class NativeDecodeMetadata:
    """A DECODE step for `NativeLayerOps.decode_attention`: the request rows,
    lengths and new K/V slots as contiguous int64 (batch,) tensors, made once per
    step; `checked` once the first layer's tensors passed `can_decode`."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    checked: bool = False

    @classmethod
    def of(cls, forward_batch: ForwardBatch) -> NativeDecodeMetadata:
        """The DECODE step's tensors, converted once."""
        return cls(
            forward_batch.req_pool_indices.to(torch.int64).contiguous(),
            forward_batch.seq_lens.to(torch.int64).contiguous(),
            forward_batch.out_cache_loc.to(torch.int64).contiguous(),
        )

    @classmethod
    def of_extend_rows(cls, forward_batch: ForwardBatch) -> NativeDecodeMetadata:
        """An EXTEND step as decode rows, one per new token (as TARGET_VERIFY is laid
        out): the token at position p of request r is a row of r with seq_len p + 1."""
        extend_lens = forward_batch.extend_seq_lens.to(torch.int64)
        rows = torch.repeat_interleave(forward_batch.req_pool_indices.to(torch.int64), extend_lens)
        # From the KV lengths, not `positions` (a model may offset its positions):
        # row j of a request after `prefix` cached tokens sees prefix + j + 1 keys.
        first_row = torch.cumsum(extend_lens, 0) - extend_lens
        j = torch.arange(rows.shape[0], dtype=torch.int64) - torch.repeat_interleave(first_row, extend_lens)
        prefix = torch.repeat_interleave(forward_batch.extend_prefix_lens.to(torch.int64), extend_lens)
        return cls(
            rows.contiguous(),
            (prefix + j + 1).contiguous(),
            forward_batch.out_cache_loc.to(torch.int64).contiguous(),
        )


@dataclass
class NativeExtendMetadata:
    """An EXTEND step for `NativeLayerOps.extend_attention`: request rows, lengths,
    new-token counts and each request's first row of q, as contiguous int64 (batch,)
    tensors made once per step; `checked` once the first layer passed `can_extend`."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    checked: bool = False

    @classmethod
    def of(cls, forward_batch: ForwardBatch) -> NativeExtendMetadata:
        """The EXTEND step's tensors, converted once (extend_start_loc: the exclusive
        cumulative sum of extend_seq_lens)."""
        extend_seq_lens = forward_batch.extend_seq_lens.to(torch.int64).contiguous()
        return cls(
            forward_batch.req_pool_indices.to(torch.int64).contiguous(),
            forward_batch.seq_lens.to(torch.int64).contiguous(),
            extend_seq_lens,
            (torch.cumsum(extend_seq_lens, 0) - extend_seq_lens).contiguous(),
        )


class TorchAttentionBackend(AttentionBackend):
    """The torch CPU path (`kernels/torch_native.py`): per-step metadata, runs on any device.

    With `native` (the C++ CPU kernels), DECODE steps whose tensors it takes attend
    through `NativeLayerOps.decode_attention`, bf16 EXTEND steps on a CPU with AMX
    through `NativeLayerOps.extend_attention`, other EXTEND steps as decode rows
    (`NativeDecodeMetadata.of_extend_rows`; module docstring); all read K/V in place and
    need no per-step gather indices. Other steps take `torch_native` (SDPA over a gather).

    extend_as_decode_rows: False sends those EXTEND steps to `torch_native` instead
        (the oracle in tests, the baseline in benchmarks).
    """

    # `arborlm_decode_attention` stores all rows' K/V, then attends row by row; the torch
    # fallback stores first too, and gathers each row's keys by its own seq_len.
    takes_verify_rows = True

    def __init__(self, native: NativeLayerOps | None = None, extend_as_decode_rows: bool = True):
        self.native = native
        self.extend_as_decode_rows = extend_as_decode_rows

    @classmethod
    def create(cls, device: torch.device, native: NativeLayerOps | None) -> TorchAttentionBackend:
        return cls(native)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if self.native is not None and mode.is_decode():
            # The layers check that the kernel takes their tensors, and fall back if not.
            forward_batch.attn_metadata = NativeDecodeMetadata.of(forward_batch)
        elif self.native is not None and self.native.amx and mode.is_extend():
            # bf16 steps take the AMX kernel; the first layer turns other steps into decode rows.
            forward_batch.attn_metadata = NativeExtendMetadata.of(forward_batch)
        elif self.native is not None and self.extend_as_decode_rows and mode.is_extend():
            forward_batch.attn_metadata = NativeDecodeMetadata.of_extend_rows(forward_batch)
        else:
            forward_batch.attn_metadata = self._torch_metadata(forward_batch)

    @staticmethod
    def _torch_metadata(forward_batch: ForwardBatch):
        """`torch_native`'s gather indices and masks for this step."""
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            return torch_native.build_decode_metadata(
                req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                max(forward_batch.seq_lens_cpu), forward_batch.token_to_kv_pool.num_kv_heads,
            )
        return torch_native.build_extend_step_metadata(
            req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            forward_batch.extend_seq_lens_cpu, forward_batch.seq_lens_cpu,
            forward_batch.token_to_kv_pool.num_kv_heads,
        )

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        meta = forward_batch.attn_metadata
        if isinstance(meta, NativeExtendMetadata) and not (meta.checked or self._takes_extend(q, layer_id, forward_batch)):
            meta = forward_batch.attn_metadata = (
                NativeDecodeMetadata.of_extend_rows(forward_batch) if self.extend_as_decode_rows else None
            )
        if isinstance(meta, NativeDecodeMetadata):
            o = self._native_decode(q, k, v, layer_id, forward_batch, meta, scale, sliding_window, logit_cap)
            if o is not None:
                return o
            forward_batch.attn_metadata = None
        # The native decode kernel stores the new K/V itself; every other path stores them first.
        forward_batch.token_to_kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        if isinstance(meta, NativeExtendMetadata):
            return self._native_extend(q, layer_id, forward_batch, meta, scale, sliding_window, logit_cap)
        if forward_batch.attn_metadata is None:
            forward_batch.attn_metadata = self._torch_metadata(forward_batch)
        return self._torch_attention(q, layer_id, forward_batch, scale, sliding_window, logit_cap)

    def _takes_extend(self, q, layer_id, forward_batch) -> bool:
        """Whether the AMX extend kernel takes this step's tensors (`can_extend`)."""
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)
        return self.native.can_extend(q, k_buffer, v_buffer, forward_batch.req_to_token_pool.req_to_token)

    def _native_decode(self, q, k, v, layer_id, forward_batch, meta: NativeDecodeMetadata, scale,
                       sliding_window, logit_cap) -> torch.Tensor | None:
        """The DECODE step through the C++ kernel, which also stores k, v; None where it
        does not take these tensors (nothing is stored then)."""
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        new_kv = (k, v, meta.out_cache_loc)
        if not (meta.checked or self.native.can_decode(q, k_buffer, v_buffer, req_to_token, new_kv)):
            return None
        # Every layer has the same shapes, dtypes and layout: check the first only.
        meta.checked = True
        return self.native.decode_attention(
            q, k_buffer, v_buffer, req_to_token, meta.req_pool_indices, meta.seq_lens,
            scale, sliding_window, logit_cap, new_kv=new_kv, check=False,
        )

    def _native_extend(self, q, layer_id, forward_batch, meta: NativeExtendMetadata, scale,
                       sliding_window, logit_cap) -> torch.Tensor:
        """The EXTEND step through the AMX kernel (K/V already stored; `_takes_extend` held)."""
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)
        meta.checked = True
        return self.native.extend_attention(
            q, k_buffer, v_buffer, forward_batch.req_to_token_pool.req_to_token, meta.req_pool_indices,
            meta.seq_lens, meta.extend_seq_lens, meta.extend_start_loc, scale, sliding_window, logit_cap,
        )

    def _torch_attention(self, q, layer_id, forward_batch, scale, sliding_window, logit_cap) -> torch.Tensor:
        """`torch_native` over the step's gather metadata (K/V already stored)."""
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)
        meta = forward_batch.attn_metadata
        if forward_batch.forward_mode.is_decode():
            return torch_native.decode_attention(q, k_buffer, v_buffer, meta, scale, sliding_window, logit_cap)
        if isinstance(meta, torch_native.MixedMetadata):
            return torch_native.mixed_attention(q, k_buffer, v_buffer, meta, scale, sliding_window, logit_cap)
        return torch_native.extend_attention(q, k_buffer, v_buffer, meta, scale, sliding_window, logit_cap)
