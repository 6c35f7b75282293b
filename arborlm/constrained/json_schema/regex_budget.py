"""Matching a user's regular expressions within a time budget.

JSON Schema's ``pattern`` and ``patternProperties`` are the user's regexes,
and the strings they are matched against are the user's too (``enum``
values, property names) or the model's (a finished output). Python's `re`
backtracks: ``^(a+)+$`` against 26 ``a`` and a ``!`` takes seconds, twice as
long per added character, and holds the GIL throughout, so a thread does not
help and the HTTP process stops answering (``/health`` included) while it
runs. Every search of a user pattern while preparing a schema
(`prepare_json_schema`) or validating an output (`validate_json_output`)
goes through a `RegexBudget` instead: the ``regex`` module (the same syntax
as `re` in its default VERSION0 mode; a dependency of ``transformers``) with
its ``timeout``, and ``concurrent=True``, which releases the GIL while it
matches. All searches of one job share one budget of matching time (the
job's other work, such as importing xgrammar on the first schema, does not
count), so a schema cannot spend it a thousand times over; past it the
search raises `PatternTimeout`, which fails that request alone.

Measured (this 2-core machine, ``^(a+)+$`` against ``"a" * n + "!"``): `re`
takes 0.08 s at n = 20, 0.16 s at 22, 0.57 s at 24, doubling per
character; ``regex`` answers in under 1 ms (it prunes that repeat), and on
``(a|aa)+$``, which it cannot prune, stops at the timeout while another
thread keeps running (largest gap 14 ms).
"""

from __future__ import annotations

import time

import regex

from arborlm.constrained.keys import GrammarError

# Budget of all the regex searches of one `prepare_json_schema` call, in seconds. Real schemas
# spend microseconds; it runs in a worker thread of the front with the GIL released.
PREPARE_REGEX_BUDGET_S = 0.5
# Budget of all the regex searches of one output's validation, in seconds. The front validates
# on its event loop, which must keep answering (``/health`` within 100 ms).
OUTPUT_REGEX_BUDGET_S = 0.05


class PatternTimeout(GrammarError):
    """Matching a user's pattern outlived its job's `RegexBudget`.

    Parameters
    ----------
    pattern:
        The pattern whose search ran out of time.
    budget_s:
        The job's whole budget, in seconds.
    """

    def __init__(self, pattern: str, budget_s: float):
        super().__init__(
            f"json_schema: matching the pattern {pattern!r} took longer than the {budget_s:g} s allowed "
            "(a regular expression that backtracks, such as a nested repeat like (a+)+); "
            "write it without nested or overlapping repeats",
            "json_schema",
        )
        self.pattern = pattern
        self.budget_s = budget_s


class RegexBudget:
    """The time one job may spend matching user patterns, shared by all its searches.

    Parameters
    ----------
    budget_s:
        Seconds of matching allowed in all.

    `spent_s` is the matching time used so far. One job, one thread: make a
    budget per `prepare_json_schema` call or per validated output.
    """

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.spent_s = 0.0

    def search(self, pattern: str, text: str) -> bool:
        """Whether ``pattern`` matches anywhere in ``text`` (`re.search` semantics).

        Raises
        ------
        PatternTimeout
            The budget ran out before or during the search.
        GrammarError
            The ``regex`` module cannot compile ``pattern`` (which `re`
            compiled: the schema was checked already).
        """
        return self._match(regex.search, pattern, text)

    def fullmatch(self, pattern: str, text: str) -> bool:
        """Whether ``pattern`` matches the whole of ``text`` (`re.fullmatch` semantics); raises as `search`."""
        return self._match(regex.fullmatch, pattern, text)

    def _match(self, match, pattern: str, text: str) -> bool:
        remaining = self.budget_s - self.spent_s
        if remaining <= 0:
            raise PatternTimeout(pattern, self.budget_s)
        start = time.perf_counter()
        try:
            return match(pattern, text, timeout=remaining, concurrent=True) is not None
        except TimeoutError:
            # The budget is spent whatever the clocks say: regex's timer may stop a hair
            # before ours, and a later search must not get that crumb.
            self.spent_s = self.budget_s
            raise PatternTimeout(pattern, self.budget_s) from None
        except regex.error as e:
            raise GrammarError(f"json_schema: the pattern {pattern!r} cannot be matched: {e}", "json_schema") from e
        finally:
            if self.spent_s < self.budget_s:  # a timeout already set it to the whole budget
                self.spent_s += time.perf_counter() - start
