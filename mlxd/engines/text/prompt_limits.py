"""Checks on what a client sends before it reaches a tokenizer or MLX.

Token ids from a client (prompt ids, ``logit_bias`` keys, ``stop_token_ids``)
end up as indices into MLX arrays, and MLX does not bounds-check indices on
CPU: an id outside the logits reads or writes outside the array and can kill
the process. Every such id is checked against ``vocab_bound`` first.

Long text is refused by a character bound before any tokenisation, and text
near the bound is counted chunk by chunk with an early stop, so refusing an
oversized prompt costs memory and time in proportion to the model's context,
not to the size of the input (a tokenizer's full encoding of a 20 MB prompt
takes gigabytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mlx.core as mx

from mlxd.errors import InvalidRequest

# Text longer than this is counted in chunks before it is tokenised whole.
CHUNK_CHARS = 65_536
# Cutting text can split what would be one token into a few (and a tokenizer may
# add a prefix token to each piece), so each chunk's count is reduced by this
# much: the chunked total never exceeds the true count.
CHUNK_SLACK_TOKENS = 4
# Normalisers can drop characters (control and zero-width characters), so the
# character bound allows this many times the longest token per context token.
CHAR_BOUND_FACTOR = 2


def vocab_bound(model: Any, config: dict[str, Any], fallback: int) -> int:
    """How many token ids the model can take: its logits' width, never more than the
    config's ``vocab_size`` (the tokenizer's length may differ from both)."""
    bounds = []
    width = _logits_width(model)
    if width:
        bounds.append(width)
    declared = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(declared, int) and declared > 0:
        bounds.append(declared)
    return min(bounds) if bounds else fallback


def _logits_width(model: Any) -> int | None:
    """The last dimension of the model's output for one token. MLX is lazy: the
    shape is known without evaluating the graph, so this costs no compute."""
    try:
        out = model(mx.array([[0]]))
        return int(out.shape[-1]) if isinstance(out, mx.array) else None
    except Exception:
        return None


def embedding_rows(model: Any, config: dict[str, Any], fallback: int) -> int:
    """Token ids an encoder's word-embedding table can index."""
    bounds = []
    modules = model.named_modules() if hasattr(model, "named_modules") else []
    for name, module in modules:
        weight = getattr(module, "weight", None)
        if name.endswith(("word_embeddings", "embed_tokens", "tok_embeddings")) and \
                weight is not None:
            bounds.append(int(weight.shape[0]))
    declared = config.get("vocab_size")
    if isinstance(declared, int) and declared > 0:
        bounds.append(declared)
    return min(bounds) if bounds else fallback


def check_token_ids(ids: Iterable[int], bound: int, param: str) -> None:
    """400 naming ``param`` for any id outside ``[0, bound)`` (negative ids included)."""
    for t in ids:
        if not 0 <= t < bound:
            raise InvalidRequest(f"{param}: token ids must be in [0, {bound}), this model's "
                                 f"vocabulary; got {t}.", param=param)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: its longest vocabulary entry."""
    try:
        return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    except Exception:
        return 64  # no vocabulary to read: a generous guess


def char_bound(tokens: int, token_chars: int) -> int:
    """Characters that ``tokens`` tokens can never exceed (with headroom)."""
    return tokens * token_chars * CHAR_BOUND_FACTOR


def text_chars(value: Any) -> int:
    """Characters in every string inside ``value`` (messages, content parts, tools)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


def reaches(encode: Callable[[str], list[int]], text: str, limit: int) -> bool:
    """Whether ``text`` certainly has at least ``limit`` tokens.

    Tokenises one chunk at a time and stops as soon as the answer is known, so
    the work is bounded by ``limit`` tokens, not by the length of ``text``.
    """
    count = 0
    start = 0
    while start < len(text):
        end = _cut(text, start + CHUNK_CHARS)
        count += max(0, len(encode(text[start:end])) - CHUNK_SLACK_TOKENS)
        if count >= limit:
            return True
        start = end
    return False


def count_chunked(encode: Callable[[str], list[int]], text: str) -> int:
    """Tokens of ``text`` counted one chunk at a time (memory bounded by a chunk); never
    more than the true count (each chunk's count is reduced by the split slack)."""
    count = 0
    start = 0
    while start < len(text):
        end = _cut(text, start + CHUNK_CHARS)
        count += max(0, len(encode(text[start:end])) - CHUNK_SLACK_TOKENS)
        start = end
    return count


def _cut(text: str, end: int) -> int:
    """A chunk end at whitespace near ``end`` where there is one (fewer split tokens)."""
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", end - 1024, end)
    return space + 1 if space > 0 else end


# Characters handed to a tokenizer in one call when encoding many texts: an HF
# tokenizer holds about 160 bytes per character of a call's input at its peak.
GROUP_CHARS = 1 << 20


def char_groups(texts: list[str], budget: int = GROUP_CHARS) -> Iterator[list[str]]:
    """Consecutive runs of ``texts`` of at most ``budget`` characters (one text at least)."""
    group: list[str] = []
    size = 0
    for text in texts:
        if group and size + len(text) > budget:
            yield group
            group, size = [], 0
        group.append(text)
        size += len(text)
    if group:
        yield group
