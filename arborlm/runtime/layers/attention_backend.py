"""Attention backends: how a layer's attention reads and writes the paged KV pool.

A model layer computes q, k, v for the step's new tokens and hands them to an
`AttentionBackend`, which stores k, v at `forward_batch.out_cache_loc` and attends
over each request's K/V found through `req_to_token`. The model calls
`init_forward_metadata` once per step, before its layers, so that per-step index
work is not redone per layer. The torch backend runs `torch_native.py` (the CPU
path), with decode steps through the native C++ kernel of `cpu_ops.py` when given
one; the Triton backend runs `triton_extend.py` / `triton_decode.py` (the CUDA
path, reading K/V through `req_to_token` with no gather); the reference backend
runs `reference.py` (the oracle).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from arborlm.kernels import reference, torch_native
from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.config import ATTENTION_BACKENDS
from arborlm.runtime.forward_batch_info import ForwardBatch


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


@dataclass
class NativeDecodeMetadata:
    """A DECODE step for `NativeLayerOps.decode_attention`: the request rows,
    lengths and new K/V slots as contiguous int64 (batch,) tensors, made once per
    step; `checked` once the first layer's tensors passed `can_decode`."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    checked: bool = False


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


class TorchAttentionBackend(AttentionBackend):
    """The torch CPU path (`kernels/torch_native.py`): per-step metadata, runs on any device.

    With `native` (the C++ CPU kernels), DECODE steps whose tensors it takes attend
    through `NativeLayerOps.decode_attention`, and on a CPU with AMX the EXTEND steps
    through `NativeLayerOps.extend_attention`; both read K/V in place and need no
    per-step gather indices. Other steps take `torch_native` (SDPA over a gather).
    """

    def __init__(self, native: NativeLayerOps | None = None):
        self.native = native

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.native is not None and self.native.amx and forward_batch.forward_mode.is_extend():
            extend_seq_lens = forward_batch.extend_seq_lens.to(torch.int64)
            forward_batch.attn_metadata = NativeExtendMetadata(
                forward_batch.req_pool_indices.to(torch.int64).contiguous(),
                forward_batch.seq_lens.to(torch.int64).contiguous(),
                extend_seq_lens.contiguous(),
                (torch.cumsum(extend_seq_lens, 0) - extend_seq_lens).contiguous(),
            )
        elif self.native is not None and forward_batch.forward_mode.is_decode():
            # The layers check that the kernel takes their tensors, and fall back if not.
            forward_batch.attn_metadata = NativeDecodeMetadata(
                forward_batch.req_pool_indices.to(torch.int64).contiguous(),
                forward_batch.seq_lens.to(torch.int64).contiguous(),
                forward_batch.out_cache_loc.to(torch.int64).contiguous(),
            )
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
        pool = forward_batch.token_to_kv_pool
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        meta = forward_batch.attn_metadata
        if isinstance(meta, NativeDecodeMetadata):
            new_kv = (k, v, meta.out_cache_loc)
            if meta.checked or self.native.can_decode(q, k_buffer, v_buffer, req_to_token, new_kv):
                # Every layer has the same shapes, dtypes and layout: check the first only.
                meta.checked = True
                return self.native.decode_attention(
                    q, k_buffer, v_buffer, req_to_token, meta.req_pool_indices, meta.seq_lens,
                    scale, sliding_window, logit_cap, new_kv=new_kv, check=False,
                )
            forward_batch.attn_metadata = None
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        if isinstance(meta, NativeExtendMetadata):
            if meta.checked or self.native.can_extend(q, k_buffer, v_buffer, req_to_token):
                meta.checked = True
                return self.native.extend_attention(
                    q, k_buffer, v_buffer, req_to_token, meta.req_pool_indices, meta.seq_lens,
                    meta.extend_seq_lens, meta.extend_start_loc, scale, sliding_window, logit_cap,
                )
            forward_batch.attn_metadata = None
        if forward_batch.attn_metadata is None:
            forward_batch.attn_metadata = self._torch_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            return torch_native.decode_attention(
                q, k_buffer, v_buffer, forward_batch.attn_metadata, scale, sliding_window, logit_cap
            )
        meta = forward_batch.attn_metadata
        if not isinstance(meta, torch_native.MixedMetadata):
            return torch_native.extend_attention(q, k_buffer, v_buffer, meta, scale, sliding_window, logit_cap)
        decode = None
        if self.native is not None and self.native.can_decode(q, k_buffer, v_buffer, req_to_token):
            # The decode tokens riding along a prefill take the native kernel (K/V already stored).
            def decode(q_single: torch.Tensor) -> torch.Tensor:
                return self.native.decode_attention(
                    q_single, k_buffer, v_buffer, req_to_token, meta.single_req_pool_indices, meta.decode.seq_lens,
                    scale, sliding_window, logit_cap, check=False,
                )
        return torch_native.mixed_attention(
            q, k_buffer, v_buffer, meta, scale, sliding_window, logit_cap, decode=decode
        )


