"""The attention kernels of `cpu_ops.NativeLayerOps` over the paged KV pool, through ctypes.

`NativeAttentionOps` is the part of `NativeLayerOps` that attends (a mixin over the
library `cpu_ops` loads, `self.lib`, and its AMX flag, `self.amx`):

- `decode_attention`: decode (and speculative verify) rows over the pool, K/V read in
  place through `req_to_token`, in q's dtype or one byte per value (`kv_cache_dtype`);
- `store_kv_int8`: new K/V into an int8 pool, rounded as `TokenToKVPool.set_kv_buffer`;
- `extend_attention`: EXTEND steps in bf16 on AMX tiles;
- `extend_attention_tiled`: EXTEND steps on any CPU over any pool dtype, in tiles of
  64 keys widened once (one-byte pools read in place);
- `can_decode` / `can_extend`: which tensors those take.
"""

from __future__ import annotations

import torch

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# What a KV pool layer stores, as `arborlm_decode_attention` numbers it: q's dtype, or one
# byte per value (`kv_cache_dtype`; int8 with an fp16 scale per slot and KV head).
KV_DTYPE_CODES = {**_DTYPE_CODES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.int8: 4}
# AMX tiles consume K 32 bf16 at a time (the AMX linear layer and extend attention).
AMX_STEP_K = 32
# Query rows of one attention block on AMX tiles (two 16-row tiles): a KV head's
# group of query heads must fit, so extend attention takes at most 32 per KV head.
AMX_QUERY_ROWS = 32


def _rows_ok(t: torch.Tensor) -> bool:
    """A CPU tensor of a supported dtype whose last dimension is contiguous.

    Called several times per layer: uses the cheapest tensor attributes (`is_cpu`,
    not `device.type`)."""
    return t.is_cpu and t.dtype in _DTYPE_CODES and t.stride(-1) == 1


