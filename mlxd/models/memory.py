"""Memory budget parsing and per-model memory estimates (no MLX needed).

An estimate is the weights plus a reserve for the model's serving limits:
KV cache for text/vision models (``max_num_seqs`` x context, capped by
``kv_reserve_tokens``) and the prefix cache; activation buffers for the
other kinds. After a load the manager replaces the weights part with the
measured figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxd.jsonfile import read_json_object
from mlxd.models.kinds import KINDS
from mlxd.models.spec import ModelKind, parse_size

if TYPE_CHECKING:
    from mlxd.config import ServerConfig

DEFAULT_KV_RESERVE_TOKENS = 32_768
MIN_ACTIVATION_RESERVE = 32 * 1024 * 1024


def total_memory_bytes() -> int:
    """Physical memory of this machine (unified memory on Apple silicon)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def parse_budget(value: str | int | float | None, total: int | None = None) -> int:
    """``8GB`` / ``512MiB`` / bytes / ``70%`` (of physical memory). None: 75% of memory."""
    total = total if total is not None else total_memory_bytes()
    if value is None:
        return int(total * 0.75)
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"cannot parse memory budget {value!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"memory budget percentage must be in (0, 100]: {value!r}")
        return int(total * pct / 100)
    return parse_size(value)


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class MemoryEstimate:
    weights: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.reserve


def weights_bytes_of_folder(folder: Path) -> int:
    """Bytes of the weight files in a model folder."""
    total = 0
    for pattern in ("*.safetensors", "*.npz", "*.bin", "*.onnx", "*.gguf"):
        total += sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file())
    return total


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4, kv_bits: int | None = None,
                       kv_group_size: int = 64) -> int:
    """K and V of every layer for one token. Quantized KV (``kv_bits``) holds each value in
    ``kv_bits`` bits plus, per ``kv_group_size`` values, a scale and a bias of the model's
    dtype (``mx.quantize``'s layout)."""
    cfg = config.get("text_config") or config
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    values = 2 * layers * kv_heads * head_dim
    if kv_bits is None:
        return values * dtype_bytes
    return values * kv_bits // 8 + values // kv_group_size * 2 * dtype_bytes


def text_transient_bytes(config: dict[str, Any], prefill_tokens: int, *, prefill_rows: int = 1,
                         decode_rows: int = 1, dtype_bytes: int = 4) -> int:
    """What one scheduler step of a text model holds beyond its weights and live KV.

    A prefill chunk (``prefill_rows`` prompts of ``prefill_tokens`` each, prefilled
    together): one layer's activations at a time, about four hidden-size and three
    intermediate-size values per token (hidden state, norm, projections; the MLP's gate,
    up and product) in the model's dtype, and one head's attention scores per row over
    the chunk (float32). A decode step: the logits of ``decode_rows`` rows in float32,
    three times (logits, log-probs, a processed copy). 0 when the config lacks the sizes.
    """
    cfg = config.get("text_config") or config
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    if not hidden:
        return 0
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or config.get("vocab_size") or 0)
    tokens = max(1, prefill_rows) * max(1, prefill_tokens)
    activations = tokens * (4 * hidden + 3 * inter) * dtype_bytes
    scores = max(1, prefill_rows) * prefill_tokens * prefill_tokens * 4
    logits = 3 * max(1, decode_rows) * vocab * 4
    return activations + scores + logits


def encoder_activation_bytes(config: dict[str, Any], batch_tokens: int,
                             dtype_bytes: int = 4) -> int:
    """Peak activations of one padded encoder batch (embedding / rerank models).

    Per token: about six intermediate-size buffers live at once, plus one row of
    attention scores per head as long as the longest sequence. Fitted on
    all-MiniLM-L6-v2 with MLX on CPU (8192 tokens: 276 MiB at length 32, 456 MiB
    at length 512; this gives 300 and 480). 0 when the config lacks the sizes.
    """
    cfg = config.get("text_config") or config
    hidden = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    longest = min(int(cfg.get("max_position_embeddings") or 512), batch_tokens)
    if not hidden or not heads:
        return 0
    return dtype_bytes * batch_tokens * (6 * inter + heads * longest)


# Whisper windows through the encoder and the token loop at once, from one upload or
# several (engines/audio/stt_batched.py): the estimate's reserve holds that many.
SPEECH_BATCH_WINDOWS = 8


