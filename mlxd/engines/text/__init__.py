"""The text core: the language-model engine, prompt preparation, schedulers, prefix cache,
speculative decoding, structured output, sampling and tool parsers. Vision and the sharded
engine build on it."""
