"""Bytes a request holds outside any engine (decoded images, audio samples), in the budget.

A vision request's decoded images and a transcription's samples are real memory
that no model's estimate covers; twenty of them at once filled gigabytes past the
budget. ``TransientMemory.hold`` counts such bytes beside the loaded models: a
request whose bytes do not fit waits, as a load does, until models unload or
other requests release theirs (``--contention fail``: a 503 at once), up to the
manager's wait timeout. One request is always let through when no other holds
any, so a request within the per-request limits never waits for itself, and a
load never waits for transient bytes (the request holding them may be the one
that needs the load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from mlxd.errors import Overloaded
from mlxd.models.memory import format_bytes


class BudgetPolicy(Protocol):
    """What a hold reads of the manager's policy (``ManagerPolicy``)."""

    budget_bytes: int
    wait_timeout_s: float
    contention: str


class TransientHold:
    """``nbytes`` counted in the budget until ``release`` (idempotent)."""

    def __init__(self, memory: TransientMemory, nbytes: int) -> None:
        self._memory = memory
        self.nbytes = nbytes
        self._released = False

    async def release(self) -> None:
        if not self._released:
            self._released = True
            await self._memory._give_back(self.nbytes)


class TransientMemory:
    """The transient bytes of requests in flight, under one manager's budget and lock."""

    def __init__(self, changed: asyncio.Condition, policy: BudgetPolicy,
                 used_bytes: Callable[[], int], closing: Callable[[], bool]) -> None:
        """``changed``: the manager's condition (its lock guards the budget);
        ``used_bytes``: what models hold; ``closing``: the server is shutting down."""
        self._changed = changed
        self._policy = policy
        self._used_bytes = used_bytes
        self._closing = closing
        self.held = 0  # bytes held by requests now
        self.holders = 0

    async def hold(self, nbytes: int, what: str) -> TransientHold:
        """Count ``nbytes`` (``what`` names them in a refusal) once they fit; see above."""
        policy = self._policy
        deadline = time.monotonic() + policy.wait_timeout_s
        async with self._changed:
            while True:
                if self._closing():
                    raise Overloaded("The server is shutting down.", retry_after=5)
                used = self._used_bytes()
                if not self.holders or used + self.held + nbytes <= policy.budget_bytes:
                    self.held += nbytes
                    self.holders += 1
                    return TransientHold(self, nbytes)
                message = (f"Memory budget {format_bytes(policy.budget_bytes)} is held by "
                           f"models ({format_bytes(used)}) and {self.holders} other "
                           f"request(s) ({format_bytes(self.held)}); {what} need "
                           f"{format_bytes(nbytes)}.")
                remaining = deadline - time.monotonic()
                if policy.contention == "fail" or remaining <= 0:
                    raise Overloaded(message, retry_after=5, code="memory_budget_full")
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                except asyncio.TimeoutError:
                    pass

    async def _give_back(self, nbytes: int) -> None:
        async with self._changed:
            self.held = max(0, self.held - nbytes)
            self.holders = max(0, self.holders - 1)
            self._changed.notify_all()
