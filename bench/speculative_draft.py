"""Draft-model speculation (``--draft-model``) vs none, SmolLM2-135M float32 as the target.

``python -m bench.speculative_draft [--quick]``: the same greedy requests go through
mlxd's batched decoder with speculation off and then with a draft model, one right
after the other, in one process (``bench/speculative.py``'s ``compare``).

The only real model on this disk with SmolLM2's tokenizer is SmolLM2-135M itself,
so the drafts are built from it:

- ``self``: SmolLM2-135M drafting for itself. Every draft is accepted, but the
  draft costs what the target costs, so nothing can be saved: the ratio is the
  cost of the machinery at full acceptance.
- ``first N layers``: SmolLM2's own first N of its 30 layers with its final norm
  and head (an early-exit draft, about N/30 of the target's cost per token): a
  real, cheaper draft whose acceptance this bench measures.

A small random draft with the same tokenizer would say nothing about speed (it
almost never agrees with the target), so none is run. A real pair (e.g. a 1.7B
target with a 135M draft) is not on this disk. Results:
``bench/results/speculative_draft.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.servers import write_report
from bench.speculative import REPO, compare, workloads


def early_exit(folder: Path, layers: int) -> Any:
    """The model at ``folder`` cut to its first ``layers`` layers (norm and head kept)."""
    from mlx_lm import load

    model = load(str(folder))[0]
    model.model.layers = model.model.layers[:layers]
    return model


def drafts(folder: Path, target: Any, names: list[str]) -> list[tuple[str, Any]]:
    """``self`` or a layer count N (the first N layers), in order."""
    return [("self", target) if n == "self" else (f"first {n} layers", early_exit(folder, int(n)))
            for n in names]


def run(folder: Path, quick: bool, repeats: int, k: int, only: str | None,
        names: list[str]) -> dict[str, Any]:
    from mlx_lm import load

    model, tok = load(str(folder))[:2]
    results: dict[str, Any] = {"model": folder.name, "rows": []}
    for name, draft in drafts(folder, model, names):
        for w in workloads(quick):
            if (only and only not in w.name) or len(w.prompts) > 1:
                continue
            row = {"draft": name, **compare(model, tok, w, repeats, k, draft)}
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [f"## Speculative decoding with a draft model, target {results['model']}", "",
             "Ratios: with the draft / without speculation, decode tok/s, median of the runs.",
             "", "| draft | workload | k | off tok/s | draft tok/s | ratio | identical | "
             "accepted | rejected | acceptance | steps off / on |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['draft']} | {r['workload']} | {r['num_draft_tokens']} | "
                     f"{r['off_tok_s']} | {r['on_tok_s']} | {r['ratio']}x | {r['identical']} | "
                     f"{r['accepted']} | {r['rejected']} | {r['acceptance']} | "
                     f"{r['steps_off']} / {r['steps_on']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.model import smollm2_float32
    from mlxd.config import default_home

    p = argparse.ArgumentParser(prog="python -m bench.speculative_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer tokens")
    p.add_argument("--drafts", default="self,10,20",
                   help="comma list: self and/or N (SmolLM2's first N layers as the draft)")
    p.add_argument("--repeats", type=int, default=1, help="off/draft pairs per workload")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="most drafts per step")
    p.add_argument("--only", default=None, help="only workloads whose name contains this")
    p.add_argument("--home", type=Path, default=default_home(), help="mlxd home (conversions)")
    p.add_argument("--model", type=Path, default=None, help="an MLX folder (default SmolLM2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    folder = args.model or smollm2_float32(args.home)
    results = run(folder, args.quick, args.repeats, args.num_draft_tokens, args.only,
                  [n.strip() for n in args.drafts.split(",") if n.strip()])
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out, "speculative_draft", results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
