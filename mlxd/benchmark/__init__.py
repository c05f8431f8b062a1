"""``mlxd bench``: a streaming load generator for any OpenAI-compatible server.

A pure HTTP client (httpx): nothing here imports mlx or the engines, so it can
measure mlxd, mlx-lm's server, vllm-mlx or anything else that speaks
``/v1/chat/completions`` or ``/v1/completions`` with ``stream=true``.

- ``prompts``: synthetic prompts of roughly N tokens, with a shared prefix and
  multi-turn conversations.
- ``loadgen``: one streamed request (``stream_request``) and one concurrency
  level (``run_level``) with closed-loop workers, bounded in count and time.
- ``report``: percentiles, the per-level summary, markdown, JSON and PNG.
"""
