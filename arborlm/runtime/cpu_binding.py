"""Which CPU cores a process's compute threads run on.

Why: every CPU kernel (torch's intra-op pool and the native kernels' OpenMP teams) uses
as many threads as the process may run on. Two data-parallel workers or two
tensor-parallel ranks on one machine would each start a team over every core, so each
parallel region waits for threads the other process holds (measured on 2 cores: two
workers decoding at once gave 14 tok/s each unbound, 90 tok/s each bound to one core).
So `arborlm serve --dp-size N` and `--tp-size N` split the cores they may use (their
affinity mask, which `taskset` narrows) into N disjoint slices, as vLLM's CPU backend does
per rank (`VLLM_CPU_OMP_THREADS_BIND`) and SGLang's (`SGLANG_CPU_OMP_THREADS_BIND`), and
start each process on its slice with `OMP_NUM_THREADS` equal to the slice's size.

Imports no torch: the front process starts the workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence


def available_cpus() -> tuple[int, ...]:
    """The CPU ids this thread may run on (its affinity mask), sorted; every CPU where the
    platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def cpu_threads() -> int:
    """How many compute threads this process should run: the CPUs it may run on (>= 1)."""
    return max(1, len(available_cpus()))


def split_cpus(n: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """`n` slices of `cpus` (default `available_cpus()`), one per worker or rank.

    With at least `n` CPUs the slices are disjoint, contiguous and cover them, their sizes
    differing by at most one (the first ones larger). With fewer, slice i is the one CPU
    `cpus[i % len(cpus)]`: processes share cores, one thread each, which oversubscribes
    least.

    Raises
    ------
    ValueError: `n` < 1, or `cpus` is empty.
    """
    cpus = tuple(available_cpus() if cpus is None else cpus)
    if n < 1:
        raise ValueError(f"cannot split the CPUs into {n} slices: need at least one")
    if not cpus:
        raise ValueError("cannot split an empty set of CPUs")
    if len(cpus) < n:
        return [(cpus[i % len(cpus)],) for i in range(n)]
    base, extra = divmod(len(cpus), n)
    slices, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        slices.append(cpus[start:start + size])
        start += size
    return slices


@contextlib.contextmanager
def bound_to(cpus: Sequence[int]) -> Iterator[None]:
    """Processes started inside run on `cpus` with `OMP_NUM_THREADS=len(cpus)`.

    A child inherits the affinity of the thread that starts it and the environment at its
    start; this sets both on the calling thread and puts them back on exit, so the caller
    itself runs where it ran before. Where the platform has no affinity call only the
    thread count applies.
    """
    saved_env = os.environ.get("OMP_NUM_THREADS")
    saved_mask = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if saved_mask is not None:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        if saved_mask is not None:
            os.sched_setaffinity(0, saved_mask)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


def describe(cpus: Sequence[int]) -> str:
    """`cpus` as a `taskset`-style list ("0-3,8"), for logs."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
