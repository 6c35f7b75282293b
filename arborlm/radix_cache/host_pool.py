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
tensors; sizes are in tokens. The free list is lazy (`HostSlotAllocator`): a
tier of billions of slots costs no per-token array in RAM until its slots are
used and given back. `host_memory_available_bytes` and `shutil.disk_usage` are
what the caller checks a tier's size against before building one.
"""

from __future__ import annotations

import os
import tempfile

import torch

from arborlm.radix_cache.memory_pool import TokenToKVPool

# Where the tier lives (`--hicache-storage-backend`): host memory, or a memory-mapped file.
HOST_STORAGE_BACKENDS = ("file",)


def host_memory_available_bytes() -> int:
    """Memory the kernel can give this process without swapping (MemAvailable), in bytes.

    Falls back to free physical pages where /proc/meminfo is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_file_dir(file_dir: str | None = None) -> str:
    """The directory the file backend's mapping is created in."""
    return file_dir or tempfile.gettempdir()


class HostSlotAllocator:
    """Free host slots `1..size` without a per-slot array: slots never handed out are the
    range `[next_fresh, size]`, slots given back a list (SGLang keeps a full free list; a
    file-backed tier may be far larger than RAM, and its free list with it)."""

    def __init__(self, size: int):
        self.size = size
        self.clear()

    def clear(self) -> None:
        self.next_fresh = 1  # the first slot never handed out
        self.returned = torch.empty(0, dtype=torch.int64)

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return int(self.returned.numel()) + self.size + 1 - self.next_fresh

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take `need_size` slots: (need_size,) int64 (given-back ones first), or None when too few are free."""
        if need_size > self.available_size():
            return None
        taken, self.returned = self.returned[:need_size], self.returned[need_size:]
        fresh = need_size - taken.numel()
        if fresh:
            taken = torch.cat([taken, torch.arange(self.next_fresh, self.next_fresh + fresh, dtype=torch.int64)])
            self.next_fresh += fresh
        return taken

    def free(self, indices: torch.Tensor) -> None:
        """Give slots back. `indices`: (n,) integer tensor of slots taken from `alloc`."""
        if indices.numel():
            self.returned = torch.cat([self.returned, indices.to("cpu", torch.int64)])

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of `slots` ((n,) int64) are free."""
        return (slots >= self.next_fresh) | torch.isin(slots, self.returned)

    def check_invariants(self) -> None:
        """Assert that no slot is free twice and that slot 0 is never free."""
        values = self.returned.tolist()
        assert len(set(values)) == len(values), "host slot freed twice"
        assert all(1 <= v < self.next_fresh for v in values), "host slot out of range"


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
        in `host_file_dir(file_dir)`; unlinked at once, so
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
        self.allocator = HostSlotAllocator(size)
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
        fd, path = tempfile.mkstemp(prefix="arborlm-hicache-", suffix=".kv", dir=host_file_dir(file_dir))
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
