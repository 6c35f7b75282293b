"""The scheduler's child processes start with the OpenMP wait policy the launcher gives them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import arborlm
from arborlm.runtime import launcher


def child_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_spincount_set_for_the_children_only(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with launcher._scheduler_environment():
        assert os.environ["GOMP_SPINCOUNT"] == launcher.SCHEDULER_GOMP_SPINCOUNT
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.parametrize("name,value", [("GOMP_SPINCOUNT", "7"), ("OMP_WAIT_POLICY", "PASSIVE")])
def test_a_users_setting_is_kept(monkeypatch, name, value):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv(name, value)
    with launcher._scheduler_environment():
        assert os.environ.get("GOMP_SPINCOUNT") == (value if name == "GOMP_SPINCOUNT" else None)
    assert os.environ[name] == value


@pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                    reason="a child's environment is read from /proc/<pid>/environ, which this OS lacks; "
                           "the two tests above check what the launcher gives it without /proc")
def test_the_scheduler_process_starts_with_it(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    engine = arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=4096)
    try:
        env = child_environment(engine._scheduler.process.pid)
        assert env.get("GOMP_SPINCOUNT") == launcher.SCHEDULER_GOMP_SPINCOUNT
        assert "GOMP_SPINCOUNT" not in os.environ
        out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 2
    finally:
        engine.shutdown()
