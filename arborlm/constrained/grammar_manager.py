"""The compiled-grammar cache and the compile slots that fill it.

The scheduler asks `GrammarManager.request` for a request's `GrammarKey` when it
arrives and gets a `PendingGrammar` at once; compiling runs elsewhere so the
event loop keeps decoding other requests. Each step the scheduler polls
`PendingGrammar.result` for its waiting requests (None while compiling), admits
those whose grammar is ready and aborts those whose grammar failed or took
longer than ``grammar_compile_timeout``. With nothing else to do it blocks in
`GrammarManager.wait_any`.

Compiled grammars are cached by (backend name, the key's chosen backend, kind, text, lenient),
least recently used first out, so a schema used by many requests compiles once.

Where compiling runs. xgrammar's and outlines-core's compilers are C++/Rust
calls that cannot be interrupted, and some grammars compile for minutes (or
never finish). A thread that runs one cannot be stopped: it keeps a worker and
a CPU core busy and holds up process exit. So each of ``max_workers`` compile
slots drives a `CompileWorker` process (`compile_worker.py`) for backends that
can ship a compiled grammar between processes (`GrammarBackend.worker_args`);
a compile that outlives the deadline of every request waiting for it is ended
by killing that process, and a fresh one starts at once. Backends that cannot
ship (test fakes) compile on threads: a compile past its deadline gives up its
slot to a new thread, so it cannot starve the others, but it keeps its core
busy until it returns (a daemon thread, so it does not hold up exit). Such
abandoned compiles are capped: while ``max_abandoned_compiles`` of them still
run, a grammar that is not cached is refused at once
(`GrammarCompilesOverloaded`, which the server should answer with 503; a
compile already cached or in flight is still served), so a stream of slow
schemas cannot pile threads onto the cores.

Cost of the worker process (SmolLM2 tokenizer, 49152 tokens, a busy 2-core
machine): start-up 3 s idle, 7 to 9 s busy (importing xgrammar imports torch
and transformers), paid by a slot's first compile and, after a kill, hidden by
restarting at once; about 300 MB resident per worker. xgrammar's JSON form of
a compiled grammar repeats its whole FSM per rule: a large JSONSchemaBench
schema (WashingtonPost wp_17, 80 KB) compiles in 5.7 s, but its JSON is
884 MB, 94 s to write and 56 s to read, and over 60 sampled schemas writing
plus reading it cost 1 to 30 times the compile. So xgrammar ships only
grammars of at most `~xgrammar_backend.MAX_SHIPPED_BYTES` compiled bytes (a
few ms); the serving process compiles the others again once the worker has
shown that they finish (twice the compile time, bounded). outlines-core's
Index pickles in under 1 ms. Cache hits cost nothing more.

A manager dropped without `shutdown` is collected (its slot threads hold it
only while they work) and its workers are killed; a worker also exits by
itself when its parent dies.

After SGLang's ``sglang/srt/constrained/base_grammar_backend.py`` (cache of
futures) and its scheduler's grammar queue (timeout per request).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey
from arborlm.constrained.compile_worker import (
    CompilerClosed,
    CompileTimeout,
    CompileWorker,
    WorkerCrashed,
    WorkerSetupError,
    setup_message,
)
from arborlm.constrained.registry import backend_class

logger = logging.getLogger(__name__)

# How often an idle slot's thread checks that its manager is still referenced.
IDLE_CHECK_S = 1.0


class GrammarCompilesOverloaded(GrammarError):
    """A new grammar compile refused while abandoned compiles (past their deadline, on threads
    that cannot be stopped) fill `GrammarManager.max_abandoned_compiles`.

    The grammar may be fine: the client should retry later. `code` is the HTTP
    error code it stands for (``server_overloaded``, a 503, as for `ServerOverloadedError`).
    """

    code = "server_overloaded"


def create_grammar_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    """The grammar backend ``name`` (one of `GRAMMAR_BACKEND_NAMES`), built for ``tokenizer``.

    ``vocab_size`` is the number of columns of the logits, ``eos_token_ids`` the stop ids.

    Raises
    ------
    ValueError
        ``name`` is not a known backend.
    """
    return backend_class(name)(tokenizer, vocab_size, eos_token_ids)


@dataclass(eq=False)
class CompileJob:
    """One grammar to compile, shared by every request that asked for it meanwhile.

    deadline: the latest `time.monotonic` deadline of those requests; it only
        grows (a cache hit on the job in flight extends it). Once it has passed
        nobody waits for the result, and the slot gives the compile up.
    """

    key: GrammarKey
    future: concurrent.futures.Future
    deadline: float


class PendingGrammar:
    """One request's wait for a compiled grammar.

    key: the grammar asked for.
    deadline: `time.monotonic` seconds after which `result` raises the timeout.
    """

    def __init__(self, key: GrammarKey, future: concurrent.futures.Future, deadline: float, timeout_s: float):
        self.key = key
        self.deadline = deadline
        self._future = future
        self._timeout_s = timeout_s

    def done(self) -> bool:
        """True when compiling has finished (successfully or not)."""
        return self._future.done()

    def result(self, now: float | None = None) -> CompiledGrammar | None:
        """The compiled grammar, or None while it is still compiling.

        now: `time.monotonic` seconds (default: read the clock).

        Raises
        ------
        GrammarError
            The backend rejected the grammar or failed (any exception becomes a
            GrammarError), its compile worker died, compiling was cancelled by
            shutdown, or ``now`` is past `deadline` and compiling has not finished.
        """
        if self._future.done():
            if self._future.cancelled():
                raise GrammarError("grammar compilation was cancelled: the grammar manager shut down", self.key.param)
            error = self._future.exception()
            if error is None:
                return self._future.result()
            if isinstance(error, GrammarCompilesOverloaded):
                raise GrammarCompilesOverloaded(error.message, error.param) from error
            if isinstance(error, GrammarError):
                raise GrammarError(error.message, error.param) from error  # a fresh one per request
            raise _backend_failure(self.key, error) from error
        if (time.monotonic() if now is None else now) > self.deadline:
            raise _timeout_error(self.key, self._timeout_s)
        return None


class GrammarManager:
    """Compiles grammars in killable worker processes (or threads) and caches them (LRU).

    Parameters
    ----------
    backend:
        Compiles the grammars (its ``name`` is part of the cache key).
    compile_timeout:
        Seconds a request may wait for its grammar (``grammar_compile_timeout``).
        A compile that no request waits for any more is ended (its worker
        process killed and restarted); on a thread it is abandoned, finishing in
        the background while a fresh thread takes its slot.
    max_workers:
        Compiles that run at once (worker processes, started on first use).
    max_cache_entries:
        Compiled grammars kept (in flight ones included); the least recently
        requested goes first.
    use_worker_processes:
        Compile in worker processes built from ``backend.worker_args()`` (when
        it is not None) or on threads; None: ``backend.compile_in_worker_by_default``
        (outlines-core: processes; xgrammar: threads, see `XGrammarBackend`).
    max_abandoned_compiles:
        Thread compiles given up at their deadline that may still run; while
        that many do, `request` refuses grammars it has to compile
        (`GrammarCompilesOverloaded`).

    Thread-safe: `request` and `stats` may be called from any thread.
    """

    def __init__(self, backend: GrammarBackend, compile_timeout: float, max_workers: int = 2,
                 max_cache_entries: int = 1024, max_recorded_times: int = 1024,
                 use_worker_processes: bool | None = None, max_abandoned_compiles: int = 2):
        if compile_timeout <= 0:
            raise ValueError(f"compile_timeout must be > 0, got {compile_timeout}")
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_abandoned_compiles < 1:
            raise ValueError(f"max_abandoned_compiles must be >= 1, got {max_abandoned_compiles}")
        self.max_abandoned_compiles = max_abandoned_compiles
        self.backend = backend
        self.compile_timeout = compile_timeout
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str, str, str, bool], CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs_ready = threading.Condition(self._lock)
        self._queue: deque[CompileJob] = deque()  # jobs no slot has taken yet
        self._num_compiled = 0
        self._num_cache_hits = 0
        self._num_failures = 0
        self._num_timeouts = 0
        self._num_overloaded = 0
        self._compile_times_s: deque[float] = deque(maxlen=max_recorded_times)
        self._closed = False
        if use_worker_processes is None:
            use_worker_processes = backend.compile_in_worker_by_default
        self._slots = _make_slots(backend, max_workers, use_worker_processes)
        self._assigned: list[CompileJob | None] = [None] * max_workers  # each slot's current job
        for i in range(max_workers):
            # A weak reference: a manager dropped without `shutdown` is collected, and its slots close.
            threading.Thread(
                target=_drive_slot,
                args=(weakref.ref(self), self._jobs_ready, i),
                name=f"arborlm-grammar-{i}",
                daemon=True,
            ).start()

    @property
    def uses_worker_processes(self) -> bool:
        """True when compiles run in worker processes (False: on threads)."""
        return any(isinstance(slot, CompileWorker) for slot in self._slots)

    def request(self, key: GrammarKey) -> PendingGrammar:
        """Start compiling ``key`` (or reuse the cached compile) and return the wait for it.

        The deadline is now + ``compile_timeout``, also for a cache hit on a
        compile still in flight. A grammar not in the cache while
        `max_abandoned_compiles` abandoned compiles still run is refused: the
        wait's `PendingGrammar.result` raises `GrammarCompilesOverloaded` (not cached).

        Raises
        ------
        RuntimeError
            After `shutdown`.
        """
        cache_key = self._cache_key(key)
        deadline = time.monotonic() + self.compile_timeout
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarManager is shut down")
            job = self._cache.get(cache_key)
            if job is not None:
                self._cache.move_to_end(cache_key)
                self._num_cache_hits += 1
                job.deadline = max(job.deadline, deadline)
            elif self._num_abandoned_running() >= self.max_abandoned_compiles:
                self._num_overloaded += 1
                return PendingGrammar(key, _failed_future(self._overloaded_error(key)), deadline, self.compile_timeout)
            else:
                job = CompileJob(key, concurrent.futures.Future(), deadline)
                self._cache[cache_key] = job
                if len(self._cache) > self.max_cache_entries:
                    self._cache.popitem(last=False)
                idle = next((i for i, assigned in enumerate(self._assigned) if assigned is None), None)
                if idle is None:
                    self._queue.append(job)
                else:
                    self._assigned[idle] = job  # taken at once, so shutdown sees it as running
                self._jobs_ready.notify_all()
        return PendingGrammar(key, job.future, deadline, self.compile_timeout)

    def wait_any(self, pendings: list[PendingGrammar], timeout: float) -> list[PendingGrammar]:
        """Block up to ``timeout`` seconds until one of ``pendings`` is done; return the done ones.

        Returns at once when one is already done or ``pendings`` is empty.
        """
        if not pendings:
            return []
        futures = {p._future for p in pendings}
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return [p for p in pendings if p.done()]

    def stats(self) -> dict:
        """Counters since start.

        num_compiled: successful compiles; num_cache_hits: requests served by
        the cache (done or in flight); num_failures: compiles that raised or
        whose worker died; num_timeouts: compiles given up at their deadline;
        num_cached: entries in the cache; compile_times_s: the latest compile
        durations in seconds (oldest first, bounded); worker_pids: the live
        compile worker processes; num_worker_starts: worker processes started
        (restarts after a kill or a crash included); num_abandoned_running:
        thread compiles given up at their deadline that still run;
        num_overloaded: grammars refused while those were at
        `max_abandoned_compiles`.
        """
        with self._lock:
            return {
                "num_compiled": self._num_compiled,
                "num_cache_hits": self._num_cache_hits,
                "num_failures": self._num_failures,
                "num_timeouts": self._num_timeouts,
                "num_cached": len(self._cache),
                "compile_times_s": list(self._compile_times_s),
                "worker_pids": [pid for slot in self._slots if (pid := slot.pid) is not None],
                "num_worker_starts": sum(getattr(slot, "num_started", 0) for slot in self._slots),
                "num_abandoned_running": self._num_abandoned_running(),
                "num_overloaded": self._num_overloaded,
            }

    def shutdown(self) -> None:
        """Cancel queued compiles, kill the worker processes and return without waiting for threads.

        A compile running in a worker process is cancelled with it; one on a
        thread (a backend without worker support) stays pending.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cache.clear()
            cancelled, self._queue = list(self._queue), deque()
            cancelled += [job for job, slot in zip(self._assigned, self._slots)
                          if job is not None and isinstance(slot, CompileWorker)]
            self._jobs_ready.notify_all()
        for job in cancelled:
            _cancel(job.future)
        for slot in self._slots:
            slot.close()

    def _take_job(self, index: int) -> CompileJob | None:
        """Slot ``index``'s next job (assigned by `request`, or the oldest queued); call under the lock."""
        if self._assigned[index] is None and self._queue:
            self._assigned[index] = self._queue.popleft()
        return self._assigned[index]

    def _step(self, index: int, job: CompileJob) -> bool:
        """Run ``job`` on slot ``index`` unless it is cancelled or overdue; False after `shutdown`.

        The slot is marked idle before the job's waiters wake, so that their next
        request finds it free.
        """
        outcome = None  # (compiled, error)
        if job.future.done():
            pass  # cancelled
        elif time.monotonic() > job.deadline:
            outcome = None, self._timed_out(job)  # nobody waits any more; do not start it
        else:
            try:
                outcome = self._run(index, job)
            except CompilerClosed:  # `shutdown` has cancelled the job if it ran in a worker process
                return False
        with self._lock:
            self._assigned[index] = None
        if outcome is not None:
            _set_future(job.future, result=outcome[0], error=outcome[1])
        return True

    def _run(self, index: int, job: CompileJob) -> tuple[CompiledGrammar | None, GrammarError | None]:
        """Run ``job`` on slot ``index`` and count the outcome: (compiled grammar, None) or (None, error).

        Raises
        ------
        CompilerClosed
            The manager shut down meanwhile.
        """
        slot = self._slots[index]
        try:
            compiled, compile_s = slot.run(job)
        except CompilerClosed:
            raise
        except CompileTimeout:
            return None, self._timed_out(job)
        except WorkerCrashed as e:
            return None, self._failed(job, GrammarError(str(e), job.key.param), uncache=True)
        except WorkerSetupError as e:
            logger.warning("grammar compiles run on a thread, which cannot be stopped: %s", e)
            slot.close()
            self._slots[index] = ThreadSlot(self.backend)
            return self._run(index, job)
        except BaseException as e:  # noqa: BLE001 — every failure reaches the request
            return None, self._failed(job, e if isinstance(e, GrammarError) else _backend_failure(job.key, e))
        with self._lock:
            self._num_compiled += 1
            self._compile_times_s.append(compile_s)
        return compiled, None

    def _failed(self, job: CompileJob, error: GrammarError, *, uncache: bool = False) -> GrammarError:
        """Count a failed compile; with ``uncache`` drop it from the cache (a later request compiles afresh)."""
        with self._lock:
            self._num_failures += 1
            if uncache:
                self._uncache(job)
        return error

    def _timed_out(self, job: CompileJob) -> GrammarError:
        """Count a compile given up at its deadline and drop it from the cache; the error for it."""
        with self._lock:
            self._num_timeouts += 1
            self._uncache(job)
        return _timeout_error(job.key, self.compile_timeout)

    def _num_abandoned_running(self) -> int:
        """Thread compiles given up at their deadline that still run, over all slots."""
        return sum(slot.num_abandoned_running for slot in self._slots if isinstance(slot, ThreadSlot))

    def _overloaded_error(self, key: GrammarKey) -> GrammarCompilesOverloaded:
        return GrammarCompilesOverloaded(
            f"grammar compiles are overloaded: {self.max_abandoned_compiles} compiles that outlived "
            f"grammar_compile_timeout={self.compile_timeout:g} s still run and cannot be stopped; "
            f"the {key.kind} grammar was not compiled, retry later", key.param)

    def _cache_key(self, key: GrammarKey) -> tuple[str, str, str, str, bool]:
        # key.backend: under "auto" the backend the front chose; the same text may go to either.
        return (self.backend.name, key.backend, key.kind, key.text, key.lenient)

    def _uncache(self, job: CompileJob) -> None:
        cache_key = self._cache_key(job.key)
        if self._cache.get(cache_key) is job:
            del self._cache[cache_key]


