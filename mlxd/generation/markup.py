"""Find marker strings in a text stream that arrives in arbitrary pieces.

A marker may be split across any number of chunks (tokens), so text that
could be the start of a marker is held back until it is known not to be.
This is the one primitive behind stop strings, reasoning and tool markup.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_marker_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class MarkerScanner:
    """Splits streamed text at the first occurrence of any of ``markers``."""

    def __init__(self, markers: Sequence[str] = ()) -> None:
        self.markers = [m for m in markers if m]
        self._pending = ""

    def set_markers(self, markers: Sequence[str]) -> None:
        self.markers = [m for m in markers if m]

    def feed(self, text: str) -> tuple[str, str | None, str]:
        """Consume ``text``.

        Returns ``(safe_text, marker, rest)``: ``safe_text`` can be emitted;
        ``marker`` is the first marker found (None if none) and ``rest`` the
        text after it, which the caller feeds again in its new state.
        """
        buf = self._pending + text
        self._pending = ""
        first: tuple[int, str] | None = None
        for marker in self.markers:
            at = buf.find(marker)
            if at >= 0 and (first is None or at < first[0] or
                            (at == first[0] and len(marker) > len(first[1]))):
                first = (at, marker)
        if first is not None:
            at, marker = first
            return buf[:at], marker, buf[at + len(marker):]
        hold = partial_marker_suffix(buf, self.markers)
        if hold:
            self._pending = buf[-hold:]
            return buf[:-hold], None, ""
        return buf, None, ""

    def flush(self) -> str:
        """Return held-back text at the end of the stream."""
        out, self._pending = self._pending, ""
        return out

    @property
    def pending(self) -> str:
        return self._pending
