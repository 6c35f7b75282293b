"""The scheduler's own process: a zmq loop around `Scheduler`.

receive (non-blocking while there is work, a 1 s poll when idle) → step →
send outputs. The process reports its `ModelInfo` (or a load error) through a
pipe when ready and exits when told to, or when its parent is gone. A watchdog
thread (`watchdog.Watchdog`) ends the process when an iteration with work lasts
longer than `watchdog_timeout` (a hung step), so the front sees a dead scheduler
instead of waiting forever.

With `tp_size` > 1 this process is tensor-parallel rank 0: it joins the group on
`PortArgs.nccl_port`, its model worker broadcasts each step to the other ranks
(`distributed/step_sync.py`), the loop sends them a keep-alive while idle, and on exit
it tells them to stop.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from arborlm.envs import ENVS
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import BatchTokenOut, ReqOutput
from arborlm.runtime.watchdog import LoopProgress, Watchdog

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


@dataclass
class Shutdown:
    """Tells the scheduler process to exit."""


@dataclass
class PortArgs:
    """zmq addresses joining the front and the scheduler, and the tensor-parallel rendezvous port
    (`nccl_port`, SGLang's name: loopback TCP, None when tp_size is 1)."""

    scheduler_input: str
    scheduler_output: str
    nccl_port: int | None = None


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, ready_conn) -> None:
    """Process entry: build the scheduler, report readiness, loop until shutdown.

    SIGINT is ignored: Ctrl-C reaches the whole process group, and the parent, which
    handles it, stops this process (`Shutdown`, or a kill after its timeout); a
    KeyboardInterrupt here would only print a traceback from wherever the loop was."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=server_args.server.log_level.upper(), format="%(asctime)s scheduler %(message)s")
    parent = os.getppid()
    try:
        scheduler = _build_scheduler(server_args, port_args)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_conn.send({"status": "error", "error": e, "traceback": traceback.format_exc()})
        return
    ctx = zmq.Context()
    recv_sock = ctx.socket(zmq.PULL)
    recv_sock.connect(port_args.scheduler_input)
    send_sock = ctx.socket(zmq.PUSH)
    send_sock.connect(port_args.scheduler_output)
    ready_conn.send({"status": "ready", "model_info": scheduler.model_info})
    progress = LoopProgress()
    watchdog = Watchdog(progress, server_args.scheduler.watchdog_timeout, describe=lambda: _describe(scheduler))
    watchdog.start()
    broadcaster = _step_broadcaster(scheduler)
    try:
        step = _step_function(scheduler, ENVS.test_hang_after_steps)
        keep_alive = broadcaster.keep_alive if broadcaster is not None else None
        event_loop(scheduler, recv_sock, send_sock, parent, progress, step, keep_alive)
    finally:
        watchdog.stop()
        if broadcaster is not None:
            broadcaster.shutdown()
        ctx.destroy(linger=0)


def _build_scheduler(server_args: ServerArgs, port_args: PortArgs):
    """The `Scheduler`; with tp_size > 1, over a model worker of tensor-parallel rank 0."""
    from arborlm.runtime.scheduler import Scheduler

    if server_args.parallel.tp_size == 1:
        return Scheduler(server_args)
    from arborlm.runtime.distributed.parallel_state import init_parallel_state
    from arborlm.runtime.model_runner import ModelRunner, resolve_device
    from arborlm.runtime.model_worker import ModelWorker

    parallel = init_parallel_state(0, server_args.parallel.tp_size, port_args.nccl_port,
                                   resolve_device(server_args.model.device))
    worker = ModelWorker(ModelRunner(server_args, parallel=parallel))
    return Scheduler(server_args, worker, worker.tokenizer)


def _step_broadcaster(scheduler):
    """Rank 0's `StepBroadcaster` when the model is split over several ranks, else None."""
    runner = scheduler.model_runner
    return getattr(runner, "step_broadcaster", None) if runner is not None else None


def event_loop(scheduler, recv_sock, send_sock, parent_pid: int, progress: LoopProgress,
               step: Callable[[], list[ReqOutput]], keep_alive: Callable[[], None] | None = None) -> None:
    """receive → step → send, until `Shutdown` or the parent process disappears.

    progress: told when each iteration with work begins and when the loop goes idle
        (the watchdog reads it).
    step: `scheduler.step` (or the test hook's wrapper of it, `_step_function`).
    keep_alive: called every iteration (and idle poll) with tensor parallelism: the step
        broadcaster's keep-alive, which raises once a rank is gone (the process then exits).
    """
    num_steps = 0
    while True:
        if keep_alive is not None:
            keep_alive()
        if not scheduler.has_work():
            progress.idle()
            if not recv_sock.poll(IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    return
                continue
        progress.begin(f"step {num_steps} (with the messages received before it)")
        if not _apply_messages(scheduler, recv_sock, send_sock):
            return
        outputs = step()
        num_steps += 1
        if outputs:
            send_sock.send_pyobj(BatchTokenOut(outputs))


def _apply_messages(scheduler, recv_sock, send_sock) -> bool:
    """Hand every queued message to the scheduler, sending its replies; False on `Shutdown`."""
    for message in _recv_all(recv_sock):
        if isinstance(message, Shutdown):
            return False
        reply = scheduler.handle(message)
        if reply is not None:
            send_sock.send_pyobj(reply)
    return True


def _recv_all(sock) -> list:
    messages = []
    while True:
        try:
            messages.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return messages


def _describe(scheduler) -> str:
    """The scheduler's queue lengths, for the watchdog's log line."""
    info = scheduler.get_info()
    return f"{info['num_running_reqs']} requests running, {info['num_waiting_reqs']} waiting"


def _step_function(scheduler, hang_after_steps: int | None) -> Callable[[], list[ReqOutput]]:
    """`scheduler.step`; with `hang_after_steps` set (`ARBORLM_TEST_HANG_AFTER_STEPS`, tests
    only), a wrapper whose step after that many never returns: a hung forward step for the
    watchdog to catch. Only the loop thread hangs; the watchdog thread runs on."""
    if hang_after_steps is None:
        return scheduler.step
    num_done = itertools.count()

    def step() -> list[ReqOutput]:
        if next(num_done) >= hang_after_steps:
            _hang_forever()
        return scheduler.step()

    return step


def _hang_forever() -> None:
    """Block this thread for good (releasing the GIL); named so that the stack dump shows it."""
    logger.warning("ARBORLM_TEST_HANG_AFTER_STEPS: the scheduler's loop hangs here on purpose")
    threading.Event().wait()