def _drive_slot(manager_ref: weakref.ref, jobs_ready: threading.Condition, index: int) -> None:
    """Slot ``index``'s thread: run jobs until the manager shuts down or is collected, then close the slot.

    It holds the manager only while it takes or runs a job, not while it waits
    (on the manager's condition), so a manager dropped without `shutdown` is
    collected and its worker processes are killed.
    """
    slot = None
    while True:
        with jobs_ready:
            manager = manager_ref()
            if manager is None or manager._closed:
                break
            slot = manager._slots[index]
            job = manager._take_job(index)
            if job is None:
                del manager
                jobs_ready.wait(IDLE_CHECK_S)
                continue
        if not manager._step(index, job):
            break
        del manager, job
    if slot is not None:
        slot.close()


class ThreadSlot:
    """Runs each compile on a fresh daemon thread of this process.

    A compile past its job's deadline is abandoned: `run` raises
    `CompileTimeout` and the slot takes the next job on a new thread while the
    old one runs on (it cannot be stopped) and its result is dropped.
    `num_abandoned` counts them all, `num_abandoned_running` those still running.
    """

    pid = None

    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self._closed = threading.Event()
        self._wakeup: threading.Event | None = None
        self.num_abandoned = 0
        self._abandoned: list[threading.Thread] = []
        self._abandoned_lock = threading.Lock()  # `run`'s thread appends, the manager's callers count

    @property
    def num_abandoned_running(self) -> int:
        """Abandoned compiles whose thread has not returned yet."""
        with self._abandoned_lock:
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)

    def run(self, job: CompileJob) -> tuple[CompiledGrammar, float]:
        """Compile ``job.key``; (compiled, seconds).

        Raises
        ------
        GrammarError
            As the backend's ``compile``; other exceptions pass through.
        CompileTimeout
            ``job.deadline`` passed first (the thread is abandoned).
        CompilerClosed
            `close` was called first.
        """
        done = self._wakeup = threading.Event()
        outcome: dict = {}

        def compile_on_thread() -> None:
            start = time.perf_counter()
            try:
                outcome["compiled"] = self.backend.compile(job.key)
            except BaseException as e:  # noqa: BLE001 — handed to the slot's thread
                outcome["error"] = e
            outcome["compile_s"] = time.perf_counter() - start
            done.set()

        thread = threading.Thread(target=compile_on_thread, name="arborlm-grammar-compile", daemon=True)
        thread.start()
        while not done.wait(max(0.0, job.deadline - time.monotonic())):
            if time.monotonic() > job.deadline:
                self.num_abandoned += 1
                with self._abandoned_lock:
                    self._abandoned.append(thread)
                logger.warning("abandoned a %s grammar compile past its deadline (%d so far); its thread runs on",
                               job.key.kind, self.num_abandoned)
                raise CompileTimeout
        if self._closed.is_set() and "compile_s" not in outcome:
            raise CompilerClosed
        if "error" in outcome:
            raise outcome["error"]
        return outcome["compiled"], outcome["compile_s"]

    def close(self) -> None:
        self._closed.set()
        if self._wakeup is not None:
            self._wakeup.set()


