"""Start the ranks > 0 of a tensor-parallel server (the front process's side; imports no torch).

`launch_tp_workers` picks a free loopback port for the `torch.distributed` rendezvous and
spawns one `tp_worker.run_tp_worker_process` per rank 1..tp_size-1; rank 0 is the scheduler's
own process (`scheduler_process.py`), given the same port. `TpWorkers` lets the launcher wait
for them, watch them and stop them. Each rank starts on its own slice of the cores
(`cpu_binding.split_cpus`; rank 0's is `rank0_cpus`), so the ranks' kernels do not wait
on each other's threads.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from arborlm.errors import EngineDeadError, ModelLoadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.cpu_binding import available_cpus, bound_to, split_cpus


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TpWorkers:
    """The running processes of ranks 1..tp_size-1.

    nccl_port: the rendezvous port rank 0 joins too (SGLang's `nccl_port`).
    processes: rank r's process at index r - 1; readers: their readiness pipes.
    rank0_cpus: the CPU ids rank 0 (the scheduler process) is to start on; all of the
        caller's when tp_size is 1.
    """

    nccl_port: int
    processes: list[BaseProcess] = field(default_factory=list)
    readers: list = field(default_factory=list)
    rank0_cpus: tuple[int, ...] = field(default_factory=available_cpus)

    def check_started(self) -> None:
        """Raise the load error a rank reported, or EngineDeadError for a rank that died
        starting; return quietly while they are loading or once they are ready."""
        for rank, (process, reader) in enumerate(zip(self.processes, self.readers), start=1):
            if reader is None or not (reader.poll() or not process.is_alive()):
                continue
            self.readers[rank - 1] = None
            try:
                msg = reader.recv()
            except EOFError:  # the process is gone without a word (killed, or out of memory)
                process.join(5)
                raise EngineDeadError(f"tensor-parallel rank {rank} exited while starting "
                                      f"(code {process.exitcode})") from None
            if msg["status"] != "ready":
                _raise_start_error(rank, msg, process)

    def first_dead(self) -> str | None:
        """Why a rank is gone, in words, or None while all run.

        Every rank is looked at once one is seen dead, and a rank killed by a signal
        (negative exit code) is named before one that exited: a killed rank breaks the
        group's collective and its peers then exit with `PEER_LOST_EXIT_CODE`, possibly
        seen first."""
        dead = [(rank, process.exitcode) for rank, process in enumerate(self.processes, start=1)
                if not process.is_alive()]
        if not dead:
            return None
        rank, code = next(((r, c) for r, c in dead if c is not None and c < 0), dead[0])
        return f"tensor-parallel rank {rank} exited (code {code}); the server cannot go on"

    def stop(self, timeout_s: float) -> None:
        """Wait for the ranks to exit (rank 0 told them to), killing any still running after `timeout_s`."""
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(5)


def _raise_start_error(rank: int, msg: dict, process: BaseProcess) -> None:
    error = msg.get("error")
    if isinstance(error, (ModelLoadError, ValueError, TypeError)):
        raise error
    process.join(5)
    raise EngineDeadError(f"tensor-parallel rank {rank} failed to start (code {process.exitcode}): {error}\n"
                          f"{msg.get('traceback', '')}")


def launch_tp_workers(server_args: ServerArgs, ctx) -> TpWorkers:
    """Spawn ranks 1..tp_size-1 with `ctx` (a `spawn` multiprocessing context); an empty
    `TpWorkers` (port 0) when tp_size is 1."""
    from arborlm.runtime.distributed.tp_worker import run_tp_worker_process

    tp_size = server_args.parallel.tp_size
    if tp_size == 1:
        return TpWorkers(nccl_port=0)
    cpu_slices = split_cpus(tp_size)
    workers = TpWorkers(nccl_port=free_loopback_port(), rank0_cpus=cpu_slices[0])
    for rank in range(1, tp_size):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_tp_worker_process, args=(server_args, rank, workers.nccl_port, writer),
                              daemon=True, name=f"arborlm-tp{rank}")
        with bound_to(cpu_slices[rank]):
            process.start()
        writer.close()
        workers.processes.append(process)
        workers.readers.append(reader)
    return workers
