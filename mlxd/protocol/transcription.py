"""OpenAI audio transcription / translation forms (``POST /v1/audio/transcriptions``,
``/v1/audio/translations``): the text fields of the multipart body, and the
OpenAPI schema of that body.

The fields arrive as strings; pydantic converts them (``"0.2"`` -> 0.2,
``"true"`` -> True). Unknown fields are accepted and ignored, as OpenAI
clients send extras.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
Granularity = Literal["segment", "word"]
MAX_PROMPT_CHARS = 4096


class ServerVad(BaseModel):
    """OpenAI's ``chunking_strategy`` object: cut at pauses with these settings. Strict
    like every JSON body: numbers are JSON numbers (the route turns the SDK's
    ``chunking_strategy[...]`` form fields into JSON values first)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False)
    silence_duration_ms: int = Field(400, ge=0, le=10_000)
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)


class TranscriptionForm(BaseModel):
    """The text fields of a transcription or translation upload."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    language: str | None = Field(None, pattern=r"^[a-z]{2,3}$", description=(
        "ISO-639-1 code of the spoken language (transcriptions only); omitted: detected"))
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description=(
        "Text the recording continues: names, spelling, style"))
    response_format: ResponseFormat = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    timestamp_granularities: list[Granularity] = Field(default_factory=list, max_length=2)
    stream: bool = False
    # "auto" or a server_vad object (OpenAI's), or "sequential" (mlxd's: Whisper's own
    # window-after-window loop, each window conditioned on the text before); omitted:
    # batched at pauses when the recording is longer than 30 s, else sequential.
    chunking_strategy: Literal["auto", "sequential"] | ServerVad | None = None

    @field_validator("chunking_strategy", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        """A multipart field is a string: an object comes as JSON (or as the SDK's
        ``chunking_strategy[type]`` fields, gathered by the route)."""
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("chunking_strategy is not a JSON object") from None
        return value

    @model_validator(mode="after")
    def _combinations(self) -> TranscriptionForm:
        if self.timestamp_granularities and self.response_format != "verbose_json":
            raise ValueError("timestamp_granularities needs response_format 'verbose_json'")
        if self.stream and self.response_format not in ("json", "text"):
            raise ValueError("stream=true streams text: use response_format 'json' or 'text'")
        return self

    @property
    def word_timestamps(self) -> bool:
        return "word" in self.timestamp_granularities


def form_schema(translation: bool) -> dict[str, Any]:
    """The ``multipart/form-data`` request body of the OpenAPI document."""
    props: dict[str, Any] = {
        "file": {"type": "string", "format": "binary", "description": (
            "The recording: wav, mp3, flac, m4a, ogg, webm... (--max-audio-upload-bytes)")},
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string", "maxLength": MAX_PROMPT_CHARS},
        "response_format": {"type": "string",
                            "enum": ["json", "text", "srt", "verbose_json", "vtt"]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    }
    if not translation:
        props["language"] = {"type": "string", "pattern": "^[a-z]{2,3}$"}
        props["timestamp_granularities[]"] = {
            "type": "array", "items": {"type": "string", "enum": ["segment", "word"]}}
        props["stream"] = {"type": "boolean"}
        props["chunking_strategy"] = {"oneOf": [
            {"type": "string", "enum": ["auto", "sequential"]},
            ServerVad.model_json_schema()]}
    schema = {"type": "object", "required": ["file", "model"], "properties": props}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}
