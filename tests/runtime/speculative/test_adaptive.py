"""The cost-aware switch (`adaptive.py`): its estimates and plans (tables), and the scheduler
under it with scripted time.

Scheduler runs use the scripted target of `test_spec_scheduler_fake_worker` and its
`ScriptedClock`: every step advances the clock by a scripted function of the rows it
runs, and the switch reads that clock, so a run's "wall time" is deterministic. The
outputs must equal the script whatever the switch decides; what it decides shows in
the scripted time of the run against speculation off.
"""

from __future__ import annotations

import pytest

from arborlm.runtime.speculative.adaptive import (
    AcceptanceEstimate,
    AdaptiveConfig,
    AdaptivePolicy,
    StepCostModel,
    StepTimer,
)
from tests.runtime.scheduler_helpers import make_req, run_to_completion
from tests.runtime.speculative.test_spec_scheduler_fake_worker import (
    copy_script,
    create_spec_scheduler,
    prompt_for,
)

CFG = AdaptiveConfig()


def test_acceptance_estimate_counts_tried_tokens():
    est = AcceptanceEstimate(CFG)
    assert est.rate == pytest.approx(CFG.prior_rate)
    est.observe(draft_len=6, num_accepted=0)  # one token tried, rejected
    assert est.rate == pytest.approx(0.7 * 0.6 / (0.7 + 1))
    est.observe(draft_len=6, num_accepted=6)  # all six tried and kept
    low = 0.7 * 0.6 / 1.7
    assert est.rate == pytest.approx((0.7 * 0.7 * 0.6 + 6) / (0.7 * 1.7 + 6))
    assert est.rate > low
    est.observe(draft_len=0, num_accepted=0)  # no draft: no evidence
    before = est.rate
    for _ in range(200):
        est.forget()
    assert est.rate == pytest.approx(CFG.prior_rate, abs=1e-3)
    assert before != est.rate


@pytest.mark.parametrize("points, rows, want", [
    ([(1, 0.010), (3, 0.030), (5, 0.050)], 4, 0.040),  # exact line through the origin
    ([(2, 0.012), (6, 0.016)], 10, 0.020),  # extrapolated along the slope
    ([(4, 0.020), (4, 0.030)], 40, None),  # one row count: the weighted mean, whatever the rows
    ([(1, 0.050), (8, 0.010)], 8, None),  # a falling fit is clamped flat: the weighted mean
])
def test_step_cost_model(points, rows, want):
    model = StepCostModel(decay=0.9)
    assert model.empty and model.estimate(rows) is None
    for n, t in points:
        model.observe(n, t)
    if want is None:
        weights = [0.9 ** (len(points) - 1 - i) for i in range(len(points))]
        want = sum(w * t for w, (_, t) in zip(weights, points)) / sum(weights)
    assert model.estimate(rows) == pytest.approx(want)


def policy_with(decode, verify) -> AdaptivePolicy:
    """A policy whose cost models saw decode steps ``[(rows, s)]`` and verify steps ``[(rows, s)]``."""
    policy = AdaptivePolicy()
    for rows, s in decode:
        policy.costs[policy.DECODE].observe(rows, s)
    for rows, s in verify:
        policy.costs[policy.VERIFY].observe(rows, s)
    return policy


BANDWIDTH_BOUND = dict(decode=[(4, 0.0204), (8, 0.0208)], verify=[(8, 0.0208), (40, 0.024)])  # 20 ms + 0.1 ms/row
COMPUTE_BOUND = dict(decode=[(4, 0.041), (8, 0.081)], verify=[(8, 0.081), (40, 0.401)])  # 1 ms + 10 ms/row


