"""Tiny random-weight models of real architectures, built at test time.

A byte-level BPE tokenizer is trained on Python's own stdlib sources (no hub
access), a ChatML chat template is attached, and a Llama model of the
requested size is initialised with a fixed seed and saved as an MLX folder
that mlx-lm loads like any other.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(max_bytes: int) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "*.py")))
    texts, total = [], 0
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(out: Path, vocab_size: int = 2048, extra_tokens: tuple[str, ...] = (),
                    chat_template: str = CHATML) -> dict[str, int]:
    """Train and save a byte-level BPE tokenizer; returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = SPECIALS + list(extra_tokens)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(2_000_000), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": s in SPECIALS} for s in specials}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "clean_up_tokenization_spaces": False, "model_max_length": 2048,
        "chat_template": chat_template}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return ids


def build_llama(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int | None = None, intermediate: int | None = None,
                vocab_size: int = 2048, context: int = 2048, seed: int = 0,
                extra_tokens: tuple[str, ...] = (), chat_template: str = CHATML,
                tokenizer_from: Path | None = None, quiet_specials: bool = True) -> Path:
    """Build a random Llama model folder; returns ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (out / name).write_bytes((Path(tokenizer_from) / name).read_bytes())
        cfg = json.loads((Path(tokenizer_from) / "tokenizer_config.json").read_text())
        ids = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
        vocab = json.loads((Path(tokenizer_from) / "tokenizer.json").read_text())
        n_vocab = len(vocab["model"]["vocab"]) + len(vocab.get("added_tokens", []))
    else:
        ids = train_tokenizer(out, vocab_size, extra_tokens, chat_template)
        from tokenizers import Tokenizer

        n_vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "intermediate_size": intermediate or int(8 * hidden / 3 / 8 + 0.5) * 8,
        "vocab_size": n_vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": context, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": None, "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"], "torch_dtype": "float32",
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if quiet_specials:
        # Zero the special tokens' (tied) embedding rows so a random model
        # practically never ends early; tests then get full-length outputs.
        rows = mx.array(sorted(ids[s] for s in SPECIALS))
        w = model.model.embed_tokens.weight
        w[rows] = 0.0
        model.model.embed_tokens.weight = w
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return out


def save_random_mlx_lm(out: Path, config: dict, seed: int = 0) -> Path:
    """An mlx-lm model of ``config``'s architecture with seeded random weights, saved
    (weights + config.json) into ``out`` like any MLX folder."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
