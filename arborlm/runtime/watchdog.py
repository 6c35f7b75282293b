"""The scheduler's watchdog: end the scheduler process when its event loop is stuck.

A scheduler that hangs (a forward step that never returns, a deadlock) is not dead,
so the front's dead-scheduler path (`launcher.SchedulerProcess.watch`) never fires and
every request waits forever. As in SGLang (`Scheduler.watchdog_thread`,
`--watchdog-timeout`), a daemon thread in the scheduler process checks that the loop
makes progress while it has work; past `watchdog_timeout` seconds it logs what the
loop was doing, dumps every thread's stack (faulthandler) and exits the process with
`WATCHDOG_EXIT_CODE`. The front then sees a dead scheduler: in-flight requests get
503 `engine_dead` and the HTTP server stops.

The loop thread writes `LoopProgress`; the watchdog thread only reads it. An idle
loop (waiting for messages, nothing queued or running) is never a hang.

Limitation: the watchdog is a Python thread, so a hang inside C code that holds the
GIL also stops it; forward steps release the GIL while they wait on kernels.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The exit status of a process the watchdog ended: 124, as timeout(1) exits.
WATCHDOG_EXIT_CODE = 124
# The longest pause between two checks, in seconds: a hang is caught at most this
# long after `timeout_s` (sooner with a short timeout, which is checked 4 times per period).
MAX_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Activity:
    """What the loop began, and when.

    what: a few words for the log ("step 1234", "handling 2 messages").
    started_s: `time.monotonic()` when it began, in seconds.
    """

    what: str
    started_s: float


class LoopProgress:
    """What the event loop is doing now: written by the loop thread, read by the watchdog.

    `current` is replaced whole by one assignment (an immutable `Activity`), so a
    reader sees the old or the new value and no lock is needed.

    Parameters
    ----------
    clock: seconds, monotonic (`time.monotonic`; a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.current: Activity | None = None

    def begin(self, what: str) -> None:
        """The loop starts a unit of work (one iteration with work): the hang clock restarts."""
        self.current = Activity(what, self._clock())

    def idle(self) -> None:
        """The loop waits for messages with nothing to do: not a hang, however long."""
        self.current = None

    def elapsed_s(self, activity: Activity) -> float:
        """Seconds since `activity` began."""
        return self._clock() - activity.started_s


def exit_process(message: str) -> None:
    """Log `message`, dump every thread's stack to stderr and end this process.

    `os._exit`, not `sys.exit`: the stuck loop thread would never let an orderly
    exit finish. The status is `WATCHDOG_EXIT_CODE`, so the parent can say why.
    """
    logger.error(message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(WATCHDOG_EXIT_CODE)


class Watchdog:
    """A daemon thread that calls `on_timeout` once when the loop is stuck.

    Parameters
    ----------
    progress: the loop's `LoopProgress`.
    timeout_s: seconds one activity may last (`SchedulerConfig.watchdog_timeout`); > 0.
    on_timeout: called with the log line, on the watchdog thread (`exit_process` by
        default; a recorder in tests).
    describe: extra words about the loop's state for the log line (queue lengths);
        called only when the watchdog fires.
    interval_s: seconds between checks; default a quarter of `timeout_s`, at most
        `MAX_CHECK_INTERVAL_S`.

    Raises
    ------
    ValueError: `timeout_s` is not > 0.
    """

    def __init__(self, progress: LoopProgress, timeout_s: float,
                 on_timeout: Callable[[str], None] = exit_process,
                 describe: Callable[[], str] = lambda: "", interval_s: float | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: expected > 0")
        self.progress = progress
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.describe = describe
        self.interval_s = min(timeout_s / 4, MAX_CHECK_INTERVAL_S) if interval_s is None else interval_s
        self._stopped = threading.Event()

    def check(self) -> str | None:
        """The log line when the current activity has outlasted the timeout, else None."""
        current = self.progress.current  # read once: the loop thread may replace it meanwhile
        if current is None:
            return None
        stuck_s = self.progress.elapsed_s(current)
        if stuck_s <= self.timeout_s:
            return None
        try:
            extra = self.describe()
        except Exception as e:  # noqa: BLE001 - the words are optional; the exit is not
            extra = f"(its state could not be read: {e!r})"
        return (f"watchdog: the scheduler's event loop made no progress for {stuck_s:.1f} s "
                f"(watchdog_timeout={self.timeout_s:g} s) while in {current.what}"
                f"{'; ' + extra if extra else ''}; dumping thread stacks and exiting")

    def start(self) -> threading.Thread:
        """Start checking every `interval_s` on a daemon thread (it dies with the process)."""
        thread = threading.Thread(target=self._run, name="arborlm-scheduler-watchdog", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop checking (the loop returned); the thread ends within `interval_s`."""
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            message = self.check()
            if message is not None:
                self.on_timeout(message)
                return
