"""Constrained decoding with llguidance: one matcher per sequence, as a logits processor.

The tokenizer conversion is done once per model load. Each constrained
sequence gets its own ``LLMatcher``; unconstrained sequences in the same
batch have no processor and pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import copy
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxd.errors import InvalidRequest

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# Tokens the context may change by between two calls (speculative drafts, rejected).
ROLLBACK_WINDOW = 64


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer (built lazily; ~1 s for big vocabularies)."""

    def __init__(self, backend_tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        # A ``tokenizers.Tokenizer`` (a fast HF tokenizer's public ``backend_tokenizer``).
        self._backend = backend_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._ll: Any = None

    @property
    def ll(self) -> Any:
        if self._ll is None:
            from llguidance import LLTokenizer

            # What llguidance.hf.from_tokenizer does, from the backend tokenizer: its
            # JSON (added tokens included) without padding or truncation.
            backend = copy(self._backend)
            backend.no_padding()
            backend.no_truncation()
            self._ll = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                   eos_token=self.eos_ids[0] if len(self.eos_ids) == 1
                                   else self.eos_ids)
        return self._ll

    def validate(self, grammar: str, param: str = "response_format") -> None:
        """400 with llguidance's message when the grammar does not compile."""
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_error:
            raise InvalidRequest(f"Invalid constraint: {messages[0] if messages else 'error'}",
                                 param=param)
        # A grammar can compile and still admit nothing: the matcher fails at once.
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        matcher.compute_bitmask()
        if matcher.is_error():
            reason = matcher.get_error().splitlines()[0] if matcher.get_error() else "error"
            raise InvalidRequest(f"Invalid constraint: it admits no output ({reason}).",
                                 param=param)

    def processor(self, grammar: str) -> LogitsProcessor:
        """A fresh logits processor that masks every token the grammar forbids."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll, grammar, log_level=0)
        vocab = self.vocab_size
        base = [-1]  # context length at the first call (the prompt)
        seen: list[int] = []  # output tokens the matcher consumed

        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            n = int(tokens.shape[0]) if tokens.ndim else 0
            if base[0] < 0:
                base[0] = n
            if not _follow(matcher, seen, tokens, base[0], n):
                return logits  # this position follows a draft the grammar refuses: never kept
            if matcher.is_error():
                raise RuntimeError(f"constraint failed: {matcher.get_error()}")
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
            width = logits.shape[-1]
            if width > allowed.size:
                allowed = np.concatenate([allowed, np.zeros(width - allowed.size, bool)])
            mask = mx.array(allowed[:width])
            return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))

        return process


def _follow(matcher: Any, seen: list[int], tokens: mx.array, base: int, n: int) -> bool:
    """Bring ``matcher`` to the output in ``tokens[base:n]``; False if the grammar refuses it.

    Speculative decoding shows the processor contexts with drafted tokens that can
    be rejected, so the context may shrink or change in its last few tokens: the
    matcher rolls back to where it agrees with the context, then consumes the rest.
    """
    start = max(0, min(len(seen), n - base) - ROLLBACK_WINDOW)  # agreed before this
    tail = cast(list[int], tokens[base + start:n].tolist()) if n > base + start else []
    agree = start
    for tok in tail:
        if agree >= len(seen) or seen[agree] != tok:
            break
        agree += 1
    if agree < len(seen):
        matcher.rollback(len(seen) - agree)
        del seen[agree:]
    for tok in tail[agree - start:]:
        if matcher.try_consume_tokens([int(tok)]) != 1:
            return False
        seen.append(int(tok))
    return True