class NativeAttentionOps:
    """Attention over the paged pool through the C++ kernels (module docstring); needs
    `self.lib` (the `cpu_ops` library) and `self.amx`."""

    def decode_attention(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        check: bool = True,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decode attention over the paged pool, K/V read in place.

        q: (batch, num_q_heads, head_dim) float32 or bfloat16, heads contiguous within a row.
        k_buffer, v_buffer: (slots, num_kv_heads, head_dim) contiguous, in q's dtype or
        one byte per value (float8_e4m3fn, float8_e5m2, or int8 with `kv_scales`),
        widened in registers as each row is read.
        req_to_token: (pool_rows, max_context) int32; req_pool_indices, seq_lens:
        (batch,) int64 CPU. Semantics as `reference.decode_attention`; indices are the
        scheduler's and are not range-checked (an out-of-range slot reads out of bounds).
        sliding_window: None (or 0) = no window.
        new_kv: `(k, v, out_cache_loc)` to store first (k, v: (batch, num_kv_heads,
        head_dim), heads contiguous; out_cache_loc: (batch,) int64), as
        `pool.set_kv_buffer` would; pools of q's dtype only.
        check: False skips `can_decode` when the caller has checked tensors of
            the same layout (a step checks its first layer only).
        kv_scales: an int8 pool's (k_scale, v_scale), (slots, num_kv_heads) float16
            contiguous: row (slot, head) holds `buffer[slot, head] * scale[slot, head]`.

        Returns (batch, num_q_heads, head_dim) in q's dtype.

        Raises
        ------
        ValueError
            For layouts the kernel does not take (check `can_decode` first).
        """
        if check and not self.can_decode(q, k_buffer, v_buffer, req_to_token, new_kv, kv_scales):
            raise ValueError("decode_attention: unsupported dtype, device or layout for the native kernel")
        batch, num_q_heads, head_dim = q.shape
        out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype)
        req_pool_indices = req_pool_indices.to(torch.int64).contiguous()
        seq_lens = seq_lens.to(torch.int64).contiguous()
        store = (None, 0, None, 0, None)
        if new_kv is not None:
            k, v, loc = new_kv
            loc = loc.to(torch.int64).contiguous()
            store = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), loc.data_ptr())
        scales = (None, None) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
        self.lib.arborlm_decode_attention(
            _DTYPE_CODES[q.dtype], KV_DTYPE_CODES[k_buffer.dtype], q.data_ptr(), q.stride(0), k_buffer.data_ptr(),
            v_buffer.data_ptr(), *scales, req_to_token.data_ptr(), req_to_token.stride(0),
            req_pool_indices.data_ptr(), seq_lens.data_ptr(),
            batch, num_q_heads, k_buffer.shape[1], head_dim, scale, sliding_window or 0, logit_cap,
            out.data_ptr(), out.stride(0), *store,
        )
        return out

    def store_kv_int8(self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, buffers: tuple[torch.Tensor, ...]
                      ) -> None:
        """Store new K/V into one layer of an int8 pool as `TokenToKVPool.set_kv_buffer`
        rounds them (bit for bit), in one pass.

        k, v: (tokens, num_kv_heads, head_dim) float32 / bfloat16, heads contiguous (token
        stride free). loc: (tokens,) int64 slots. buffers: (k_buffer, v_buffer) (slots,
        num_kv_heads, head_dim) int8 and (k_scale, v_scale) (slots, num_kv_heads) float16,
        contiguous. Slots are not range-checked.

        Raises
        ------
        ValueError
            For other dtypes or layouts.
        """
        k_buffer, v_buffer, k_scale, v_scale = buffers
        tokens, heads, head_dim = k.shape
        ok = (
            k.dtype in _DTYPE_CODES and v.dtype == k.dtype and v.shape == k.shape and _rows_ok(k) and _rows_ok(v)
            and k.stride(1) == head_dim and v.stride(1) == head_dim and loc.shape == (tokens,)
            and all(b.dtype == torch.int8 and b.is_contiguous() and b.shape[1:] == (heads, head_dim)
                    for b in (k_buffer, v_buffer))
            and all(s.dtype == torch.float16 and s.is_contiguous() and s.shape == k_buffer.shape[:2]
                    for s in (k_scale, v_scale))
        )
        if not ok:
            raise ValueError("store_kv_int8: unsupported dtype or layout for the native kernel")
        loc = loc.to(torch.int64).contiguous()
        self.lib.arborlm_store_kv_int8(
            _DTYPE_CODES[k.dtype], k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), loc.data_ptr(), tokens,
            heads, head_dim, k_buffer.data_ptr(), v_buffer.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
        )

    def extend_attention(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        extend_start_loc: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of an EXTEND step's new tokens over the paged pool (bf16, AMX).

        q: (num_tokens, num_q_heads, head_dim), new tokens request after request.
        k_buffer, v_buffer: (slots, num_kv_heads, head_dim) contiguous, already holding
        the new tokens' K/V. req_pool_indices, seq_lens, extend_seq_lens,
        extend_start_loc (each request's first row of q): (batch,) int64 CPU,
        contiguous (the caller converts them once per step). Semantics as
        `reference.extend_attention`, with the probabilities rounded to bf16 before
        they weigh V; indices are not range-checked. Check `can_extend` first.

        Returns (num_tokens, num_q_heads, head_dim) bf16.
        """
        num_tokens, num_q_heads, head_dim = q.shape
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype)
        self.lib.arborlm_extend_attention_bf16(
            q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), req_to_token.data_ptr(),
            req_to_token.stride(0), req_pool_indices.data_ptr(), seq_lens.data_ptr(), extend_seq_lens.data_ptr(),
            extend_start_loc.data_ptr(), req_pool_indices.shape[0], num_q_heads, k_buffer.shape[1], head_dim,
            scale, sliding_window or 0, logit_cap, out.data_ptr(), out.stride(0),
        )
        return out

    def extend_attention_tiled(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        extend_start_loc: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Attention of an EXTEND step's new tokens over the paged pool, K/V read in place
        in tiles of 64 keys widened to float32 (any CPU; FlashAttention's online softmax).

        q: (num_tokens, num_q_heads, head_dim) float32 or bfloat16, new tokens request
        after request, heads contiguous within a row. k_buffer, v_buffer: (slots,
        num_kv_heads, head_dim) contiguous, in q's dtype or one byte per value (as
        `decode_attention`, int8 with `kv_scales`), already holding the new tokens' K/V.
        req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc (each request's
        first row of q): (batch,) int64 CPU, contiguous. Semantics as
        `reference.extend_attention` (scores and softmax in float32); indices are not
        range-checked. `kv_scales`: an int8 pool's, as `decode_attention`'s. check: False
        skips `can_decode` (which decides what this kernel takes) when the caller has
        checked tensors of the same layout.

        Returns (num_tokens, num_q_heads, head_dim) in q's dtype.

        Raises
        ------
        ValueError
            For layouts the kernel does not take.
        """
        if check and not self.can_decode(q, k_buffer, v_buffer, req_to_token, kv_scales=kv_scales):
            raise ValueError("extend_attention_tiled: unsupported dtype, device or layout for the native kernel")
        num_tokens, num_q_heads, head_dim = q.shape
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype)
        scales = (None, None) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
        self.lib.arborlm_extend_attention(
            _DTYPE_CODES[q.dtype], KV_DTYPE_CODES[k_buffer.dtype], q.data_ptr(), q.stride(0), k_buffer.data_ptr(),
            v_buffer.data_ptr(), *scales, req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
            seq_lens.data_ptr(), extend_seq_lens.data_ptr(), extend_start_loc.data_ptr(), req_pool_indices.shape[0],
            num_q_heads, k_buffer.shape[1], head_dim, scale, sliding_window or 0, logit_cap, out.data_ptr(),
            out.stride(0),
        )
        return out

    def can_extend(self, q, k_buffer, v_buffer, req_to_token) -> bool:
        """Whether `extend_attention` takes these tensors: AMX, bf16, head_dim a multiple
        of 32, at most 32 query heads per KV head, and `can_decode`'s layouts."""
        return (
            self.amx and q.dtype is torch.bfloat16 and q.dim() == 3 and q.shape[2] % AMX_STEP_K == 0
            and k_buffer.dim() == 3 and q.shape[1] // max(k_buffer.shape[1], 1) <= AMX_QUERY_ROWS
            and self.can_decode(q, k_buffer, v_buffer, req_to_token)
        )

    @staticmethod
    def can_decode(q, k_buffer, v_buffer, req_to_token, new_kv=None, kv_scales=None) -> bool:
        """Whether `decode_attention` takes these tensors (a pool of q's dtype, or of one
        byte per value: fp8, or int8 with its `kv_scales`; a new_kv store only into the first)."""
        same_dtype = k_buffer.dtype == q.dtype
        ok = (
            q.dim() == 3 and _rows_ok(q) and q.stride(1) == q.shape[2] and q.dtype in _DTYPE_CODES
            and (same_dtype or k_buffer.dtype in KV_DTYPE_CODES) and v_buffer.dtype == k_buffer.dtype
            and (kv_scales is not None) == (k_buffer.dtype == torch.int8)
            and k_buffer.is_contiguous() and v_buffer.is_contiguous() and k_buffer.device.type == "cpu"
            and k_buffer.dim() == 3 and v_buffer.shape == k_buffer.shape and q.shape[2] == k_buffer.shape[2]
            and req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
            and q.shape[1] % k_buffer.shape[1] == 0
        )
        if ok and kv_scales is not None:
            ok = all(s.dtype == torch.float16 and s.is_contiguous() and s.shape == k_buffer.shape[:2]
                     for s in kv_scales)
        if not ok or new_kv is None:
            return ok
        k, v, loc = new_kv
        return same_dtype and all(
            t.dtype == q.dtype and t.shape == (q.shape[0],) + tuple(k_buffer.shape[1:])
            and _rows_ok(t) and t.stride(1) == t.shape[2]
            for t in (k, v)
        ) and loc.shape == (q.shape[0],)
