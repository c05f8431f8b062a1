"""Token endpoint models: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

The shapes are vLLM's, which lm-evaluation-harness and other token-counting
clients speak: a ``prompt`` (vLLM's ``TokenizeCompletionRequest``) or chat
``messages`` (``TokenizeChatRequest``) in; ``{count, max_model_len, tokens,
token_strs}`` out. ``model`` may be left out, as vLLM serves one model: the
server's default model (``mlxd serve MODEL``, or its first chat model) answers.
Unknown fields are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from mlxd.protocol.openai import ChatMessage, ToolDef


class TokenizeRequest(BaseModel):
    """Exactly one of ``prompt`` (plain text) or ``messages`` (rendered by the chat template)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: True for a prompt (BOS...), False for messages (the template adds them).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool | None = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        # As vLLM: only an explicit add_generation_prompt conflicts (its default is True).
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text; each must be in the model's vocabulary."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, min_length=1)
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """What a remote-tokenizer client needs: the special tokens, the context length and
    the chat template (vLLM returns the tokenizer's config; these are its common keys)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    model_max_length: int
    vocab_size: int
    chat_template: str | None = None
