"""Start, watch and stop the scheduler process: the one piece of code the in-process
`Engine` and the HTTP server (`arborlm.entrypoints`) share.

`launch_scheduler` spawns `run_scheduler_process` (model, pools, radix cache)
behind two zmq IPC sockets in a private temporary folder and waits until the
child reports its `ModelInfo`. The caller then builds a `TokenizerManager` on
its own asyncio loop (it binds those sockets), calls `SchedulerProcess.watch`
so that a dying scheduler fails every waiting request, and on shutdown calls
`begin_stop`, `close_front` (on the manager's loop) and `stop`. A hung scheduler
is ended by its own watchdog (`watchdog.py`) and so takes the same dying path.

With `tp_size` > 1 the scheduler's process is tensor-parallel rank 0 and the ranks
1..tp_size-1 are processes of their own (`distributed/launch.py`), started beside it and
watched with it: any rank dying stops the server with a reason naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from arborlm.chat_template import apply_chat_template_override
from arborlm.errors import EngineDeadError, ModelLoadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.cpu_binding import bound_to
from arborlm.runtime.distributed.launch import TpWorkers, launch_tp_workers
from arborlm.runtime.io_struct import ModelInfo
from arborlm.runtime.scheduler_process import PortArgs, Shutdown, run_scheduler_process
from arborlm.runtime.watchdog import WATCHDOG_EXIT_CODE

logger = logging.getLogger(__name__)

SCHEDULER_START_TIMEOUT_S = 900.0
MONITOR_INTERVAL_S = 1.0
# A child killed by SIGTERM waits this long for the parent's own shutdown (`begin_stop`) before it
# is reported: `timeout` and systemd's cgroup kill send SIGTERM to every process at once.
SIGTERM_GRACE_S = 2.0
STOP_TIMEOUT_S = 10.0
# How long a child that failed to start (it sent its error) gets to exit before it is killed.
STARTUP_EXIT_GRACE_S = 3.0
# How long libgomp's threads spin for the next parallel region before they sleep (its default
# is 300000 spins; `GOMP_SPINCOUNT`). Between decode steps the scheduler runs a millisecond or
# two of Python while its OpenMP threads spin, on the cores the HTTP front needs to write the
# step's tokens; spinning less lets them sleep there and still spans the gaps between one
# step's kernels. Served at 1 client on 2 cores: 1.06-1.10x output tok/s, level at 8 clients
# (docs/decode_step.md).
SCHEDULER_GOMP_SPINCOUNT = "100000"


@contextlib.contextmanager
def _main_module_not_reimported():
    """Keep `spawn` from re-running the caller's script in the scheduler process.

    The scheduler's entry point and arguments live in arborlm, so the child does
    not need `__main__`; without this, a script that builds an Engine at module
    level (no `if __name__ == "__main__":` guard) would start engines recursively,
    and `python - < script` or `python -c` could not start one at all.
    """
    main = sys.modules.get("__main__")
    saved_spec = getattr(main, "__spec__", None)
    saved_file = getattr(main, "__file__", None)
    main.__spec__ = None
    if saved_file is not None:
        del main.__file__
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


@contextlib.contextmanager
def _scheduler_environment():
    """Spawned children start with `GOMP_SPINCOUNT` at `SCHEDULER_GOMP_SPINCOUNT`, unless the
    user set it or `OMP_WAIT_POLICY`; the parent's own environment is as before on exit
    (a spawned child copies it when it starts, and libgomp reads it once, at load)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = SCHEDULER_GOMP_SPINCOUNT
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)


def _rank0_binding(server_args: ServerArgs, tp_workers: TpWorkers):
    """With tp_size > 1 the scheduler process (rank 0) starts on its slice of the cores
    (`cpu_binding`); with one rank it keeps every core the front may use."""
    if server_args.parallel.tp_size == 1:
        return contextlib.nullcontext()
    return bound_to(tp_workers.rank0_cpus)


