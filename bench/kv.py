"""Quantized KV (``--kv-bits``) against full precision, on SmolLM2-135M float32, in one process.

``python -m bench.kv [--prompts N] [--tokens N]`` (also run by ``make bench``). Reported:

- KV bytes per token at the model's float32 (and, computed, float16), 8 and 4 bits,
  measured on the batch's extracted rows, and how many 4k-token sessions a fixed KV
  budget holds at each;
- perplexity of a held-out paragraph (``HELD_OUT``, written for this benchmark and used
  nowhere else), its KV quantized as it is written (chunked prefill through the cache);
- greedy agreement over the first ``--tokens`` tokens of ``--prompts`` chat prompts, 8 and
  4 bits against full precision: the share of answers identical throughout, and the mean
  share of each answer before its first difference;
- decode tok/s at 1 and 8 streams with quantized KV against without, each pair run one
  right after the other (``bench/speculative.py``'s timed decode).

Results: ``bench/results/kv.{json,md}``. In-process: no OpenBLAS preload unless the caller
set ``LD_PRELOAD``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.servers import write_report

REPO = Path(__file__).resolve().parent.parent
SESSION_TOKENS = 4096
KV_BUDGET = 8 << 30  # the fixed budget the session counts are for

HELD_OUT = (
    "The ferry left the harbour an hour late, because the fog had settled over the water "
    "before dawn and the captain would not leave until he could see the second buoy. Most of "
    "the passengers waited in the cabin with paper cups of coffee, reading or dozing against "
    "the windows, while a few stood at the rail and watched the town disappear behind them. "
    "A girl with a sketchbook tried to draw the lighthouse, gave up when it vanished into the "
    "grey, and began drawing the people around her instead: an old man asleep under a "
    "newspaper, two students arguing quietly about a train timetable, a dog that had decided "
    "the warmest place on the boat was the engine hatch. By the time the fog lifted they were "
    "halfway across, and the island rose ahead of them, green and low, with a single road "
    "climbing from the pier to the village on the hill. The captain sounded the horn twice, "
    "the dog woke up, and everyone who had been asleep pretended they had not been.")

TOPICS = ("how tides work", "why the sky is blue", "how a bicycle stays upright",
          "what a compiler does", "how bread rises", "why leaves change colour",
          "how a refrigerator keeps food cold", "what causes earthquakes",
          "how vaccines train the immune system", "why cats purr", "how a rainbow forms",
          "what a database index is", "how bees make honey", "why the moon has phases",
          "how solar panels make electricity", "what inflation means",
          "how a violin makes sound", "why we dream", "how glass is made",
          "what photosynthesis is", "how airplanes fly", "why salt melts ice",
          "how the internet routes a message", "what a black hole is", "how coffee is roasted")
TEMPLATES = ("Explain {} in a few sentences.", "Tell a curious child {}.")


def prompts(n: int) -> list[str]:
    """``n`` distinct chat prompts (up to 50)."""
    every = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return every[:n]


def bytes_per_token(model: Any, tok: Any, kv: Any) -> float:
    """KV bytes one token takes, measured on a row extracted from the batch."""
    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
    from mlxd.engines.text.sampling import greedy

    decoder = LMBatchDecoder(model, eos_ids=[], max_num_seqs=1, prefill_step_size=512,
                             kv_quantization=kv)
    tokens = tok.encode(HELD_OUT)[:32]
    uid = decoder.insert(_Prompt(tokens), 0, None, greedy, [], set(), 2)  # type: ignore[arg-type]
    decoder.next()
    cache, covered = decoder.remove([uid], return_caches=True)[uid]
    decoder.close()
    return sum(int(c.nbytes) for c in cache) / len(covered)


class _Prompt:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


def perplexity(model: Any, tokens: list[int], kv: Any, chunk: int = 64) -> float:
    """exp(mean negative log-likelihood) of ``tokens``, each predicted from the cache of
    those before it (quantized when ``kv`` is given)."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from mlxd.engines.text.quantized_cache import quantize_layers

    cache = make_prompt_cache(model)
    if kv is not None:
        cache = quantize_layers(cache, kv, QuantizedKVCache)
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        targets = tokens[start + 1:start + chunk + 1]
        inputs = tokens[start:start + len(targets)]
        logits = model(mx.array(inputs)[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
        nll -= float(picked.sum().item())
        count += len(targets)
    return math.exp(nll / count)


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Identical answers, and the mean share of each answer before its first difference."""
    shares, same = [], 0
    for ref, got in zip(reference, other):
        n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        same += ref == got
        shares.append(n / max(1, len(ref)))
    return {"identical": round(same / len(reference), 3),
            "prefix_share": round(sum(shares) / len(shares), 3)}


def run(folder: Path, n_prompts: int, n_tokens: int, speed_tokens: int,
        held_out_tokens: int | None = None) -> dict[str, Any]:
    from mlx_lm import load

    from bench.speculative import _decode
    from mlxd.engines.text.quantized_cache import KVQuantization
    from mlxd.models.memory import kv_bytes_per_token

    model, tok = load(str(folder))[:2]
    config = json.loads((folder / "config.json").read_text())
    chats = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True) for p in prompts(n_prompts)]
    held_out = tok.encode(HELD_OUT)[:held_out_tokens]
    full = _decode(model, tok, chats, n_tokens, False, 4)["tokens"]
    rows = [{"kv": "float16 (computed)", "bytes_per_token": kv_bytes_per_token(config, 2)}]
    ppl_full = perplexity(model, held_out, None)
    rows.append({"kv": "float32", "bytes_per_token": bytes_per_token(model, tok, None),
                 "perplexity": round(ppl_full, 3)})
    for bits in (8, 4):
        kv = KVQuantization(bits)
        ppl = perplexity(model, held_out, kv)
        quant = _decode(model, tok, chats, n_tokens, False, 4, kv=kv)["tokens"]
        rows.append({"kv": f"{bits}-bit (group 64)",
                     "bytes_per_token": bytes_per_token(model, tok, kv),
                     "bytes_per_token_fp16_scales": kv_bytes_per_token(config, 2, bits, 64),
                     "perplexity": round(ppl, 3),
                     "perplexity_change": round(ppl / ppl_full - 1, 4),
                     **agreement(full, quant)})
    fp16 = rows[0]["bytes_per_token"]
    for r in rows:
        r["sessions_4k"] = int(KV_BUDGET // (r["bytes_per_token"] * SESSION_TOKENS))
        r["vs_fp16"] = round(fp16 / r.get("bytes_per_token_fp16_scales",
                                          r["bytes_per_token"]), 2)
    speed = []
    for streams in (1, 8):
        batch = (chats * 8)[:streams]
        for bits in (8, 4):
            off = _decode(model, tok, batch, speed_tokens, False, 4)
            on = _decode(model, tok, batch, speed_tokens, False, 4, kv=KVQuantization(bits))
            speed.append({"streams": streams, "bits": bits, "off_tok_s": round(off["tok_s"], 2),
                          "on_tok_s": round(on["tok_s"], 2),
                          "ratio": round(on["tok_s"] / off["tok_s"], 3) if off["tok_s"] else None})
    return {"model": folder.name, "prompts": len(chats), "tokens": n_tokens,
            "held_out_tokens": len(held_out), "speed_tokens": speed_tokens,
            "budget_bytes": KV_BUDGET, "rows": rows, "speed": speed}


def markdown(results: dict[str, Any]) -> str:
    lines = [f"## Quantized KV, {results['model']}", "",
             f"Sessions: {SESSION_TOKENS}-token sessions in {results['budget_bytes'] >> 30} GiB "
             f"of KV. Perplexity: a held-out paragraph of {results['held_out_tokens']} tokens. "
             f"Agreement: greedy answers of {results['prompts']} prompts over their first "
             f"{results['tokens']} tokens, against float32 KV. x fp16: bytes per token against "
             "float16 KV, the quantized ones with float16 scales (a float16 model's).", "",
             "| KV | bytes/token | x fp16 | 4k sessions | perplexity | change | identical | "
             "prefix share |", "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['kv']} | {r['bytes_per_token']:.0f} | {r['vs_fp16']} | "
                     f"{r['sessions_4k']} | {r.get('perplexity', '')} | "
                     f"{r.get('perplexity_change', '')} | {r.get('identical', '')} | "
                     f"{r.get('prefix_share', '')} |")
    lines += ["", f"Decode tok/s ({results['speed_tokens']} tokens per stream), quantized "
                  "against float32 KV, each pair run back to back:", "",
              "| streams | bits | float32 tok/s | quantized tok/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {s['streams']} | {s['bits']} | {s['off_tok_s']} | {s['on_tok_s']} | "
              f"{s['ratio']}x |" for s in results["speed"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 prompts, 32 tokens")
    p.add_argument("--prompts", type=int, default=None, help="agreement prompts (default 50)")
    p.add_argument("--tokens", type=int, default=None, help="agreement tokens (default 64)")
    p.add_argument("--speed-tokens", type=int, default=None,
                   help="tokens per stream of the speed runs (default 128)")
    p.add_argument("--held-out-tokens", type=int, default=None,
                   help="perplexity over the paragraph's first N tokens (default: all)")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    folder = args.model or smollm2_float32(args.home)
    results = run(folder, args.prompts or (10 if args.quick else 50),
                  args.tokens or (32 if args.quick else 64),
                  args.speed_tokens or (48 if args.quick else 128), args.held_out_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "kv", results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
