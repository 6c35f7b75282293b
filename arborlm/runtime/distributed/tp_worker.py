"""The process of a tensor-parallel rank > 0: load this rank's shards, then run what rank 0 sends.

`run_tp_worker_process` joins the group, builds a `ModelRunner` (its slices of the weights,
its K/V heads' pools, sized as rank 0's), reports ready (or the load error) through a pipe,
and loops: receive a `step_sync` message, run the step's forward on its pools, until
`ShutdownRanks`. Its logits are thrown away (rank 0 samples); only its collectives count.
When rank 0 is gone the receive fails and the process exits with status 1: the launcher,
which watches every rank, then stops the server with a clear reason. A forward that raises
here ends the process too (fail-stop): its collectives could no longer pair with rank 0's.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

from arborlm.runtime.config import ServerArgs

logger = logging.getLogger(__name__)

# Exit status of a rank whose peer (rank 0) vanished.
PEER_LOST_EXIT_CODE = 1


def run_tp_worker_process(server_args: ServerArgs, tp_rank: int, nccl_port: int, ready_conn) -> None:
    """Process entry of rank `tp_rank` (> 0); returns (exit 0) on `ShutdownRanks`.

    SIGINT is ignored, as in the scheduler process: rank 0 stops this rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=server_args.server.log_level.upper(),
                        format=f"%(asctime)s tp{tp_rank} %(message)s")
    from arborlm.runtime.distributed.parallel_state import (
        destroy_parallel_state,
        init_parallel_state,
    )
    from arborlm.runtime.model_runner import ModelRunner, resolve_device

    try:
        parallel = init_parallel_state(tp_rank, server_args.parallel.tp_size, nccl_port,
                                       resolve_device(server_args.model.device))
        runner = ModelRunner(server_args, parallel=parallel)
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which raises it
        ready_conn.send({"status": "error", "error": e, "traceback": traceback.format_exc()})
        os._exit(PEER_LOST_EXIT_CODE)  # leave at once: the group's other ranks are failing too
    ready_conn.send({"status": "ready"})
    ready_conn.close()
    try:
        serve_steps(runner)
    except RuntimeError as e:
        logger.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", tp_rank, e)
        os._exit(PEER_LOST_EXIT_CODE)
    destroy_parallel_state(parallel)


def serve_steps(runner) -> int:
    """Receive → forward until `ShutdownRanks`; returns the number of steps run.

    Raises
    ------
    RuntimeError
        When rank 0 is gone (a failed broadcast) or a forward's collective fails.
    """
    from arborlm.runtime.distributed.step_sync import ForwardStep, ShutdownRanks, receive_step

    num_steps = 0
    while True:
        message = receive_step(runner.parallel)
        if isinstance(message, ShutdownRanks):
            return num_steps
        if isinstance(message, ForwardStep):
            runner.model.forward(message.to_batch(runner.req_to_token_pool, runner.token_to_kv_pool))
            num_steps += 1
