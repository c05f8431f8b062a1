"""OpenAI speech request model (``POST /v1/audio/speech``).

``speed`` and the input length are range-checked by the route, so a refusal
names the server's limit and the flag that sets it. Unknown fields are
accepted and ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class SpeechCreateRequest(BaseModel):
    """Text to speak, with which model and voice, in which audio format."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str
    voice: str = Field(min_length=1)
    speed: StrictFloat = 1.0  # a JSON number: not "2.5", not true
    response_format: SpeechFormat = "mp3"
    # "audio": the encoded file, sent in chunks as it is made; "sse": base64 chunks in
    # speech.audio.delta events, then speech.audio.done.
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