@pytest.mark.parametrize("costs, max_lens, rates, want", [
    (dict(decode=[], verify=[]), [3, 0, 5], [0.1, 0.9, 0.1], [3, 0, 5]),  # nothing timed: try all
    (BANDWIDTH_BOUND, [4, 4, 4, 4], [0.9] * 4, [4, 4, 4, 4]),  # rows nearly free, drafts good
    (COMPUTE_BOUND, [4, 4, 4, 4], [0.9] * 4, [0, 0, 0, 0]),  # each row costs a step's worth
    (BANDWIDTH_BOUND, [4, 4, 0, 4], [0.9, 0.005, 0.9, 0.9], [4, 0, 0, 4]),  # the hopeless one is left out
    (BANDWIDTH_BOUND, [6, 0, 0, 0], [0.05, 0.5, 0.5, 0.5], [1, 0, 0, 0]),  # a poor draft's tail is cut
    (BANDWIDTH_BOUND, [4, 4, 0, 0], [0.2, 0.9, 0.2, 0.2], [2, 4, 0, 0]),  # each cut where worth < row cost
])
def test_plan(costs, max_lens, rates, want):
    assert policy_with(**costs).plan(max_lens, rates) == want


def test_plan_before_any_verify_step_takes_verify_as_cheap_as_decode():
    policy = policy_with(decode=[(2, 0.02), (4, 0.04)], verify=[])
    assert policy.plan([3, 3], [0.5, 0.5]) == [3, 3]


def test_plan_times_each_kind_first_and_then_now_and_then():
    """The first step of each kind is not counted; until a plain decode step is timed (or after
    explore_every steps without one) the step decodes plainly; after explore_every steps
    without a verify step it verifies every draft."""
    now = [0.0]
    policy = AdaptivePolicy(AdaptiveConfig(explore_every=3), clock=lambda: now[0])

    def step(kind, rows, seconds):
        policy.start_step(kind, rows)
        now[0] += seconds
        policy.end_step()

    assert policy.plan([4, 4], [0.9, 0.9]) == [4, 4]  # nothing timed: try
    step(policy.VERIFY, 10, 5.0)  # the first verify step: one-time costs, not counted
    assert policy.plan([4, 4], [0.9, 0.9]) == [4, 4]
    step(policy.VERIFY, 10, 0.021)
    assert policy.plan([4, 4], [0.9, 0.9]) == [0, 0]  # no plain step timed yet
    step(policy.DECODE, 2, 9.0)  # the first plain step: not counted
    assert policy.plan([4, 4], [0.9, 0.9]) == [0, 0]
    step(policy.DECODE, 2, 0.020)
    for _ in range(3):
        assert policy.plan([4, 4], [0.9, 0.9]) == [4, 4]
        step(policy.VERIFY, 10, 0.021)
    assert policy.plan([4, 4], [0.9, 0.9]) == [0, 0]  # explore_every verify steps in a row
    step(policy.DECODE, 2, 0.020)
    # Verify steps now look slow: plain decode wins ...
    policy.costs[policy.VERIFY].observe(10, 1.0)
    assert policy.steps_since[policy.VERIFY] == 1
    for _ in range(2):
        assert policy.plan([4, 4], [0.9, 0.9]) == [0, 0]
        step(policy.DECODE, 2, 0.020)
    assert policy.plan([4, 4], [0.9, 0.9]) == [4, 4]  # ... until explore_every steps without one: re-time it


def test_step_timer_with_an_injected_clock():
    now = [10.0]
    timer = StepTimer(lambda: now[0])
    assert timer.stop() is None
    timer.start("verify", 9)
    now[0] += 0.5
    timer.retag("decode", 4)
    assert timer.stop() == ("decode", 4, 0.5)
    timer.start("verify", 9)
    timer.cancel()
    assert timer.stop() is None


def test_bad_config():
    with pytest.raises(ValueError, match="rate_decay"):
        AdaptiveConfig(rate_decay=1.5)
    with pytest.raises(ValueError, match="prior_weight"):
        AdaptiveConfig(prior_weight=0)
    with pytest.raises(ValueError, match="explore_every"):
        AdaptiveConfig(explore_every=0)


# ---- the scheduler under scripted time ----------------------------------------------------------

RIDS = [f"r{i}" for i in range(6)]


