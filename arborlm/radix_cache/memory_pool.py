"""The preallocated KV memory: request rows, KV slots and the slot allocator.

Two-level mapping, as in SGLang: `ReqToTokenPool.req_to_token[req_pool_idx, pos]`
is the KV slot of a request's token at `pos`; `TokenToKVPool` holds the K and V of
every slot, `[layers, slots, kv_heads, head_dim]`. Slot 0 is never handed out: it
is the padding slot that dummy writes may target.

The K/V may be stored in fp8 (`kv_cache_dtype`, SGLang's names `fp8_e5m2` and
`fp8_e4m3`) or int8: half the bytes of bf16, so about twice the tokens in the same
memory. New K/V are cast on the way in (fp8: saturated to the format's range;
int8: symmetric per token and KV head, an fp16 scale per (token, head), 2 bytes
beside head_dim) and attention reads them upcast (`read_kv`, used by
`layers/attention/quantized_kv_backend.py`).
"""

from __future__ import annotations

import torch

# SGLang's --kv-cache-dtype names -> the storage dtype ("auto": the model's dtype).
KV_CACHE_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
INT8_SCALE_DTYPE = torch.float16  # one scale per (layer, slot, KV head) of an int8 pool


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

    Allocation is by slot (page_size 1); indices are int64 tensors on the CPU. `alloc`
    takes slots from the front of the free list, `free` puts them at its back. Freed slots
    wait in a queue of their own and join the list only when an allocation reaches them
    (`free_slots` shows the joined list): joining on every `free` copied the whole free list
    (megabytes at the default pool size), once per verify step for its rejected drafts.
    The order slots are handed out in is the same either way.
    """

    # Queued pieces are joined among themselves past this many (the queue stays short
    # when allocations rarely reach it).
    MAX_QUEUED_PIECES = 64

    def __init__(self, size: int):
        self.size = size
        self.clear()

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return int(self._head.numel()) + self._queued

    @property
    def free_slots(self) -> torch.Tensor:
        """Every free slot in the order `alloc` hands them out: (n,) int64."""
        self._join()
        return self._head

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` slots: (need_size,) int64, or None when too few are free."""
        if need_size > self.available_size():
            return None
        if need_size > self._head.numel():
            self._join()
        taken = self._head[:need_size]
        self._head = self._head[need_size:]
        return taken

    def free(self, indices: torch.Tensor) -> None:
        """Give slots back. `indices`: (n,) integer tensor of slots taken from `alloc` (copied)."""
        if indices.numel() == 0:
            return
        self._freed.append(indices.to("cpu", torch.int64, copy=True).reshape(-1))
        self._queued += int(indices.numel())
        if len(self._freed) > self.MAX_QUEUED_PIECES:
            self._freed = [torch.cat(self._freed)]

    def _join(self) -> None:
        if self._freed:
            self._head = torch.cat([self._head, *self._freed])
            self._freed, self._queued = [], 0

    def clear(self) -> None:
        self._head = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._freed: list[torch.Tensor] = []
        self._queued = 0

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
    dtype: KV dtype: the model's, or one of `KV_CACHE_DTYPES` (`quantized`).

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
        # int8: K = k_buffer * k_scale[..., None] per (layer, slot, KV head); None otherwise.
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale, self.v_scale = (torch.zeros(shape[:3], dtype=INT8_SCALE_DTYPE, device=self.device)
                                          for _ in range(2))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory of one slot across all layers, K and V (and an int8 pool's scales), in bytes."""
        values = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if dtype == torch.int8:
            values += 2 * num_layers * num_kv_heads * torch.empty((), dtype=INT8_SCALE_DTYPE).element_size()
        return values

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored in fp8 (attention must read them through `read_kv`)."""
        return self.dtype in KV_CACHE_DTYPES.values()

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer: two (size + 1, num_kv_heads, head_dim) views, in `dtype`."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def get_kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 pool's scales of one layer: (k_scale, v_scale), two (size + 1,
        num_kv_heads) float16 views (value = stored int8 * scale); None for other dtypes."""
        if self.k_scale is None:
            return None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of new tokens. `loc`: (n,) int64 slots; `k`, `v`: (n, num_kv_heads, head_dim).

        Into an fp8 pool the values are saturated to the format's finite range first
        (a plain cast makes fp8_e5m2's overflow inf)."""
        if self.dtype == torch.int8:
            for buffer, scales, new in ((self.k_buffer, self.k_scale, k), (self.v_buffer, self.v_scale, v)):
                scale = (new.float().abs().amax(dim=-1) / 127).to(INT8_SCALE_DTYPE)  # (n, kv_heads)
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                stored = torch.round(new.float() / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
                buffer[layer_id].index_copy_(0, loc, stored)
                scales[layer_id].index_copy_(0, loc, scale)
            return
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
        if self.dtype == torch.int8:
            return tuple(
                (buffer[layer_id].index_select(0, slots).float()
                 * scales[layer_id].index_select(0, slots).float().unsqueeze(-1)).to(dtype)
                for buffer, scales in ((self.k_buffer, self.k_scale), (self.v_buffer, self.v_scale))
            )
        return (self.k_buffer[layer_id].index_select(0, slots).to(dtype),
                self.v_buffer[layer_id].index_select(0, slots).to(dtype))
