"""Stop strings: end a sequence when its text contains one, never emit past it."""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.generation.markup import MarkerScanner


@dataclass
class StopResult:
    text: str
    stopped: bool = False
    stop_sequence: str | None = None


class StopStringMatcher:
    """Holds back text that may begin a stop string; truncates at a match."""

    def __init__(self, stop: list[str], include_in_output: bool = False) -> None:
        self._scanner = MarkerScanner(stop)
        self._include = include_in_output
        self.stopped = False

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        safe, marker, _rest = self._scanner.feed(text)
        if marker is None:
            return StopResult(safe)
        self.stopped = True
        return StopResult(safe + (marker if self._include else ""), True, marker)

    def flush(self) -> str:
        return "" if self.stopped else self._scanner.flush()
