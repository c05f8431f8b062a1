"""The registry file: validation that names entry, field and line; atomic writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mlxd.models.registry import RegistryError, RegistryFile, parse_registry
from mlxd.models.spec import ModelEntry, parse_size

GOOD = """\
manager:
  memory_budget: 8GB
  idle_unload_seconds: 600
  contention: wait
  wait_timeout_s: 30
models:
  - name: chat
    source: /models/chat
    kind: text
    pinned: true
    defaults:
      temperature: 0.2
      max_tokens: 256
      chat_template_kwargs: {enable_thinking: false}
  - name: emb
    source: org/embedder
    revision: abc123
    ttl_seconds: 120
"""


def test_a_valid_registry_parses() -> None:
    data = parse_registry(GOOD, Path("models.yaml"))
    assert [m.name for m in data.models] == ["chat", "emb"]
    assert data.models[0].defaults.chat_template_kwargs == {"enable_thinking": False}
    assert data.manager.memory_budget == "8GB"


@pytest.mark.parametrize("text, expected", [
    ("models:\n  - name: a\n    source: x\n    kind: llm\n",
     "models.yaml:4: model 'a' (entry 1), field 'kind'"),
    ("models:\n  - name: a\n    source: x\n  - name: b\n    source: y\n    ttl_seconds: -1\n",
     "models.yaml:6: model 'b' (entry 2), field 'ttl_seconds'"),
    ("models:\n  - name: a\n    source: x\n    color: red\n",
     "model 'a' (entry 1), field 'color': Extra inputs are not permitted"),
    ("models:\n  - source: x\n", "models entry 1, field 'name'"),
    ("manager:\n  memory_budget: lots\nmodels: []\n", "manager.memory_budget"),
    ("manager:\n  contention: maybe\n", "manager.contention"),
    ("models:\n  - name: a\n    source: x\n  - name: a\n    source: y\n",
     "model name 'a' is defined twice"),
    ("models:\n  - name: a\n    source: x\n    defaults: {temperature: -3}\n",
     "model 'a' (entry 1), field 'defaults.temperature'"),
    ("models:\n  - name: a\n    source: x\n    defaults: {top_p: 1.0e+142}\n",
     "field 'defaults.top_p'"),
    ("models:\n  - name: a\n    source: x\n    defaults: {repetition_penalty: .inf}\n",
     "field 'defaults.repetition_penalty'"),
    ("models: [\n", "not valid YAML"),
    ("- just a list\n", "must be a mapping"),
])
def test_invalid_registries_name_the_problem(text: str, expected: str) -> None:
    with pytest.raises(RegistryError) as err:
        parse_registry(text, Path("models.yaml"))
    assert expected in str(err.value)


def test_sizes_parse_in_every_notation() -> None:
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size(1024) == 1024
    assert parse_size("1.5g") == 1_500_000_000
    with pytest.raises(ValueError):
        parse_size("much")


def test_upsert_and_remove_round_trip(tmp_path: Path) -> None:
    reg = RegistryFile(tmp_path / "models.yaml")
    reg.path.write_text(GOOD)
    assert reg.upsert(ModelEntry(name="new", source="/x")) is False
    assert reg.upsert(ModelEntry(name="chat", source="/y")) is True
    data = reg.load()
    assert [m.name for m in data.models] == ["chat", "emb", "new"]
    assert data.models[0].source == "/y"
    assert data.manager.memory_budget == "8GB"
    assert reg.remove("emb") is True and reg.remove("emb") is False
    assert not list(tmp_path.glob(".models.yaml.*"))  # no temp files left behind


WRITER = """
import sys
from pathlib import Path
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelEntry
reg = RegistryFile(Path(sys.argv[1]))
i = 0
while True:
    i += 1
    reg.upsert(ModelEntry(name=f"m{i % 50}", source="/models/" + "x" * 2000 + str(i)))
"""


def test_kill_9_during_writes_always_leaves_a_valid_registry(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    RegistryFile(path).upsert(ModelEntry(name="seed", source="/s"))
    for delay in (0.3, 0.45, 0.6, 0.8, 1.0):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        data = RegistryFile(path).load()  # parses: old or new, never half
        assert data.models[0].name == "seed"
        assert yaml.safe_load(path.read_text())["models"]


def test_generation_config_fills_unset_sampling_defaults(tmp_path: Path) -> None:
    from mlxd.models.catalog import with_generation_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}')
    entry = ModelEntry.model_validate({"name": "m", "source": str(tmp_path),
                                       "defaults": {"temperature": 0.1}})
    filled = with_generation_defaults(entry, tmp_path)
    assert (filled.defaults.temperature, filled.defaults.top_p, filled.defaults.top_k) == \
        (0.1, 0.95, 20)


def test_serve_without_arguments_adds_registered_models_to_the_starter_set(tmp_path: Path) -> None:
    from mlxd.config import ServerConfig
    from mlxd.models.catalog import build_catalog
    from mlxd.models.starter import starter_entries

    home = tmp_path / "home"
    home.mkdir()
    model = tmp_path / "mine"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], '
                                       '"model_type": "llama"}')
    RegistryFile(home / "models.yaml").upsert(ModelEntry(name="mine", source=str(model)))
    catalog = build_catalog(ServerConfig(home=home))
    names = [r.entry.name for r in catalog.registrations]
    starters = [e.name for e in starter_entries()]
    assert starters[0] == "smollm2-135m-instruct"
    assert {"all-minilm-l6-v2", "piper-joe"} <= set(starters)
    assert names == [*starters, "mine"]
    assert catalog.aliases["default"] == "smollm2-135m-instruct"
    assert catalog.registry is not None and catalog.registry.path == home / "models.yaml"
