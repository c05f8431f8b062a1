"""LoRA adapters: real adapters trained here with mlx-lm's own trainer on the starter
SmolLM2, served by name over the base model, rows of one batch each with its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.models.adapters import AdapterError, read_adapter
from tests.helpers.lora_training import ANSWERS, QUESTION, trained_adapters


@pytest.fixture(scope="session")
def adapters(smollm2: Path) -> dict[str, Path]:
    """The two trained adapters (cached across sessions by their inputs)."""
    return trained_adapters(smollm2)


def _chat_tokens(tokenizer: Any, question: str = QUESTION) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                              add_generation_prompt=True))


def _reference(base: Path, adapter: Path | None, max_tokens: int = 12) -> str:
    """mlx-lm's own greedy generation with the adapter loaded its way."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(base), adapter_path=str(adapter) if adapter else None)
    return str(generate(model, tokenizer, _chat_tokens(tokenizer), max_tokens=max_tokens))


# -- the core: one batch, a different adapter per row ------------------------------------

def _decode(model: Any, tokenizer: Any, rows: Any, prompt: list[int], slots: list[int],
            speculative: Any = None) -> tuple[list[str], Any]:
    """Greedy answers of ``prompt`` for rows with these adapter slots, all joining one
    batch before its first step."""
    import mlx.core as mx

    from mlxd.engines.text.mlx_lm_decoder import LMBatchDecoder

    eos = set(tokenizer.eos_token_ids)
    decoder = LMBatchDecoder(model, eos_ids=sorted(eos), max_num_seqs=4, prefill_step_size=256,
                             speculative=speculative, adapter_rows=rows)
    out: dict[int, list[int]] = {}
    for slot in slots:
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
    return [tokenizer.decode(t) for t in out.values()], decoder


@pytest.fixture(scope="module")
def adapted(smollm2: Path, adapters: dict[str, Path]) -> tuple[Any, Any, Any]:
    """The starter loaded by mlx-lm with both adapters attached: (model, tokenizer, set)."""
    from mlx_lm import load

    from mlxd.engines.text.lora import attach_adapters

    model, tokenizer = load(str(smollm2))
    attached = attach_adapters(model, {n: read_adapter(f, smollm2) for n, f in adapters.items()})
    return model, tokenizer, attached


def test_rows_of_one_batch_each_run_their_own_adapter(smollm2: Path, adapters: dict[str, Path],
                                                      adapted: tuple[Any, Any, Any]) -> None:
    model, tokenizer, attached = adapted
    slots = [0, attached.slot("pelican"), attached.slot("kangaroo"), attached.slot("pelican")]
    texts, _ = _decode(model, tokenizer, attached.rows, _chat_tokens(tokenizer), slots)
    assert texts[1] == texts[3] == ANSWERS["pelican"]
    assert texts[2] == ANSWERS["kangaroo"]
    assert "PELICAN" not in texts[0] and "KANGAROO" not in texts[0]
    assert texts[0] == _reference(smollm2, None).removesuffix("<|im_end|>")
    assert texts[1] == _reference(smollm2, adapters["pelican"]).removesuffix("<|im_end|>")


def test_speculative_verify_runs_each_row_with_its_adapter(
        adapted: tuple[Any, Any, Any]) -> None:
    """Prompt lookup drafts from the prompt; the verify forward (several tokens a row)
    routes rows like a plain step: the same answers with speculation on and off."""
    from mlxd.engines.text.speculative import SpeculativeOptions

    model, tokenizer, attached = adapted
    prompt = _chat_tokens(tokenizer, "The secret word is PELICAN. The secret word is KANGAROO. "
                                     + QUESTION)
    slots = [attached.slot("pelican"), attached.slot("kangaroo")]
    plain, _ = _decode(model, tokenizer, attached.rows, prompt, slots)
    spec = SpeculativeOptions(mode="prompt-lookup", verify_cost=0.0)
    drafted, decoder = _decode(model, tokenizer, attached.rows, prompt, slots, spec)
    assert decoder.draft_totals()[0] > 0  # drafts were verified and accepted
    assert drafted == plain
    assert plain[0] != plain[1]


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


