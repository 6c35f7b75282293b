"""A grammar compile worker process, and the handle the serving process drives it with.

`GrammarManager` gives each of its compile slots a `CompileWorker`: a child
process started with ``subprocess.Popen`` (the scheduler is a daemonic
multiprocessing child and may not have multiprocessing children) that builds
the same grammar backend from the arguments the serving one was built with
(`GrammarBackend.worker_args`) and compiles one grammar at a time. A compile
that outlives its deadline is ended by killing the process; a fresh one starts
at once, so its start-up (seconds: xgrammar imports torch) is mostly over by
the next compile.

Wire format, both ways over the child's stdin and stdout: an 8-byte big-endian
length, then that many bytes of pickle. Requests: the setup message
``(module, class qualname, args, kwargs)``, then ``("compile", GrammarKey)``.
Replies: ``("ready",)`` or ``("setup_failed", traceback)``, then per compile
``("ok", payload, compile_s)``, ``("error", message, param)`` (a
`GrammarError`) or ``("failed", "Type: message")``. The payload is
`GrammarBackend.compile_serialized`'s, None meaning "compile it again in the
serving process" (`GrammarBackend.load_compiled` otherwise).

The child runs with a stand-in ``arborlm`` package (only its folder), so that
it imports the grammar modules without the serving stack (``arborlm/__init__``
imports the engine); it reserves its stdout for replies (fd 1 then points to
stderr) and exits at once when its stdin reaches EOF or its parent's pid
changes, even in the middle of a compile: a worker never outlives its parent.

Module level imports only the standard library, so the child reads its setup
message before the heavy imports start.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
import traceback

_HEADER = struct.Struct(">Q")
# How often the child checks that its parent is alive while stdin is quiet.
PARENT_CHECK_S = 1.0

# Run as ``python -c _BOOTSTRAP <arborlm package folder>``.
_BOOTSTRAP = (
    "import sys, types\n"
    "package = types.ModuleType('arborlm')\n"
    "package.__path__ = [sys.argv[1]]\n"
    "sys.modules['arborlm'] = package\n"
    "from arborlm.constrained.compile_worker import main\n"
    "main()\n"
)


class CompileTimeout(Exception):
    """The job outlived its deadline and was given up (its worker killed, or its thread abandoned)."""


class CompilerClosed(Exception):
    """The grammar manager shut down while the job ran."""


class WorkerCrashed(Exception):
    """The worker died while compiling (killed from outside, out of memory, a crash in the compiler)."""


class WorkerSetupError(Exception):
    """A compile worker cannot be used for this backend (arguments that do not pickle, a failed start)."""


class CompileWorker:
    """One compile slot of `GrammarManager`: drives one worker process at a time.

    Parameters
    ----------
    backend:
        The serving process's backend: loads the payloads (`load_compiled`) and
        compiles again what the worker did not ship.
    setup:
        The pickled setup message (`setup_message`), shared by the slots.

    `run` is called from the slot's thread only; `close` from any thread.
    The process starts on the first `run`.
    """

    def __init__(self, backend, setup: bytes):
        self.backend = backend
        self._setup = setup
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._closed = False
        self._running = False  # the slot's thread is inside `run`
        self.num_started = 0

    @property
    def pid(self) -> int | None:
        """The worker process's pid while it runs, else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(self, job) -> tuple:
        """Compile ``job.key`` in the worker; (compiled grammar, seconds).

        Raises
        ------
        GrammarError
            The grammar is rejected, or compiling failed.
        WorkerCrashed
            The worker died while compiling, twice (a fresh one is started).
        CompileTimeout
            ``job.deadline`` (which may grow meanwhile) passed first; the
            worker was killed and a fresh one started.
        CompilerClosed
            `close` was called first.
        WorkerSetupError
            The worker could not build the backend.
        """
        from arborlm.constrained.keys import GrammarError

        self._running = True
        try:
            try:
                reply = self._compile_remotely(job)
            except WorkerCrashed:
                # It may have died before it read this job (killed while idle, a race with
                # the liveness check): try once more on the fresh worker.
                reply = self._compile_remotely(job)
        finally:
            self._running = False
        if reply[0] == "error":
            raise GrammarError(reply[1], reply[2])
        if reply[0] == "failed":
            raise GrammarError(f"compiling the {job.key.kind} grammar failed: {reply[1]}", job.key.param)
        _, payload, compile_s = reply
        if payload is not None:
            return self.backend.load_compiled(job.key, payload), compile_s
        start = time.perf_counter()  # the worker has shown that it finishes
        return self.backend.compile(job.key), compile_s + time.perf_counter() - start

    def close(self) -> None:
        """Kill the worker (if any) and reap it; later `run` calls raise `CompilerClosed`."""
        with self._lock:
            self._closed = True
            proc = self._proc
        if not self._running:
            self._kill()  # reaps it and closes the pipes
        elif proc is not None:
            _kill_and_reap(proc)  # the slot's thread sees EOF and closes the pipes

    def _compile_remotely(self, job) -> tuple:
        """Send ``job`` to the worker (started if needed) and return its reply."""
        if self._proc is None or self._proc.poll() is not None:
            self._restart()  # first use, or it died while idle
        proc = self._proc
        if proc is None:
            raise CompilerClosed
        if not self._ready:
            # A job that times out while the worker starts leaves it starting (killing it
            # would start over, and a timeout shorter than the start-up would never compile).
            reply = self._receive(job, proc, kill_at_deadline=False)
            if reply[0] == "setup_failed":
                self._kill()
                raise WorkerSetupError(f"the grammar compile worker could not build the backend:\n{reply[1]}")
            self._ready = True
        try:
            _write_message(proc.stdin.fileno(), pickle.dumps(("compile", job.key)))
        except (OSError, ValueError):
            pass  # it died since (or was closed); the read below says how
        return self._receive(job, proc)

    def _receive(self, job, proc: subprocess.Popen, kill_at_deadline: bool = True) -> tuple:
        """The worker's next reply, waiting until ``job.deadline``.

        Raises `CompileTimeout` at the deadline (after killing the worker and
        starting a fresh one, with ``kill_at_deadline``), `CompilerClosed`,
        `WorkerCrashed` (a fresh worker started) or `WorkerSetupError` when it ends.
        """
        fd = proc.stdout.fileno()
        while True:
            remaining = job.deadline - time.monotonic()
            if remaining <= 0:
                if kill_at_deadline:
                    self._restart()
                raise CompileTimeout
            if select.select([fd], [], [], remaining)[0]:
                break
        try:
            return pickle.loads(_read_message(fd))
        except (EOFError, OSError, pickle.UnpicklingError):
            exit_code = _kill_and_reap(proc)
            if self._closed:
                self._kill()
                raise CompilerClosed from None
            if not self._ready:
                self._kill()
                raise WorkerSetupError(
                    f"the grammar compile worker exited during start-up (exit code {exit_code})"
                ) from None
            self._restart()
            raise WorkerCrashed(
                f"the grammar compile worker died while compiling this {job.key.kind} grammar "
                f"(exit code {exit_code})"
            ) from None

    def _restart(self) -> None:
        """Kill the current worker (if any) and start a fresh one, setup message sent."""
        self._kill()
        with self._lock:
            if self._closed:
                raise CompilerClosed
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, _package_folder()],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=_child_env(),
                )
            except OSError as e:
                raise WorkerSetupError(f"cannot start a grammar compile worker: {e}") from e
            self._proc, self._ready = proc, False
            self.num_started += 1
        try:
            _write_message(proc.stdin.fileno(), self._setup)
        except OSError:
            pass  # it died at once; the first read says how

    def _kill(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _kill_and_reap(proc)
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()


def setup_message(backend) -> bytes:
    """The pickled setup message that builds ``backend`` again in a worker.

    Raises
    ------
    WorkerSetupError
        The backend has no worker arguments, or they do not pickle.
    """
    worker_args = backend.worker_args()
    if worker_args is None:
        raise WorkerSetupError(f"the {backend.name} grammar backend cannot compile in a worker process")
    cls = type(backend)
    try:
        return pickle.dumps((cls.__module__, cls.__qualname__, *worker_args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 — pickle raises many types
        raise WorkerSetupError(f"the {backend.name} grammar backend's arguments do not pickle: {e}") from e


def _kill_and_reap(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc`` unless it has exited, and wait for it (no zombie); its exit code."""
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    return proc.wait()


def _package_folder() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict[str, str]:
    """This environment with this process's ``sys.path`` in PYTHONPATH (backends defined outside site-packages)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _write_message(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_message(fd: int) -> bytes:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return _read_exact(fd, size)


# ---------------------------------------------------------------- the worker process


def main() -> None:
    """The worker's loop: build the backend from the setup message, then compile requests one at a time."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from the libraries go to stderr, not into the replies
    inbox: queue.Queue[bytes] = queue.Queue()
    threading.Thread(target=_read_requests, args=(0, inbox, os.getppid()), daemon=True).start()
    try:
        module, qualname, args, kwargs = pickle.loads(inbox.get())
        cls = importlib.import_module(module)
        for name in qualname.split("."):
            cls = getattr(cls, name)
        backend = cls(*args, **kwargs)
    except BaseException:  # noqa: BLE001 — reported to the parent
        _reply(reply_fd, ("setup_failed", traceback.format_exc()))
        return
    from arborlm.constrained.keys import GrammarError

    _reply(reply_fd, ("ready",))
    while True:
        _, key = pickle.loads(inbox.get())
        start = time.perf_counter()
        try:
            payload = backend.compile_serialized(key)
            reply = pickle.dumps(("ok", payload, time.perf_counter() - start), protocol=pickle.HIGHEST_PROTOCOL)
        except GrammarError as e:
            reply = pickle.dumps(("error", e.message, e.param))
        except Exception as e:  # noqa: BLE001 — reported to the parent
            reply = pickle.dumps(("failed", f"{type(e).__name__}: {e}"))
        _write_message(reply_fd, reply)


def _reply(fd: int, message: tuple) -> None:
    _write_message(fd, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _read_requests(fd: int, inbox: queue.Queue, parent_pid: int) -> None:
    """The child's stdin reader: queue each request; end the process at EOF or when the parent is gone."""
    try:
        while True:
            while not select.select([fd], [], [], PARENT_CHECK_S)[0]:
                if os.getppid() != parent_pid:
                    os._exit(0)
            inbox.put(_read_message(fd))
    except (EOFError, OSError):
        pass
    os._exit(0)  # also in the middle of a compile: the parent is gone or gave up on this worker


if __name__ == "__main__":
    main()
