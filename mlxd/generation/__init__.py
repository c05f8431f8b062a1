"""Backend-free text generation pipeline shared by every API.

token ids -> incremental detokenizer -> stop strings -> reasoning split ->
tool-call parse -> events. Nothing here imports mlx or FastAPI.
"""
