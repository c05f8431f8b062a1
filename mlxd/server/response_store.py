"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Bounded by count and by bytes (the UTF-8 size of its JSON); the least
recently used response goes first. One store per app, ``ServerContext.response_store``
(sized by ``response_store_max`` / ``_bytes``); it is only touched from the
event loop, so it needs no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """The response as returned, and the conversation that led to it (without instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    nbytes: int


def _utf8_len(value: Any) -> int:
    """Bytes of ``value`` as UTF-8 JSON (characters would undercount CJK text or emoji 3-4x)."""
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))


class ResponseStore:
    """An LRU map of response id -> ``StoredResponse`` under a count and a byte limit."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max(0, max_items)
        self.max_bytes = max(0, max_bytes)
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._items

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (keyed by its ``id``); False if it alone exceeds the byte limit."""
        nbytes = _utf8_len(response) + _utf8_len(messages)
        if self.max_items == 0 or nbytes > self.max_bytes:
            return False
        self.delete(response["id"])
        self._items[response["id"]] = StoredResponse(response, messages, nbytes)
        self.nbytes += nbytes
        while len(self._items) > self.max_items or self.nbytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= evicted.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None if unknown or evicted."""
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.nbytes -= item.nbytes
        return True

