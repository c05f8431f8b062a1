"""The no-HTTP contenders of ``bench/embeddings.py``, each run in its own process.

``python -m bench.embeddings_workers KIND --model FOLDER --inputs FILE --json OUT``
with KIND one of:

- ``raw``: mlx-embeddings itself (``utils.load``; tokenizer + model + eval per batch),
- ``st``: sentence-transformers on torch CPU (``encode(batch_size=...)``),
- ``raw-rerank``: mlxd's ``rerank_forward`` on MLX without the server,
- ``hf-rerank``: transformers ``AutoModelForSequenceClassification`` on torch CPU.

Each does one warm-up pass, then ``--repeats`` timed passes over the same inputs
in batches of ``--batch``, and writes the pass times (and, for ``st``, the
vectors as .npy so the parent can check the HTTP vectors against them).
A separate process per contender: the same BLAS environment (``LD_PRELOAD``)
as the server, and no torch in MLX's process or the other way round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Pass = Callable[[], Any]


def _timed(run_pass: Pass, repeats: int) -> tuple[list[float], Any]:
    out = run_pass()  # warm-up: lazy loads, allocator, thread pools
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run_pass()
        times.append(time.perf_counter() - start)
    return times, out


def _batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def raw_mlx_embeddings(model_dir: str, texts: list[str], batch: int) -> Pass:
    """mlx-embeddings as its README uses it: tokenizer(padding) -> model -> text_embeds."""
    import mlx.core as mx
    from mlx_embeddings.utils import load

    model, tokenizer = load(model_dir)

    def run_pass() -> np.ndarray:
        out = []
        for chunk in _batches(texts, batch):
            enc = tokenizer(chunk, return_tensors="mlx", padding=True, truncation=True,
                            max_length=256)
            emb = model(enc["input_ids"], attention_mask=enc["attention_mask"]).text_embeds
            mx.eval(emb)
            out.append(np.array(emb))
        return np.concatenate(out)

    return run_pass


def sentence_transformers(model_dir: str, texts: list[str], batch: int) -> Pass:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    return lambda: model.encode(texts, batch_size=batch, convert_to_numpy=True)


def raw_rerank(model_dir: str, pairs: list[list[str]], batch: int) -> Pass:
    """mlxd's ``rerank_forward`` on MLX, tokenised by the model's tokenizer, no server."""
    import mlx.core as mx
    from transformers import AutoTokenizer

    from mlxd.engines.encoders.cross_encoder import load_cross_encoder, rerank_forward

    model = load_cross_encoder(Path(model_dir), dtype=mx.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)

    def run_pass() -> np.ndarray:
        out = []
        for chunk in _batches(pairs, batch):
            enc = tok([q for q, _ in chunk], [d for _, d in chunk], truncation="only_second",
                      max_length=512, padding=True, return_tensors="np")
            logits = rerank_forward(model, mx.array(enc["input_ids"]),
                                    mx.array(enc["attention_mask"]),
                                    mx.array(enc["token_type_ids"]))
            mx.eval(logits)
            out.append(np.array(logits))
        return np.concatenate(out)

    return run_pass


def hf_rerank(model_dir: str, pairs: list[list[str]], batch: int) -> Pass:
    """transformers' BertForSequenceClassification on torch CPU."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)

    def run_pass() -> np.ndarray:
        out = []
        with torch.inference_mode():
            for chunk in _batches(pairs, batch):
                enc = tok([q for q, _ in chunk], [d for _, d in chunk], truncation="only_second",
                          max_length=512, padding=True, return_tensors="pt")
                out.append(model(**enc).logits.numpy())
        return np.concatenate(out)

    return run_pass


KINDS: dict[str, Callable[[str, list[Any], int], Pass]] = {
    "raw": raw_mlx_embeddings, "st": sentence_transformers,
    "raw-rerank": raw_rerank, "hf-rerank": hf_rerank}


def main(argv: list[str] | None = None) -> int:
    """Measure one contender; write ``{"times_s": [...], "items": n}`` to ``--json``."""
    p = argparse.ArgumentParser(prog="python -m bench.embeddings_workers")
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--model", required=True)
    p.add_argument("--inputs", type=Path, required=True, help="JSON list of texts or pairs")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--vectors", type=Path, default=None, help="save the outputs (.npy)")
    args = p.parse_args(argv)
    items = json.loads(args.inputs.read_text())
    times, out = _timed(KINDS[args.kind](args.model, items, args.batch), args.repeats)
    if args.vectors is not None:
        np.save(args.vectors, np.asarray(out, dtype=np.float32))
    args.json.write_text(json.dumps({"kind": args.kind, "items": len(items),
                                     "batch": args.batch, "times_s": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
