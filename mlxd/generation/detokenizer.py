"""Incremental detokenization that is exact for any Hugging Face tokenizer.

Decoding token by token loses information (SentencePiece drops the leading
space of a sequence; byte-level BPE splits UTF-8 characters across tokens).
So each step decodes a short window of recent tokens twice, with and without
the new token, and emits the difference once it is not an incomplete
character. The window is seeded with the end of the prompt so the first
generated token gets the spacing it has in context.
"""

from __future__ import annotations

from typing import Any, Protocol

_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Feeds ``last_segment`` with the new text of each token (mlx-lm's interface)."""

    def __init__(self, tokenizer: _Decoder, prompt_tail: list[int] | None = None) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list((prompt_tail or [])[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.last_segment = ""
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def add_token(self, token: int) -> None:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.last_segment = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
        else:
            self.last_segment = ""
        self.text += self.last_segment

    def finalize(self) -> None:
        """Flush whatever is left (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self.last_segment = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += self.last_segment