def speech_activation_bytes(config: dict[str, Any], audio_seconds: float,
                            dtype_bytes: int = 4,
                            batch_windows: int = SPEECH_BATCH_WINDOWS) -> int:
    """Peak activations of one Whisper-shaped transcription of the longest allowed upload.

    mlx-whisper takes the log-mel of the whole recording at once (plus 30 s of padding):
    its STFT peaks at about 100 frames x 201 bins x 32 bytes per second (measured with
    tiny.en on CPU: 92 MiB for 120 s, 393 MiB for 600 s; this gives 92 and 387). Then one
    30 s window through the encoder: attention scores per head over ``n_audio_ctx``
    squared, and a few residual-width buffers (measured 79 MiB for tiny.en; this gives 99).
    A batched transcription (``engines/audio/stt_batched.py``) takes the log-mel and the
    encoder window by window but keeps ``batch_windows`` windows' features, and their
    token loop, live at once, whichever uploads they come from (concurrent uploads share
    one batch, never more windows): counted as ``batch_windows`` encoder peaks, an upper
    bound, and the peak is the larger of the two.
    """
    ctx = int(config.get("n_audio_ctx") or 1500)
    heads = int(config.get("n_audio_head") or 8)
    state = int(config.get("n_audio_state") or 512)
    recording = int((audio_seconds + 30) * 100 * 201 * 32)
    window = dtype_bytes * (3 * heads * ctx * ctx // 2 + 8 * ctx * state)
    return max(recording + window, batch_windows * window)


# The image-feature cache of each vision model (engines/vision/features.py), by bytes.
FEATURE_CACHE_BYTES = 64 * 1024 * 1024
# Pixels of the largest image a vision tower without a fixed input size is assumed to
# take (Qwen2-VL's processors resize to at most 1280 x 28 x 28 by default).
VISION_MAX_PIXELS = 1280 * 28 * 28


def vision_activation_bytes(config: dict[str, Any], max_pixels: int = VISION_MAX_PIXELS,
                            dtype_bytes: int = 4) -> int:
    """Peak activations of the vision tower on the largest image it takes: one patch
    token per ``patch_size`` squared pixels (the fixed ``image_size`` when the tower has
    one), with the same per-token terms as ``encoder_activation_bytes``. 0 without a
    vision config."""
    vc = config.get("vision_config") or {}
    hidden = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
    if not hidden:
        return 0
    patch = int(vc.get("patch_size") or 14)
    size = vc.get("image_size")
    tokens = (int(size) // patch) ** 2 if size else max(1, max_pixels // (patch * patch))
    heads = int(vc.get("num_attention_heads") or vc.get("num_heads") or 1)
    inter = int(vc.get("intermediate_size") or int(vc.get("mlp_ratio") or 4) * hidden)
    return dtype_bytes * tokens * (6 * inter + heads * tokens)


def estimate_memory(kind: ModelKind, weights: int, config: dict[str, Any] | None = None, *,
                    max_num_seqs: int = 16, context: int = 4096,
                    kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS,
                    prefix_cache_bytes: int = 0, dtype_bytes: int = 4,
                    encoder_batch_tokens: int = 8192,
                    audio_seconds: float = 1800.0, kv_bits: int | None = None,
                    kv_group_size: int = 64) -> MemoryEstimate:
    """Weights plus the reserve for this kind's serving limits (a text model's KV at
    ``kv_bits`` when it is quantized)."""
    if kind in (ModelKind.TEXT, ModelKind.VISION):
        tokens = min(max_num_seqs * context, kv_reserve_tokens)
        per_token = kv_bytes_per_token(config or {}, dtype_bytes, kv_bits, kv_group_size)
        reserve = per_token * tokens + prefix_cache_bytes
        if kind == ModelKind.VISION:  # + the feature cache and one image through the tower
            reserve += FEATURE_CACHE_BYTES + vision_activation_bytes(config or {},
                                                                     dtype_bytes=dtype_bytes)
        return MemoryEstimate(weights, reserve)
    if kind in (ModelKind.EMBEDDING, ModelKind.RERANK):
        activations = encoder_activation_bytes(config or {}, encoder_batch_tokens, dtype_bytes)
        if activations:
            return MemoryEstimate(weights, max(MIN_ACTIVATION_RESERVE, activations))
    if kind == ModelKind.STT and config and "n_audio_ctx" in config:
        activations = speech_activation_bytes(config, audio_seconds, dtype_bytes)
        return MemoryEstimate(weights, max(MIN_ACTIVATION_RESERVE, activations))
    frac = KINDS[kind].activation_reserve
    return MemoryEstimate(weights, max(MIN_ACTIVATION_RESERVE, int(weights * frac)))


def with_draft(est: MemoryEstimate, draft: Path, kv_tokens: int,
               dtype_bytes: int = 4) -> MemoryEstimate:
    """A text model's estimate plus its draft model's weights and a KV reserve of the same
    tokens (the draft caches every running sequence too). A draft not on disk yet (a hub
    id) adds nothing here; the measured figure replaces the weights after the load."""
    if not draft.is_dir():
        return est
    config = read_config(draft) if (draft / "config.json").is_file() else {}
    return MemoryEstimate(est.weights + weights_bytes_of_folder(draft),
                          est.reserve + kv_bytes_per_token(config, dtype_bytes) * kv_tokens)


def read_config(folder: Path) -> dict[str, Any]:
    return read_json_object(Path(folder) / "config.json")


def prefix_cache_bytes(config: ServerConfig, budget: int) -> int:
    """``--prefix-cache-bytes``, or by default 5% of the memory budget (at most 1 GiB)."""
    if config.prefix_cache_bytes is not None:
        return max(0, config.prefix_cache_bytes)
    return min(2**30, budget // 20)
