"""Grammar backends the compile-worker tests build in worker processes (importable there by name)."""

from __future__ import annotations

import os
import time

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey


class WorkerCompiled(CompiledGrammar):
    """A fake compiled grammar that knows which process compiled it."""

    def __init__(self, key: GrammarKey, pid: int):
        self.key = key
        self.pid = pid

    def new_matcher(self, stop_token_ids=()):
        raise NotImplementedError


class SleepyBackend(GrammarBackend):
    """Compiles regex keys instantly into a `WorkerCompiled`, except (by text): "sleep" sleeps
    for an hour, "bad" raises GrammarError, "boom" raises RuntimeError, "crash" ends the process,
    "big" is not shipped (the serving process compiles it again)."""

    name = "sleepy"
    kinds = ("regex",)

    def __init__(self, label: str = "sleepy"):
        self.label = label

    @classmethod
    def _check_syntax(cls, key: GrammarKey) -> None:
        pass

    def compile(self, key: GrammarKey) -> WorkerCompiled:
        payload = self.compile_serialized(key)
        return WorkerCompiled(key, os.getpid()) if payload is None else self.load_compiled(key, payload)

    def compile_serialized(self, key: GrammarKey) -> dict | None:
        if key.text == "sleep":
            time.sleep(3600)
        if key.text == "crash":
            os._exit(3)
        if key.text == "bad":
            raise GrammarError("bad grammar", key.param)
        if key.text == "boom":
            raise RuntimeError("backend crashed")
        if key.text == "big":
            return None
        return {"pid": os.getpid(), "label": self.label}

    def load_compiled(self, key: GrammarKey, payload: dict) -> WorkerCompiled:
        assert payload["label"] == self.label  # built from the same arguments
        return WorkerCompiled(key, payload["pid"])
