"""The cost-aware switch of speculation: draft only where the expected tokens per second win.

Place in the request path: `Speculator.propose_drafts` (scheduling.py) asks
`AdaptivePolicy.plan` how many draft tokens each request of a decode step may
take, and times the step it built (from the proposal to the end of the
scheduler step, `StepTimer`); the verify results update each request's
acceptance estimate. The policy only decides whether and how much to draft;
outputs stay those of speculation off.

The rule is SmartSpec's goodput (Liu et al. 2024, "Optimizing Speculative
Decoding for Serving Large Language Models Using Goodput", arXiv 2406.14066),
over this engine's own measurements:

* Per draft, a token acceptance rate ``a`` (an exponentially weighted
  estimate, `AcceptanceEstimate`): an n-gram draft's is that of its source,
  shared by every request (`ngram.NgramDrafter.propose`: a suffix of
  4 tokens matched in the request's own tokens, 2 tokens, a value looked up
  on the prompt's text ...), which predicts acceptance far better than the
  request's own history; a draft model's is its request's. Taking draft tokens ``1..k`` it expects
  ``1 + a + a^2 + ... + a^k`` tokens from the verify step (each draft token is
  kept only if all before it were; Leviathan et al. 2023), so the j-th draft
  token is worth ``a^j`` tokens.
* Per kind of step, its wall time as a linear function of its rows
  (`StepCostModel`): a plain decode step of ``B`` requests takes ``T_d(B)``, a
  verify step of ``N`` rows (``B`` plus the draft tokens) ``T_v(N)``.
* The step drafts the ``m`` draft tokens of highest worth (over all requests)
  that maximise ``(B + sum of their worth) / T_v(B + m)``, and drafts nothing
  when ``B / T_d(B)`` is at least as high.

The first step of each kind is not counted (it carries one-time costs:
allocations, first calls into kernels). Before any step is timed the step
drafts (to time a verify step); before any plain decode step is timed the step
decodes plainly (to time that). Both kinds are re-timed now and then: after
``explore_every`` steps without a plain decode step, the next one decodes
plainly, and after as many without a verify step, the next one with drafts
verifies them all, so neither estimate goes stale because the policy stopped
choosing its kind (a slow step seen once would otherwise keep drafting off). A source (or
request) whose drafts are rejected stops drafting; while it does not draft its estimate
drifts back toward the prior (`AcceptanceEstimate.forget`), so drafts that start to be
accepted later are tried again, when the batch's cost allows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdaptiveConfig:
    """Constants of the switch (dimensionless; decays are the weight kept per observation).

    prior_rate, prior_weight: a new request's (draft source's) acceptance rate and how
        many draft tokens' worth of evidence it counts as.
    rate_decay: weight a request's acceptance estimate keeps per verify step of its request.
    source_decay: weight a draft source's estimate (shared by every request's drafts
        of that source, several per step) keeps per verify result it counts.
    forget: per decode step a request (a source) is not verified, the share of its
        evidence kept (the rest returns to the prior).
    cost_decay: weight a step-time model keeps per step timed.
    explore_every: after this many timed steps without a plain decode step (a verify
        step), the next step that may be one is (so ``T_d`` and ``T_v`` stay measured).
    """

    prior_rate: float = 0.6
    prior_weight: float = 1.0
    rate_decay: float = 0.7
    source_decay: float = 0.95
    forget: float = 0.95
    cost_decay: float = 0.9
    explore_every: int = 16

    def __post_init__(self):
        for name in ("prior_rate", "rate_decay", "source_decay", "forget", "cost_decay"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name}={value!r} must be in (0, 1)")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight={self.prior_weight!r} must be > 0")
        if self.explore_every < 1:
            raise ValueError(f"explore_every={self.explore_every!r} must be >= 1")


@dataclass
class AcceptanceEstimate:
    """One request's draft token acceptance rate: accepted / tried, exponentially weighted.

    A verify step with a draft of ``k`` tokens of which the first ``n`` were
    accepted tried ``n + 1`` tokens (the first rejected one included) unless all
    ``k`` were accepted: the maximum-likelihood count for the geometric model.
    """

    config: AdaptiveConfig
    decay: float | None = None  # weight kept per observation (None: config.rate_decay)
    accepted: float = field(init=False)
    tried: float = field(init=False)

    def __post_init__(self):
        if self.decay is None:
            self.decay = self.config.rate_decay
        self.accepted = self.config.prior_rate * self.config.prior_weight
        self.tried = self.config.prior_weight

    @property
    def rate(self) -> float:
        """The estimated probability that a draft token is accepted, in (0, 1)."""
        return self.accepted / self.tried

    def observe(self, draft_len: int, num_accepted: int) -> None:
        """Count one verify step: ``num_accepted`` of ``draft_len`` draft tokens kept."""
        if draft_len <= 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.tried = self.decay * self.tried + min(draft_len, num_accepted + 1)

    def forget(self) -> None:
        """Move a step's share of the evidence back to the prior (a step without verifying)."""
        keep, cfg = self.config.forget, self.config
        self.accepted = keep * self.accepted + (1 - keep) * cfg.prior_rate * cfg.prior_weight
        self.tried = keep * self.tried + (1 - keep) * cfg.prior_weight


