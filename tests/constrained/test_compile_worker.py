"""GrammarManager with compile worker processes: a stuck compile is killed at its deadline and
others keep compiling; crashes restart the worker; errors come back typed; shutdown and a dead
parent leave no worker behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from arborlm.constrained.base import GrammarError, GrammarKey
from arborlm.constrained.grammar_manager import GrammarManager, create_grammar_backend
from tests.constrained.worker_backends import SleepyBackend, WorkerCompiled

REPO = Path(__file__).resolve().parents[2]


def regex(text: str) -> GrammarKey:
    return GrammarKey("regex", text)


def wait_result(manager: GrammarManager, pending, timeout: float = 30):
    assert manager.wait_any([pending], timeout=timeout) == [pending], "no result in time"
    return pending.result()


def is_gone(pid: int) -> bool:
    """True when ``pid`` has exited (no such process, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if is_gone(pid):
            return True
        time.sleep(0.05)
    return is_gone(pid)


def no_worker_children(timeout: float = 2) -> bool:
    end = time.monotonic() + timeout
    while worker_children() and time.monotonic() < end:
        time.sleep(0.05)
    return worker_children() == []


def worker_children() -> list[int]:
    """Live compile worker processes whose parent is this process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z" and b"compile_worker import main" in cmdline:
            found.append(int(entry.name))
    return found


# Worker start-up imports torch (seconds on a busy machine): the fixture waits for both workers
# with a long timeout, then shortens it for the test.
TIMEOUT_S = 1.5


@pytest.fixture
def manager():
    manager = GrammarManager(SleepyBackend("t"), compile_timeout=120)
    assert manager.uses_worker_processes
    warm = [manager.request(regex("warm-1")), manager.request(regex("warm-2"))]  # one per slot
    assert {wait_result(manager, pending, timeout=120).pid for pending in warm} == set(manager.stats()["worker_pids"])
    assert len(manager.stats()["worker_pids"]) == 2
    manager.compile_timeout = TIMEOUT_S
    yield manager
    manager.shutdown()
    assert no_worker_children()


def test_compiles_in_a_worker_process(manager):
    compiled = wait_result(manager, manager.request(regex("a")))
    assert isinstance(compiled, WorkerCompiled) and compiled.key == regex("a")
    assert compiled.pid != os.getpid() and compiled.pid in manager.stats()["worker_pids"]
    assert manager.request(regex("a")).result() is compiled  # cached
    assert wait_result(manager, manager.request(regex("big"))).pid == os.getpid()  # compiled again here
    stats = manager.stats()
    assert stats["num_compiled"] == 4 and stats["num_cache_hits"] == 1


def test_stuck_compiles_are_killed_and_others_still_compile(manager):
    stuck_pids = set(manager.stats()["worker_pids"])
    stuck = [manager.request(regex("sleep")), manager.request(GrammarKey("json_schema", "sleep"))]
    for pending in stuck:
        with pytest.raises(GrammarError, match=rf"grammar_compile_timeout={TIMEOUT_S:g} s") as error:
            wait_result(manager, pending, timeout=10)
        assert error.value.param in ("regex", "json_schema")
    assert all(wait_gone(pid, timeout=1) for pid in stuck_pids)
    # Fresh workers started when the stuck ones were killed; today's threads would still be stuck.
    manager.compile_timeout = 60  # allow for the start-up of the fresh workers
    start = time.monotonic()
    after = wait_result(manager, manager.request(regex("b")), timeout=30)
    assert isinstance(after, WorkerCompiled) and after.pid not in stuck_pids
    assert time.monotonic() - start < 10  # worker start-up (imports torch), on a busy 2-core machine
    stats = manager.stats()
    assert stats["num_timeouts"] == 2 and not stuck_pids & set(stats["worker_pids"])
    assert stats["num_cached"] == 3  # the warm-ups and "b": a timed-out compile is not cached


def test_a_later_request_extends_the_deadline(manager):
    first = manager.request(regex("sleep"))
    time.sleep(TIMEOUT_S * 0.6)
    second = manager.request(regex("sleep"))  # a cache hit on the compile in flight
    assert second.deadline > first.deadline
    with pytest.raises(GrammarError, match="grammar_compile_timeout"):
        first.result(now=first.deadline + 0.01)
    assert not first.done()  # the worker keeps compiling for the second request
    with pytest.raises(GrammarError, match="grammar_compile_timeout"):
        wait_result(manager, second, timeout=10)
    assert time.monotonic() >= second.deadline


@pytest.mark.parametrize(
    ("text", "message"),
    [("bad", "^bad grammar$"), ("boom", "^compiling the regex grammar failed: RuntimeError: backend crashed$")],
)
def test_compile_errors_come_back_typed(manager, text, message):
    for _ in range(2):  # the second from the cache
        with pytest.raises(GrammarError, match=message) as error:
            wait_result(manager, manager.request(regex(text)))
        assert error.value.param == "regex"
    assert manager.stats()["num_failures"] == 1
    assert isinstance(wait_result(manager, manager.request(regex("ok"))), WorkerCompiled)


def test_a_killed_worker_is_restarted(manager):
    manager.compile_timeout = 60  # allow for the start-up of the fresh workers
    first = wait_result(manager, manager.request(regex("a")))
    os.kill(first.pid, signal.SIGKILL)
    assert wait_gone(first.pid)
    second = wait_result(manager, manager.request(regex("b")))
    assert second.pid != first.pid
    with pytest.raises(GrammarError, match=r"worker died while compiling this regex grammar \(exit code 3\)"):
        wait_result(manager, manager.request(regex("crash")))
    assert wait_gone(second.pid)
    third = wait_result(manager, manager.request(regex("c")))
    assert third.pid not in (first.pid, second.pid)
    stats = manager.stats()
    assert stats["num_failures"] == 1 and stats["num_worker_starts"] >= 4, stats  # 2, then after the kill, the crash


def test_shutdown_kills_the_workers_at_once(manager):
    manager.compile_timeout = 60
    pids = manager.stats()["worker_pids"]
    stuck = [manager.request(regex("sleep")), manager.request(GrammarKey("ebnf", "sleep"))]
    queued = [manager.request(regex("b")), manager.request(regex("c"))]
    time.sleep(0.3)
    start = time.monotonic()
    manager.shutdown()
    assert time.monotonic() - start < 1
    assert no_worker_children()
    assert all(is_gone(pid) for pid in pids)
    start = time.monotonic()
    assert len(manager.wait_any(stuck + queued, timeout=5)) == 4 and time.monotonic() - start < 1
    for pending in stuck + queued:
        with pytest.raises(GrammarError, match="cancelled"):
            wait_result(manager, pending, timeout=5)
    with pytest.raises(RuntimeError, match="shut down"):
        manager.request(regex("a"))


def test_workers_exit_when_their_parent_dies(tmp_path):
    script = textwrap.dedent(
        """
        import os, sys, time
        from arborlm.constrained.base import GrammarKey
        from arborlm.constrained.grammar_manager import GrammarManager, create_grammar_backend
        from tests.constrained.worker_backends import SleepyBackend

        manager = GrammarManager(SleepyBackend(), compile_timeout=600)
        pending = manager.request(GrammarKey("regex", "sleep"))
        while not manager.stats()["worker_pids"]:
            time.sleep(0.05)
        time.sleep(0.5)
        print(*manager.stats()["worker_pids"], flush=True)
        os._exit(0)  # no shutdown, no atexit
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert pids
    assert all(wait_gone(pid) for pid in pids)


def test_timeouts_shorter_than_the_start_up_do_not_restart_the_worker():
    manager = GrammarManager(SleepyBackend(), compile_timeout=0.05, max_workers=1)
    try:
        first = manager.request(regex("a"))
        with pytest.raises(GrammarError, match="grammar_compile_timeout"):
            wait_result(manager, first, timeout=10)
        pid = manager.stats()["worker_pids"][0]
        manager.compile_timeout = 120
        assert wait_result(manager, manager.request(regex("b")), timeout=120).pid == pid  # the same worker
    finally:
        manager.shutdown()


def test_a_dropped_manager_closes_its_workers():
    manager = GrammarManager(SleepyBackend(), compile_timeout=120)
    pid = wait_result(manager, manager.request(regex("a")), timeout=120).pid
    del manager
    gc.collect()
    assert wait_gone(pid, timeout=10)


def test_backends_without_worker_support_use_threads():
    from tests.constrained.test_grammar_manager import FakeBackend

    manager = GrammarManager(FakeBackend(), compile_timeout=5)
    try:
        assert not manager.uses_worker_processes
        assert manager.stats()["worker_pids"] == []
    finally:
        manager.shutdown()


def test_unpicklable_backend_arguments_fall_back_to_threads():
    manager = GrammarManager(SleepyBackend(lambda: None), compile_timeout=5)  # a lambda does not pickle
    try:
        assert not manager.uses_worker_processes
        assert wait_result(manager, manager.request(regex("a"))).pid == os.getpid()
    finally:
        manager.shutdown()


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_real_backends_compile_in_a_worker(name, tokenizer, eos):
    manager = GrammarManager(create_grammar_backend(name, tokenizer, 49152, [eos]), compile_timeout=120, max_workers=1,
                             use_worker_processes=True)
    try:
        assert manager.uses_worker_processes
        keys = [regex("(ab){2,3}"), GrammarKey("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')]
        texts = ["abab", '{"a": 12}']
        for key, text in zip(keys, texts):
            matcher = wait_result(manager, manager.request(key), timeout=120).new_matcher()
            for token_id in tokenizer.encode(text, add_special_tokens=False):
                assert matcher.accept_token(token_id), (key, text)
            assert matcher.accept_token(eos)
        with pytest.raises(GrammarError) as error:
            wait_result(manager, manager.request(regex("(a")), timeout=120)
        assert error.value.param == "regex" and "regex" in error.value.message
        assert manager.stats()["num_compiled"] == 2 and manager.stats()["num_failures"] == 1
    finally:
        manager.shutdown()
    assert no_worker_children()


def test_xgrammar_ships_small_grammars_and_compiles_large_ones_again(tokenizer, eos):
    from arborlm.constrained import xgrammar_backend

    backend = xgrammar_backend.XGrammarBackend(tokenizer, 49152, [eos])
    small = backend.compile_serialized(regex("(ab){2,3}"))
    assert small is not None
    matcher = backend.load_compiled(regex("(ab){2,3}"), small).new_matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode("abab", add_special_tokens=False))
    large = GrammarKey("json_schema", '{"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,40}"}}')
    assert backend.compile(large).memory_size_bytes > xgrammar_backend.MAX_SHIPPED_BYTES
    assert backend.compile_serialized(large) is None


def test_default_compile_place_per_backend(tokenizer, eos):
    """outlines-core ships its compiled index cheaply: worker processes. xgrammar would ship
    large grammars only by compiling them twice: threads, one compile."""
    expected = {"outlines": True, "xgrammar": False}
    for name, in_worker in expected.items():
        manager = GrammarManager(create_grammar_backend(name, tokenizer, 49152, [eos]), compile_timeout=60)
        try:
            assert manager.uses_worker_processes is in_worker, name
        finally:
            manager.shutdown()
