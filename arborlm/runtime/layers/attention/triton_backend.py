"""The Triton attention backend: `kernels/triton_extend.py` and `triton_decode.py`.

The CUDA path: the kernels read K/V through `req_to_token` with no gather, from a pool
in the model's dtype or in one byte per value (`kv_cache_dtype`, widened in the kernel). On the
CPU they run only under `TRITON_INTERPRET=1` (tests). Triton is imported when a
step runs, so this module imports where triton is not installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from arborlm.kernels.cpu_ops import NativeLayerOps
from arborlm.runtime.forward_batch_info import ForwardBatch
from arborlm.runtime.layers.attention.base import AttentionBackend


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with triton installed, or
    any device under Triton's interpreter (`TRITON_INTERPRET=1`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


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

    # Verify chains stay extend-shaped here: the extend kernel reads a request's K/V once
    # per block of its chain, the decode kernel once per row (and its KV split count would
    # follow the row count); on a GPU the extend kernel is the cheaper verify.
    takes_verify_rows = False
    # The kernels widen fp8 / int8 K/V as they load them (`triton_common.load_kv_rows`).
    reads_one_byte_kv = True

    @classmethod
    def create(cls, device: torch.device, native: NativeLayerOps | None) -> TritonAttentionBackend:
        """Raises ValueError where Triton cannot run on `device` (see `triton_usable`)."""
        if not triton_usable(device):
            raise ValueError(
                f"attention_backend='triton' cannot run on {device.type}: it needs a CUDA GPU with triton "
                "installed (or TRITON_INTERPRET=1, the slow interpreter); use 'torch' or 'auto'"
            )
        return cls()

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
        kv_scales = pool.get_kv_scales(layer_id)
        if forward_batch.attn_metadata is None:
            self.init_forward_metadata(forward_batch)
        meta: TritonMetadata = forward_batch.attn_metadata
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        q = q.contiguous()
        if forward_batch.forward_mode.is_decode():
            return triton_decode.decode_attention(
                q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                scale, sliding_window, logit_cap, num_kv_splits=meta.num_kv_splits, max_len=meta.max_len,
                kv_scales=kv_scales,
            )
        return triton_extend.extend_attention(
            q, k_buffer, v_buffer, req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, scale, sliding_window, logit_cap,
            extend_start_loc=meta.extend_start_loc, max_extend_len=meta.max_extend_len, kv_scales=kv_scales,
        )
