"""CPU slices for data-parallel workers and tensor-parallel ranks (`runtime/cpu_binding.py`)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from arborlm.runtime.cpu_binding import available_cpus, bound_to, cpu_threads, describe, split_cpus


@pytest.mark.parametrize("num_cpus", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_slices_are_disjoint_cover_the_cpus_and_differ_by_at_most_one(num_cpus, n):
    cpus = tuple(range(10, 10 + num_cpus))
    slices = split_cpus(n, cpus)
    assert len(slices) == n
    if num_cpus >= n:
        flat = [c for s in slices for c in s]
        assert sorted(flat) == list(cpus) and len(set(flat)) == num_cpus
        assert max(map(len, slices)) - min(map(len, slices)) <= 1
        assert all(list(s) == list(range(s[0], s[0] + len(s))) for s in slices)  # contiguous
    else:  # fewer cores than processes: one core each, shared round-robin
        assert slices == [(cpus[i % num_cpus],) for i in range(n)]


def test_split_refuses_no_slices_and_no_cpus():
    with pytest.raises(ValueError, match="at least one"):
        split_cpus(0, (0, 1))
    with pytest.raises(ValueError, match="empty"):
        split_cpus(2, ())


def test_describe_writes_taskset_lists():
    assert describe([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert describe([3]) == "3"


def _child_report(queue) -> None:
    """What a spawned child sees: its CPUs, OMP_NUM_THREADS, torch's threads after
    set_cpu_threads, and libgomp's default team size on a new thread (the native kernels')."""
    import ctypes
    import threading

    import torch

    from arborlm.runtime.model_loader import set_cpu_threads

    set_cpu_threads()
    team = []
    lib = ctypes.CDLL("libgomp.so.1")
    thread = threading.Thread(target=lambda: team.append(lib.omp_get_max_threads()))
    thread.start()
    thread.join()
    queue.put((available_cpus(), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), team[0]))


def test_a_child_started_inside_bound_to_runs_on_its_slice_with_that_many_threads():
    cpus = available_cpus()
    mine = cpus[-1:]
    saved_env = os.environ.get("OMP_NUM_THREADS")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_report, args=(queue,))
    with bound_to(mine):
        proc.start()
    try:
        seen_cpus, env, torch_threads, omp_team = queue.get(timeout=120)
    finally:
        proc.join(30)
    assert seen_cpus == mine and env == "1" and torch_threads == 1 and omp_team == 1
    # The caller runs where it ran before, with its environment as it was.
    assert available_cpus() == cpus and cpu_threads() == len(cpus)
    assert os.environ.get("OMP_NUM_THREADS") == saved_env
