"""``MLXMultimodalLM``: vision-language generation over mlx-vlm.

The same engine as text models (``MLXLanguageModel``: one generation pipeline
for sampling, stop strings, tool calls, reasoning and structured output),
with three parts swapped: mlx-vlm loads the model and its processor (float32
on CPU, the checkpoint's dtype on a GPU), ``VisionInputProcessor`` keeps image
and video parts and runs the processor per request, and ``VLMBatchDecoder``
decodes through mlx-vlm's continuous ``BatchGenerator`` with per-request
input embeddings. The family's patches (``engines/vision/patches``) are applied
at load and undone at close. Image features are cached by image hash
(``engines/vision/features.py``), so a second turn about the same image does not
run the vision tower again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxd.engines.device import device_name, weights_nbytes
from mlxd.engines.text.engine import MLXLanguageModel, TextEngineOptions, context_length_of
from mlxd.engines.text.input_processor import InputLimits, InputProcessor, PreparedPrompt
from mlxd.engines.text.prompt_limits import max_token_chars, vocab_bound
from mlxd.engines.text.scheduler import BatchScheduler, SchedulerBase
from mlxd.engines.text.structured import GrammarTokenizer
from mlxd.engines.upstream import mlx_vlm as vlm_internals
from mlxd.engines.vision.decoder import VLMBatchDecoder
from mlxd.engines.vision.features import FeatureCache, embed_prompt
from mlxd.engines.vision.input import VisionInputProcessor
from mlxd.engines.vision.patches import PatchHandle, registry
from mlxd.errors import InvalidRequest, ModelLoadError
from mlxd.generation.events import TokenLogprob
from mlxd.jsonfile import read_json_object
from mlxd.models.engine import EngineStats, PrefixCacheStats
from mlxd.models.memory import FEATURE_CACHE_BYTES
from mlxd.runtime.worker import ModelWorker

log = logging.getLogger(__name__)


class MLXMultimodalLM(MLXLanguageModel):
    """A vision-language model loaded with mlx-vlm and served through the batch scheduler."""

    kind = "vision"

    def __init__(self, name: str, path: Path, worker: ModelWorker,
                 options: TextEngineOptions | None = None) -> None:
        super().__init__(name, path, worker, options)
        self.processor: Any = None
        self.model_type = ""
        self.features: FeatureCache | None = None
        self._patches: PatchHandle | None = None

    # -- lifecycle (worker thread) -------------------------------------------
    def load(self) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from mlx_vlm.utils import load

        if self.options.kv_bits is not None:  # mlx-vlm's batch keeps its own KV caches
            raise ModelLoadError(self.name, "--kv-bits (quantized KV) is not supported for "
                                            "vision models; serve this model without it (a "
                                            "registry entry can set kv_bits per text model)")
        vlm_internals.ADAPTER.require(self.name)
        try:
            model, processor = load(str(self.path),
                                    trust_remote_code=self.options.trust_remote_code)
        except Exception as e:
            raise ModelLoadError(self.name, f"{type(e).__name__}: {e}") from e
        if device_name() == "cpu":  # MLX's half-precision CPU kernels are slow
            model.set_dtype(mx.float32)
        # The checkpoint's own config.json over mlx-vlm's ModelConfig: keys mlx-vlm's
        # dataclasses do not declare are kept.
        config = {**_config_dict(model.config), **read_json_object(self.path / "config.json")}
        self.model_type = str(config.get("model_type") or "")
        mismatch = image_seq_mismatch(config, processor)
        if mismatch:
            raise ModelLoadError(self.name, mismatch)
        self._patches = registry().activate(self.model_type, self.name, (model, processor))
        hf_tok: Any = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        eos = _eos_ids(config, hf_tok, self.path)
        self.model, self.processor, self.config = model, processor, config
        self.tokenizer = TokenizerWrapper(hf_tok, eos_token_ids=eos)
        self._weights_bytes = weights_nbytes(model)
        ctx = context_length_of(config, hf_tok)
        if self.options.max_context:
            ctx = min(ctx, self.options.max_context)
        self.context_length = ctx
        self.vocab_size = vocab_bound(model.language_model, config, len(hf_tok))
        self._build_parsers()
        self.inputs = self._input_processor(config)
        self.features = FeatureCache(FEATURE_CACHE_BYTES)
        self.scheduler = self._scheduler(model, [])
        self.worker.set_stepper(self.scheduler)

    def _input_processor(self, config: dict[str, Any]) -> InputProcessor:
        from mlx_vlm.utils import should_add_special_tokens

        tok = self.tokenizer
        grammar = GrammarTokenizer(tok.backend_tokenizer, self.vocab_size,
                                   sorted(tok.eos_token_ids))
        limits = InputLimits(self.context_length, self.vocab_size, max_token_chars(tok))
        prepare = {"image_token_index": config.get("image_token_index",
                                                   config.get("image_token_id")),
                   "add_special_tokens": should_add_special_tokens(self.model_type,
                                                                   self.processor)}
        return VisionInputProcessor(self.name, tok, limits, reasoning=self.reasoning,
                                    tool_format=self.tool_format, grammar_tokenizer=grammar,
                                    processor=self.processor, prepare_kwargs=prepare)

    def _scheduler(self, model: Any, probe_cache: list[Any]) -> SchedulerBase:
        """Always batched: mlx-vlm's generator batches every family it loads. Prefix
        reuse is mlx-vlm's own prefix cache inside the decoder (its blocks salted with
        our namespace), so the scheduler keeps none."""
        opts = self.options
        self.prefix_cache = None
        decoder = VLMBatchDecoder(model, self.processor, self._embed,
                                  eos_ids=list(self.tokenizer.eos_token_ids),
                                  max_num_seqs=opts.max_num_seqs,
                                  prefill_step_size=opts.prefill_step_size,
                                  namespace=self._namespace,
                                  prefix_cache_bytes=self._prefix_cache_bytes(),
                                  speculative=opts.speculative, name=self.name)
        return BatchScheduler(decoder, self.tokenizer, max_num_seqs=opts.max_num_seqs,
                              max_queue=opts.max_queue, prefill_step_size=opts.prefill_step_size,
                              prefix_cache=None, wake=self.worker.wake)

    def _prefix_cache_bytes(self) -> int:
        """The prefix cache's byte bound (0: off), as for text models."""
        return max(0, int(self.options.prefix_cache_bytes))

    def _namespace(self, prompt: PreparedPrompt) -> int:
        """The prefix-cache salt of one prompt: model identity, media hashes and cache
        salt, so KV blocks are never shared between different images or tenants."""
        parts = [self.name, str(self.path), self.model_type, *prompt.media_hashes,
                 str(prompt.cache_salt or "")]
        digest = hashlib.sha256("\x00".join(parts).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    def _embed(self, prompt: PreparedPrompt) -> dict[str, Any]:
        """One request's input embeddings (worker thread), through the feature cache."""
        return embed_prompt(self.model, self.model_type, prompt, self.features)

    def close(self) -> None:
        super().close()
        self.processor = None
        self.features = None
        if self._patches is not None:
            self._patches.undo()
            self._patches = None

    # -- facts -----------------------------------------------------------------
    def memory_bytes(self) -> int:
        features = self.features
        return super().memory_bytes() + (features.nbytes if features is not None else 0)

    def _vlm_decoder(self) -> VLMBatchDecoder | None:
        sched = self.scheduler
        decoder = sched.decoder if isinstance(sched, BatchScheduler) else None
        return decoder if isinstance(decoder, VLMBatchDecoder) else None

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        features = self.features
        decoder = self._vlm_decoder()  # the prefix cache is mlx-vlm's, inside the decoder
        out.update(prefix_cache_bytes=decoder.prefix_cache_nbytes() if decoder else 0)
        # what --speculative resolved to (off where the model's caches cannot rewind)
        out.update(speculative=decoder.speculation if decoder else "off")
        out.update(model_type=self.model_type,
                   patches=self._patches.names if self._patches else [],
                   feature_cache_bytes=features.nbytes if features else 0,
                   feature_cache_hits=features.hits if features else 0,
                   vision_tower_runs=features.tower_runs if features else 0)
        return out

    def stats(self) -> EngineStats:
        out = super().stats()
        decoder = self._vlm_decoder()
        if decoder is not None and self._prefix_cache_bytes() > 0:
            out = replace(out, prefix_cache=replace(
                out.prefix_cache or PrefixCacheStats(), hits=decoder.prefix_hits,
                misses=decoder.prefix_misses, nbytes=decoder.prefix_cache_nbytes()))
        if self.features is not None:
            out = replace(out, counters={**out.counters,
                                         "feature_cache_hits": self.features.hits,
                                         "feature_cache_misses": self.features.misses,
                                         "vision_tower_runs": self.features.tower_runs})
        return out

    async def prompt_logprobs(self, prepared: PreparedPrompt, top: int) -> list[TokenLogprob]:
        raise InvalidRequest(f"Model '{self.name}' is a vision-language model: echo with "
                             "logprobs (prompt log-probabilities) is not supported.",
                             param="echo")


def image_seq_mismatch(config: dict[str, Any], processor: Any) -> str | None:
    """Why the processor's image-token count disagrees with the model's, if it does.

    gemma3 and smolvlm/idefics3 processors expand each image to the count in
    ``processor_config.json``; a different count than the model's makes every image
    request fail (or misplace features), so the model is refused at load, naming the fix.
    """
    model_type = config.get("model_type")
    if model_type == "gemma3":
        key, want = "image_seq_length", config.get("mm_tokens_per_image")
    elif model_type in ("smolvlm", "idefics3"):
        vision = config.get("vision_config") or {}
        size, patch = vision.get("image_size"), vision.get("patch_size")
        scale = int(config.get("scale_factor") or 1)
        key = "image_seq_len"
        want = (int(size) // int(patch)) ** 2 // scale ** 2 if size and patch else None
    else:
        return None
    have = getattr(processor, key, None)
    if want is None or have is None or int(have) == int(want):
        return None
    return (f"its processor_config.json has {key}={have}, but the model takes {want} "
            f"tokens per image: set {key} to {want}.")


def _config_dict(config: Any) -> dict[str, Any]:
    """mlx-vlm's ModelConfig as a plain dict (text_config flattened in as a dict)."""
    out: dict[str, Any] = {}
    for key, value in vars(config).items():
        if hasattr(value, "__dict__") and not isinstance(value, type):
            out[key] = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        elif not key.startswith("_"):
            out[key] = value
    return out


def _eos_ids(config: dict[str, Any], tokenizer: Any, folder: Path) -> list[int]:
    """End-of-turn ids: the config's, the text config's, the generation config's and the
    tokenizer's."""
    ids: set[int] = set()
    generation = read_json_object(folder / "generation_config.json")
    for source in (config, config.get("text_config") or {}, generation):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


if TYPE_CHECKING:  # mypy proves the engine implements its family's protocol
    from mlxd.engines.base import TextGenerator

    _implements: type[TextGenerator] = MLXMultimodalLM