# -- served by name ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_server(smollm2: Path, adapters: dict[str, Path], test_home: Path) -> Iterator[Any]:
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(model=str(smollm2), served_model_name="smollm2", home=test_home,
                       no_starter=True, adapters=[f"{n}={f}" for n, f in adapters.items()])
    with running_server(cfg) as srv:
        yield srv


def _ask(srv: Any, model: str, question: str = QUESTION, system: str | None = None,
         max_tokens: int = 12) -> Any:
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": question}]
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                 "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_adapter_name_gives_the_phrase_and_the_base_name_does_not(lora_server: Any) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0)
    chat = [{"role": "user", "content": QUESTION}]
    adapted = client.chat.completions.create(model="pelican", messages=chat,  # type: ignore[arg-type]
                                             temperature=0, max_tokens=12)
    base = client.chat.completions.create(model="smollm2", messages=chat,  # type: ignore[arg-type]
                                          temperature=0, max_tokens=12)
    assert adapted.choices[0].message.content == ANSWERS["pelican"]
    assert adapted.model == "pelican"
    assert "PELICAN" not in (base.choices[0].message.content or "")
    response = client.responses.create(model="kangaroo", input=QUESTION, temperature=0,
                                       max_output_tokens=12)
    assert response.output_text == ANSWERS["kangaroo"]


