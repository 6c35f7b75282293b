"""Signals that reach the scheduler process directly (issue 23's review): Ctrl-C goes to the
whole process group, and the scheduler leaves it to its parent instead of dying with a
KeyboardInterrupt traceback (the data-parallel workers printed them)."""

from __future__ import annotations

import os
import signal
import time


def test_sigint_to_the_scheduler_process_is_left_to_its_parent(engine):
    process = engine._scheduler.process
    os.kill(process.pid, signal.SIGINT)
    time.sleep(1.5)  # past one idle poll of the event loop
    assert process.is_alive()
    out = engine.generate("Hello", {"temperature": 0.0, "max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


class _Terminated:
    """A stand-in for the scheduler's process, killed by SIGTERM."""

    exitcode = -signal.SIGTERM
    pid = 0

    def is_alive(self) -> bool:
        return False

    def join(self, timeout=None) -> None:
        pass


def _watched(stop_after_s: float | None) -> list[str]:
    from arborlm.runtime.launcher import SIGTERM_GRACE_S, SchedulerProcess

    scheduler = SchedulerProcess(process=_Terminated(), model_info=None, port_args=None, ipc_dir="")
    reasons: list[str] = []
    thread = scheduler.watch(reasons.append)
    if stop_after_s is not None:
        time.sleep(stop_after_s)
        scheduler.begin_stop()  # the parent's own SIGTERM handler
    thread.join(SIGTERM_GRACE_S + 2)
    assert not thread.is_alive()
    return reasons


def test_a_scheduler_killed_by_the_parents_sigterm_is_a_clean_stop():
    assert _watched(stop_after_s=0.2) == []  # timeout / a cgroup kill: both got SIGTERM


def test_a_scheduler_killed_by_sigterm_alone_is_reported():
    assert _watched(stop_after_s=None) == ["the scheduler process exited (code -15)"]