@dataclass
class SchedulerProcess:
    """A running scheduler child process and the addresses the front binds.

    process: the spawned child.
    model_info: what the scheduler reported when it became ready.
    port_args: the zmq addresses (IPC files under `ipc_dir`).
    ipc_dir: temporary folder removed by `stop`.
    tp_workers: the tensor-parallel ranks > 0 (none when tp_size is 1).
    """

    process: BaseProcess
    model_info: ModelInfo
    port_args: PortArgs
    ipc_dir: str
    tp_workers: TpWorkers = field(default_factory=lambda: TpWorkers(nccl_port=0))
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def watch(self, on_exit: Callable[[str], None]) -> threading.Thread:
        """Call `on_exit(reason)` from a daemon thread if the child exits before `begin_stop`.

        `on_exit` runs on the monitor thread: hand work to an event loop with
        `loop.call_soon_threadsafe`. The exit is seen within `MONITOR_INTERVAL_S`.
        """

        def run() -> None:
            while not self._stopping.is_set():
                self.process.join(MONITOR_INTERVAL_S)
                # A lost rank > 0 is named first: rank 0 exits in its wake.
                reason = self.tp_workers.first_dead() or (
                    exit_reason(self.process.exitcode) if not self.process.is_alive() else None)
                if reason is not None and self._terminated():
                    self._stopping.wait(SIGTERM_GRACE_S)
                if reason is not None and not self._stopping.is_set():
                    logger.error(reason)
                    on_exit(reason)
                    return

        thread = threading.Thread(target=run, name="arborlm-scheduler-monitor", daemon=True)
        thread.start()
        return thread

    def _terminated(self) -> bool:
        """Whether a dead child (the scheduler or a rank) was killed by SIGTERM."""
        return any(not p.is_alive() and p.exitcode == -signal.SIGTERM
                   for p in [self.process, *self.tp_workers.processes])

    def begin_stop(self) -> None:
        """Mark the exit that follows as expected (the monitor stays quiet)."""
        self._stopping.set()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for the child to exit (kill it after `timeout_s`) and remove the IPC folder.

        Call after `close_front` has sent `Shutdown`; idempotent.
        """
        self.begin_stop()
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the scheduler did not exit in %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.join(5)
        self.tp_workers.stop(timeout_s)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def exit_reason(exitcode: int | None) -> str:
    """Why the scheduler is gone, in words, from its exit status (negative: killed by that signal)."""
    reason = f"the scheduler process exited (code {exitcode})"
    if exitcode == WATCHDOG_EXIT_CODE:
        reason += (": its watchdog found the event loop stuck for longer than --watchdog-timeout "
                   "(the thread stacks are in the scheduler's log)")
    return reason


def launch_scheduler(server_args: ServerArgs, start_timeout_s: float = SCHEDULER_START_TIMEOUT_S) -> SchedulerProcess:
    """Spawn the scheduler process and wait until it has loaded the model.

    Blocks for the model load (seconds on the tiny model, up to a minute for a
    first GGUF conversion).

    Raises
    ------
    ModelLoadError, ValueError, TypeError: as the scheduler raised them while loading.
    EngineDeadError: the child did not start in `start_timeout_s`, or died starting.
    """
    ipc_dir = tempfile.mkdtemp(prefix="arborlm-")
    ctx = mp.get_context("spawn")
    with _main_module_not_reimported(), _scheduler_environment():
        tp_workers = launch_tp_workers(server_args, ctx)
    port_args = PortArgs(
        scheduler_input=f"ipc://{ipc_dir}/scheduler_input",
        scheduler_output=f"ipc://{ipc_dir}/scheduler_output",
        nccl_port=tp_workers.nccl_port or None,
    )
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_scheduler_process, args=(server_args, port_args, writer), daemon=True)
    with _main_module_not_reimported(), _scheduler_environment(), _rank0_binding(server_args, tp_workers):
        process.start()
    writer.close()
    try:
        model_info = _wait_ready(process, reader, start_timeout_s, tp_workers)
    except BaseException:
        for child in [process, *tp_workers.processes]:
            # A child that sent its error exits by itself: killed, it would leave its
            # semaphores to the resource tracker (a "leaked semaphore" warning at exit).
            child.join(STARTUP_EXIT_GRACE_S)
            if child.is_alive():
                child.kill()
            child.join(5)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    return SchedulerProcess(process=process, model_info=model_info, port_args=port_args, ipc_dir=ipc_dir,
                            tp_workers=tp_workers)


def _wait_ready(process: BaseProcess, reader, timeout_s: float, tp_workers: TpWorkers) -> ModelInfo:
    """Read the child's one readiness message: its `ModelInfo`, or the error it failed with.

    Meanwhile the tensor-parallel ranks > 0 are checked each `MONITOR_INTERVAL_S`: one that
    fails to load raises its error (rank 0 would otherwise wait for it in a collective).
    """
    deadline = time.monotonic() + timeout_s
    while not reader.poll(min(MONITOR_INTERVAL_S, max(0.0, deadline - time.monotonic()))):
        tp_workers.check_started()
        if time.monotonic() >= deadline:
            raise EngineDeadError("the scheduler did not start in time")
    try:
        msg = reader.recv()
    except EOFError as e:
        process.join(5)
        raise EngineDeadError(f"the scheduler exited while starting (code {process.exitcode})") from e
    if msg["status"] == "ready":
        return msg["model_info"]
    error = msg["error"]
    if isinstance(error, (ModelLoadError, ValueError, TypeError)):
        raise error
    raise EngineDeadError(f"the scheduler failed to start: {error}\n{msg['traceback']}")


def load_tokenizer(model_info: ModelInfo, chat_template: str | None = None):
    """The Hugging Face tokenizer of the checkpoint the scheduler loaded, its chat template
    replaced by `chat_template` (a Jinja file or a built-in name, `--chat-template`) when given."""
    from transformers import AutoTokenizer

    return apply_chat_template_override(AutoTokenizer.from_pretrained(model_info.checkpoint), chat_template)


async def close_front(manager) -> None:
    """Tell the scheduler to exit and close the manager's sockets.

    Run on the manager's own loop: its zmq sockets belong to that loop's thread.
    """
    manager.send_sock.send_pyobj(Shutdown())
    await asyncio.sleep(0.05)  # let the shutdown message leave the socket
    manager.close()
