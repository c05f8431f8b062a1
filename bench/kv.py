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

``--fp-prefix 0,1,4,16,64`` runs a study instead (issue 29: should the first tokens of a
prompt stay full precision?): for 8 and 4 bits, 4 bits at group 32, keys 8 / values 4 and
keys at group 32, the held-out perplexity (at four prefill chunkings: their spread is the
measure's noise) and greedy agreement with the first N positions of every sequence kept
full precision and the rest rounded as quantized storage holds them
(``mx.dequantize(mx.quantize(x))``, a study cache in this file, checked against mlx-lm's
``QuantizedKVCache`` at N = 0). Results: ``bench/results/kv-fp-prefix.{json,md}``.

Results: ``bench/results/kv.{json,md}``. In-process: no OpenBLAS preload unless the caller
set ``LD_PRELOAD``. The model runs mlxd's CPU paths as a server's load installs them
(``engines/kernels/prefill.py``; over quantized KV, ``quantized_attention.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

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
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from mlxd.engines.text.quantized_cache import quantize_layers

    cache = make_prompt_cache(model)
    if kv is not None:
        cache = quantize_layers(cache, kv, QuantizedKVCache)
    nll = token_nlls(model, tokens, cache, chunk)
    return math.exp(sum(nll) / len(nll))


def token_nlls(model: Any, tokens: list[int], cache: list[Any], chunk: int) -> list[float]:
    """The negative log-likelihood of each of ``tokens`` after the first, predicted from
    ``cache`` holding those before it, prefilled ``chunk`` tokens at a time."""
    import mlx.core as mx

    nll: list[float] = []
    for start in range(0, len(tokens) - 1, chunk):
        targets = tokens[start + 1:start + chunk + 1]
        inputs = tokens[start:start + len(targets)]
        logits = model(mx.array(inputs)[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
        nll += cast(list[float], (-picked[:, 0]).tolist())
    return nll


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


# --- Full-precision first tokens (``--fp-prefix``) ---------------------------------------

TAIL_FROM = 128  # the tail perplexity's first predicted position (past every prefix but 128)
# Prefill chunkings the perplexity is measured with: the same tokens and the same rounding
# rule, only the float accumulation order differs, and 4-bit rounding amplifies that (a
# value near a level boundary flips), so their spread is the measure's own noise.
PPL_CHUNKS = (64, 48, 32, 16)


@dataclass(frozen=True)
class Layout:
    """How a study cache stores K and V past its first ``fp_prefix`` positions: keys at
    ``k_bits``, values at ``v_bits`` (None: full precision), one scale and bias per
    ``group_size`` values (``v_group_size`` for values, when it differs)."""

    k_bits: int | None
    v_bits: int | None
    group_size: int = 64
    v_group_size: int | None = None

    @property
    def v_group(self) -> int:
        return self.v_group_size or self.group_size

    @property
    def name(self) -> str:
        if self.k_bits is None and self.v_bits is None:
            return "float32"
        if (self.k_bits, self.group_size) == (self.v_bits, self.v_group):
            return f"{self.k_bits}-bit (group {self.group_size})"
        return (f"K {self.k_bits}-bit g{self.group_size} / "
                f"V {self.v_bits}-bit g{self.v_group}")

    def fp16_bytes_per_value(self) -> float:
        """Mean bytes of one quantized K or V value of a float16 model (float16 scales)."""
        def one(bits: int | None, group: int) -> float:
            return 2.0 if bits is None else bits / 8 + 2 * 2 / group
        return (one(self.k_bits, self.group_size) + one(self.v_bits, self.v_group)) / 2


# 8 and 4 bits as mlxd builds them, 4 bits at group 32, then two mixed layouts (mlxd has
# one setting for both): keys at 8 bits, and keys at group 32 with values at group 64.
STUDY_LAYOUTS = (Layout(8, 8), Layout(4, 4), Layout(4, 4, 32), Layout(8, 4),
                 Layout(4, 4, 32, 64))


def session_vs_fp16(layout: Layout, fp_prefix: int, tokens: int = SESSION_TOKENS) -> float:
    """KV bytes of a float16 model's ``tokens``-token session at float16 against with its
    first ``fp_prefix`` tokens float16 and the rest stored as ``layout`` says."""
    kept = min(fp_prefix, tokens)
    return tokens * 2.0 / (kept * 2.0 + (tokens - kept) * layout.fp16_bytes_per_value())


def _rounded(x: Any, bits: int | None, group_size: int) -> Any:
    """``x`` as quantized storage gives it back: what ``quantized_matmul`` computes on."""
    import mlx.core as mx

    if bits is None:
        return x
    return mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits),
                         group_size=group_size, bits=bits)


@functools.lru_cache(maxsize=1)
def _study_cache_class() -> type:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    class StudyKVCache(BatchKVCache):  # type: ignore[misc]
        """mlx-lm's left-padded ``BatchKVCache`` (one row or many) whose rows keep their
        first ``fp_prefix`` positions full precision and every later one rounded through
        ``mx.quantize``/``mx.dequantize`` as it is written: the values quantized storage
        holds, attended to by the float SDPA (the same numbers ``quantized_matmul`` uses,
        up to accumulation order)."""

        def __init__(self, left_padding: list[int], layout: Layout, fp_prefix: int) -> None:
            super().__init__(left_padding)
            self.layout, self.fp_prefix = layout, fp_prefix

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            n = keys.shape[2]
            position = self.offset[:, None] + mx.arange(n)[None]  # each row's own positions
            late = (position >= self.fp_prefix)[:, None, :, None]
            g = self.layout.group_size
            keys = mx.where(late, _rounded(keys, self.layout.k_bits, g), keys)
            values = mx.where(late, _rounded(values, self.layout.v_bits,
                                             self.layout.v_group), values)
            return super().update_and_fetch(keys, values)

    return StudyKVCache


def study_caches(model: Any, left_padding: list[int], layout: Layout,
                 fp_prefix: int) -> list[Any]:
    cls = _study_cache_class()
    return [cls(left_padding, layout, fp_prefix) for _ in model.layers]


def study_perplexity(model: Any, tokens: list[int], layout: Layout, fp_prefix: int,
                     chunk: int = 64) -> tuple[float, float]:
    """``perplexity`` through a one-row study cache: (all of ``tokens``, the tail predicted
    at positions ``TAIL_FROM`` on)."""
    nll = token_nlls(model, tokens, study_caches(model, [0], layout, fp_prefix), chunk)
    tail = nll[TAIL_FROM:]
    return math.exp(sum(nll) / len(nll)), math.exp(sum(tail) / len(tail)) if tail else math.nan


def study_greedy(model: Any, chats: list[list[int]], n_tokens: int, eos: set[int],
                 layout: Layout, fp_prefix: int) -> list[list[int]]:
    """Greedy answers of every prompt in one left-padded batch, cut after a first EOS."""
    import mlx.core as mx

    width = max(len(c) for c in chats)
    padding = [width - len(c) for c in chats]
    cache = study_caches(model, padding, layout, fp_prefix)
    inputs = mx.array([[0] * p + c for p, c in zip(padding, chats)])
    out: list[list[int]] = [[] for _ in chats]
    for _ in range(n_tokens):
        nxt = mx.argmax(model(inputs, cache=cache)[:, -1, :], axis=-1)
        mx.eval(nxt)
        for row, t in zip(out, cast(list[int], nxt.tolist())):
            row.append(t)
        inputs = nxt[:, None]
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]
            for row in out]


