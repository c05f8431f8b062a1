"""Speculative decoding (prompt lookup) vs none, on SmolLM2-135M float32, in one process.

``python -m bench.speculative [--quick]`` (also run by ``make bench``): the same
greedy requests go through mlxd's batched decoder (``LMBatchDecoder``) with
``--speculative off`` and then ``prompt-lookup`` (forced on, whatever the device),
one right after the other, so both see about the same machine load. In-process:
no OpenBLAS preload unless the caller set ``LD_PRELOAD``. Reported per workload: decode tok/s (first token to last, prefill
excluded) of each, their ratio, whether the tokens are identical, the draft
acceptance rate and tokens per forward. Also the cost of one forward over
B x (1 + k) tokens against B x 1, which decides how much verification a step
can afford. Results: ``bench/results/speculative.{json,md}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.servers import write_report

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    max_tokens: int


def _copy_prompt(source: str) -> str:
    return ("Repeat the following Python code exactly, without any change or comment:\n\n"
            f"```python\n{source}```")


def _source(func: Any) -> str:
    """A function's source without its docstring (a small model copies code, not prose)."""
    text = textwrap.dedent(inspect.getsource(func))
    return re.sub(r'\n\s*"""[\s\S]*?"""', "", text, count=1)


def workloads(quick: bool) -> list[Workload]:
    """A copy-heavy answer (small stdlib functions to repeat), plain chat, and both in one
    batch. The functions are ones SmolLM2-135M repeats nearly verbatim: with a long
    signature such as ``json.dumps``'s it changes defaults and then loops, so its answer
    stops being a copy after ~40 tokens and measures the model, not the drafting."""
    import shlex
    import string

    code = "\n\n".join(_source(f) for f in (shlex.quote, shlex.join, textwrap.indent,
                                               string.capwords))
    chat = "Write a short story about a robot who learns to paint, in about 150 words."
    n = 96 if quick else 192
    return [Workload("copy-heavy answer, 1 stream", [_copy_prompt(code)], n),
            Workload("plain chat, 1 stream", [chat], n),
            Workload("copy + chat, 4 streams", [_copy_prompt(code), chat] * 2, n)]


def _decode(model: Any, tok: Any, prompts: list[list[int]], max_tokens: int,
            spec: bool, num_draft_tokens: int, draft: Any = None,
            kv: Any = None) -> dict[str, Any]:
    """Greedy decode of ``prompts``; ``spec`` drafts by prompt lookup, or with the draft
    model ``draft`` when one is given (``bench/speculative_draft.py``); ``kv``: a
    ``KVQuantization`` for the batch's KV (``bench/kv.py``)."""
    from mlxd.engines.text.draft import DraftModel
    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder
    from mlxd.engines.text.prompt_limits import vocab_bound
    from mlxd.engines.text.sampling import greedy
    from mlxd.engines.text.speculative import SpeculativeOptions

    eos = sorted(tok.eos_token_ids)
    mode = "off" if not spec else "draft" if draft is not None else "prompt-lookup"
    vocab = vocab_bound(model, {}, len(tok))
    decoder = LMBatchDecoder(model, eos_ids=eos, max_num_seqs=8, prefill_step_size=2048,
                             speculative=SpeculativeOptions(
                                 mode=mode, num_draft_tokens=num_draft_tokens),
                             drafter=(lambda: DraftModel(draft, vocab=vocab))
                             if mode == "draft" else None, kv_quantization=kv)
    owner = {decoder.insert(SimpleNamespace(tokens=p), 0, None, greedy, [], set(eos),  # type: ignore[arg-type]
                            max_tokens): i for i, p in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in prompts]
    first = None
    done, steps = 0, 0
    while done < len(prompts):
        _, responses = decoder.next()
        if responses and first is None:
            first = time.perf_counter()
            steps = 0
        steps += 1
        for r in responses:
            out[owner[r.uid]].append(r.token)
            done += r.finish_reason is not None
    seconds = time.perf_counter() - (first or time.perf_counter())
    accepted, rejected = decoder.draft_totals()
    decoder.close()
    decoded = sum(len(t) for t in out) - len(prompts)  # the first tokens came with prefill
    return {"tokens": out, "tok_s": decoded / seconds if seconds > 0 else 0.0,
            "steps": steps, "accepted": accepted, "rejected": rejected}


