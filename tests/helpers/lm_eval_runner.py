"""Run lm-evaluation-harness against a server, offline, and print what it scored.

``python -m tests.helpers.lm_eval_runner URL`` evaluates the local tasks in
``tests/data/lm_eval`` twice with ``local-completions`` (a multiple-choice task
scored by loglikelihood and a ``generate_until`` task) and twice with
``local-chat-completions`` (the ``generate_until`` task), naming model ``tiny``
and giving no tokenizer: ``local-completions`` must find the server's
``/tokenizer_info`` and ``/tokenize`` or fall back to downloading a tokenizer
named ``tiny``, which fails offline. It prints one JSON object after ``MARKER``: per run, the
scores and every document's responses (loglikelihoods, generations).

A separate process because the hub's offline switches are read when
``huggingface_hub`` is imported, and the test process has imported it already.
lm-eval's Python API (not its CLI) so the task index holds only these tasks:
the CLI indexes every built-in task first, ten seconds on a small machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TASKS = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
MC, GEN = "mlxd_tiny_mc", "mlxd_tiny_gen"
MARKER = "LM_EVAL_RUNS "  # starts the result line (lm-eval prints tables and logs too)


def evaluate(url: str, model: str, tasks: list[str]) -> dict[str, Any]:
    """One lm-eval run: its scores and each document's responses, per task."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    chat = model == "local-chat-completions"
    endpoint = "chat/completions" if chat else "completions"
    out = simple_evaluate(
        model=model, model_args={"model": "tiny", "base_url": f"{url}/v1/{endpoint}",
                                 "num_concurrent": 1, "max_retries": 1},
        tasks=tasks, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=1, log_samples=True, apply_chat_template=chat)
    assert out is not None
    samples = {task: sorted([row["doc_id"], json.dumps(row["resps"])] for row in rows)
               for task, rows in out["samples"].items()}
    return {"results": out["results"], "samples": samples}


def main(url: str) -> None:
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        assert os.environ.get(key) == "1", f"{key}=1 must be set before lm-eval is imported"
    os.chdir(TASKS)  # the task files name their data files relative to their folder
    runs = {f"completions{i}": evaluate(url, "local-completions", [MC, GEN]) for i in range(2)}
    runs |= {f"chat{i}": evaluate(url, "local-chat-completions", [GEN]) for i in range(2)}
    print(MARKER + json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])
