"""Tests: build tiny random-weight vision-language models of REAL mlx-vlm architectures,
fully offline (no Hugging Face hub), loadable with `mlx_vlm.load(folder)`.

Families: qwen2_vl, qwen2_5_vl, llava, gemma3, smolvlm (idefics3 arch), paligemma

Each output folder contains:
  config.json                 model_type + top-level text params (qwen*) or text_config, + vision_config
  model.safetensors           random weights (MLX layout by default, HF/PyTorch layout with --hf-format)
  tokenizer.json              byte-level BPE trained on Python stdlib source + family special tokens
  tokenizer_config.json       PreTrainedTokenizerFast + special tokens (+ image_token etc.) + chat_template
  special_tokens_map.json
  chat_template.json          {"chat_template": ...}  (read by mlx-vlm's own processors)
  preprocessor_config.json    image processor (written by transformers' *ImageProcessorPil.save_pretrained
                              where the class exists without torch, else by hand)
  processor_config.json       processor kwargs (image_seq_len, patch_size, ...)
  generation_config.json

Usage
  python make_tiny_vlm.py --family qwen2_vl --out models/qwen2_vl-tiny
  python make_tiny_vlm.py --family qwen2_vl --out models/qwen2_vl-hf --hf-format   # HF key names, torch conv layout
  python make_tiny_vlm.py --family all --out models                               # one subfolder per family

Requires: mlx, mlx-vlm (0.7.10 tested), transformers (5.x, pulled by mlx-vlm), tokenizers, pillow.
No torch needed.
"""
import argparse
import glob
import json
import os
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "smolvlm", "paligemma"]

# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------


def corpus_files(max_bytes):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(
        f for f in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
        if "site-packages" not in f and "/test" not in f and "idle_test" not in f
    )
    out, total = [], 0
    for f in files:
        out.append(f)
        total += os.path.getsize(f)
        if total >= max_bytes:
            break
    return out, total