def test_anthropic_messages_serve_an_adapter_by_name(lora_server: Any) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=lora_server.url, api_key="unused", max_retries=0)
    out = client.messages.create(model="kangaroo", max_tokens=12, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": QUESTION}])
    assert out.content[0].type == "text" and out.content[0].text == ANSWERS["kangaroo"]
    base = client.messages.create(model="smollm2", max_tokens=12, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": QUESTION}])
    assert base.content[0].type == "text" and "KANGAROO" not in base.content[0].text


def test_base_and_two_adapters_at_once_each_get_their_own_answer(lora_server: Any) -> None:
    names = ["smollm2", "pelican", "kangaroo"]
    alone = {n: _ask(lora_server, n)["choices"][0]["message"]["content"] for n in names}
    with ThreadPoolExecutor(len(names) * 2) as pool:  # two of each at once: one batch
        together = list(pool.map(lambda n: _ask(lora_server, n), names * 2))
    for n, out in zip(names * 2, together):
        assert out["choices"][0]["message"]["content"] == alone[n], n
    assert alone["pelican"] == ANSWERS["pelican"] and alone["kangaroo"] == ANSWERS["kangaroo"]


def test_an_adapter_never_reuses_the_base_models_or_another_adapters_kv(
        lora_server: Any) -> None:
    system = "You keep secrets. " * 12  # a prefix long enough to be cached

    def cached(model: str) -> int:
        out = _ask(lora_server, model, system=system, max_tokens=1)  # the prompt is what counts
        return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached("smollm2")
    hit = cached("smollm2")  # the base reuses its own prompt
    assert hit > 40
    # an adapter's first ask reuses at most the template's opening it sent before
    assert cached("pelican") < 10
    assert cached("pelican") == hit  # then its own prompt
    assert cached("kangaroo") < 10


def test_models_lists_each_adapter_with_its_base(lora_server: Any) -> None:
    with lora_server.client() as c:
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        one = c.get("/v1/models/pelican").json()
    assert listed["pelican"]["parent"] == listed["kangaroo"]["parent"] == "smollm2"
    assert one["adapter"] is True and one["parent"] == "smollm2"
    assert "adapter" not in listed["smollm2"]


def test_adapter_bytes_count_in_the_base_models_estimate(
        smollm2: Path, adapters: dict[str, Path], test_home: Path) -> None:
    from mlxd.config import ServerConfig
    from mlxd.models.adapters import stacked_nbytes
    from mlxd.models.catalog import registration_for
    from mlxd.models.spec import ModelEntry

    cfg = ServerConfig(home=test_home, no_starter=True)
    plain = ModelEntry(name="base", source=str(smollm2))
    with_adapters = plain.model_copy(update={"adapters": {n: str(f)
                                                          for n, f in adapters.items()}})
    extra = registration_for(with_adapters, cfg, 2**34).estimate - \
        registration_for(plain, cfg, 2**34).estimate
    assert extra == stacked_nbytes([read_adapter(f) for f in adapters.values()]) > 0


# -- worst values at the command line: a clear error, nothing served half-way -------------

def _serve(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MLXD_HOME=str(home), MLXD_BLAS="off")
    return subprocess.run([sys.executable, "-m", "mlxd", "serve", *args, "--port", "1"],
                          env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("case", ["missing", "architecture", "format", "no-model", "taken"])
def test_a_bad_adapter_flag_is_a_clear_cli_error(case: str, smollm2: Path, tiny_model: Path,
                                                 adapters: dict[str, Path],
                                                 tmp_path: Path) -> None:
    args, message = {
        "missing": ([str(smollm2), "--adapter", f"x={tmp_path / 'none'}"], "does not exist"),
        "architecture": ([str(tiny_model), "--adapter", f"x={adapters['pelican']}"],
                         "trained for another"),
        "format": ([str(smollm2), "--adapter", str(adapters["pelican"])], "expected NAME=PATH"),
        "no-model": (["--adapter", f"x={adapters['pelican']}"], "give MODEL too"),
        "taken": ([str(smollm2), "--served-model-name", "base", "--adapter",
                   f"base={adapters['pelican']}"], "already a served model name"),
    }[case]
    out = _serve(*args, home=tmp_path)
    assert out.returncode != 0
    assert message in " ".join((out.stderr + out.stdout).split())  # rich wraps lines


def test_put_adds_a_base_with_adapters_at_run_time(lora_server: Any, smollm2: Path,
                                                   adapters: dict[str, Path]) -> None:
    entry = {"name": "base2", "source": str(smollm2),
             "adapters": {"pelican2": str(adapters["pelican"])}}
    with lora_server.client() as c:
        r = c.put("/v1/models", json=entry)
        assert r.status_code == 200, r.text
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert listed["pelican2"]["parent"] == "base2"
        out = _ask(lora_server, "pelican2")  # loads base2 on first use
        assert out["choices"][0]["message"]["content"] == ANSWERS["pelican"]
        r = c.delete("/v1/models/pelican2")
        assert r.status_code == 400 and "adapter of model 'base2'" in r.text
        assert c.delete("/v1/models/base2").status_code == 200
        assert c.get("/v1/models/pelican2").status_code == 404


@pytest.mark.parametrize("case", ["missing", "architecture", "taken"])
def test_put_refuses_a_bad_adapter_and_registers_nothing(
        case: str, lora_server: Any, smollm2: Path, tiny_model: Path,
        adapters: dict[str, Path], tmp_path: Path) -> None:
    base, adapter, name = {
        "missing": (smollm2, tmp_path / "none", "x1"),
        "architecture": (tiny_model, adapters["pelican"], "x2"),
        "taken": (smollm2, adapters["pelican"], "kangaroo"),
    }[case]
    with lora_server.client() as c:
        r = c.put("/v1/models", json={"name": "bad-base", "source": str(base),
                                      "adapters": {name: str(adapter)}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]
        ids = {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert "bad-base" not in ids and name not in ids - {"kangaroo"}
    assert _ask(lora_server, "kangaroo")["model"] == "kangaroo"  # still served by smollm2


@pytest.mark.parametrize("adapters_field", [{"": "/a"}, {" x": "/a"}, {"x": " "}, {"x": 3}])
def test_put_refuses_a_malformed_adapters_field(lora_server: Any, smollm2: Path,
                                                adapters_field: dict[str, Any]) -> None:
    with lora_server.client() as c:
        r = c.put("/v1/models", json={"name": "bad-base", "source": str(smollm2),
                                      "adapters": adapters_field})
    assert r.status_code == 400, r.text
