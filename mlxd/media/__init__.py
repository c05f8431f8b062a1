"""Media inputs and outputs, without MLX: images, video frames and audio.

This layer (a peer of ``sources/`` and ``runtime/``) reads what clients send
(data: URLs, http(s) URLs under an SSRF guard, uploads), checks the limits
before any expensive decode, and hands engines decoded, hashed items
(``types.py``). It never imports mlx, FastAPI or the engines.
"""
