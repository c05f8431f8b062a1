"""Train a tiny VLM of a real family to name the colour of an image (test time, ~10 s).

Adapted from the project's reference script (shared notes, train_tiny_vlm_colours.py):
inputs are built as mlx-vlm builds them at inference (``prepare_inputs`` per image), the
loss covers the answer tokens and the end of turn only. The result is saved as an mlx-vlm
folder that mlxd serves like any other model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

QUESTION = "What colour is this image?"
COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 50, 220),
    "yellow": (240, 225, 30), "black": (15, 15, 15), "white": (240, 240, 240),
    "orange": (250, 140, 10), "purple": (130, 30, 160),
}
NAMES = list(COLOURS)
SIZES = [56, 84]  # 4 and 9 qwen image tokens: small steps keep training fast
EOT = {"qwen2_vl": "<|im_end|>", "llava": "</s>", "gemma3": "<end_of_turn>"}


def make_image(name: str, rng: np.random.Generator, w: int, h: int) -> Any:
    from PIL import Image

    base = np.array(COLOURS[name], np.float32) + rng.uniform(-25, 25, 3)
    arr = base[None, None, :] + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


class _Data:
    def __init__(self, model: Any, processor: Any) -> None:
        from mlx_vlm.utils import should_add_special_tokens

        self.processor = processor
        self.tok = processor.tokenizer
        self.model_type = model.config.model_type
        self.image_token_index = getattr(model.config, "image_token_index", None)
        self.add_special = should_add_special_tokens(self.model_type, processor)
        eot = self.tok.convert_tokens_to_ids(EOT[self.model_type])
        self.pad = self.tok.pad_token_id
        # Rendered as mlxd renders a request whose image part comes first (mlx-vlm's own
        # prompt_utils puts gemma3's image after the text: a model trained on that order
        # would not answer requests in the usual one).
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": QUESTION}]}]
        self.prompt = self.tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
        lead = " " if self.prompt.endswith(":") else ""
        self.answer_ids = {n: [*self.tok.encode(lead + n, add_special_tokens=False), eot]
                           for n in NAMES}

    def batch(self, names: list[str], images: list[Any]) -> tuple[Any, dict[str, Any], Any]:
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs

        inps = [prepare_inputs(self.processor, images=[im], prompts=self.prompt,
                               image_token_index=self.image_token_index,
                               add_special_tokens=self.add_special) for im in images]
        prompts = [i["input_ids"][0].tolist() for i in inps]
        p = len(prompts[0])
        a = max(len(self.answer_ids[n]) for n in names)
        ids = np.full((len(names), p + a), self.pad, np.int32)
        lmask = np.zeros((len(names), p + a - 1), np.float32)
        for i, (n, row) in enumerate(zip(names, prompts)):
            ans = self.answer_ids[n]
            ids[i, :p] = row
            ids[i, p:p + len(ans)] = ans
            lmask[i, p - 1:p - 1 + len(ans)] = 1.0
        extra = {"pixel_values": mx.concatenate([i["pixel_values"] for i in inps], axis=0)}
        if "image_grid_thw" in inps[0]:
            extra["image_grid_thw"] = mx.concatenate([i["image_grid_thw"] for i in inps], axis=0)
        return mx.array(ids), extra, mx.array(lmask)


def _forward(model: Any, ids: Any, extra: dict[str, Any]) -> Any:
    import mlx.core as mx

    mt = model.config.model_type
    if mt == "qwen2_vl":
        return model(ids, pixel_values=extra["pixel_values"],
                     image_grid_thw=extra["image_grid_thw"]).logits
    if mt == "gemma3":  # causal LM over the merged embeddings (the 4-D mask is not causal)
        emb = model.get_input_embeddings(ids, extra["pixel_values"],
                                         mask=mx.ones(ids.shape, mx.int32)).inputs_embeds
        h = model.language_model.model(ids, inputs_embeds=emb)
        return model.language_model.model.embed_tokens.as_linear(h)
    return model(ids, extra["pixel_values"], mask=None).logits


def _gather_merge(model: Any) -> None:
    """llava: MLX cannot differentiate mlx-vlm's slice-assign merge; a gather merge (the
    same result for one row) is used for training only (the instance, not the class)."""
    import mlx.core as mx

    tok = model.config.image_token_index

    def merge(image_features: Any, inputs_embeds: Any, input_ids: Any) -> Any:
        m = input_ids == tok
        idx = mx.maximum(mx.cumsum(m.astype(mx.int32), axis=1) - 1, 0)
        g = mx.take_along_axis(image_features, idx[..., None], axis=1)
        return mx.where(m[..., None], g.astype(inputs_embeds.dtype), inputs_embeds)

    model._merge_input_ids_with_image_features = merge


def train_colours(src: Path, out: Path, *, seed: int = 0, max_steps: int = 300) -> Path:
    """Train the model in ``src`` until every held-out colour is answered (teacher-forced),
    and save it to ``out``. Reused when ``out`` exists."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    from mlxd.engines.vision.patches import registry

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    model, processor = load(str(src))
    handle = registry().activate(model.config.model_type, "train", (model, processor))
    try:
        if model.config.model_type == "llava":
            _gather_merge(model)
        data = _Data(model, processor)
        lm = model.language_model
        if model.config.model_type == "gemma3":
            lm.lm_head.weight = lm.model.embed_tokens.weight
            lm.lm_head.freeze()
        model.train()
        opt = optim.Adam(learning_rate=1e-3)

        def loss_fn(m: Any, ids: Any, extra: Any, lmask: Any) -> Any:
            logits = _forward(m, ids, extra)[:, :-1]
            ce = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:])
            return (ce * lmask).sum() / lmask.sum()

        step = nn.value_and_grad(model, loss_fn)
        held = [(n, make_image(n, np.random.default_rng(7 + i), 84, 84))
                for i, n in enumerate(NAMES)]
        for i in range(max_steps):
            s = SIZES[rng.integers(len(SIZES))], SIZES[rng.integers(len(SIZES))]
            names = [NAMES[j % len(NAMES)] for j in rng.permutation(8)]
            ids, extra, lmask = data.batch(names, [make_image(n, rng, *s) for n in names])
            loss, grads = step(model, ids, extra, lmask)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state, loss)
            if i % 10 == 9:
                ids, extra, lmask = data.batch([n for n, _ in held], [im for _, im in held])
                ok = (mx.argmax(_forward(model, ids, extra)[:, :-1], -1) == ids[:, 1:]) | \
                    (lmask == 0)
                if bool(mx.all(ok).item()):
                    break
        if model.config.model_type == "gemma3":
            lm.lm_head.weight = lm.model.embed_tokens.weight
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    finally:
        handle.undo()
    return out