def check_simulation(model: Any, tokens: list[int]) -> list[dict[str, Any]]:
    """The study cache at ``fp_prefix`` 0 against mlx-lm's real ``QuantizedKVCache``
    (``perplexity`` above): held-out perplexity, and the largest logit difference of the
    paragraph's first 64 tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    from mlxd.engines.text.quantized_cache import KVQuantization, quantize_layers

    rows = []
    for layout in (Layout(8, 8), Layout(4, 4), Layout(4, 4, 32)):
        assert layout.k_bits is not None
        kv = KVQuantization(layout.k_bits, layout.group_size)
        real = perplexity(model, tokens, kv)
        sim = study_perplexity(model, tokens, layout, 0)[0]
        head = mx.array(tokens[:64])[None]
        a = model(head, cache=quantize_layers(make_prompt_cache(model), kv, QuantizedKVCache))
        b = model(head, cache=study_caches(model, [0], layout, 0))
        rows.append({"kv": layout.name, "real_perplexity": round(real, 3),
                     "simulated_perplexity": round(sim, 3),
                     "difference": round(sim / real - 1, 5),
                     "max_logit_difference": cast(float, mx.abs(a - b).max().item())})
    return rows


def fp_prefix_study(folder: Path, prefixes: list[int], n_prompts: int, n_tokens: int,
                    held_out_tokens: int | None = None) -> dict[str, Any]:
    """Perplexity and greedy agreement of every ``STUDY_LAYOUTS`` layout with the first N
    positions of each sequence full precision, for each N of ``prefixes``; against the
    same batch with full-precision KV."""
    from mlx_lm import load

    model, tok = load(str(folder))[:2]
    chats = [tok.apply_chat_template([{"role": "user", "content": p}],
                                     add_generation_prompt=True)
             for p in prompts(max(1, n_prompts))]
    held_out = tok.encode(HELD_OUT)[:held_out_tokens]
    eos = set(tok.eos_token_ids)
    full = Layout(None, None)
    # each chunking, full precision: (perplexity, tail perplexity)
    base = [study_perplexity(model, held_out, full, 0, c) for c in PPL_CHUNKS]
    (ppl_full, tail_full) = base[0]
    rows: list[dict[str, Any]] = [{"kv": full.name, "fp_prefix": None,
                                   "perplexity": round(ppl_full, 3),
                                   "tail_perplexity": None if math.isnan(tail_full)
                                   else round(tail_full, 3),
                                   "bytes_per_token_fp16": 2 * _kv_values(folder) * 2,
                                   "session_vs_fp16": 1.0}]
    for layout in STUDY_LAYOUTS:  # perplexity first: seconds each
        for n in prefixes:
            got = [study_perplexity(model, held_out, layout, n, c) for c in PPL_CHUNKS]
            change = [p / b[0] - 1 for p, b in zip((g[0] for g in got), base)]
            tail = [t / b[1] - 1 for t, b in zip((g[1] for g in got), base)]
            rows.append({"kv": layout.name, "layout": layout, "fp_prefix": n,
                         "perplexity": round(got[0][0], 3),
                         "perplexity_change": round(change[0], 4),
                         "change_by_chunk": [round(c, 4) for c in change],
                         "change_mean": round(sum(change) / len(change), 4),
                         "change_min": round(min(change), 4),
                         "change_max": round(max(change), 4),
                         **({} if math.isnan(tail[0]) else
                            {"tail_change_mean": round(sum(tail) / len(tail), 4)}),
                         "bytes_per_token_fp16": round(
                             2 * _kv_values(folder) * layout.fp16_bytes_per_value()),
                         "session_vs_fp16": round(session_vs_fp16(layout, n), 2)})
            print(f"{layout.name} N={n}: perplexity change {rows[-1]['change_by_chunk']}",
                  file=sys.stderr, flush=True)
    check = check_simulation(model, held_out)
    print(f"simulation check: {check}", file=sys.stderr, flush=True)
    if n_prompts:
        reference = study_greedy(model, chats, n_tokens, eos, full, 0)
        for r in rows[1:]:
            r.update(agreement(reference, study_greedy(model, chats, n_tokens, eos,
                                                       r["layout"], r["fp_prefix"])))
            print(f"{r['kv']} N={r['fp_prefix']}: identical {r['identical']}",
                  file=sys.stderr, flush=True)
    for r in rows:
        r.pop("layout", None)
    return {"model": folder.name, "prompts": len(chats) if n_prompts else 0,
            "tokens": n_tokens, "held_out_tokens": len(held_out), "tail_from": TAIL_FROM,
            "chunks": list(PPL_CHUNKS),
            "prompt_tokens": [min(map(len, chats)), max(map(len, chats))],
            "simulation_check": check, "rows": rows}


def _kv_values(folder: Path) -> int:
    """K (or V) values per token, over all layers."""
    c = json.loads((folder / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * c.get("num_key_value_heads",
                                               c["num_attention_heads"]) * head)


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


def fp_prefix_markdown(results: dict[str, Any]) -> str:
    lines = [f"## Full-precision first tokens, {results['model']}", "",
             f"Perplexity: the held-out paragraph ({results['held_out_tokens']} tokens). "
             "Agreement: "
             f"greedy answers of {results['prompts']} prompts "
             f"({results['prompt_tokens'][0]}-{results['prompt_tokens'][1]} prompt tokens) "
             f"over {results['tokens']} tokens, one left-padded batch, against float32 KV. "
             "N: positions of each sequence kept full precision. bytes/token: a float16 "
             f"model's (float16 scales); x fp16 ({SESSION_TOKENS // 1024}k): a "
             f"{SESSION_TOKENS}-token session's KV at float16 against with N tokens float16.",
             "", f"Change: against float32 KV at the same chunking; chunk {results['chunks'][0]} "
             f"(the perplexity shown), then the mean [min, max] over prefill chunks of "
             f"{', '.join(map(str, results['chunks']))} tokens (only the float accumulation "
             "order differs between them: their spread is a floor on the measure's noise). Tail: "
             "the "
             f"tokens predicted at positions {results['tail_from']} on, mean change.",
             "", "| KV | N | perplexity | change | change, mean [min, max] | tail change | "
             "identical | prefix share | bytes/token | x fp16 (4k) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        n = "" if r["fp_prefix"] is None else r["fp_prefix"]
        spread = (f"{r['change_mean']:+.1%} [{r['change_min']:+.1%}, {r['change_max']:+.1%}]"
                  if "change_mean" in r else "")
        def pct(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:+.1%}" if key in r else ""

        same = (f"{round(r['identical'] * results['prompts'])} of {results['prompts']}"
                if "identical" in r else "")
        share = f"{r['prefix_share']:.0%}" if "prefix_share" in r else ""
        lines.append(f"| {r['kv']} | {n} | {r['perplexity']:.2f} | "
                     f"{pct('perplexity_change')} | {spread} | {pct('tail_change_mean')} | "
                     f"{same} | {share} | {r['bytes_per_token_fp16']:,} | "
                     f"{r['session_vs_fp16']} |")
    lines += ["", "Simulation (N = 0) against mlx-lm's `QuantizedKVCache`:", "",
              "| KV | real perplexity | simulated | difference | max logit difference |",
              "|---|---|---|---|---|"]
    lines += [f"| {c['kv']} | {c['real_perplexity']} | {c['simulated_perplexity']} | "
              f"{c['difference']} | {c['max_logit_difference']:.2g} |"
              for c in results["simulation_check"]]
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
    p.add_argument("--fp-prefix", default=None, metavar="N,N,...",
                   help="instead of the rest: the full-precision first tokens study, these N "
                        "(e.g. 0,1,4,16,64; `--prompts 0` skips its agreement)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--tag", default="kv", help="result file names")
    args = p.parse_args(argv)
    folder = args.model or smollm2_float32(args.home)
    if args.fp_prefix is not None:
        study = fp_prefix_study(folder, [int(n) for n in args.fp_prefix.split(",")],
                                50 if args.prompts is None and not args.quick else
                                (args.prompts if args.prompts is not None else 10),
                                args.tokens or (32 if args.quick else 64), args.held_out_tokens)
        args.out.mkdir(parents=True, exist_ok=True)
        write_report(args.out, f"{args.tag}-fp-prefix", study, fp_prefix_markdown)
        return 0
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
