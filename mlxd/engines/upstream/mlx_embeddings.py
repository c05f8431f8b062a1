"""mlx-embeddings' internals, behind one seam: the Hugging Face tokenizer its
``TokenizerWrapper`` holds (the encoders tokenise with it directly, in batches).
``tests/test_upstream_adapters.py`` checks it on the installed version; a model load
runs ``ADAPTER.require`` (see ``upstream/versions.py``)."""

from __future__ import annotations

from typing import Any

from mlxd.engines.upstream.versions import Adapter, Private

PRIVATE = (
    Private("mlx_embeddings.tokenizer_utils", "TokenizerWrapper", "_tokenizer", "attribute",
            "engines/encoders/embeddings.py: the tokenizer behind the wrapper"),
)

ADAPTER = Adapter("mlx-embeddings", ("0.1.0",), PRIVATE)


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer behind mlx-embeddings' ``TokenizerWrapper`` (or
    ``wrapper`` itself when it is not wrapped)."""
    return getattr(wrapper, "_tokenizer", wrapper)
