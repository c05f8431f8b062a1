"""A Kokoro model of the real architecture with random weights, built at test time.

mlx-audio's Kokoro decoder has fixed widths (1024 / 512 channels, a 512-wide
text encoder, a 128 + 128 style vector), so only the ALBERT text model, the
layer counts and the iSTFT generator are shrunk here. The vocabulary is
Kokoro's own phoneme set (IPA plus misaki's A I O W Y diphthong letters), so
espeak-ng's phonemes map onto it as they do for the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

# Kokoro-82M's config.json vocab (symbol -> id); ids < 178.
KOKORO_SYMBOLS = (';:,.!?—…"()“” \u0303ʣʥʦʨᵝ\uab67AIOQSTWYᵊabcdefhijklmnopqrstuvwxyz'
                  'ɑɐɒæβɔɕçɖðʤəɚɛɜɟɡɥɨɪʝɯɰŋɳɲɴøɸθœɹɾɻʁɽʂʃʈʧʊʋʌɣɤχʎʒʔˈˌːʰʲ↓→↗↘ᵻ')
SAMPLE_RATE = 24_000


def kokoro_vocab() -> dict[str, int]:
    return {symbol: i + 1 for i, symbol in enumerate(dict.fromkeys(KOKORO_SYMBOLS))}


def tiny_kokoro_config() -> dict[str, object]:
    return {
        "model_type": "kokoro",
        "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6],
                     "gen_istft_hop_size": 5, "gen_istft_n_fft": 20,
                     "resblock_dilation_sizes": [[1, 3, 5]], "resblock_kernel_sizes": [3],
                     "upsample_initial_channel": 512},
        "dim_in": 64, "dropout": 0.2, "hidden_dim": 512, "max_conv_dim": 512, "max_dur": 4,
        "multispeaker": True, "n_layer": 1, "n_mels": 80, "n_token": 178, "style_dim": 128,
        "text_encoder_kernel_size": 5,
        "plbert": {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
                   "max_position_embeddings": 512, "num_hidden_layers": 1, "dropout": 0.1,
                   "embedding_size": 32},
        "vocab": kokoro_vocab(),
        "sample_rate": SAMPLE_RATE,
    }


def build_tiny_kokoro(folder: Path, voices: tuple[str, ...] = ("af_test", "bm_test"),
                      seed: int = 0) -> Path:
    """Write config.json, model.safetensors and voices/<id>.safetensors into ``folder``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_kokoro_config()
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # mlx-audio starts weight-normalised convolutions with all-ones directions, which
    # compound layer after layer: random directions (each row unit-norm once normalised)
    # keep the activations near unit scale, like a trained model's.
    for i, key in enumerate(k for k in weights if k.endswith("weight_v")):
        weights[key] = mx.random.normal(weights[key].shape, key=mx.random.key(seed * 1000 + i))
    # Random weights put the generator's log-magnitudes far from 0 and its exp() overflows:
    # a small output layer keeps the spectrum finite (the audio is noise, but real numbers).
    for key in ("decoder.generator.conv_post.weight_g", "decoder.generator.conv_post.bias"):
        weights[key] = weights[key] * 0.01
    # A random F0 predictor says -300 Hz, and the sine source turns that into NaN: a pitch
    # near 120 Hz, as a trained model predicts.
    weights["predictor.F0_proj.weight"] = weights["predictor.F0_proj.weight"] * 0.01
    weights["predictor.F0_proj.bias"] = mx.full(weights["predictor.F0_proj.bias"].shape, 120.0)
    # Real checkpoints keep PyTorch's (out, in, k) conv layout, which the loader's sanitize
    # transposes: store those weights as the real files do.
    sanitized = model.sanitize(dict(weights))
    for key, value in weights.items():
        if key in sanitized and sanitized[key].shape != value.shape:
            weights[key] = value.transpose(0, 2, 1)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, ensure_ascii=False))
    (folder / "voices").mkdir(exist_ok=True)
    for i, voice in enumerate(voices):
        mx.random.seed(seed + 1 + i)
        # A voice pack: one 256-wide style vector per input length (510 + 1 rows).
        pack = mx.random.normal((511, 1, 256)) * 0.1
        mx.save_safetensors(str(folder / "voices" / f"{voice}.safetensors"), {"voice": pack})
    return folder
