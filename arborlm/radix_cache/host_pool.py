"""The host KV tier's memory: K/V slots off the device, and the copies to and from the pool.

The second tier of the hierarchical cache (SGLang's HiCache, `sglang/srt/mem_cache/
memory_pool_host.py`): radix nodes evicted from the device `TokenToKVPool` keep
their K/V here, and a later prefix hit copies them back instead of recomputing
them (`HiRadixCache`). The buffers have the device pool's layout, `[layers,
slots, kv_heads, head_dim]` in the pool's dtype (fp8 pools included), and
live in one of:

- pinned host memory, when the device pool is on CUDA (fast DMA copies);
- plain host memory, when the pool is on the CPU (the tier is then simply
  a larger pool that attention never reads, so it never slows a step);
- a memory-mapped file (`storage_backend="file"`): the tier may then be
  larger than RAM, the OS page cache keeping its hot part in memory.

Slot 0 is never handed out, as in the device pool. Slots are (n,) int64 CPU
tensors; sizes are in tokens.
"""

from __future__ import annotations

import os
import tempfile

import torch

from arborlm.radix_cache.memory_pool import TokenToKVPool, TokenToKVPoolAllocator

# Where the tier lives (`--hicache-storage-backend`): host memory, or a memory-mapped file.
HOST_STORAGE_BACKENDS = ("file",)


def _as_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` viewed as uint8 (last dim times the element size): one copy path for
    every dtype, fp8 included (index_copy_ has no fp8 kernel)."""
    return buffer.view(torch.uint8)


class HostKVPool:
    """K and V of `size` host slots, and a free list over them.

    Parameters
    ----------
    size: usable host slots (tokens); the buffers hold `size + 1` rows (row 0 = padding).
    num_layers, num_kv_heads, head_dim, dtype: the device pool's shape and dtype.
    pin_memory: page-lock the buffers (when the device pool is on CUDA).
    storage_backend: None (host memory) or "file" (a memory-mapped temporary file
        in `file_dir`, default `tempfile.gettempdir()`; unlinked at once, so
        nothing is left behind when the process ends).

    Raises
    ------
    ValueError
        For `size < 1` or an unknown `storage_backend`.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
        storage_backend: str | None = None,
        file_dir: str | None = None,
    ):
        if size < 1:
            raise ValueError(f"size must be >= 1 host slot, got {size}")
        if storage_backend is not None and storage_backend not in HOST_STORAGE_BACKENDS:
            raise ValueError(
                f"storage_backend={storage_backend!r} is invalid: expected None or one of {HOST_STORAGE_BACKENDS}"
            )
        self.size = size
        self.dtype = dtype
        self.storage_backend = storage_backend
        self.allocator = TokenToKVPoolAllocator(size)
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        if storage_backend == "file":
            self.k_buffer, self.v_buffer = (self._mapped(shape, dtype, file_dir) for _ in range(2))
        else:
            # empty, not zeros: a host slot is always written (backed up) before it is read, and
            # untouched pages of a large tier then cost no memory.
            self.k_buffer, self.v_buffer = (
                torch.empty(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(2)
            )

    @staticmethod
    def _mapped(shape: tuple[int, ...], dtype: torch.dtype, file_dir: str | None) -> torch.Tensor:
        """A zero-filled tensor backed by a shared memory mapping of a fresh temporary file."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        fd, path = tempfile.mkstemp(prefix="arborlm-hicache-", suffix=".kv", dir=file_dir)
        try:
            os.ftruncate(fd, nbytes)  # sparse: blocks are allocated as slots are written
            mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the data; no file outlives the process
        return mapped.view(dtype).view(shape)

    @classmethod
    def for_device_pool(
        cls,
        device_pool: TokenToKVPool,
        size: int,
        storage_backend: str | None = None,
    ) -> HostKVPool:
        """A host pool of `size` slots with `device_pool`'s shape and dtype (pinned on CUDA)."""
        return cls(
            size, device_pool.num_layers, device_pool.num_kv_heads, device_pool.head_dim, device_pool.dtype,
            pin_memory=device_pool.device.type == "cuda" and storage_backend is None,
            storage_backend=storage_backend,
        )

    # ---- slots ----------------------------------------------------------------

    def available_size(self) -> int:
        """Free host slots, in tokens."""
        return self.allocator.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` host slots, (need_size,) int64, or None when too few are free."""
        return self.allocator.alloc(need_size)

    def free(self, host_slots: torch.Tensor) -> None:
        """Give host slots back."""
        self.allocator.free(host_slots)

    # ---- copies ---------------------------------------------------------------

    def backup_from_device(self, device_pool: TokenToKVPool, device_slots: torch.Tensor,
                           host_slots: torch.Tensor) -> None:
        """Copy the K/V of `device_slots` (every layer) into `host_slots`; both (n,) int64, same n."""
        self._copy(device_pool.k_buffer, device_slots, self.k_buffer, host_slots)
        self._copy(device_pool.v_buffer, device_slots, self.v_buffer, host_slots)

    def load_to_device(self, device_pool: TokenToKVPool, host_slots: torch.Tensor,
                       device_slots: torch.Tensor) -> None:
        """Copy the K/V of `host_slots` (every layer) into `device_slots`; both (n,) int64, same n."""
        self._copy(self.k_buffer, host_slots, device_pool.k_buffer, device_slots)
        self._copy(self.v_buffer, host_slots, device_pool.v_buffer, device_slots)

    @staticmethod
    def _copy(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> None:
        assert len(src_slots) == len(dst_slots), f"{len(src_slots)} slots copied into {len(dst_slots)}"
        rows = _as_bytes(src).index_select(1, src_slots.to(src.device))  # (layers, n, kv_heads, bytes)
        # One gathered block per direction; pinned memory makes the device copy a DMA.
        _as_bytes(dst).index_copy_(1, dst_slots.to(dst.device), rows.to(dst.device, non_blocking=False))

    def check_invariants(self) -> None:
        """Assert that no host slot is free twice and slot 0 is never free."""
        self.allocator.check_invariants()
