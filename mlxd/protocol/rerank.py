"""Rerank request model: the Cohere / Jina shape (``POST /v1/rerank``, ``/rerank``,
``/v2/rerank``).

``documents`` are strings or objects with a ``text`` field (Cohere v1, Jina);
other fields of those objects are ignored. Unknown top-level fields (Cohere's
``max_chunks_per_doc``, ``rank_fields``...) are accepted and ignored.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    query: str
    documents: list[str | RerankDocument]
    top_n: StrictInt | None = Field(None, ge=1)
    return_documents: StrictBool = True
