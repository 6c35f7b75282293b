"""Schemas whose patterns backtrack (issue 16): preparing one must not stall the HTTP process.

Each case is a small, valid JSON schema whose ``pattern`` (or ``patternProperties`` key)
takes Python's `re` seconds against one of the schema's own strings (an ``enum`` value, a
property name), doubling per character; `re` holds the GIL, so before the fix ``/health``
went unanswered meanwhile. Now every search of a user pattern runs under a budget with the
GIL released (`json_schema/regex_budget.py`). While each case is sent, a thread polls
``/health`` and a normal request runs beside it: every health answer comes within
`HEALTH_BOUND_S`, the normal request completes, and the schema gets its 400 (naming the
pattern) within `REFUSAL_BOUND_S`, or, where xgrammar's preparation runs out of its
budget but llguidance (which needs no such search) takes the schema, the default backend
auto serves it on llguidance within the same bound. Each case counts into the battery's tally.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.reliability.bad_requests import check_error_body
from tests.reliability.conftest import assert_pools_whole

TALLY = "backtracking schemas"
# The aim is 100 ms; a busy 2-core CI machine adds scheduling noise, and before the fix the
# stall was seconds.
HEALTH_BOUND_S = 0.25
# The budget of a schema's searches is 0.5 s (PREPARE_REGEX_BUDGET_S), plus the request's own work.
REFUSAL_BOUND_S = 2.0
POLL_EVERY_S = 0.02
NORMAL_REQUEST = {"input_ids": [1, 504, 3158, 2777], "sampling_params": {
    "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
# Sent first: the front imports the grammar backend (and torch) on its first constrained request.
WARM_REQUEST = {"text": "x", "sampling_params": {"json_schema": {"type": "string", "pattern": "^a+$"},
                                                 "max_new_tokens": 4}}

# (name, schema, pattern, served_by): served_by None means a 400 naming the pattern (both
# backends the server's default, auto, tries refuse it); else the backend auto serves it on.
CASES = [
    # The schema: an enum filtered by a pattern; the enum empties, the 400 names the pattern.
    ("enum beside (a+)+", {"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 26 + "!"]}, "^(a+)+$", None),
    # A repeat the `regex` module cannot prune either: stopped by the budget.
    ("enum beside (a|aa)+", {"type": "string", "pattern": "^(a|aa)+$", "enum": ["a" * 40 + "!"]}, "^(a|aa)+$",
     None),
    # xgrammar's preparation matches the listed name against the key pattern (stopped by the
    # budget); llguidance matches them with its own regex engine (derivatives, no backtracking),
    # so auto serves it there.
    ("listed property under a patternProperties key",
     {"type": "object", "properties": {"a" * 40 + "!": {"type": "string"}},
      "patternProperties": {"^(a|aa)+$": {"type": "integer"}}}, "^(a|aa)+$", "llguidance"),
]


class HealthPoller:
    """Polls ``/health`` from its own thread and keeps each answer's latency in seconds."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                response = client.get("/health")
                self.latencies_s.append(time.perf_counter() - start)
                if response.status_code != 200:
                    self.failures.append(f"/health answered {response.status_code}")
                self._stop.wait(POLL_EVERY_S)


@pytest.fixture(scope="module")
def http(main_server):
    with main_server.client() as client:
        yield client
        assert_pools_whole(client)


def _normal_request(http: httpx.Client, results: list) -> None:
    start = time.perf_counter()
    response = http.post("/generate", json=NORMAL_REQUEST)
    results.append((response.status_code, time.perf_counter() - start, response.text[:300]))


@pytest.mark.parametrize("name, schema, pattern, served_by", CASES, ids=[c[0] for c in CASES])
def test_backtracking_schema_does_not_stall_the_server(main_server, http, tally, name, schema, pattern, served_by):
    tally[TALLY][0] += 1
    assert http.post("/generate", json=WARM_REQUEST).status_code == 200
    normal: list = []
    with HealthPoller(main_server.base_url) as poller:
        time.sleep(0.1)  # a few answers before the schema arrives
        beside = threading.Thread(target=_normal_request, args=(http, normal))
        start = time.perf_counter()
        beside.start()
        response = http.post("/generate", json={"text": "x", "sampling_params": {
            "json_schema": schema, "max_new_tokens": 8}})
        refused_after_s = time.perf_counter() - start
        beside.join(timeout=60)
        time.sleep(0.1)
    assert not poller.failures, poller.failures
    assert len(poller.latencies_s) >= 5, poller.latencies_s
    slowest = max(poller.latencies_s)
    assert slowest < HEALTH_BOUND_S, f"{name}: /health took {slowest * 1000:.0f} ms while the schema was prepared"
    assert refused_after_s < REFUSAL_BOUND_S, f"{name}: answered after {refused_after_s:.2f} s"
    if served_by is None:
        assert response.status_code == 400, response.text[:500]
        error = check_error_body(response.json())
        assert error["param"] == "json_schema" and pattern in error["message"], error
    else:
        assert response.status_code == 200, response.text[:500]
        meta = response.json()["meta_info"]
        # not an abort: the output so far was under the schema's grammar (validated if finished)
        assert meta["grammar_backend"] == served_by and meta["finish_reason"]["type"] in ("stop", "length"), meta
    assert normal and normal[0][0] == 200, normal
    tally[TALLY][1] += 1
