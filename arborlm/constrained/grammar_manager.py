"""The compiled-grammar cache and the worker threads that fill it.

The scheduler asks `GrammarManager.request` for a request's `GrammarKey` when it
arrives and gets a `PendingGrammar` at once; compiling runs on a thread pool so
the event loop keeps decoding other requests. Each step the scheduler polls
`PendingGrammar.result` for its waiting requests (None while compiling), admits
those whose grammar is ready and aborts those whose grammar failed or took
longer than ``grammar_compile_timeout``. With nothing else to do it blocks in
`GrammarManager.wait_any`.

Compiled grammars are cached by (backend name, kind, text), least recently used
first out, so a schema used by many requests compiles once.

After SGLang's ``sglang/srt/constrained/base_grammar_backend.py`` (cache of
futures, one executor) and its scheduler's grammar queue (timeout per request).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict, deque

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey

GRAMMAR_BACKEND_NAMES = ("xgrammar", "outlines")


def backend_class(name: str) -> type[GrammarBackend]:
    """The `GrammarBackend` subclass called ``name`` ("xgrammar" or "outlines").

    Imported on first use, so a front that only checks grammars loads one library.

    Raises
    ------
    ValueError
        ``name`` is not a known backend.
    """
    if name == "xgrammar":
        from arborlm.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    if name == "outlines":
        from arborlm.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend
    raise ValueError(f"unknown grammar backend {name!r}; expected one of {GRAMMAR_BACKEND_NAMES}")


def create_grammar_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    """A backend ``name`` for ``tokenizer`` (logits of ``vocab_size`` columns, stop ids ``eos_token_ids``).

    Raises
    ------
    ValueError
        ``name`` is not a known backend.
    """
    return backend_class(name)(tokenizer, vocab_size, eos_token_ids)


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
            GrammarError), compiling was cancelled by shutdown, or ``now`` is
            past `deadline` and compiling has not finished.
        """
        if self._future.done():
            if self._future.cancelled():
                raise GrammarError("grammar compilation was cancelled: the grammar manager shut down", self.key.param)
            error = self._future.exception()
            if error is None:
                return self._future.result()
            if isinstance(error, GrammarError):
                raise GrammarError(error.message, error.param) from error  # a fresh one per request
            raise _backend_failure(self.key, error) from error
        if (time.monotonic() if now is None else now) > self.deadline:
            raise GrammarError(
                f"the {self.key.kind} grammar did not compile within "
                f"grammar_compile_timeout={self._timeout_s:g} s",
                self.key.param,
            )
        return None


class GrammarManager:
    """Compiles grammars on worker threads and caches them (LRU).

    Parameters
    ----------
    backend:
        Compiles the grammars (its ``name`` is part of the cache key).
    compile_timeout:
        Seconds a request may wait for its grammar (``grammar_compile_timeout``).
    max_workers:
        Compiler threads. A compile that never returns keeps its thread; the
        others keep serving.
    max_cache_entries:
        Compiled grammars kept (in flight ones included); the least recently
        requested goes first.

    Thread-safe: `request` and `stats` may be called from any thread.
    """

    def __init__(self, backend: GrammarBackend, compile_timeout: float, max_workers: int = 2,
                 max_cache_entries: int = 1024, max_recorded_times: int = 1024):
        if compile_timeout <= 0:
            raise ValueError(f"compile_timeout must be > 0, got {compile_timeout}")
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        self.backend = backend
        self.compile_timeout = compile_timeout
        self.max_cache_entries = max_cache_entries
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="arborlm-grammar")
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._num_compiled = 0
        self._num_cache_hits = 0
        self._num_failures = 0
        self._compile_times_s: deque[float] = deque(maxlen=max_recorded_times)
        self._closed = False

    def request(self, key: GrammarKey) -> PendingGrammar:
        """Start compiling ``key`` (or reuse the cached compile) and return the wait for it.

        The deadline is now + ``compile_timeout``, also for a cache hit on a
        compile still in flight.

        Raises
        ------
        RuntimeError
            After `shutdown`.
        """
        cache_key = (self.backend.name, key.kind, key.text)
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarManager is shut down")
            future = self._cache.get(cache_key)
            if future is not None:
                self._cache.move_to_end(cache_key)
                self._num_cache_hits += 1
            else:
                future = self._executor.submit(self._compile, key)
                self._cache[cache_key] = future
                if len(self._cache) > self.max_cache_entries:
                    self._cache.popitem(last=False)
        return PendingGrammar(key, future, time.monotonic() + self.compile_timeout, self.compile_timeout)

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
        the cache (done or in flight); num_failures: compiles that raised;
        num_cached: entries in the cache; compile_times_s: the latest compile
        durations in seconds (oldest first, bounded).
        """
        with self._lock:
            return {
                "num_compiled": self._num_compiled,
                "num_cache_hits": self._num_cache_hits,
                "num_failures": self._num_failures,
                "num_cached": len(self._cache),
                "compile_times_s": list(self._compile_times_s),
            }

    def shutdown(self) -> None:
        """Cancel compiles not yet started and return without waiting for running ones."""
        with self._lock:
            self._closed = True
            self._cache.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: GrammarKey) -> CompiledGrammar:
        """Runs on a worker thread; every failure leaves as a GrammarError."""
        start = time.perf_counter()
        try:
            compiled = self.backend.compile(key)
        except GrammarError:
            self._count_failure()
            raise
        except Exception as e:
            self._count_failure()
            raise _backend_failure(key, e) from e
        elapsed_s = time.perf_counter() - start
        with self._lock:
            self._num_compiled += 1
            self._compile_times_s.append(elapsed_s)
        return compiled

    def _count_failure(self) -> None:
        with self._lock:
            self._num_failures += 1


def _backend_failure(key: GrammarKey, error: BaseException) -> GrammarError:
    return GrammarError(f"compiling the {key.kind} grammar failed: {type(error).__name__}: {error}", key.param)
