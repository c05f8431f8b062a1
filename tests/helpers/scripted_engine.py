"""Scripted generation through the real engine and the real ``OutputPipeline``.

A random tiny model cannot be made to think or call a tool on demand, so API
adapter tests script the *tokens* instead: ``ScriptedLoader`` loads the real
``MLXLanguageModel`` (real tokenizer, chat template, ``prepare``, reasoning
and tool-call format detection) and, while ``reply`` is set, replaces only the
sampling step: the reply text is tokenized with the model's tokenizer and its
token ids are fed one by one to the engine's own pipeline (incremental
detokenizer -> stop strings -> reasoning split -> tool-call parse), honouring
``max_tokens`` and stop strings like the scheduler does. With ``reply=None``
the model generates for real. What this tests is everything after sampling:
the pipeline and each API's adapter, not the model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxd.config import ServerConfig
from mlxd.engines.factory import build_loader
from mlxd.generation.events import Event
from mlxd.models.spec import ModelEntry, ModelKind
from tests.helpers.server import RunningServer, running_server
from tests.helpers.tiny_models import build_llama

AGENT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# A Qwen-like ChatML template that renders tools, tool calls, tool results and
# reasoning, so prompts show whether an adapter passed them through.
AGENT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{\"id\": \"{{ tc.id }}\", \"name\": "
    "\"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n"
    "<tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% endif %}"
)


def build_agent_model(out: Path) -> Path:
    """A tiny Llama whose tokenizer knows ``<think>``/``<tool_call>`` (built once per path).

    As in Qwen's tokenizer, the markers are added tokens that are *not* special,
    so they decode as text and a grammar can match them as text.
    """
    if (out / "model.safetensors").exists():
        return out
    build_llama(out, hidden=64, layers=2, heads=4, seed=0, extra_tokens=AGENT_TOKENS,
                chat_template=AGENT_TEMPLATE)
    return plain_markers(out)


def plain_markers(out: Path) -> Path:
    """The ``<think>``/``<tool_call>`` markers of the model in ``out`` as added tokens
    that decode as text, as in Qwen's tokenizer."""
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    for token in spec["added_tokens"]:
        if token["content"] in AGENT_TOKENS:
            token["special"] = False
    path.write_text(json.dumps(spec))
    return out


class ScriptedLoader:
    """The model manager's loader: the real engine, with ``generate`` scriptable."""

    def __init__(self, config: ServerConfig) -> None:
        self._loader = build_loader(config, budget_bytes=2**30)
        self.reply: str | None = None
        self.prompts: list[str] = []

    def resolve(self, entry: ModelEntry) -> Path:
        return self._loader.resolve(entry)

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: Any) -> Any:
        engine = self._loader.build(entry, kind, path, worker)
        real_generate = engine.generate
        engine.generate = functools.partial(self._generate, engine, real_generate)
        return engine

    async def _generate(self, engine: Any, real_generate: Any, prepared: Any,
                        seed_offset: int = 0) -> AsyncIterator[Event]:
        self.prompts.append(prepared.prompt_text)
        if self.reply is None:
            async for event in real_generate(prepared, seed_offset):
                yield event
            return
        pipeline = engine._pipeline(prepared)  # the engine's own pipeline for this request
        tokens = engine.tokenizer.encode(self.reply, add_special_tokens=False)
        reason = "stop"
        for i, token in enumerate(tokens):
            if i >= prepared.max_tokens:
                reason = "length"
                break
            for event in pipeline.feed(token):
                yield event
            if pipeline.stopped:
                break
        else:
            pipeline.count_eos()
        for event in pipeline.finish(reason):
            yield event

    @property
    def last_prompt(self) -> str:
        return self.prompts[-1]


@contextmanager
def scripted_server(model: Path, home: Path, name: str = "tiny",
                    **config: Any) -> Iterator[tuple[RunningServer, ScriptedLoader]]:
    """A real server on 127.0.0.1 serving ``model`` through a ``ScriptedLoader``."""
    cfg = ServerConfig(model=str(model), home=home, no_starter=True, served_model_name=name,
                       **config)
    loader = ScriptedLoader(cfg)
    with running_server(cfg, loader=loader) as srv:
        yield srv, loader
