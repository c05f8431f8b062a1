"""Scripted token streams for pipeline tests: text cut into arbitrary token pieces."""

from __future__ import annotations

from typing import Any


class PieceTokenizer:
    """A tokenizer whose token i decodes to ``pieces[i]`` (decode = concatenation)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def add(self, piece: str) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(self.pieces[i] for i in ids)


def split_all_ways(text: str, max_cuts: int = 2) -> list[list[str]]:
    """``text`` cut at every position (1 cut) and every pair of positions (2 cuts)."""
    n = len(text)
    outs = [[text]]
    for i in range(1, n):
        outs.append([text[:i], text[i:]])
    if max_cuts >= 2:
        for i in range(1, n):
            for j in range(i + 1, n):
                outs.append([text[:i], text[i:j], text[j:]])
    return outs


def char_pieces(text: str) -> list[str]:
    return list(text)
