"""OpenAI Embeddings request model (``POST /v1/embeddings``).

``input`` is kept loose here (a string or a list of anything) so the route
can answer a malformed one with a message that says which item is wrong.
Unknown fields are accepted and ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class EmbeddingRequest(BaseModel):
    """A string, a list of strings, a token-id list, or a list of token-id lists."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, gt=0)
    user: str | None = None
