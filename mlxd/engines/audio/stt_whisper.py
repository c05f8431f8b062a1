"""Whisper through mlx-whisper: its model, its window-by-window ``transcribe`` loop.

``mlx_whisper.transcribe`` decodes long audio 30 s window by window (seeking by
the timestamps it predicts, temperature fallback, word timings from the
cross-attention), but fetches its model from ``ModelHolder``, a class-level
cache keyed by path: one model per process, loaded behind our back and never
freed on unload. ``bind_transcribe`` gives each engine its own copy of that
function whose ``ModelHolder`` is the engine's loaded model, so two Whisper
models can be served side by side and an unload frees the weights. It checks
the library still has that shape and refuses to load otherwise. The same copy
checks for cancellation before each 30 s window (its ``pad_or_trim`` call), so a
job nobody waits for stops there.
"""

from __future__ import annotations

import importlib
import json
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engines.base import TranscriptionRequest
from mlxd.errors import InvalidRequest, ModelLoadError

TranscribeFn = Callable[..., dict[str, Any]]
# OpenAI's temperature 0: start greedy, raise it while the output looks like a failure.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def is_whisper_folder(path: Path) -> bool:
    """An mlx-whisper folder: ModelDimensions in config.json plus weights.safetensors/npz."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    has_weights = (path / "weights.safetensors").exists() or (path / "weights.npz").exists()
    return isinstance(config, dict) and {"n_mels", "n_audio_ctx"} <= set(config) and has_weights


def load_whisper(name: str, path: Path, dtype: Any) -> Any:
    """The mlx-whisper model in ``dtype``, with the alignment heads the folder names."""
    try:
        from mlx_whisper.load_models import load_model
    except ImportError as e:
        raise ModelLoadError(name, "Whisper models need mlx-whisper: pip install --no-deps "
                                   "'mlx-whisper>=0.4.3' (see docs/audio.md)") from e
    model = load_model(str(path), dtype=dtype)
    heads = path / "alignment_heads.json"
    if heads.exists():
        model.set_alignment_heads(np.asarray(json.loads(heads.read_text()), dtype=np.int64))
    return model


def bind_transcribe(name: str, model: Any, printed: Callable[[str], None],
                    check_cancelled: Callable[[], None] = lambda: None) -> TranscribeFn:
    """mlx-whisper's ``transcribe``, reading ``model`` instead of its process-wide cache.

    With ``verbose=True`` it prints each segment as soon as its window is decoded
    (``[00:00.000 --> 00:03.360] text``); its ``print`` is ``printed`` instead, so a
    caller can stream segments without a change to the loop. ``check_cancelled`` runs
    before each window is cut from the spectrogram and may raise to stop the loop.
    """
    # The package re-exports the function under the module's name: fetch the module.
    library = importlib.import_module("mlx_whisper.transcribe")
    fn = library.transcribe
    if ("ModelHolder" not in fn.__code__.co_names or not hasattr(library, "ModelHolder")
            or "pad_or_trim" not in fn.__code__.co_names):
        raise ModelLoadError(name, "this mlx-whisper version's transcribe() no longer reads "
                                   "its model from ModelHolder; mlxd supports mlx-whisper 0.4.x")

    class _Holder:
        @staticmethod
        def get_model(_path: str, _dtype: Any) -> Any:
            return model

    def _print(*args: Any, **_kw: Any) -> None:
        printed(" ".join(str(a) for a in args))

    pad_or_trim = fn.__globals__["pad_or_trim"]

    def _window(*args: Any, **kw: Any) -> Any:  # once per 30 s window
        check_cancelled()
        return pad_or_trim(*args, **kw)

    env = dict(fn.__globals__, ModelHolder=_Holder, print=_print, pad_or_trim=_window)
    bound = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    return bound


def language_name(code: str | None) -> str | None:
    """OpenAI's verbose_json names the language ("english"), Whisper's result gives its
    code ("en"): the name from Whisper's own table, else what the model gave."""
    if code is None:
        return None
    try:
        from mlx_whisper.tokenizer import LANGUAGES
    except ImportError:  # an mlx-audio family without mlx-whisper installed
        return code
    return str(LANGUAGES.get(code, code))


def check_language(name: str, model: Any, request: TranscriptionRequest) -> str | None:
    """The language to decode in (None: detect), or a 400 the model cannot honour."""
    from mlx_whisper.tokenizer import LANGUAGES

    if not model.is_multilingual:
        if request.task == "translate":
            raise InvalidRequest(f"Model '{name}' is English-only and cannot translate; use a "
                                 "multilingual Whisper model.", param="model")
        if request.language not in (None, "en"):
            raise InvalidRequest(f"Model '{name}' is English-only; language "
                                 f"'{request.language}' is not supported.", param="language")
        return "en"
    if request.language is not None and request.language not in LANGUAGES:
        raise InvalidRequest(f"Language '{request.language}' is not one Whisper knows "
                             "(ISO-639-1 codes such as 'en', 'de', 'ja').", param="language")
    return request.language


SEGMENT_LINE = re.compile(r"^\[[0-9:.]+ --> [0-9:.]+\] (.*)$", re.DOTALL)


def segment_text(line: str) -> str | None:
    """The text of a segment line mlx-whisper prints with ``verbose=True`` (else None)."""
    m = SEGMENT_LINE.match(line)
    return m.group(1) if m else None


def temperatures(request: TranscriptionRequest) -> tuple[float, ...]:
    """The temperatures to decode at, in order (OpenAI's 0: greedy, then the fallback)."""
    return FALLBACK_TEMPERATURES if request.temperature == 0 else (request.temperature,)


def run_whisper(transcribe: TranscribeFn, model: Any, request: TranscriptionRequest,
                language: str | None, verbose: bool = False) -> dict[str, Any]:
    """One recording through the window-by-window loop (on the model's worker thread);
    ``verbose``: print (to the bound ``printed``) each segment as it is decoded."""
    fp16 = model.encoder.conv1.weight.dtype == mx.float16
    return transcribe(request.audio, path_or_hf_repo="", verbose=True if verbose else None,
                      temperature=temperatures(request), initial_prompt=request.prompt or None,
                      word_timestamps=request.word_timestamps, language=language,
                      task=request.task, fp16=fp16)
