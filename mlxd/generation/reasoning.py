"""Reasoning parsers: which markers wrap a model's thinking, chosen by name or detected.

``--reasoning-parser NAME`` picks one; otherwise the tokenizer tells (mlx-lm
detects ``<think>``-style tokens in the vocabulary). Whether generation starts
inside the reasoning block is decided from the rendered prompt: templates such
as DeepSeek-R1's open ``<think>`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.generation.registry import NamedRegistry


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers around a model's reasoning (``start`` ... ``end``)."""

    name: str
    start: str
    end: str
    families: str

    def starts_inside(self, prompt_text: str) -> bool:
        """True when the prompt itself opened a reasoning block left unclosed."""
        tail = prompt_text.rstrip()
        at = tail.rfind(self.start)
        return at >= 0 and tail.find(self.end, at) < 0


REASONING_PARSERS: NamedRegistry[ReasoningFormat] = NamedRegistry("reasoning parser")
REASONING_PARSERS.add(ReasoningFormat("think", "<think>", "</think>",
                                      "any model using <think>...</think>"))
REASONING_PARSERS.add(ReasoningFormat("qwen3", "<think>", "</think>",
                                      "Qwen3, QwQ (enable_thinking via chat_template_kwargs)"))
REASONING_PARSERS.add(ReasoningFormat("deepseek_r1", "<think>", "</think>",
                                      "DeepSeek-R1 and its distills (template opens <think>)"))
REASONING_PARSERS.add(ReasoningFormat("longcat", "<longcat_think>", "</longcat_think>",
                                      "LongCat"))
REASONING_PARSERS.add(ReasoningFormat("think_tokens", "<|think:start|>", "<|think:end|>",
                                      "models with <|think:*|> tokens"))
REASONING_PARSERS.add(ReasoningFormat("gemma_channel", "<|channel>thought", "<channel|>",
                                      "Gemma 4 thought channel"))


def reasoning_format(
    name: str | None, detected: tuple[str, str] | None = None
) -> ReasoningFormat | None:
    """Resolve a ``--reasoning-parser`` name, or fall back to the tokenizer's markers.

    ``name="none"`` turns reasoning separation off. An unknown name raises
    ``ValueError`` listing the known ones.
    """
    if name == "none":
        return None
    if name:
        try:
            return REASONING_PARSERS[name]
        except KeyError:
            raise ValueError(
                f"Unknown reasoning parser '{name}'. Known: {', '.join(REASONING_PARSERS)}, none"
            ) from None
    if detected:
        start, end = detected
        for fmt in REASONING_PARSERS.values():
            if (fmt.start, fmt.end) == (start, end):
                return fmt
        return ReasoningFormat("detected", start, end, "detected from the tokenizer")
    return None