def base_tokenizer(vocab_size, corpus_mb, cache_dir):
    """Byte-level BPE trained on stdlib source; cached as JSON (no specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    cache = Path(cache_dir) / f"base_bpe_{vocab_size}_{corpus_mb}mb.json"
    if cache.exists():
        return Tokenizer.from_file(str(cache))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files, total = corpus_files(int(corpus_mb * 1e6))

    def it():
        for f in files:
            with open(f, encoding="utf-8", errors="ignore") as fh:
                yield fh.read()

    t0 = time.time()
    tok.train_from_iterator(it(), trainer=trainer, length=len(files))
    print(f"tokenizer: BPE trained on {len(files)} files / {total/1e6:.1f} MB in "
          f"{time.time()-t0:.1f}s, vocab={tok.get_vocab_size()}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(cache))
    return tok


def write_tokenizer(out, base_tok_json, specials, tok_cfg_extra, chat_template,
                    bos_post_processor=None):
    """Add family specials to a copy of the base tokenizer and write all tokenizer files.
    Returns {token: id}."""
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_str(base_tok_json)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos_post_processor:  # e.g. Gemma-style: always prepend <bos>
        bos = bos_post_processor
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for s in specials}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": chat_template,
    }
    cfg.update(tok_cfg_extra)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    stm = {k: v for k, v in tok_cfg_extra.items()
           if k in ("bos_token", "eos_token", "pad_token", "unk_token",
                    "additional_special_tokens") and v is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2))
    return ids, tok.get_vocab_size()


# --------------------------------------------------------------------------
# chat templates (shortened versions of the real ones; same special-token layout)
# --------------------------------------------------------------------------

QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-1.5 style (llava-hf uses "USER: <image>\n... ASSISTANT:")
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}\n"
    "{% else %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# PaliGemma has no chat template (prompt-only); mlx-vlm's prompt_utils formats it.
PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)

# --------------------------------------------------------------------------
# family specs
# --------------------------------------------------------------------------

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                 "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                 "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                 "<|image_pad|>", "<|video_pad|>"]


def spec_qwen(family, a):
    H, L, heads, kv = a.hidden, a.layers, a.heads, a.kv_heads
    head_dim = H // heads
    half = head_dim // 2                       # mrope_section sums to head_dim/2
    t = half // 4
    mrope = [t, (half - t) // 2, half - t - (half - t) // 2]
    tok = dict(specials=QWEN_SPECIALS,
               extra={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                      "unk_token": None, "errors": "replace", "split_special_tokens": False,
                      "additional_special_tokens": QWEN_SPECIALS[1:]},
               template=QWEN2_VL_TEMPLATE)

    def config(ids, vocab):
        cfg = {
            "architectures": ["Qwen2VLForConditionalGeneration" if family == "qwen2_vl"
                              else "Qwen2_5_VLForConditionalGeneration"],
            "model_type": family,
            # mlx-vlm's qwen2(_5)_vl ModelConfig.from_dict copies ROOT keys into text_config,
            # so the text params must live at the root (as in the published Qwen2-VL configs).
            "hidden_size": H, "intermediate_size": a.intermediate or 2 * H,
            "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": kv,
            "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": mrope},
            "tie_word_embeddings": True, "hidden_act": "silu", "sliding_window": 4096,
            "use_sliding_window": False, "torch_dtype": a.dtype,
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "vision_token_id": ids["<|vision_pad|>"],
        }
        ve = a.vision_hidden
        if family == "qwen2_vl":
            cfg["vision_config"] = {
                "model_type": "qwen2_vl", "depth": a.vision_layers, "embed_dim": ve,
                "hidden_size": H,  # merger output = LM hidden size
                "num_heads": a.vision_heads, "in_channels": 3, "in_chans": 3,
                "mlp_ratio": 2,  # must be int: transformers 5 strict config validation
                "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "hidden_act": "quick_gelu"}
        else:
            cfg["vision_config"] = {
                "model_type": "qwen2_5_vl", "depth": a.vision_layers, "hidden_size": ve,
                "intermediate_size": 2 * ve, "out_hidden_size": H,
                "num_heads": a.vision_heads, "in_channels": 3, "in_chans": 3,
                "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "window_size": 112, "tokens_per_second": 2,
                "fullatt_block_indexes": [a.vision_layers - 1], "hidden_act": "silu"}
        return cfg

    def preprocessor(out):
        # Qwen2-VL image processor settings. min/max_pixels kept small => few image tokens
        # (max 112*112 px -> 8x8 patches of 14 -> 16 tokens after 2x2 merge).
        d = {"min_pixels": a.qwen_min_pixels, "max_pixels": a.qwen_max_pixels,
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711]}
        try:  # transformers 5 falls back to the PIL (no-torch) image processor class
            from transformers import Qwen2VLImageProcessor
            ip = Qwen2VLImageProcessor(
                size={"shortest_edge": d["min_pixels"], "longest_edge": d["max_pixels"]},
                patch_size=14, temporal_patch_size=2, merge_size=2,
                image_mean=d["image_mean"], image_std=d["image_std"])
            ip.save_pretrained(out)
            pp = json.loads((out / "preprocessor_config.json").read_text())
            pp.update({"min_pixels": d["min_pixels"], "max_pixels": d["max_pixels"]})
            pp["image_processor_type"] = "Qwen2VLImageProcessor"
            (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
        except Exception as e:  # pragma: no cover
            print("  (transformers Qwen2VLImageProcessor unavailable, writing by hand:", e, ")")
            d.update({"image_processor_type": "Qwen2VLImageProcessor",
                      "processor_class": "Qwen2VLProcessor", "do_resize": True,
                      "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                      "do_convert_rgb": True,
                      "size": {"shortest_edge": d["min_pixels"], "longest_edge": d["max_pixels"]}})
            (out / "preprocessor_config.json").write_text(json.dumps(d, indent=2))
        # video settings (qwen2_vl reads them from preprocessor_config or video_preprocessor_config)
        vp = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
              "temporal_patch_size": 2, "merge_size": 2, "min_pixels": d["min_pixels"],
              "max_pixels": d["max_pixels"], "fps": 2.0, "min_frames": 2, "max_frames": 8,
              "image_mean": d["image_mean"], "image_std": d["image_std"]}
        (out / "video_preprocessor_config.json").write_text(json.dumps(vp, indent=2))
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "Qwen2VLProcessor" if family == "qwen2_vl"
             else "Qwen2_5_VLProcessor"}, indent=2))

    return tok, config, preprocessor


def spec_llava(a):
    specials = ["<s>", "</s>", "<unk>", "<pad>", "<image>"]
    H = a.hidden
    img, patch = a.llava_image_size, 14
    tok = dict(specials=specials,
               extra={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                      "unk_token": "<unk>", "image_token": "<image>",
                      "extra_special_tokens": {"image_token": "<image>"},
                      "add_bos_token": True, "padding_side": "left"},
               template=LLAVA_TEMPLATE, bos="<s>")

    def config(ids, vocab):
        return {
            "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "image_token_index": ids["<image>"], "projector_hidden_act": "gelu",
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
            "vocab_size": vocab, "pad_token_id": ids["<pad>"], "eos_token_id": ids["</s>"],
            "tie_word_embeddings": False,
            "text_config": {
                "model_type": "llama", "hidden_size": H, "intermediate_size": a.intermediate or 2 * H,
                "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
                "num_key_value_heads": a.kv_heads, "rms_norm_eps": 1e-5, "vocab_size": vocab,
                "max_position_embeddings": 4096, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "bos_token_id": ids["<s>"],
                "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"]},
            "vision_config": {
                "model_type": "clip_vision_model", "hidden_size": a.vision_hidden,
                "intermediate_size": 2 * a.vision_hidden, "num_hidden_layers": a.vision_layers,
                "num_attention_heads": a.vision_heads, "image_size": img, "patch_size": patch,
                "projection_dim": a.vision_hidden, "num_channels": 3, "layer_norm_eps": 1e-5,
                "hidden_act": "quick_gelu"},
        }

    def preprocessor(out):
        from transformers import CLIPImageProcessor
        ip = CLIPImageProcessor(size={"shortest_edge": img}, crop_size={"height": img, "width": img},
                                do_center_crop=True, do_resize=True, do_normalize=True,
                                image_mean=[0.48145466, 0.4578275, 0.40821073],
                                image_std=[0.26862954, 0.26130258, 0.27577711])
        ip.save_pretrained(out)
        pp = json.loads((out / "preprocessor_config.json").read_text())
        pp["image_processor_type"] = "CLIPImageProcessor"
        (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
        (out / "processor_config.json").write_text(json.dumps({
            "processor_class": "LlavaProcessor", "image_token": "<image>", "patch_size": patch,
            "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
            indent=2))

    return tok, config, preprocessor


def spec_gemma3(a):
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    H = a.hidden
    img, patch, mm_tokens = a.gemma_image_size, 14, a.gemma_mm_tokens
    tok = dict(specials=specials,
               extra={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                      "unk_token": "<unk>", "add_bos_token": True, "padding_side": "left",
                      "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                      "image_token": "<image_soft_token>",
                      "extra_special_tokens": {"boi_token": "<start_of_image>",
                                               "eoi_token": "<end_of_image>",
                                               "image_token": "<image_soft_token>"}},
               template=GEMMA3_TEMPLATE, bos="<bos>")
    head_dim = H // a.heads

    def config(ids, vocab):
        return {
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
            "image_token_index": ids["<image_soft_token>"], "mm_tokens_per_image": mm_tokens,
            "vocab_size": vocab, "hidden_size": H, "pad_token_id": ids["<pad>"],
            "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "bos_token_id": ids["<bos>"],
            "text_config": {
                "model_type": "gemma3_text", "hidden_size": H,
                "intermediate_size": a.intermediate or 2 * H, "num_hidden_layers": a.layers,
                "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-6,
                "vocab_size": vocab, "sliding_window": 512, "sliding_window_pattern": 2,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_global_base_freq": 1000000.0, "max_position_embeddings": 4096,
                "mm_tokens_per_image": mm_tokens, "hidden_activation": "gelu_pytorch_tanh"},
            "vision_config": {
                "model_type": "siglip_vision_model", "hidden_size": a.vision_hidden,
                "intermediate_size": 2 * a.vision_hidden, "num_hidden_layers": a.vision_layers,
                "num_attention_heads": a.vision_heads, "image_size": img, "patch_size": patch,
                "num_channels": 3, "layer_norm_eps": 1e-6, "vision_use_head": False},
        }

    def preprocessor(out):
        from transformers import Gemma3ImageProcessor
        ip = Gemma3ImageProcessor(size={"height": img, "width": img}, do_pan_and_scan=False,
                                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        ip.save_pretrained(out)
        pp = json.loads((out / "preprocessor_config.json").read_text())
        pp["image_processor_type"] = "Gemma3ImageProcessor"
        pp["image_seq_length"] = mm_tokens
        (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "Gemma3Processor", "image_seq_length": mm_tokens}, indent=2))

    return tok, config, preprocessor


def spec_smolvlm(a):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>",
                "<fake_token_around_image>", "<image>", "<global-img>"]
    # SmolVLM row/col tokens <row_1_col_1> ... are needed when images are split into tiles
    specials += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    H = a.hidden
    img, patch, scale = a.smol_image_size, a.smol_patch, 2
    seq_len = ((img // patch) ** 2) // (scale ** 2)
    tok = dict(specials=specials,
               extra={"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
                      "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                      "additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                    "<end_of_utterance>", "<global-img>"],
                      "extra_special_tokens": {"fake_image_token": "<fake_token_around_image>",
                                               "image_token": "<image>",
                                               "global_image_token": "<global-img>",
                                               "end_of_utterance_token": "<end_of_utterance>"}},
               template=SMOLVLM_TEMPLATE)

    def config(ids, vocab):
        return {
            "architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm",
            "image_token_id": ids["<image>"], "scale_factor": scale, "vocab_size": vocab,
            "pad_token_id": ids["<|im_end|>"], "eos_token_id": ids["<end_of_utterance>"],
            "tie_word_embeddings": False,
            "text_config": {
                "model_type": "llama", "hidden_size": H, "intermediate_size": a.intermediate or 2 * H,
                "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
                "num_key_value_heads": a.kv_heads, "rms_norm_eps": 1e-5, "vocab_size": vocab,
                "rope_theta": 100000.0, "max_position_embeddings": 4096,
                "tie_word_embeddings": False},
            "vision_config": {
                "model_type": "smolvlm_vision", "hidden_size": a.vision_hidden,
                "intermediate_size": 2 * a.vision_hidden, "num_hidden_layers": a.vision_layers,
                "num_attention_heads": a.vision_heads, "image_size": img, "patch_size": patch,
                "num_channels": 3, "layer_norm_eps": 1e-6},
        }

    def preprocessor(out):
        # size.longest_edge = resize target before splitting; max_image_size = tile size
        d = dict(do_resize=True, size={"longest_edge": img * (2 if a.smol_split else 1)},
                 do_image_splitting=a.smol_split,
                 max_image_size={"longest_edge": img}, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                 do_convert_rgb=True, do_pad=True)
        try:
            from transformers import SmolVLMImageProcessor
            ip = SmolVLMImageProcessor(**d)
            ip.save_pretrained(out)
            pp = json.loads((out / "preprocessor_config.json").read_text())
        except Exception as e:  # pragma: no cover
            print("  (SmolVLMImageProcessor unavailable, writing by hand:", e, ")")
            pp = dict(d)
        pp["image_processor_type"] = "SmolVLMImageProcessor"
        pp["processor_class"] = "SmolVLMProcessor"
        (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "SmolVLMProcessor", "image_seq_len": seq_len}, indent=2))

    return tok, config, preprocessor


def spec_paligemma(a):
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
    H = a.hidden
    img, patch = a.pali_image_size, 14
    n_img = (img // patch) ** 2
    tok = dict(specials=specials,
               extra={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                      "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                      "image_token": "<image>",
                      "extra_special_tokens": {"image_token": "<image>"}},
               template=PALIGEMMA_TEMPLATE)
    head_dim = H // a.heads

    def config(ids, vocab):
        return {
            "architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma",
            "image_token_index": ids["<image>"], "vocab_size": vocab, "hidden_size": H,
            "projection_dim": H, "pad_token_id": ids["<pad>"], "eos_token_id": ids["<eos>"],
            "bos_token_id": ids["<bos>"],
            "text_config": {
                "model_type": "gemma", "hidden_size": H, "intermediate_size": a.intermediate or 2 * H,
                "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
                "num_key_value_heads": a.kv_heads, "head_dim": head_dim, "vocab_size": vocab,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_image_tokens": n_img,
                "hidden_activation": "gelu_pytorch_tanh"},
            "vision_config": {
                "model_type": "siglip_vision_model", "hidden_size": a.vision_hidden,
                "intermediate_size": 2 * a.vision_hidden, "num_hidden_layers": a.vision_layers,
                "num_attention_heads": a.vision_heads, "image_size": img, "patch_size": patch,
                "projection_dim": H, "num_image_tokens": n_img, "num_channels": 3},
        }

    def preprocessor(out):
        from transformers import SiglipImageProcessor
        ip = SiglipImageProcessor(size={"height": img, "width": img}, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3)
        ip.save_pretrained(out)
        pp = json.loads((out / "preprocessor_config.json").read_text())
        pp["image_processor_type"] = "SiglipImageProcessor"
        pp["image_seq_length"] = n_img
        pp["processor_class"] = "PaliGemmaProcessor"
        (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
        (out / "processor_config.json").write_text(json.dumps(
            {"processor_class": "PaliGemmaProcessor", "image_seq_length": n_img}, indent=2))

    return tok, config, preprocessor


def get_spec(family, a):
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return spec_qwen(family, a)
    return {"llava": spec_llava, "gemma3": spec_gemma3, "smolvlm": spec_smolvlm,
            "paligemma": spec_paligemma}[family](a)


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------


def build_model(config):
    """Instantiate the mlx-vlm Model class exactly as mlx_vlm.utils.load_model does."""
    import copy

    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = copy.deepcopy(config)
    arch, _ = get_model_and_args(cfg)
    cfg.setdefault("text_config", cfg.pop("llm_config", {}))
    cfg.setdefault("vision_config", {})
    cfg.setdefault("audio_config", {})
    mc = arch.ModelConfig.from_dict(cfg)
    mc = update_module_configs(mc, arch, cfg, ["text", "vision", "perceiver", "projector", "audio"])
    return arch.Model(mc)


def to_hf_layout(family, weights):
    """MLX parameter names/layout -> the HF checkpoint names/layout that mlx-vlm's sanitize()
    expects from a hub checkpoint (used to test `mlx_vlm convert` on an HF-style folder)."""
    out = {}
    for k, v in weights.items():
        nk = k
        if family in ("qwen2_vl", "qwen2_5_vl"):
            nk = nk.replace("vision_tower.", "visual.")
            nk = nk.replace("language_model.model.", "model.").replace("language_model.lm_head", "lm_head")
            if nk.endswith("patch_embed.proj.weight") and v.ndim == 5:  # (O,T,H,W,C)->(O,C,T,H,W)
                v = v.transpose(0, 4, 1, 2, 3)
        else:
            if v.ndim == 4 and ("patch_embedding.weight" in nk or "patch_embed" in nk):
                v = v.transpose(0, 3, 1, 2)  # (O,H,W,C) -> (O,C,H,W)
        out[nk] = v
    return out


# --------------------------------------------------------------------------


def build(family, out, a, base_json):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok, config_fn, preproc_fn = get_spec(family, a)
    ids, vocab = write_tokenizer(out, base_json, tok["specials"], tok["extra"], tok["template"],
                                 tok.get("bos"))
    config = config_fn(ids, vocab)
    preproc_fn(out)
    gen = {"eos_token_id": config.get("eos_token_id"), "pad_token_id": config.get("pad_token_id")}
    if config.get("bos_token_id") is not None:
        gen["bos_token_id"] = config["bos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

    mx.random.seed(a.seed)
    model = build_model(config)
    params = dict(tree_flatten(model.parameters()))
    if not a.keep_special_logits:
        # zero the embedding rows of special tokens (tied or untied heads) so a random model
        # practically never emits EOS / image tokens => full-length, deterministic benchmarks
        rows = mx.array(sorted(ids.values()))
        for k in list(params):
            if (k.endswith(("embed_tokens.weight", "lm_head.weight"))
                    and params[k].shape[0] == vocab):
                w = params[k]
                w[rows] = 0.0
                params[k] = w
    dtype = getattr(mx, a.dtype)
    params = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in params.items()}
    nparams = sum(v.size for v in params.values())
    if a.hf_format:
        params = to_hf_layout(family, params)
        meta = {"format": "pt"}
    else:
        meta = {"format": "mlx"}
    mx.eval(params)
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata=meta)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # mlx-vlm's processors call AutoTokenizer.from_pretrained(folder), which parses config.json
    # with transformers' *strict* config dataclasses (v5): a wrong field type (e.g. a float
    # mlp_ratio) makes processor loading fail. Check it here.
    try:
        from transformers import AutoConfig
        AutoConfig.from_pretrained(str(out))
    except Exception as e:
        print(f"  WARNING: transformers.AutoConfig rejects config.json: {type(e).__name__}: {e}")
    size = os.path.getsize(out / "model.safetensors")
    print(f"{family}: {nparams/1e6:.2f}M params, vocab={vocab}, dtype={a.dtype}, "
          f"{'HF' if a.hf_format else 'MLX'} layout, file={size/1e6:.1f} MB, "
          f"{time.time()-t0:.1f}s -> {out}")
    return out


def main():
    a = _parser().parse_args()
    base = base_tokenizer(a.vocab, a.corpus_mb, a.tokenizer_cache)
    base_json = base.to_str()
    fams = FAMILIES if a.family == "all" else [a.family]
    for fam in fams:
        out = Path(a.out) / fam if a.family == "all" else Path(a.out)
        build(fam, out, a, base_json)


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, choices=[*FAMILIES, "all"])
    ap.add_argument("--out", required=True, help="output folder (parent folder for --family all)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vision-hidden", type=int, default=64)
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--vision-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocab before special tokens")
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    ap.add_argument("--tokenizer-cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tiny-vlm-tokenizers"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--hf-format", action="store_true",
                    help="write HF/PyTorch key names + conv layout (input for mlx_vlm convert)")
    ap.add_argument("--keep-special-logits", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    # per-family image geometry (small => few image tokens)
    ap.add_argument("--qwen-min-pixels", type=int, default=28 * 28 * 4)
    ap.add_argument("--qwen-max-pixels", type=int, default=112 * 112)
    ap.add_argument("--llava-image-size", type=int, default=56)    # 4x4=16 patches -> 16 tokens
    ap.add_argument("--gemma-image-size", type=int, default=56)    # 4x4 patches -> pooled
    ap.add_argument("--gemma-mm-tokens", type=int, default=4)      # 2x2 pooled tokens
    ap.add_argument("--smol-image-size", type=int, default=64)
    ap.add_argument("--smol-patch", type=int, default=16)          # 4x4 patches / 2^2 -> 4 tokens
    ap.add_argument("--smol-split", action="store_true", help="do_image_splitting (tiles)")
    ap.add_argument("--pali-image-size", type=int, default=56)     # 16 image tokens
    return ap


def build_tiny_vlm(family: str, out: Path, tokenizer_cache: Path, **overrides) -> Path:
    """One tiny float32 VLM of ``family`` in ``out`` (built once: reused when present)."""
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    ap = argparse.ArgumentParser()
    ap.add_argument("--family")
    ap.add_argument("--out")
    a = _defaults()
    a.dtype = "float32"
    a.tokenizer_cache = str(tokenizer_cache)
    for k, v in overrides.items():
        setattr(a, k, v)
    base = base_tokenizer(a.vocab, a.corpus_mb, a.tokenizer_cache)
    return build(family, out, a, base.to_str())


def _defaults() -> argparse.Namespace:
    """The command line's defaults, as a namespace."""
    import sys
    argv, sys.argv = sys.argv, ["tiny_vlm", "--family", "qwen2_vl", "--out", "unused"]
    try:
        return _parser().parse_args()
    finally:
        sys.argv = argv


if __name__ == "__main__":
    main()
