"""The engine protocols: one lifecycle every engine shares, one call surface per family.

A route leases a model through its family (``manager.acquire(name, CHAT)``)
and gets a ``ModelLease[TextGenerator]``: the type checker then holds it to
the family's protocol, never to one engine's attributes. Which engine class
serves which kind is each kind's ``KindSpec`` (``models/kinds.py``), read by
``engines/registry.py``.

The lifecycle every engine shares (``ModelEngine``, with its typed ``EngineFacts``
and ``EngineStats``) lives in ``models/engine.py``, below this layer, so the model
manager holds engines by type too; it is re-exported here.

Nothing here imports MLX or an engine module (the HTTP layer imports this
file); the value types the protocols name are imported for type checking only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, runtime_checkable

from mlxd.models.engine import EngineFacts as EngineFacts  # re-exported
from mlxd.models.engine import EngineStats as EngineStats
from mlxd.models.engine import ModelEngine as ModelEngine
from mlxd.models.engine import Voice as Voice
from mlxd.models.spec import (
    CHAT_KINDS,
    EMBEDDING_KINDS,
    RERANK_KINDS,
    STT_KINDS,
    TTS_KINDS,
    Family,
    ModelKind,
)

if TYPE_CHECKING:
    import numpy as np

    from mlxd.engines.encoders.token_batcher import Encoded
    from mlxd.engines.text.input_processor import PreparedPrompt
    from mlxd.generation.events import Event, TokenLogprob
    from mlxd.generation.params import GenerationRequest


# -- text generation (text and vision-language models) -------------------------

@runtime_checkable
class TextGenerator(ModelEngine, Protocol):
    """Chat and completion models: prepare a request once, then generate from it."""

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Render, tokenise and check ``request`` off the event loop (a 4xx if it is bad)."""

    def generate(self, prepared: PreparedPrompt, seed_offset: int = 0) -> AsyncIterator[Event]:
        """Stream the events of one choice; closing the iterator cancels it.

        ``seed_offset`` gives each of ``n`` choices its own seed.
        """

    def count_tokens(self, prepared: PreparedPrompt) -> int:
        """Tokens the prepared prompt takes in the context (media placeholders included)."""

    def cached_tokens(self, prepared: PreparedPrompt) -> int:
        """Prompt tokens the prefix cache would supply if the prompt were admitted now
        (an estimate: other requests may change the cache before it is)."""

    def prompt_text(self, prepared: PreparedPrompt) -> str:
        """The prompt as text: what ``echo`` returns and what the model reads."""

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text (special tokens included)."""

    async def prompt_logprobs(self, prepared: PreparedPrompt,
                              top: int) -> list[TokenLogprob]:
        """One entry per prompt token, each with its log-probability given the tokens
        before it and the ``top`` most likely alternatives; the first has none (None)."""

    # -- the token endpoints (/tokenize, /detokenize, /tokenizer_info) --
    async def tokenize(self, request: GenerationRequest, *, add_special_tokens: bool,
                       token_strs: bool = False) -> Tokenized:
        """The tokens of ``request``'s prompt or chat messages, as ``prepare`` renders them
        (a 400 for what ``prepare`` refuses: over the context, media on a text model...),
        without generation's checks; off the event loop."""

    async def decode(self, tokens: Sequence[int]) -> str:
        """Client token ids as text, off the event loop: a 400 for any id outside the
        vocabulary or more ids than the context holds (checked before decoding)."""

    def tokenizer_info(self) -> dict[str, Any]:
        """The special tokens, context length, vocabulary size and chat template
        (``TokenizerInfoResponse``'s fields)."""


@dataclass(frozen=True)
class Tokenized:
    """A prompt's token ids (``token_strs``: each id's vocabulary entry, when asked for)."""

    tokens: list[int]
    max_model_len: int  # the model's context length
    token_strs: list[str] | None = None


# -- embeddings and reranking ---------------------------------------------------

@runtime_checkable
class Embedder(ModelEngine, Protocol):
    """Embedding models: tokenise (and check) inputs, then embed them in shared batches."""

    def check_dimensions(self, dimensions: int | None) -> None:
        """400 unless the model can return vectors of ``dimensions`` (None: its own)."""

    async def encode(self, inputs: list[str | list[int]]) -> list[Encoded]:
        """Texts or token-id lists, tokenised and checked against the model's limits."""

    async def embed(self, encoded: list[Encoded], dimensions: int | None = None) -> np.ndarray:
        """One vector per input (rows of a float32 matrix), cut to ``dimensions``."""


