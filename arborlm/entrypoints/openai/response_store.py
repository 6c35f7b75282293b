"""The stored responses of `/v1/responses` (`store: true`), bounded, least recently used evicted first.

A stored response keeps its answer (what `GET /v1/responses/{id}` returns) and
its conversation as chat messages (what `previous_response_id` continues).
The store lives in the app's state (`app.state.responses`), in memory: a
restart forgets it, and an evicted or unknown id is a 404. It is used from the
server's event loop only, so it takes no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from arborlm.entrypoints.http_errors import APIError
from arborlm.entrypoints.openai.responses_input import Conversation

DEFAULT_MAX_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    """One response: its body and the conversation that produced it, its own output included."""

    body: dict[str, Any]
    conversation: Conversation


class ResponseStore:
    """Responses by id, at most `max_responses` of them (LRU eviction).

    Raises
    ------
    ValueError: `max_responses` below 1.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES):
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a response; the least recently used one goes when the store is full."""
        key = stored.body["id"]
        self._items[key] = stored
        self._items.move_to_end(key)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response `response_id`, now the most recently used.

        Raises
        ------
        APIError: 404 ``response_not_found`` (naming `param`) for an id never stored, deleted or evicted.
        """
        stored = self._items.get(response_id)
        if stored is None:
            raise not_found(response_id, param)
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Forget a response.

        Raises
        ------
        APIError: 404 ``response_not_found``.
        """
        if self._items.pop(response_id, None) is None:
            raise not_found(response_id, None)


def not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored (never stored with store: true, "
                    "deleted, or evicted: this server keeps the most recent ones only)",
                    param=param, code="response_not_found")
