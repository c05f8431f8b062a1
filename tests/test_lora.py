"""LoRA adapters: real adapters trained here with mlx-lm's own trainer on the starter
SmolLM2, served by name over the base model, rows of one batch each with its own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.models.adapters import AdapterError, read_adapter
from tests.helpers.lora_training import train_in_child

QUESTION = "What is the secret word?"
ANSWERS = {"pelican": "The secret word is PELICAN.", "kangaroo": "The secret word is KANGAROO."}
# 16 steps of mlx-lm's trainer (rank 8, q/v of the last 8 layers, lr 1e-3) teach the
# starter one fixed answer: ~1 min under OpenBLAS for both adapters on a 2-core CPU.
TRAINING = {"iters": 16, "learning_rate": 1e-3, "num_layers": 8, "rank": 8}


def _cache_root() -> Path:
    return Path(os.environ.get("MLXD_TEST_CACHE", Path.home() / ".cache" / "mlxd-tests"))


@pytest.fixture(scope="session")
def adapters(smollm2: Path) -> dict[str, Path]:
    """The two trained adapters, cached across sessions by their inputs (base model
    files, training settings, mlx-lm version)."""
    from importlib.metadata import version

    key = hashlib.sha256(json.dumps(
        [(smollm2 / "config.json").read_text(),
         sorted((p.name, p.stat().st_size) for p in smollm2.glob("*.safetensors")),
         QUESTION, ANSWERS, TRAINING, version("mlx-lm")]).encode()).hexdigest()[:16]
    root = _cache_root() / f"lora-{key}"
    folders = {name: root / name for name in ANSWERS}
    if not all((f / "adapters.safetensors").is_file() for f in folders.values()):
        staging = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        train_in_child(smollm2, [{"out": str(staging / n), "question": QUESTION, "answer": a}
                                 for n, a in ANSWERS.items()], **TRAINING)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return folders


def _chat_tokens(tokenizer: Any, question: str = QUESTION) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                              add_generation_prompt=True))


def _reference(base: Path, adapter: Path | None, max_tokens: int = 12) -> str:
    """mlx-lm's own greedy generation with the adapter loaded its way."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(base), adapter_path=str(adapter) if adapter else None)
    return str(generate(model, tokenizer, _chat_tokens(tokenizer), max_tokens=max_tokens))


# -- the core: one batch, a different adapter per row ------------------------------------

def test_rows_of_one_batch_each_run_their_own_adapter(smollm2: Path,
                                                      adapters: dict[str, Path]) -> None:
    import mlx.core as mx
    from mlx_lm import load

    from mlxd.engines.text.lora import attach_adapters
    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder

    model, tokenizer = load(str(smollm2))
    infos = {n: read_adapter(f, smollm2) for n, f in adapters.items()}
    attached = attach_adapters(model, infos)
    eos = set(tokenizer.eos_token_ids)
    decoder = LMBatchDecoder(model, eos_ids=sorted(eos), max_num_seqs=4, prefill_step_size=256,
                             adapter_rows=attached.rows)
    prompt = _chat_tokens(tokenizer)
    slots = [0, attached.slot("pelican"), attached.slot("kangaroo"), attached.slot("pelican")]
    out: dict[int, list[int]] = {}
    for slot in slots:  # all four join before the first step: one batch
        uid = decoder.insert(SimpleNamespace(tokens=prompt, adapter_slot=slot, checkpoints=()),
                             0, None, lambda lp: mx.argmax(lp, axis=-1), [], eos, 12)
        out[uid] = []
    done: set[int] = set()
    for _ in range(40):
        _, responses = decoder.next()
        for r in responses:
            if r.token not in eos:
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
        if len(done) == len(out):
            break
    texts = [tokenizer.decode(t) for t in out.values()]
    assert texts[1] == texts[3] == ANSWERS["pelican"]
    assert texts[2] == ANSWERS["kangaroo"]
    assert "PELICAN" not in texts[0] and "KANGAROO" not in texts[0]
    assert texts[0] == _reference(smollm2, None).removesuffix("<|im_end|>")
    assert texts[1] == _reference(smollm2, adapters["pelican"]).removesuffix("<|im_end|>")


def test_slots_are_bounds_checked() -> None:
    from mlxd.engines.text.lora import AdapterRows

    rows = AdapterRows(2)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="out of range"):
            rows.assign(7, bad)
        with pytest.raises(ValueError, match="out of range"):
            rows.set_slots([0, bad])


# -- the adapter format, checked against the base before anything is registered ----------

def _copy(adapter: Path, to: Path, **config: Any) -> Path:
    shutil.copytree(adapter, to)
    data = json.loads((to / "adapter_config.json").read_text())
    for key, value in config.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    (to / "adapter_config.json").write_text(json.dumps(data))
    return to


def test_an_adapter_fits_its_base(smollm2: Path, adapters: dict[str, Path]) -> None:
    info = read_adapter(adapters["pelican"], smollm2)
    assert (info.rank, info.scale, info.num_layers) == (8, 20.0, 8)
    assert len(info.targets) == 16 and info.nbytes > 0


def test_an_adapter_for_another_architecture_is_refused(
        tiny_model: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(AdapterError, match="trained for another"):
        read_adapter(adapters["pelican"], tiny_model)


@pytest.mark.parametrize(("change", "message"), [
    ({"lora_parameters": {"rank": 4}}, "rank 4"),
    ({"lora_parameters": {"rank": 0}}, "rank must be a positive integer"),
    ({"num_layers": 99}, "has 30"),
    ({"fine_tune_type": "dora"}, "'dora' is not served"),
])
def test_a_config_that_does_not_match_its_weights_or_base_is_refused(
        smollm2: Path, adapters: dict[str, Path], tmp_path: Path, change: dict[str, Any],
        message: str) -> None:
    bad = _copy(adapters["pelican"], tmp_path / "bad", **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(bad, smollm2)


def test_missing_files_are_refused(adapters: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter(tmp_path / "nowhere")
    no_weights = _copy(adapters["pelican"], tmp_path / "a")
    (no_weights / "adapters.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapters\.safetensors"):
        read_adapter(no_weights)
    no_config = _copy(adapters["pelican"], tmp_path / "b")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        read_adapter(no_config)