@runtime_checkable
class Reranker(ModelEngine, Protocol):
    """Cross-encoders: score each (query, document) pair."""

    async def encode(self, query: str, documents: list[str]) -> list[Encoded]:
        """The pairs, tokenised (each ``len()`` is its token count) and checked."""

    async def score(self, encoded: list[Encoded]) -> np.ndarray:
        """One relevance score in [0, 1] per pair, in input order."""


# -- speech to text (/v1/audio/transcriptions, /v1/audio/translations) -----------

@dataclass(frozen=True)
class Chunking:
    """How a long recording is cut into Whisper's 30-s windows (``chunking_strategy``).

    ``batched``: at pauses (voice activity), the windows decoded together, each without
    the previous one's text; ``sequential``: mlx-whisper's loop, window after window,
    each conditioned on the text before; ``default``: batched when the recording is
    longer than one window, else sequential. The VAD fields are OpenAI's ``server_vad``.
    """

    mode: Literal["default", "batched", "sequential"] = "default"
    threshold: float = 0.5  # 0-1: higher needs louder audio to count as speech
    silence_duration_ms: int = 400  # a shorter pause does not end the speech
    prefix_padding_ms: int = 300  # audio kept around each stretch of speech


@dataclass(frozen=True)
class TranscriptionRequest:
    """One uploaded recording to transcribe (or translate into English)."""

    audio: np.ndarray  # mono float32 samples in [-1, 1] at ``sample_rate``
    sample_rate: int = 16_000  # what speech recognisers read (media/audio_decode.py)
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = None  # ISO-639-1; None: detect it
    prompt: str | None = None  # text the recording continues (names, spelling, style)
    temperature: float = 0.0
    word_timestamps: bool = False  # ``timestamp_granularities`` includes "word"
    chunking: Chunking = Chunking()


@dataclass(frozen=True)
class TranscriptWord:
    word: str
    start: float  # seconds from the start of the recording
    end: float


@dataclass(frozen=True)
class TranscriptSegment:
    """One stretch of speech, what ``verbose_json``, ``srt`` and ``vtt`` are built from."""

    id: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    compression_ratio: float | None = None


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None  # detected or as requested
    duration: float  # seconds of audio
    segments: tuple[TranscriptSegment, ...] = ()
    words: tuple[TranscriptWord, ...] = ()  # only when word timestamps were asked for
    language_name: str | None = None  # "english" for "en" (verbose_json's field)


@runtime_checkable
class Transcriber(ModelEngine, Protocol):
    """Speech-to-text models. The server decodes the upload and checks its limits
    (``media/audio_decode.py``) before it leases the model."""

    async def transcribe(self, request: TranscriptionRequest,
                         on_text: Callable[[str], None] | None = None) -> Transcription:
        """The whole transcript; the route renders ``response_format`` from it.

        ``on_text`` (for ``stream=true``) is called with each piece of text as it is
        decoded (a segment, a window), from the model's worker thread.
        """


# -- text to speech (/v1/audio/speech, /v1/audio/voices) -------------------------

@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str
    speed: float = 1.0  # OpenAI's range is [0.25, 4.0]
    instructions: str | None = None  # tone and style, for models that take them
    language: str | None = None


@dataclass(frozen=True)
class AudioChunk:
    """Synthesised audio as it is produced; the route encodes ``response_format``."""

    pcm: bytes  # mono, signed 16-bit little-endian samples
    sample_rate: int


@runtime_checkable
class SpeechSynthesizer(ModelEngine, Protocol):
    """Text-to-speech models."""

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        """Stream the speech; closing the iterator cancels it."""


# -- what each endpoint family leases -------------------------------------------

def _text(engine: object) -> TypeGuard[TextGenerator]:
    return isinstance(engine, TextGenerator)


def _embedder(engine: object) -> TypeGuard[Embedder]:
    return isinstance(engine, Embedder)


def _reranker(engine: object) -> TypeGuard[Reranker]:
    return isinstance(engine, Reranker)


def _transcriber(engine: object) -> TypeGuard[Transcriber]:
    return isinstance(engine, Transcriber)


def _synthesizer(engine: object) -> TypeGuard[SpeechSynthesizer]:
    return isinstance(engine, SpeechSynthesizer)


CHAT: Family[TextGenerator] = Family("chat", CHAT_KINDS, _text)
COMPLETION: Family[TextGenerator] = Family("completion", frozenset({ModelKind.TEXT}), _text)
EMBEDDING: Family[Embedder] = Family("embedding", EMBEDDING_KINDS, _embedder)
RERANK: Family[Reranker] = Family("rerank", RERANK_KINDS, _reranker)
TRANSCRIPTION: Family[Transcriber] = Family("transcription", STT_KINDS, _transcriber)
SPEECH: Family[SpeechSynthesizer] = Family("speech", TTS_KINDS, _synthesizer)
