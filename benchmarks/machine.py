"""What the benchmarks measure of the machine itself, in the same run as their cells."""

from __future__ import annotations

import time

import torch


def copy_bandwidth_gbs(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Best read + write GB/s of `copy_` between two `num_bytes` buffers (bigger than the caches),
    after one untimed copy (first-touch page faults)."""
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9