@dataclass
class TritonMetadata:
    """Per-step values the Triton kernels take as plain Python numbers or small tensors.

    Attributes
    ----------
    max_len: longest seq_len of the step (tokens).
    extend_start_loc: (batch,) int64 index of each request's first new token (EXTEND only).
    max_extend_len: largest number of new tokens of one request (EXTEND only).
    num_kv_splits: decode parts per request (DECODE only).
    """

    max_len: int
    extend_start_loc: torch.Tensor | None = None
    max_extend_len: int = 0
    num_kv_splits: int = 1


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (`triton_extend.py`, `triton_decode.py`): CUDA, or the CPU
    under `TRITON_INTERPRET=1` (tests)."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        from arborlm.kernels.triton_decode import default_num_kv_splits

        max_len = max(forward_batch.seq_lens_cpu)
        if forward_batch.forward_mode.is_decode():
            num_kv_splits = default_num_kv_splits(
                len(forward_batch.seq_lens_cpu), forward_batch.token_to_kv_pool.num_kv_heads, max_len,
                forward_batch.seq_lens.device,
            )
            forward_batch.attn_metadata = TritonMetadata(max_len=max_len, num_kv_splits=num_kv_splits)
            return
        extend_seq_lens = forward_batch.extend_seq_lens
        forward_batch.attn_metadata = TritonMetadata(
            max_len=max_len,
            extend_start_loc=torch.cumsum(extend_seq_lens, 0) - extend_seq_lens,
            max_extend_len=max(forward_batch.extend_seq_lens_cpu),
        )

    def forward(self, q, k, v, layer_id, forward_batch, scale, sliding_window=None, logit_cap=0.0):
        from arborlm.kernels import triton_decode, triton_extend

        pool = forward_batch.token_to_kv_pool
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        if forward_batch.attn_metadata is None:
            self.init_forward_metadata(forward_batch)
        meta: TritonMetadata = forward_batch.attn_metadata
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        q = q.contiguous()
        if forward_batch.forward_mode.is_decode():
            return triton_decode.decode_attention(
                q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                scale, sliding_window, logit_cap, num_kv_splits=meta.num_kv_splits, max_len=meta.max_len,
            )
        return triton_extend.extend_attention(
            q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, scale, sliding_window, logit_cap,
            extend_start_loc=meta.extend_start_loc, max_extend_len=meta.max_extend_len,
        )


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with triton installed, or
    any device under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def create_attention_backend(
    name: str, device: torch.device | str, native: NativeLayerOps | None = None
) -> AttentionBackend:
    """The attention backend called `name` for `device`.

    Parameters
    ----------
    name: "auto" (Triton on CUDA, torch elsewhere), "triton", "torch" or "reference".
    device: where the model runs.
    native: the C++ CPU kernels, which the torch backend uses for DECODE steps.

    Raises
    ------
    ValueError
        For an unknown name, or "triton" where Triton cannot run (no CUDA and no
        `TRITON_INTERPRET=1`).
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                f"attention_backend='triton' cannot run on {device.type}: it needs a CUDA GPU with triton "
                "installed (or TRITON_INTERPRET=1, the slow interpreter); use 'torch' or 'auto'"
            )
        return TritonAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend(native)
    if name == "reference":
        return ReferenceAttentionBackend()
    raise ValueError(f"attention_backend={name!r} is invalid: expected one of {ATTENTION_BACKENDS}")
