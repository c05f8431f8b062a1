"""One typed configuration object for the whole server.

Built from CLI flags (highest), ``MLXD_*`` environment variables, and
defaults; the registry file (``--models-config``) adds per-model entries and
may override the ``manager`` settings. Passed into ``build_app(config)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Quantized KV (--kv-bits, --kv-group-size): what ``mx.quantize`` takes and serving wants
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv_bits(bits: int | None) -> int | None:
    """``bits`` when it is None or one of ``KV_BITS``, else ``ValueError`` naming them."""
    if bits is not None and bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} "
                         f"(got {bits})")
    return bits


def check_kv_group_size(size: int | None) -> int | None:
    """``size`` when it is None or one of ``KV_GROUP_SIZES``, else ``ValueError``."""
    if size is not None and size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of "
                         f"{', '.join(map(str, KV_GROUP_SIZES))} (got {size})")
    return size


def default_home() -> Path:
    return Path(os.environ.get("MLXD_HOME") or Path.home() / ".cache" / "mlxd")


class ServerConfig(BaseSettings):
    """Every setting of a running mlxd; see ``mlxd serve --help`` for each flag."""

    model_config = SettingsConfigDict(env_prefix="MLXD_", extra="ignore", validate_default=True)

    # What to serve
    model: str | None = Field(None, description="Model to serve: local MLX folder, GGUF file or HF id")
    served_model_name: str | None = None
    # More names for MODEL (or, without MODEL, the first chat model): exact or glob patterns
    aliases: list[str] = Field(default_factory=list)
    models_config: Path | None = Field(None, description="Registry YAML file")
    home: Path = Field(default_factory=default_home)
    no_starter: bool = False
    # Start with no model at all (an admin adds them with PUT /v1/models); a missing
    # --models-config file is then created by the first PUT. Off: both are startup errors.
    allow_no_models: bool = False
    require_qualified: bool = False
    trust_remote_code: bool = False

    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    admin_api_key: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field("text", description=(
        "text: lines for people; json: one JSON object per line (one per request with its "
        "id, route, model, status, tokens and timings)"))
    max_body_bytes: int = 32 * 1024 * 1024
    cors_origins: list[str] = Field(default_factory=list)
    allowed_hosts: list[str] | None = Field(None, description=(
        "Host header names the server answers to besides localhost; '*': any. Default: "
        "loopback names only without an API key, any with one (a DNS rebinding guard)"))
    header_timeout: float = Field(20.0, gt=0, description=(
        "seconds for a client to send a whole request head (then 408 and close)"))
    body_timeout: float = Field(60.0, gt=0, description=(
        "seconds a request body may stall between reads (then 408 and close)"))
    max_connections: int | None = Field(None, gt=0, description=(
        "open connections at most; default min(1024, open-file limit less a reserve)"))
    drain_timeout: float = Field(5.0, ge=0, description=(
        "on SIGTERM, seconds in-flight requests (streams included) may take to finish "
        "while new ones get 503; then they are cut off"))
    log_repeat_interval: float = Field(10.0, gt=0, description=(
        "repeated connection errors (timeouts, accept failures) are logged once per this "
        "many seconds, with a count"))
    keepalive_interval: float = Field(5.0, gt=0, le=3600, description=(
        "a streaming text response silent this many seconds (a long prompt being "
        "prefilled, a batch stalled by another prefill) sends a keep-alive: an Anthropic "
        "ping, a repeated Responses response.in_progress, a chat-completions SSE comment"))

    # Generation defaults and limits
    max_tokens: int | None = Field(None, gt=0, description=(
        "tokens a request generates when it sets no limit (default: the rest of the context)"))
    max_n: int = 8
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    # Batching and caching (text models)
    batching: bool = True
    max_num_seqs: int = 16
    max_queue: int = 256
    prefill_step_size: int = 2048
    prefix_cache_bytes: int | None = None
    prefix_cache_disk_bytes: int = Field(0, ge=0, description=(
        "bytes of a disk tier under $MLXD_HOME/prefix-cache-disk/ that the RAM prefix "
        "cache evicts into and reads back from (default 0: off)"))
    max_context: int | None = None
    enable_prefix_cache_persist: bool = True
    speculative: Literal["auto", "prompt-lookup", "draft", "off"] = Field("auto", description=(
        "speculative decoding in the batched scheduler: prompt-lookup drafts, a draft model "
        "(draft), off, or auto (the draft model when one is given, else prompt lookup on a "
        "GPU and off on CPU)"))
    draft_model: str | None = Field(None, description=(
        "a small model with MODEL's tokenizer (folder, GGUF or HF id) that drafts tokens for "
        "MODEL to verify; loaded and unloaded with it, inside its memory estimate"))
    adapters: list[str] = Field(default_factory=list, description=(
        "LoRA adapters served over MODEL, each NAME=PATH (an mlx-lm adapter folder): NAME is "
        "a model name of its own, sharing MODEL's weights and batches"))
    num_draft_tokens: int = Field(8, ge=1, le=16, description=(
        "most tokens one sequence drafts per step (it starts at 4 and doubles while its "
        "drafts are accepted in full)"))

    # Memory management
    memory_budget: str | None = None
    idle_unload_seconds: float | None = None
    contention: Literal["wait", "fail"] | None = None
    wait_timeout_s: float | None = None
    kv_reserve_tokens: int = 32_768
    kv_bits: int | None = Field(None, description=(
        "keep text models' attention KV quantized to 4 or 8 bits in the batch and the "
        "prefix cache (default: the model's float dtype; see docs/memory.md)"))
    kv_group_size: int = Field(64, description=(
        "values per scale and bias of quantized KV (32, 64 or 128; must divide the "
        "model's head dimension)"))
    kv_output_estimate: int = Field(1024, gt=0, description=(
        "output tokens admission by live KV expects of a request that sets no limit (it may "
        "grow past it while memory allows; see docs/memory.md)"))

    # Embeddings and rerank
    max_embedding_inputs: int = 2048
    max_rerank_documents: int = 1000
    max_rerank_tokens: int = 500_000
    embedding_overflow: Literal["truncate", "error"] = "truncate"
    encoder_batch_tokens: int = Field(8192, gt=0, description=(
        "padded tokens per embedding / rerank forward pass"))

    # Images and videos sent to vision models (mlxd/media/limits.py)
    max_image_bytes: int = Field(20 * 1024 * 1024, gt=0, description="bytes per encoded image")
    max_video_bytes: int = Field(64 * 1024 * 1024, gt=0, description="bytes per encoded video")
    max_media_bytes: int = Field(128 * 1024 * 1024, gt=0, description=(
        "bytes of all images and videos of one request together"))
    max_image_pixels: int = Field(33_177_600, gt=0, description=(
        "width x height of an image or video frame (default 8K UHD)"))
    max_media_pixels: int = Field(132_710_400, gt=0, description=(
        "decoded pixels of all images and sampled video frames of one request together "
        "(default four 8K UHD images)"))
    max_images_per_request: int = Field(32, ge=0)
    max_videos_per_request: int = Field(4, ge=0)
    max_video_seconds: float = Field(300.0, gt=0, description="video duration (container header)")
    max_video_frames: int = Field(18_000, gt=0, description=(
        "frames in a video's container header (before sampling)"))
    video_fps: float = Field(2.0, gt=0, description="video frames sampled per second")
    video_max_frames: int = Field(64, gt=0, description="video frames sampled at most")
    media_fetch_timeout: float = Field(10.0, gt=0, description=(
        "seconds to fetch one http(s) image or video URL, redirects included"))
    allow_private_media_urls: bool = Field(False, description=(
        "fetch media URLs on private, loopback and link-local addresses"))

    # One model sharded over several hosts (mx.distributed, started through mlx.launch)
    hosts: str | None = Field(None, description=(
        "serve one text model sharded over these hosts: a comma-separated list or a "
        "hostfile, as mlx.launch takes them (rank 0, the first host, serves HTTP)"))
    backend: Literal["ring", "jaccl", "mpi"] = Field("ring", description=(
        "mx.distributed backend of the group (ring: TCP; jaccl: Thunderbolt RDMA; mpi)"))
    group_port: int = Field(47100, gt=0, lt=65536, description=(
        "rank 0's control port for the other ranks (the ring backend uses the next ports)"))
    group_timeout: float = Field(10.0, gt=0, description=(
        "seconds without a heartbeat after which a rank counts as dead: in-flight requests "
        "get 503 and /health reports the group unhealthy"))

    # Text sent to text-to-speech models (OpenAI's own limit is 4096)
    max_speech_input_chars: int = Field(4096, gt=0, description=(
        "characters of one /v1/audio/speech input"))

    # Audio uploads to speech-to-text models (mlxd/media/audio_limits.py)
    max_audio_upload_bytes: int = Field(25 * 1024 * 1024, gt=0, description=(
        "bytes of one uploaded audio file, counted while it streams in"))
    max_audio_seconds: float = Field(1800.0, gt=0, description=(
        "decoded duration of one upload (Whisper's memory reserve grows ~0.6 MiB per second)"))
    max_audio_sample_rate: int = Field(192_000, gt=0, description="sample rate of an upload")
    max_audio_channels: int = Field(8, gt=0, description="channels of an upload")

    # Response store (Responses API)
    response_store_max: int = 1000
    response_store_bytes: int = 64 * 1024 * 1024

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, v: int | None) -> int | None:
        return check_kv_bits(v)

    @field_validator("kv_group_size")
    @classmethod
    def _kv_group_size(cls, v: int) -> int:
        check_kv_group_size(v)
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @property
    def prefix_cache_dir(self) -> Path:
        return self.home / "prefix-cache"

    @property
    def prefix_cache_disk_dir(self) -> Path:
        return self.home / "prefix-cache-disk"
