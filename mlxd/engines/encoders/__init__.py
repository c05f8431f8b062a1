"""Encoder models: embeddings, reranking (cross-encoders), pooling and the token batcher
they share."""
