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
