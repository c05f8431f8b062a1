"""System messages after the conversation started (Anthropic's mid-conversation system
messages, OpenAI's system/developer messages between turns): a system turn in place
where the chat template renders one there, else folded into the leading system prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.engines.text.input_processor import InputLimits, InputProcessor
from mlxd.generation.chat import fold_late_system
from mlxd.generation.params import GenerationRequest

# Templates real models ship: one refuses a system role past the first message
# (Mistral and Gemma style), one renders only messages[0] as system and drops the rest.
REFUSING = (
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role only at the start') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DROPPING = (
    "{% for m in messages %}"
    "{% if m.role != 'system' or loop.first %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "First"},
                {"role": "system", "content": "Agents: none."},
                {"role": "assistant", "content": "Answer"},
                {"role": "user", "content": "Second"}]


def processor(model: Path, template: str | None) -> InputProcessor:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model)
    if template is not None:
        tok._tokenizer.chat_template = template
    return InputProcessor("tiny", tok, InputLimits(2048, 2048), reasoning=None,
                          tool_format=None, grammar_tokenizer=None)


def prompt_of(inputs: InputProcessor, messages: list[dict]) -> str:
    return inputs.prepare(GenerationRequest(messages=messages)).prompt_text


def test_a_template_that_renders_system_turns_keeps_them_in_place(tiny_model: Path) -> None:
    text = prompt_of(processor(tiny_model, None), CONVERSATION)
    assert text.index("First") < text.index("<|im_start|>system\nAgents: none.") \
        < text.index("Answer")


@pytest.mark.parametrize("template", [REFUSING, DROPPING], ids=["refusing", "dropping"])
def test_other_templates_get_late_system_text_in_the_system_prompt(
        tiny_model: Path, template: str) -> None:
    text = prompt_of(processor(tiny_model, template), CONVERSATION)
    assert text.startswith("<|im_start|>system\nBe terse.\n\nAgents: none.<|im_end|>\n")
    assert text.count("Agents: none.") == 1
    assert text.index("First") < text.index("Answer") < text.index("Second")


def test_folding_creates_a_system_prompt_when_there_is_none() -> None:
    folded = fold_late_system([{"role": "user", "content": "Hi"},
                               {"role": "system", "content": "Note."}])
    assert folded == [{"role": "system", "content": "Note."},
                      {"role": "user", "content": "Hi"}]
