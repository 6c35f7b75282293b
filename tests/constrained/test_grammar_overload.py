"""Abandoned thread compiles are capped (issue 16, item 2): a compile past its deadline keeps
running on a thread that cannot be stopped; while `max_abandoned_compiles` of them run, the
manager refuses grammars it would have to compile (`GrammarCompilesOverloaded`, a 503 code),
so a stream of slow schemas cannot take every core. Cached grammars are still served."""

from __future__ import annotations

import threading
import time

import pytest

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarKey
from arborlm.constrained.grammar_manager import GrammarCompilesOverloaded, GrammarManager
from arborlm.constrained.keys import GrammarError


class Compiled(CompiledGrammar):
    def new_matcher(self):
        raise NotImplementedError


class SlowBackend(GrammarBackend):
    """Compiles at once, except texts starting with "slow", which block until `release` (at most 30 s)."""

    name = "slow-fake"
    kinds = ("regex",)

    def __init__(self):
        self.release = threading.Event()

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        pass

    def compile(self, key: GrammarKey) -> Compiled:
        if key.text.startswith("slow"):
            self.release.wait(30)
        return Compiled()


def regex(text: str) -> GrammarKey:
    return GrammarKey("regex", text)


def wait(manager: GrammarManager, key: GrammarKey) -> CompiledGrammar:
    pending = manager.request(key)
    manager.wait_any([pending], timeout=10)
    while (compiled := pending.result()) is None:
        time.sleep(0.01)
    return compiled


@pytest.fixture
def backend():
    backend = SlowBackend()
    yield backend
    backend.release.set()


@pytest.fixture
def manager(backend):
    manager = GrammarManager(backend, compile_timeout=0.2, max_workers=1, max_abandoned_compiles=2)
    yield manager
    manager.shutdown()


def test_new_compiles_are_refused_while_abandoned_ones_fill_the_cap(backend, manager):
    assert isinstance(wait(manager, regex("fast")), Compiled)
    for text in ("slow 1", "slow 2"):
        with pytest.raises(GrammarError, match="grammar_compile_timeout"):
            wait(manager, regex(text))
    assert manager.stats()["num_abandoned_running"] == 2
    start = time.monotonic()
    refused = manager.request(regex("new"))
    assert refused.done() and time.monotonic() - start < 0.1  # refused at once, nothing started
    with pytest.raises(GrammarCompilesOverloaded, match="overloaded") as info:
        refused.result()
    assert info.value.code == "server_overloaded" and info.value.param == "regex"
    assert isinstance(wait(manager, regex("fast")), Compiled)  # a cached grammar is still served
    stats = manager.stats()
    assert stats["num_overloaded"] == 1 and stats["num_compiled"] == 1

    backend.release.set()  # the abandoned compiles return: new ones are taken again
    deadline = time.monotonic() + 10
    while manager.stats()["num_abandoned_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.stats()["num_abandoned_running"] == 0
    assert isinstance(wait(manager, regex("new")), Compiled)  # the refusal was not cached


def test_below_the_cap_a_slow_compile_only_times_out(backend, manager):
    with pytest.raises(GrammarError, match="grammar_compile_timeout"):
        wait(manager, regex("slow"))
    assert isinstance(wait(manager, regex("other")), Compiled)
    assert manager.stats()["num_overloaded"] == 0


def test_rejects_a_cap_below_one(backend):
    with pytest.raises(ValueError, match="max_abandoned_compiles"):
        GrammarManager(backend, compile_timeout=1, max_abandoned_compiles=0)