def forward_cost(model: Any, context: int = 512, reps: int = 3) -> list[dict[str, Any]]:
    """Milliseconds per forward over B x n new tokens on a ``context``-token batched cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    rows = []
    for batch in (1, 4):
        caches = [BatchKVCache([0] * batch) for _ in model.layers]
        model(mx.array([[(i * 7) % 900 + 10 for i in range(context)]] * batch), cache=caches)
        mx.eval([c.state for c in caches])
        for n in (1, 3, 5, 9, 17):
            inputs = mx.array([[11] * n] * batch)
            times = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                mx.eval(model(inputs, cache=caches))
                times.append(time.perf_counter() - t)
                for c in caches:
                    c.trim(n)
            rows.append({"batch": batch, "new_tokens": n, "ms": 1000 * min(times[1:])})
    return rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compare(model: Any, tok: Any, w: Workload, repeats: int, k: int,
            draft: Any = None) -> dict[str, Any]:
    """Off, then on, ``repeats`` times in turn: each ratio compares two runs seconds apart
    (on: prompt lookup, or the draft model ``draft``)."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in w.prompts]
    pairs = [(_decode(model, tok, prompts, w.max_tokens, False, k),
              _decode(model, tok, prompts, w.max_tokens, True, k, draft))
             for _ in range(repeats)]
    ratios = [on["tok_s"] / off["tok_s"] for off, on in pairs if off["tok_s"]]
    off, on = pairs[-1]
    drafted = on["accepted"] + on["rejected"]
    return {"workload": w.name, "streams": len(prompts), "max_tokens": w.max_tokens,
            "num_draft_tokens": k,
            "off_tok_s": round(_median([o["tok_s"] for o, _ in pairs]), 2),
            "on_tok_s": round(_median([o["tok_s"] for _, o in pairs]), 2),
            "ratio": round(_median(ratios), 3) if ratios else None,
            "ratios": [round(r, 3) for r in ratios],
            "identical": all(o["tokens"] == n["tokens"] for o, n in pairs),
            "accepted": on["accepted"], "rejected": on["rejected"],
            "acceptance": round(on["accepted"] / drafted, 3) if drafted else None,
            "steps_off": off["steps"], "steps_on": on["steps"]}


def run(folder: Path, quick: bool, *, repeats: int = 1, num_draft_tokens: int | None = None,
        only: str | None = None, with_forward_cost: bool = True) -> dict[str, Any]:
    from mlx_lm import load

    from mlxd.engines.text.speculative import SpeculativeOptions

    k = num_draft_tokens or SpeculativeOptions().num_draft_tokens
    model, tok = load(str(folder))[:2]
    results: dict[str, Any] = {"model": folder.name, "workloads": []}
    for w in workloads(quick):
        if only and only not in w.name:
            continue
        row = compare(model, tok, w, repeats, k)
        print(json.dumps(row), flush=True)
        results["workloads"].append(row)
    results["forward_cost"] = forward_cost(model) if with_forward_cost else []
    print(json.dumps(results["forward_cost"]), flush=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [f"## Speculative decoding (prompt lookup), {results['model']}", "",
             "Ratios: on / off decode tok/s, median of the runs (each run: off, then on).", "",
             "| workload | streams | k | off tok/s | on tok/s | ratio | runs | identical | "
             "accepted | rejected | acceptance | steps off / on |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["workloads"]:
        runs = ", ".join(f"{x}" for x in r["ratios"])
        lines.append(f"| {r['workload']} | {r['streams']} | {r['num_draft_tokens']} | "
                     f"{r['off_tok_s']} | {r['on_tok_s']} | {r['ratio']}x | {runs} | "
                     f"{r['identical']} | {r['accepted']} | {r['rejected']} | "
                     f"{r['acceptance']} | {r['steps_off']} / {r['steps_on']} |")
    if results["forward_cost"]:
        lines += ["", "Forward cost (ms, best of 3, 512-token cache):", "",
                  "| batch | new tokens per row | ms |", "|---|---|---|"]
        lines += [f"| {c['batch']} | {c['new_tokens']} | {c['ms']:.1f} |"
                  for c in results["forward_cost"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer output tokens")
    p.add_argument("--repeats", type=int, default=1,
                   help="off/on pairs per workload (the ratio reported is their median)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="most drafts per step (default: mlxd's --num-draft-tokens default)")
    p.add_argument("--only", default=None, help="only workloads whose name contains this")
    p.add_argument("--no-forward-cost", action="store_true", help="skip the forward costs")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    folder = args.model or smollm2_float32(args.home)
    results = run(folder, args.quick, repeats=args.repeats, num_draft_tokens=args.num_draft_tokens,
                  only=args.only, with_forward_cost=not args.no_forward_cost)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "speculative", results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
