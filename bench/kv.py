"""Quantized KV (``--kv-bits``) against full precision, on SmolLM2-135M float32, in one process.

``python -m bench.kv [--prompts N] [--tokens N] [--bytes-only]`` (also run by ``make
bench``). Reported:

- KV bytes per token at the model's float32 (and, computed, float16), 8 and 4 bits,
  measured on the batch's extracted rows, and how many 4k-token sessions a fixed KV
  budget holds at each; the same for the hybrid bench model (``bench/agent_trace.py``'s
  ``qwen3_next``, random weights: bytes only), split into its attention layers' bytes per
  token (quantized) and its recurrent layers' state per sequence (kept as it is);
- perplexity of a held-out paragraph (``HELD_OUT``, written for this benchmark and used
  nowhere else), its KV quantized as it is written (chunked prefill through the cache);
- greedy agreement over the first ``--tokens`` tokens of ``--prompts`` chat prompts, 8 and
  4 bits against full precision: the share of answers identical throughout, and the mean
  share of each answer before its first difference;
- decode tok/s at 1 and 8 streams with quantized KV against without, each pair run one
  right after the other (``bench/speculative.py``'s timed decode).

Results: ``bench/results/kv.{json,md}``. In-process: no OpenBLAS preload unless the caller
set ``LD_PRELOAD``. The model runs mlxd's CPU paths as a server's load installs them
(``engines/kernels/prefill.py``; over quantized KV, ``quantized_attention.py``).
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


def cache_bytes(model: Any, tokens: list[int], kv: Any) -> tuple[int, int, int]:
    """(tokens covered, attention layers' bytes, recurrent layers' bytes) of a row holding
    ``tokens`` extracted from the batch (``kv``: its quantization, or None)."""
    from mlx_lm.models.cache import ArraysCache

    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
    from mlxd.engines.text.sampling import greedy

    decoder = LMBatchDecoder(model, eos_ids=[], max_num_seqs=1, prefill_step_size=512,
                             kv_quantization=kv)
    uid = decoder.insert(_Prompt(tokens), 0, None, greedy, [], set(), 2)  # type: ignore[arg-type]
    decoder.next()
    cache, covered = decoder.remove([uid], return_caches=True)[uid]
    decoder.close()
    recurrent = sum(int(c.nbytes) for c in cache if isinstance(c, ArraysCache))
    return len(covered), sum(int(c.nbytes) for c in cache) - recurrent, recurrent


def bytes_per_token(model: Any, tok: Any, kv: Any) -> float:
    """KV bytes one token takes, measured on a row extracted from the batch."""
    covered, attention, recurrent = cache_bytes(model, tok.encode(HELD_OUT)[:32], kv)
    return (attention + recurrent) / covered


def hybrid_parts(model: Any, tok: Any, kv: Any) -> dict[str, float]:
    """A hybrid's cache in two parts, measured on rows of two lengths: its attention
    layers' bytes per token (they grow with the context) and its recurrent layers' bytes
    per sequence (a fixed-size state: the same at both lengths, checked)."""
    tokens = tok.encode(HELD_OUT)
    (n1, a1, r1), (n2, a2, r2) = (cache_bytes(model, tokens[:n], kv) for n in (32, 96))
    if r1 != r2 or a1 * n2 != a2 * n1:
        raise RuntimeError(f"the hybrid's cache is not attention per token + a fixed state: "
                           f"{n1} tokens {a1} + {r1} bytes, {n2} tokens {a2} + {r2}")
    attention, recurrent = a2 / n2, float(r2)
    per_token = attention + recurrent / SESSION_TOKENS
    return {"attention_bytes_per_token": attention, "recurrent_bytes_per_sequence": recurrent,
            "bytes_per_token": per_token,
            "attention_share": round(attention / per_token, 3)}


def hybrid_rows(folder: Path) -> dict[str, Any]:
    """KV bytes of the hybrid bench model (``bench/agent_trace.py``'s ``qwen3_next``):
    float32, 8 and 4 bits (its attention layers quantized, its recurrent state as it is),
    float16 computed as half of float32 (a float16 model keeps both parts in float16)."""
    from mlx_lm import load

    from mlxd.engines.text.quantized_cache import KVQuantization
    from mlxd.models.memory import kv_bytes_per_token

    model, tok = load(str(folder))[:2]
    full = hybrid_parts(model, tok, None)
    rows = [{"kv": "float16 (computed)",
             **{k: v / 2 for k, v in full.items() if k != "attention_share"},
             "attention_share": full["attention_share"]},
            {"kv": "float32", **full}]
    for bits in (8, 4):
        rows.append({"kv": f"{bits}-bit (group 64)", **hybrid_parts(model, tok,
                                                                   KVQuantization(bits))})
    fp16 = rows[0]["bytes_per_token"]
    values = full["attention_bytes_per_token"] / 4  # K and V values per token
    config = json.loads((folder / "config.json").read_text())
    for r, bits in zip(rows[1:], (None, 8, 4)):  # admission counts every layer as attention
        r["admission_bytes_per_token"] = kv_bytes_per_token(config, 4, bits, 64)
    for r in rows:
        r["sessions_4k"] = int(KV_BUDGET // (r["bytes_per_token"] * SESSION_TOKENS))
        r["vs_fp32"] = round(full["bytes_per_token"] / r["bytes_per_token"], 2)
        bits = int(r["kv"][0]) if r["kv"][0].isdigit() else None
        # a float16 model's: float16 scales and biases, its recurrent state in float16
        r["bytes_per_token_fp16_model"] = r["bytes_per_token"] if bits is None else (
            values * bits / 8 + values / 64 * 2 * 2
            + rows[0]["recurrent_bytes_per_sequence"] / SESSION_TOKENS)
        r["vs_fp16"] = round(fp16 / r["bytes_per_token_fp16_model"], 2)
    return {"model": folder.name, "rows": rows}


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
        held_out_tokens: int | None = None, bytes_only: bool = False) -> dict[str, Any]:
    """Every measure on ``folder`` (``bytes_only``: the bytes per token rows alone)."""
    from mlx_lm import load

    from bench.speculative import _decode
    from mlxd.engines.kernels.prefill import install_cpu_prefill_attention
    from mlxd.engines.text.quantized_cache import KVQuantization
    from mlxd.models.memory import kv_bytes_per_token

    model, tok = load(str(folder))[:2]
    cpu_paths = install_cpu_prefill_attention(model)  # as a server's load does (CPU only)
    config = json.loads((folder / "config.json").read_text())
    chats = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True) for p in prompts(n_prompts)]
    held_out = tok.encode(HELD_OUT)[:held_out_tokens]
    full = [] if bytes_only else _decode(model, tok, chats, n_tokens, False, 4)["tokens"]
    rows: list[dict[str, Any]] = [{"kv": "float16 (computed)",
                                   "bytes_per_token": kv_bytes_per_token(config, 2)}]
    ppl_full = None if bytes_only else perplexity(model, held_out, None)
    rows.append({"kv": "float32", "bytes_per_token": bytes_per_token(model, tok, None),
                 "perplexity": round(ppl_full, 3) if ppl_full else None})
    for bits in (8, 4):
        kv = KVQuantization(bits)
        row = {"kv": f"{bits}-bit (group 64)",
               "bytes_per_token": bytes_per_token(model, tok, kv),
               "bytes_per_token_fp16_scales": kv_bytes_per_token(config, 2, bits, 64)}
        if ppl_full:
            ppl = perplexity(model, held_out, kv)
            quant = _decode(model, tok, chats, n_tokens, False, 4, kv=kv)["tokens"]
            row.update(perplexity=round(ppl, 3), perplexity_change=round(ppl / ppl_full - 1, 4),
                       **agreement(full, quant))
        rows.append(row)
    fp16 = rows[0]["bytes_per_token"]
    for r in rows:
        r["sessions_4k"] = int(KV_BUDGET // (r["bytes_per_token"] * SESSION_TOKENS))
        r["vs_fp16"] = round(fp16 / r.get("bytes_per_token_fp16_scales",
                                          r["bytes_per_token"]), 2)
    speed = []
    for streams in () if bytes_only else (1, 8):
        batch = (chats * 8)[:streams]
        for bits in (8, 4):
            off = _decode(model, tok, batch, speed_tokens, False, 4)
            on = _decode(model, tok, batch, speed_tokens, False, 4, kv=KVQuantization(bits))
            speed.append({"streams": streams, "bits": bits, "off_tok_s": round(off["tok_s"], 2),
                          "on_tok_s": round(on["tok_s"], 2),
                          "ratio": round(on["tok_s"] / off["tok_s"], 3) if off["tok_s"] else None})
    if cpu_paths is not None:
        cpu_paths.undo()
    return {"model": folder.name, "prompts": len(chats), "tokens": n_tokens,
            "held_out_tokens": len(held_out), "speed_tokens": speed_tokens,
            "budget_bytes": KV_BUDGET, "rows": rows, "speed": speed, "bytes_only": bytes_only}


def markdown(results: dict[str, Any]) -> str:
    quality = "Bytes only (`--bytes-only`): no perplexity, agreement or speed." if results.get(
        "bytes_only") else (
        f"Perplexity: a held-out paragraph of {results['held_out_tokens']} tokens. "
        f"Agreement: greedy answers of {results['prompts']} prompts over their first "
        f"{results['tokens']} tokens, against float32 KV.")
    lines = [f"## Quantized KV, {results['model']}", "",
             f"Sessions: {SESSION_TOKENS}-token sessions in {results['budget_bytes'] >> 30} GiB "
             f"of KV. {quality} x fp16: bytes per token against "
             "float16 KV, the quantized ones with float16 scales (a float16 model's).", "",
             "| KV | bytes/token | x fp16 | 4k sessions | perplexity | change | identical | "
             "prefix share |", "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['kv']} | {r['bytes_per_token']:.0f} | {r['vs_fp16']} | "
                     f"{r['sessions_4k']} | {r.get('perplexity') or ''} | "
                     f"{r.get('perplexity_change', '')} | {r.get('identical', '')} | "
                     f"{r.get('prefix_share', '')} |")
    hybrid = results.get("hybrid")
    if hybrid:
        lines += ["", *hybrid_markdown(hybrid)]
    if not results["speed"]:
        return "\n".join(lines) + "\n"
    lines += ["", f"Decode tok/s ({results['speed_tokens']} tokens per stream), quantized "
                  "against float32 KV, each pair run back to back:", "",
              "| streams | bits | float32 tok/s | quantized tok/s | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {s['streams']} | {s['bits']} | {s['off_tok_s']} | {s['on_tok_s']} | "
              f"{s['ratio']}x |" for s in results["speed"]]
    return "\n".join(lines) + "\n"


def hybrid_markdown(hybrid: dict[str, Any]) -> list[str]:
    """The hybrid bench model's rows: bytes only (no perplexity or speed: random weights)."""
    if "error" in hybrid:
        return [f"Hybrid bench model: {hybrid['error']}"]
    lines = [f"Hybrid bench model, {hybrid['model']} (random weights: bytes only). Its "
             "attention layers' KV grows with every token and is what `--kv-bits` quantizes; "
             "its recurrent layers hold a fixed state per sequence, kept as it is. Bytes per "
             f"token of a {SESSION_TOKENS}-token session = attention per token + recurrent "
             f"state / {SESSION_TOKENS}. x fp32: measured against float32; x fp16: against "
             "float16, the quantized rows computed for a float16 model (float16 scales and "
             "state).", "",
             "| KV | attention bytes/token | recurrent bytes/sequence | bytes/token (4k "
             "session) | attention share | x fp32 | x fp16 | 4k sessions |",
             "|---|---|---|---|---|---|---|---|"]
    for r in hybrid["rows"]:
        lines.append(f"| {r['kv']} | {r['attention_bytes_per_token']:.0f} | "
                     f"{r['recurrent_bytes_per_sequence']:.0f} | {r['bytes_per_token']:.0f} | "
                     f"{r['attention_share']:.0%} | {r['vs_fp32']} | {r['vs_fp16']} | "
                     f"{r['sessions_4k']} |")
    counted = ", ".join(f"{r['kv']} {r['admission_bytes_per_token']}" for r in hybrid["rows"]
                        if "admission_bytes_per_token" in r)
    return [*lines, "", "Admission by live KV counts every layer of a hybrid as attention (an "
                        f"over-estimate), bytes per token: {counted}."]


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
    p.add_argument("--bytes-only", action="store_true",
                   help="only the bytes per token rows (no perplexity, agreement or speed)")
    p.add_argument("--no-hybrid", action="store_true",
                   help="skip the hybrid bench model's bytes rows")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="kv", help="result file names")
    args = p.parse_args(argv)
    folder = args.model or smollm2_float32(args.home)
    results = run(folder, args.prompts or (10 if args.quick else 50),
                  args.tokens or (32 if args.quick else 64),
                  args.speed_tokens or (48 if args.quick else 128), args.held_out_tokens,
                  bytes_only=args.bytes_only)
    if not args.no_hybrid:
        from bench.agent_trace import hybrid_model

        try:
            results["hybrid"] = hybrid_rows(hybrid_model(args.home, smollm2_float32(args.home)))
        except Exception as e:  # the SmolLM2 rows still count; the report says what failed
            results["hybrid"] = {"error": f"{type(e).__name__}: {e}"}
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, args.tag, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