def _make_slots(backend: GrammarBackend, count: int, use_worker_processes: bool) -> list:
    """``count`` `CompileWorker` slots when asked for and ``backend`` can compile in a worker
    process, else `ThreadSlot` ones."""
    if use_worker_processes and backend.worker_args() is not None:
        try:
            setup = setup_message(backend)
        except WorkerSetupError as e:
            logger.warning("grammar compiles run on threads, which cannot be stopped: %s", e)
        else:
            return [CompileWorker(backend, setup) for _ in range(count)]
    return [ThreadSlot(backend) for _ in range(count)]


def _cancel(future: concurrent.futures.Future) -> None:
    """Cancel ``future`` and wake its waiters (``concurrent.futures.wait`` ignores a bare ``cancel``).

    Only `GrammarManager.shutdown` cancels, once.
    """
    if not future.done() and future.cancel():
        future.set_running_or_notify_cancel()


def _failed_future(error: BaseException) -> concurrent.futures.Future:
    """A future already done with ``error``."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future


def _set_future(future: concurrent.futures.Future, *, result=None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless it is done already (cancelled by shutdown)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _timeout_error(key: GrammarKey, timeout_s: float) -> GrammarError:
    return GrammarError(
        f"the {key.kind} grammar did not compile within grammar_compile_timeout={timeout_s:g} s", key.param
    )


def _backend_failure(key: GrammarKey, error: BaseException) -> GrammarError:
    return GrammarError(f"compiling the {key.kind} grammar failed: {type(error).__name__}: {error}", key.param)