def misleading_script(rid: str, length: int = 60) -> list[int]:
    """``A B x1 A B x2 ...``: after every ``A B`` prompt lookup drafts what followed the last
    ``A B``, which is always wrong (free-form text that repeats short phrases)."""
    a, b = 10 + 2 * int(rid[1:]), 11 + 2 * int(rid[1:])
    out: list[int] = []
    x = 500 + 100 * int(rid[1:])
    while len(out) < length:
        out += [a, b, x]
        x += 1
    return out[:length]


def scripted_run(scripts, prompts, step_seconds, max_new_tokens, **overrides):
    """Run every request; return (tokens per request, the run's scripted seconds, info)."""
    sched = create_spec_scheduler(scripts, **overrides)
    sched.worker.step_seconds = step_seconds
    reqs = [make_req(rid, prompts[rid], max_new_tokens=max_new_tokens, ignore_eos=True) for rid in scripts]
    result = run_to_completion(sched, reqs)
    assert sched.worker.kv_errors == []
    return result.tokens, sched.worker.clock.now, sched.get_info()


def bandwidth_bound(rows: int) -> float:
    return 0.020 + 0.002 * rows


def compute_bound(rows: int) -> float:
    return 0.001 + 0.010 * rows


@pytest.mark.parametrize("workload, step_seconds, on_vs_off, switch_off_vs_off", [
    # Copy-heavy, rows nearly cheap: drafting wins, with the switch as much as without it.
    ("copy", bandwidth_bound, (0.0, 0.85), (0.0, 0.85)),
    # Drafts always wrong: the switch stops them (within 10 % of off); without it, a loss.
    ("misleading", bandwidth_bound, (0.0, 1.10), (1.2, 9.0)),
    # Every row costs a step's worth: the switch keeps (nearly) every step plain.
    ("copy", compute_bound, (0.0, 1.05), (1.08, 9.0)),
])
def test_the_switch_never_loses_much_and_keeps_outputs(workload, step_seconds, on_vs_off, switch_off_vs_off):
    """Scripted seconds of speculation on (cost-aware switch), off, and on without the switch
    (``speculative_adaptive=False``): the same tokens; on / off within ``on_vs_off``,
    switch-off / off within ``switch_off_vs_off``."""
    make = copy_script if workload == "copy" else misleading_script
    scripts = {rid: make(rid) for rid in RIDS}
    prompts = {rid: (prompt_for(rid) if workload == "copy" else scripts[rid][:7]) for rid in RIDS}
    off_tokens, off_s, _ = scripted_run(scripts, prompts, step_seconds, 50, speculative_algorithm=None)
    on_tokens, on_s, info = scripted_run(scripts, prompts, step_seconds, 50)
    raw_tokens, raw_s, _ = scripted_run(scripts, prompts, step_seconds, 50, speculative_adaptive=False)
    want = {rid: scripts[rid][:50] for rid in RIDS}
    assert off_tokens == on_tokens == raw_tokens == want
    assert on_vs_off[0] <= on_s / off_s <= on_vs_off[1], on_s / off_s
    assert switch_off_vs_off[0] <= raw_s / off_s <= switch_off_vs_off[1], raw_s / off_s
    assert on_s <= 1.05 * raw_s or on_s <= 1.05 * off_s  # never much worse than the better of the two
    if on_vs_off[1] < 1:
        assert info["spec_num_accepted_tokens"] > 0
    else:
        assert info["spec_num_cost_skipped_batches"] > 0



def phased_script(rid: str, length: int = 90) -> tuple[list[int], list[int]]:
    """(prompt, output): requests r0-r2 copy 6-token phrases of their prompts throughout;
    r3-r5 first repeat ``A B x`` triples (``A B`` recurs with a new ``x``: every draft, a
    2-token match, wrong), then copy their phrases too."""
    i = int(rid[1:])
    phrases = [[1000 + 100 * i + 10 * p + j for j in range(6)] for p in range(3)]
    prompt = [t for phrase in phrases for t in phrase] + [7, 8]
    out: list[int] = []
    x = 5000 + 100 * i
    while i >= 3 and len(out) < 30:
        out += [10 + 2 * i, 11 + 2 * i, x]
        x += 1
    c = 0
    while len(out) < length:
        out += phrases[c % 3]
        c += 1
    return prompt, out[:length]


