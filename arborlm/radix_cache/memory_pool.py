"""The preallocated KV memory: request rows, KV slots and the slot allocator.

Two-level mapping, as in SGLang: `ReqToTokenPool.req_to_token[req_pool_idx, pos]`
is the KV slot of a request's token at `pos`; `TokenToKVPool` holds the K and V of
every slot, `[layers, slots, kv_heads, head_dim]`. Slot 0 is never handed out: it
is the padding slot that dummy writes may target.

The K/V may be stored in fp8 (`kv_cache_dtype`, SGLang's names `fp8_e5m2` and
`fp8_e4m3`): half the bytes of bf16, so twice the tokens in the same memory. New
K/V are cast on the way in (saturated to the format's range) and attention reads
them upcast (`read_kv`, used by `layers/attention/quantized_kv_backend.py`).
"""

from __future__ import annotations

import torch

# SGLang's --kv-cache-dtype names -> the storage dtype ("auto": the model's dtype).
KV_CACHE_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores for `kv_cache_dtype` ("auto" = `model_dtype`).

    Raises
    ------
    ValueError
        For a name that is neither "auto" nor a key of `KV_CACHE_DTYPES`.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is invalid: expected 'auto' or one of {sorted(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


class ReqToTokenPool:
    """Rows of per-request slot indices.

    Parameters
    ----------
    size: number of request rows (max requests alive at once).
    max_context_len: tokens per row (prompt + output of one request).
    device: where `req_to_token` lives.

    Attributes
    ----------
    req_to_token: (size, max_context_len) int32 tensor of KV slot indices.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        """Free request rows."""
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        """Take `need_size` rows; None (and nothing taken) when too few are free."""
        if need_size > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return taken

    def free(self, req_pool_idx: int | list[int]) -> None:
        """Give rows back."""
        if isinstance(req_pool_idx, int):
            req_pool_idx = [req_pool_idx]
        self.free_slots.extend(req_pool_idx)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def check_invariants(self) -> None:
        """Assert that no row is free twice or out of range."""
        assert len(set(self.free_slots)) == len(self.free_slots), "request row freed twice"
        assert all(0 <= i < self.size for i in self.free_slots), "request row out of range"


class TokenToKVPoolAllocator:
    """Free list of KV slots `1..size` (slot 0 is the padding slot).

    Allocation is by slot (page_size 1); indices are int64 tensors on the CPU.
    """

    def __init__(self, size: int):
        self.size = size
        self.clear()

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` slots: (need_size,) int64, or None when too few are free."""
        if need_size > self.free_slots.numel():
            return None
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return taken

    def free(self, indices: torch.Tensor) -> None:
        """Give slots back. `indices`: (n,) integer tensor of slots taken from `alloc`."""
        if indices.numel() == 0:
            return
        self.free_slots = torch.cat([self.free_slots, indices.to("cpu", torch.int64)])

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def check_invariants(self) -> None:
        """Assert that no slot is free twice and that slot 0 is never free."""
        values = self.free_slots.tolist()
        assert len(set(values)) == len(values), "KV slot freed twice"
        assert all(1 <= v <= self.size for v in values), "KV slot out of range"


class TokenToKVPool:
    """K and V buffers of every slot and layer.

    Parameters
    ----------
    size: usable slots (tokens); the buffers hold `size + 1` rows (row 0 = padding).
    num_layers, num_kv_heads, head_dim: model shape.
    dtype: KV dtype: the model's, or an fp8 dtype of `KV_CACHE_DTYPES` (`quantized`).

    Attributes
    ----------
    k_buffer, v_buffer: (num_layers, size + 1, num_kv_heads, head_dim) tensors.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory of one slot across all layers, K and V, in bytes."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored in fp8 (attention must read them through `read_kv`)."""
        return self.dtype in KV_CACHE_DTYPES.values()

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer: two (size + 1, num_kv_heads, head_dim) views, in `dtype`."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of new tokens. `loc`: (n,) int64 slots; `k`, `v`: (n, num_kv_heads, head_dim).

        Into an fp8 pool the values are saturated to the format's finite range first
        (a plain cast makes fp8_e5m2's overflow inf)."""
        if self.quantized:
            bound = torch.finfo(self.dtype).max
            # index_copy_ has no fp8 kernel: copy the bytes.
            for buffer, new in ((self.k_buffer, k), (self.v_buffer, v)):
                stored = new.clamp(-bound, bound).to(self.dtype).view(torch.uint8)
                buffer[layer_id].view(torch.uint8).index_copy_(0, loc, stored)
            return
        # index_copy_ on the layer's view: one row copy per slot, no index_put broadcasting.
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))

    def read_kv(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` ((n,) int64) in layer `layer_id`, upcast to `dtype`: two
        (n, num_kv_heads, head_dim) contiguous tensors (copies)."""
        return (self.k_buffer[layer_id].index_select(0, slots).to(dtype),
                self.v_buffer[layer_id].index_select(0, slots).to(dtype))
