"""One Engine on the tiny model per module, with a pool-leak check after each test."""

from __future__ import annotations

import time

import pytest

import arborlm


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    engine = arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=8192,
                            random_seed=1234, log_level="warning")
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(tiny_engine):
    """The module's engine; afterwards every KV slot and request row must be back in its pool."""
    yield tiny_engine
    if tiny_engine._closed:
        return
    deadline = time.monotonic() + 10
    while True:  # aborted requests finish on the scheduler's next step
        info = tiny_engine.get_server_info(check_invariants=True)
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["free_req_rows"] == info["total_req_rows"]
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