def test_drafts_by_source_under_scripted_time():
    """r3-r5's drafts are all wrong for their first 30 tokens, then they copy as r0-r2 do all
    along; the switch values each draft at its source's acceptance. Scripted time: faster
    than off and than verifying every draft, the same tokens throughout, the late copiers'
    drafts taken once they copy; the long matches' estimate ends high."""
    scripts, prompts = {}, {}
    for rid in RIDS:
        prompts[rid], scripts[rid] = phased_script(rid)

    def step_seconds(rows: int) -> float:
        return 0.010 + 0.003 * rows

    off_tokens, off_s, _ = scripted_run(scripts, prompts, step_seconds, 80, speculative_algorithm=None)
    sched = create_spec_scheduler(scripts)
    sched.worker.step_seconds = step_seconds
    reqs = [make_req(rid, prompts[rid], max_new_tokens=80, ignore_eos=True) for rid in scripts]
    on = run_to_completion(sched, reqs)
    on_s = sched.worker.clock.now
    raw_tokens, raw_s, _ = scripted_run(scripts, prompts, step_seconds, 80, speculative_adaptive=False)
    assert off_tokens == on.tokens == raw_tokens == {rid: scripts[rid][:80] for rid in RIDS}
    rates = {k: round(v.rate, 2) for k, v in sched.speculator.sources.items()}
    assert rates["prompt:4"] > 0.8 and rates["prompt:2"] < rates["prompt:4"], rates
    accepted = {rid: outs[-1].spec_accepted_tokens for rid, outs in on.outputs.items()}
    assert all(accepted[rid] >= 30 for rid in RIDS[3:]), accepted
    assert on_s < 0.8 * off_s and on_s < 0.95 * raw_s, (on_s / off_s, on_s / raw_s)


def test_plan_values_each_draft_at_its_sources_acceptance():
    """Two requests with measured step costs (an extra row is worth drafting above 0.4
    tokens): one with a bad record of its own whose draft comes from a source whose drafts
    were accepted (drafted in full), one with a good record whose draft comes from a source
    whose drafts were rejected (not drafted). The source's estimate decides, not the
    request's (on bench_spec's workloads a request's record told nothing within a source)."""
    from types import SimpleNamespace

    from arborlm.runtime.config import SpeculativeConfig
    from arborlm.runtime.speculative.scheduling import SpecReqState, Speculator

    spec = Speculator(SpeculativeConfig(speculative_algorithm="NGRAM"), context_length=4096)
    policy = spec.policy
    for kind, points in ((policy.DECODE, [(2, 0.020)] * 3), (policy.VERIFY, [(2, 0.020)] + [(n, 0.020 + 0.004 * (n - 2))
                                                                                         for n in (4, 8, 14, 4, 8, 14)])):
        policy.start_step(kind, points[0][0])
        policy.end_step()  # the first step of a kind is a warm-up, not counted
        for rows, seconds in points:
            policy.costs[kind].observe(rows, seconds)
    policy.steps_since = {policy.DECODE: 0, policy.VERIFY: 0}
    for source, (accepted, tried) in {"prompt:4": (6, 6), "prompt:2": (0, 1)}.items():
        for _ in range(20):
            spec._source_estimate(source).observe(tried if source == "prompt:4" else 6, accepted)

    def req(own_accepted: int, source: str):
        acceptance = policy.new_estimate()
        for _ in range(10):
            acceptance.observe(6, own_accepted)
        return SimpleNamespace(spec_state=SpecReqState(None, acceptance, source=source))

    reqs = [req(0, "prompt:4"), req(6, "prompt:2")]
    assert reqs[0].spec_state.acceptance.rate < 0.1 < 0.9 < reqs[1].spec_state.acceptance.rate
    assert spec.plan(reqs, [6, 6]) == [6, 0]
    assert spec.plan(reqs, [0, 6]) == [0, 0] and spec.stats.num_cost_skipped_batches == 1
