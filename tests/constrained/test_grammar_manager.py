"""GrammarManager with a fake backend: cache, failures, timeouts, wait_any, shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey
from arborlm.constrained.grammar_manager import GrammarManager


class FakeCompiled(CompiledGrammar):
    def __init__(self, key: GrammarKey):
        self.key = key

    def new_matcher(self, stop_token_ids=()):
        raise NotImplementedError


class FakeBackend(GrammarBackend):
    """Compiles instantly, except: "slow" blocks until `release` (at most 10 s),
    "bad" raises GrammarError, "boom" raises RuntimeError."""

    name = "fake"
    kinds = ("regex",)

    def __init__(self):
        self.release = threading.Event()
        self.calls: list[GrammarKey] = []

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        pass

    def compile(self, key: GrammarKey) -> FakeCompiled:
        self.calls.append(key)
        if key.text == "slow":
            self.release.wait(10)
        if key.text == "bad":
            raise GrammarError("bad grammar", key.param)
        if key.text == "boom":
            raise RuntimeError("backend crashed")
        return FakeCompiled(key)


def regex(text: str) -> GrammarKey:
    return GrammarKey("regex", text)


@pytest.fixture
def backend():
    backend = FakeBackend()
    yield backend
    backend.release.set()  # let any blocked worker thread finish


@pytest.fixture
def manager(backend):
    manager = GrammarManager(backend, compile_timeout=5.0)
    yield manager
    manager.shutdown()


def wait_result(manager: GrammarManager, pending):
    assert manager.wait_any([pending], timeout=5) == [pending]
    return pending.result()


def test_cache_hit_returns_same_compiled(manager, backend):
    first = wait_result(manager, manager.request(regex("a+")))
    assert isinstance(first, FakeCompiled) and first.key == regex("a+")
    again = manager.request(regex("a+"))
    assert again.done() and again.result() is first
    stats = manager.stats()
    assert stats["num_compiled"] == 1 and stats["num_cache_hits"] == 1 and stats["num_failures"] == 0
    assert len(stats["compile_times_s"]) == 1 and stats["compile_times_s"][0] >= 0
    assert backend.calls == [regex("a+")]


def test_cache_is_lru_bounded(backend):
    manager = GrammarManager(backend, compile_timeout=5.0, max_cache_entries=2)
    try:
        for text in ("a", "b", "a", "c"):  # "b" is least recently used when "c" arrives
            wait_result(manager, manager.request(regex(text)))
        assert manager.stats()["num_cached"] == 2
        wait_result(manager, manager.request(regex("a")))
        wait_result(manager, manager.request(regex("b")))
        assert [k.text for k in backend.calls] == ["a", "b", "c", "b"]
    finally:
        manager.shutdown()


@pytest.mark.parametrize(("text", "message"), [("bad", "bad grammar"), ("boom", "RuntimeError: backend crashed")])
def test_failed_compile_raises_grammar_error(manager, text, message):
    pending = manager.request(regex(text))
    manager.wait_any([pending], timeout=5)
    for _ in range(2):  # every request for it gets the error, also from the cache
        with pytest.raises(GrammarError, match=message) as error:
            pending.result()
        assert error.value.param == "regex"
        pending = manager.request(regex(text))
    assert manager.stats()["num_failures"] == 1


def test_slow_compile_times_out_while_others_compile(backend):
    manager = GrammarManager(backend, compile_timeout=0.5)
    try:
        before = time.monotonic()
        slow = manager.request(regex("slow"))
        assert before + 0.5 <= slow.deadline <= time.monotonic() + 0.5
        fast = manager.request(regex("fast"))
        assert isinstance(wait_result(manager, fast), FakeCompiled)
        assert slow.result(now=slow.deadline - 0.01) is None
        with pytest.raises(GrammarError, match=r"grammar_compile_timeout=0\.5 s") as error:
            slow.result(now=slow.deadline + 0.01)
        assert error.value.param == "regex"
        time.sleep(max(0.0, slow.deadline - time.monotonic()) + 0.01)
        with pytest.raises(GrammarError, match="grammar_compile_timeout"):
            slow.result()
    finally:
        manager.shutdown()


def test_wait_any(manager, backend):
    assert manager.wait_any([], timeout=5) == []
    slow = manager.request(regex("slow"))
    start = time.monotonic()
    assert manager.wait_any([slow], timeout=0.1) == []
    assert 0.09 <= time.monotonic() - start < 2
    fast = manager.request(regex("fast"))
    assert manager.wait_any([slow, fast], timeout=5) == [fast]
    threading.Timer(0.05, backend.release.set).start()
    start = time.monotonic()
    assert manager.wait_any([slow], timeout=5) == [slow]
    assert time.monotonic() - start < 2
    assert isinstance(slow.result(), FakeCompiled)


def test_shutdown_does_not_wait_for_stuck_compile(backend):
    manager = GrammarManager(backend, compile_timeout=5.0, max_workers=1)
    stuck = manager.request(regex("slow"))
    queued = manager.request(regex("fast"))  # behind the stuck one on the only worker
    start = time.monotonic()
    manager.shutdown()
    assert time.monotonic() - start < 1
    assert stuck.result() is None
    with pytest.raises(GrammarError, match="cancelled"):
        queued.result()
    with pytest.raises(RuntimeError, match="shut down"):
        manager.request(regex("a"))


def test_stuck_thread_compile_gives_up_its_slot(backend):
    manager = GrammarManager(backend, compile_timeout=0.3, max_workers=1)
    try:
        assert not manager.uses_worker_processes  # the fake backend cannot ship its grammars
        slow = manager.request(regex("slow"))
        with pytest.raises(GrammarError, match="grammar_compile_timeout"):
            wait_result(manager, slow)
        assert isinstance(wait_result(manager, manager.request(regex("fast"))), FakeCompiled)
        stats = manager.stats()
        assert stats["num_timeouts"] == 1 and stats["num_compiled"] == 1 and stats["num_cached"] == 1
    finally:
        manager.shutdown()


def test_rejects_bad_settings(backend):
    with pytest.raises(ValueError, match="compile_timeout"):
        GrammarManager(backend, compile_timeout=0)
    with pytest.raises(ValueError, match="max_cache_entries"):
        GrammarManager(backend, compile_timeout=1, max_cache_entries=0)
    with pytest.raises(ValueError, match="max_workers"):
        GrammarManager(backend, compile_timeout=1, max_workers=0)
