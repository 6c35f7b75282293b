"""A scripted grammar matcher for the drafting and verification tests."""

from __future__ import annotations

import abc


class HistoryMatcher(abc.ABC):
    """A matcher that takes token t when `allows(t)` says so and ends after a token `ends(t)`
    names; keeps the tokens it accepted (its history), so tests can check it ends as it began."""

    def __init__(self):
        self.history: list[int] = []

    @abc.abstractmethod
    def allows(self, t: int) -> bool:
        """Whether the matcher takes ``t`` in its current state."""

    def ends(self, t: int) -> bool:
        return False

    def accept_token(self, t: int) -> bool:
        if self.is_terminated() or not self.allows(t):
            return False
        self.history.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.history[len(self.history) - n :]

    def is_terminated(self) -> bool:
        return bool(self.history) and self.ends(self.history[-1])