class StepCostModel:
    """Wall time of one kind of step as ``t = c0 + c1 * rows``, fitted by exponentially weighted
    least squares (``cost_decay`` per observation; ``c1 >= 0``: more rows never cost less).

    With every observation at (nearly) one row count the slope is not identified
    and the estimate is their weighted mean time, whatever ``rows``.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self._sums = [0.0] * 5  # sum of w, w*n, w*n^2, w*t, w*n*t

    @property
    def empty(self) -> bool:
        return self._sums[0] == 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """Add one timed step of ``rows`` rows that took ``seconds``."""
        n, t = float(rows), float(seconds)
        self._sums = [self.decay * s + x for s, x in zip(self._sums, (1.0, n, n * n, t, n * t))]

    def estimate(self, rows: int) -> float | None:
        """Expected seconds of a step of ``rows`` rows; None before any observation."""
        w, sn, snn, st, snt = self._sums
        if w == 0.0:
            return None
        mean_n, mean_t = sn / w, st / w
        var_n = snn / w - mean_n * mean_n
        slope = (snt / w - mean_n * mean_t) / var_n if var_n > 0.25 else 0.0
        slope = max(slope, 0.0)
        return max(mean_t + slope * (rows - mean_n), 0.0)


class StepTimer:
    """Times one scheduler step from its proposal (`start`) to its end (`stop`) with ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._pending: tuple[str, int, float] | None = None

    def start(self, kind: str, rows: int) -> None:
        self._pending = (kind, rows, self.clock())

    def retag(self, kind: str, rows: int) -> None:
        """Say what the started step turned out to be (its start time stays)."""
        if self._pending is not None:
            self._pending = (kind, rows, self._pending[2])

    def cancel(self) -> None:
        """Drop the started step (a failed one is no measure of the cost)."""
        self._pending = None

    def stop(self) -> tuple[str, int, float] | None:
        """(kind, rows, seconds) of the step started last, or None when none was started."""
        if self._pending is None:
            return None
        kind, rows, t0 = self._pending
        self._pending = None
        return kind, rows, self.clock() - t0


class AdaptivePolicy:
    """Decides each decode step's draft lengths from measured step costs (module docstring).

    Parameters
    ----------
    config: the switch's constants.
    clock: seconds, monotonic (`time.perf_counter`; tests inject a scripted clock).
    """

    DECODE, VERIFY = "decode", "verify"

    def __init__(self, config: AdaptiveConfig | None = None, clock: Callable[[], float] = time.perf_counter):
        self.config = config or AdaptiveConfig()
        self.costs = {kind: StepCostModel(self.config.cost_decay) for kind in (self.DECODE, self.VERIFY)}
        self.timer = StepTimer(clock)
        self.steps_since = {self.DECODE: 0, self.VERIFY: 0}  # timed steps since the last of each kind
        self._seen: set[str] = set()  # kinds whose first (warm-up) step went by

    def new_estimate(self) -> AcceptanceEstimate:
        """A new request's acceptance estimate (the prior)."""
        return AcceptanceEstimate(self.config)

    def new_source_estimate(self) -> AcceptanceEstimate:
        """A draft source's acceptance estimate (the prior; ``source_decay`` per observation)."""
        return AcceptanceEstimate(self.config, decay=self.config.source_decay)

    def plan(self, max_lens: Sequence[int], rates: Sequence[float]) -> list[int]:
        """The draft length of each request of a decode step (0: it does not draft).

        Sampled requests are planned like greedy ones: a draft never changes which token a
        seed draws (`verify.rejection_sample` draws each emitted token as a plain decode
        step would), so their drafts may depend on the batch and the clock.

        Parameters
        ----------
        max_lens: per request, the longest draft it has or may take (tokens).
        rates: per request, its draft's estimated acceptance rate in (0, 1).

        Returns
        -------
        list[int]
            ``k_i <= max_lens[i]``; all 0 when drafting does not raise the expected tokens
            per second.
        """
        batch = len(max_lens)
        lens = [0] * batch
        worth = sorted(((rates[i] ** j, i) for i, k in enumerate(max_lens) for j in range(1, k + 1)), reverse=True)
        if not worth:
            return lens
        decode, verify = self.costs[self.DECODE], self.costs[self.VERIFY]
        whole = list(max_lens)  # every draft in full
        if decode.empty and verify.empty:
            return whole  # nothing timed: try it
        if decode.empty or self.steps_since[self.DECODE] >= self.config.explore_every:
            return lens  # time a plain decode step
        if verify.empty or self.steps_since[self.VERIFY] >= self.config.explore_every:
            return whole  # time a verify step
        plain = decode.estimate(batch)
        tokens = float(batch)
        best_m, best = 0, tokens / plain if plain > 0 else 0.0
        for m, (value, _) in enumerate(worth, start=1):
            tokens += value
            cost = self._verify_cost(batch + m, plain)
            if cost > 0 and tokens / cost > best:
                best_m, best = m, tokens / cost
        for _, i in worth[:best_m]:
            lens[i] += 1
        return lens

    def _verify_cost(self, rows: int, plain: float) -> float:
        """T_v(rows); before any verify step is timed, the plain decode step's time."""
        cost = self.costs[self.VERIFY].estimate(rows)
        return plain if cost is None else cost

    def start_step(self, kind: str, rows: int) -> None:
        """The decode step just planned (``kind`` DECODE or VERIFY, its rows) starts now."""
        self.timer.start(kind, rows)

    def end_step(self) -> None:
        """The scheduler step ended: add its time to its kind's cost model (if it was planned here)."""
        timed = self.timer.stop()
        if timed is not None:
            kind, rows, seconds = timed
            for other in self.steps_since:
                self.steps_since[other] = 0 if other == kind else self.steps_since[other] + 1
            if kind in self._seen:
                self.costs[kind].observe(rows, seconds)
            self._seen.add(kind)
