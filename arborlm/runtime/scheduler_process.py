"""The scheduler's own process: a zmq loop around `Scheduler`.

receive (non-blocking while there is work, a 1 s poll when idle) → step →
send outputs. The process reports its `ModelInfo` (or a load error) through a
pipe when ready and exits when told to, or when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import zmq

from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import BatchTokenOut

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


@dataclass
class Shutdown:
    """Tells the scheduler process to exit."""


@dataclass
class PortArgs:
    """zmq addresses joining the front and the scheduler."""

    scheduler_input: str
    scheduler_output: str


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, ready_conn) -> None:
    """Process entry: build the scheduler, report readiness, loop until shutdown."""
    logging.basicConfig(level=server_args.server.log_level.upper(), format="%(asctime)s scheduler %(message)s")
    parent = os.getppid()
    try:
        from arborlm.runtime.scheduler import Scheduler

        scheduler = Scheduler(server_args)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_conn.send({"status": "error", "error": e, "traceback": traceback.format_exc()})
        return
    ctx = zmq.Context()
    recv_sock = ctx.socket(zmq.PULL)
    recv_sock.connect(port_args.scheduler_input)
    send_sock = ctx.socket(zmq.PUSH)
    send_sock.connect(port_args.scheduler_output)
    ready_conn.send({"status": "ready", "model_info": scheduler.model_info})
    try:
        event_loop(scheduler, recv_sock, send_sock, parent)
    finally:
        ctx.destroy(linger=0)


def event_loop(scheduler, recv_sock, send_sock, parent_pid: int) -> None:
    """receive → step → send, until `Shutdown` or the parent process disappears."""
    while True:
        if not scheduler.has_work() and not recv_sock.poll(IDLE_POLL_MS):
            if os.getppid() != parent_pid:
                return
            continue
        for message in _recv_all(recv_sock):
            if isinstance(message, Shutdown):
                return
            reply = scheduler.handle(message)
            if reply is not None:
                send_sock.send_pyobj(reply)
        outputs = scheduler.step()
        if outputs:
            send_sock.send_pyobj(BatchTokenOut(outputs))


def _recv_all(sock) -> list:
    messages = []
    while True:
        try:
            messages.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return messages
