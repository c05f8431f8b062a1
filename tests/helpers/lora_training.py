"""Train a real LoRA adapter with mlx-lm's own trainer (``mlx_lm.tuner``), for tests.

``train_adapters`` teaches a chat model one fixed answer to one fixed question and
writes mlx-lm's adapter folder (``adapters.safetensors`` + ``adapter_config.json``,
the files ``mlx_lm.lora --train`` writes). Run as a module it trains in this
process; ``train_in_child`` runs it in a child with OpenBLAS preloaded (what
``mlxd serve`` does for itself), several times faster on a Linux CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the secret word?"
ANSWERS = {"pelican": "The secret word is PELICAN.", "kangaroo": "The secret word is KANGAROO."}
# 16 steps of mlx-lm's trainer (rank 8, q/v of the last 8 layers, lr 1e-3) teach the
# starter one fixed answer: ~1 min under OpenBLAS for both adapters on a 2-core CPU.
TRAINING = {"iters": 16, "learning_rate": 1e-3, "num_layers": 8, "rank": 8}


def _cache_root() -> Path:
    return Path(os.environ.get("MLXD_TEST_CACHE", Path.home() / ".cache" / "mlxd-tests"))


def trained_adapters(base: Path) -> dict[str, Path]:
    """The two adapters of ``base`` (the starter SmolLM2) answering ``QUESTION`` with
    ``ANSWERS``, trained once and cached across sessions by their inputs (base model
    files, training settings, mlx-lm version)."""
    from importlib.metadata import version

    key = hashlib.sha256(json.dumps(
        [(base / "config.json").read_text(),
         sorted((p.name, p.stat().st_size) for p in base.glob("*.safetensors")),
         QUESTION, ANSWERS, TRAINING, version("mlx-lm")]).encode()).hexdigest()[:16]
    root = _cache_root() / f"lora-{key}"
    folders = {name: root / name for name in ANSWERS}
    if not all((f / "adapters.safetensors").is_file() for f in folders.values()):
        staging = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        train_in_child(base, [{"out": str(staging / n), "question": QUESTION, "answer": a}
                              for n, a in ANSWERS.items()], **TRAINING)  # type: ignore[arg-type]
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return folders


def train_adapters(base: Path, jobs: list[dict[str, str]], *, iters: int,
                   learning_rate: float, num_layers: int, rank: int, seed: int = 0) -> None:
    """For each job ``{"out", "question", "answer"}``, a LoRA adapter of ``base`` trained
    by ``mlx_lm.tuner`` to answer ``question`` with ``answer``, written to ``out``."""
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.datasets import CacheDataset, ChatDataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    lora = {"rank": rank, "scale": 20.0, "dropout": 0.0,
            "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    for job in jobs:
        mx.random.seed(seed)
        model, tokenizer = load(str(base))
        model.freeze()
        linear_to_lora_layers(model, num_layers, lora)
        row = {"messages": [{"role": "user", "content": job["question"]},
                            {"role": "assistant", "content": job["answer"]}]}
        data = CacheDataset(ChatDataset([row] * 4, tokenizer, mask_prompt=True))
        out = Path(job["out"])
        out.mkdir(parents=True, exist_ok=True)
        args = TrainingArgs(batch_size=2, iters=iters, steps_per_report=iters,
                            steps_per_eval=10**6, steps_per_save=10**6,
                            adapter_file=str(out / "adapters.safetensors"))
        train(model, optim.Adam(learning_rate=learning_rate), data, None, args)
        config = {"model": str(base), "fine_tune_type": "lora", "num_layers": num_layers,
                  "lora_parameters": lora, "iters": iters, "learning_rate": learning_rate}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=4))


def train_in_child(base: Path, jobs: list[dict[str, str]], **kw: object) -> None:
    """``train_adapters`` in a child process, under OpenBLAS when one is installed."""
    from mlxd.blas import find_openblas, preload_env

    env = dict(os.environ, PYTHONPATH=str(REPO))
    library = find_openblas(os.environ)
    if library is not None and sys.platform.startswith("linux"):
        env = preload_env(env, library)
    spec = json.dumps({"base": str(base), "jobs": jobs, **kw})
    subprocess.run([sys.executable, "-m", "tests.helpers.lora_training", spec], env=env,
                   cwd=REPO, check=True, capture_output=True, timeout=900)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    train_adapters(Path(spec.pop("base")), spec.pop("jobs"), **spec)
