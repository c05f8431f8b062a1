"""The adapter workflow at the command line: a PEFT adapter converted to mlx-lm's format,
``mlxd model inspect | register | qualify`` on adapters, ``convert --fuse``; each result
served and compared with the mlx-lm adapter trained here (tests/helpers/lora_training)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.lora_training import ANSWERS, QUESTION, trained_adapters
from tests.helpers.workflow import mlxd, snapshot


def write_peft(adapter: Path, out: Path, base: str, **config: Any) -> Path:
    """The mlx-lm adapter's own factors saved as Hugging Face PEFT saves a LoRA adapter:
    ``lora_A`` (r, in) = lora_a.T, ``lora_B`` (out, r) = lora_b.T, alpha = scale * r."""
    from safetensors.numpy import load_file, save_file

    mlx_config = json.loads((adapter / "adapter_config.json").read_text())
    rank = mlx_config["lora_parameters"]["rank"]
    tensors = {}
    for name, value in load_file(str(adapter / "adapters.safetensors")).items():
        path, leaf = name.rsplit(".", 1)
        tensors[f"base_model.model.{path}.lora_{leaf[-1].upper()}.weight"] = \
            np.ascontiguousarray(value.T)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
            "lora_alpha": mlx_config["lora_parameters"]["scale"] * rank, "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": base,
            "bias": "none", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, **config}
    (out / "adapter_config.json").write_text(json.dumps(peft, indent=2))
    return out


@dataclass
class Flow:
    home: Path
    lora: Path  # a copy of the trained mlx-lm adapter (manifests are written beside it)
    peft: Path  # the same factors in PEFT's format
    steps: dict[str, Any]

    @property
    def registry(self) -> Path:
        return self.home / "models.yaml"


@pytest.fixture(scope="module")
def flow(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Flow:
    """A registry with the starter as ``smollm2``; over it the mlx-lm adapter registered
    as ``pelican`` and its PEFT twin as ``pelican-peft`` (converted on register); and the
    starter with the adapter fused in, registered as ``fused``."""
    from mlxd.models.registry import RegistryFile
    from mlxd.models.spec import ModelEntry

    root = tmp_path_factory.mktemp("lora-flow")
    home = root / "home"
    home.mkdir()
    lora = root / "pelican"
    shutil.copytree(trained_adapters(smollm2)["pelican"], lora)
    _edit_config(lora, model=str(smollm2))  # trained over this very folder
    peft = write_peft(lora, root / "pelican-peft", str(smollm2))
    registry = RegistryFile(home / "models.yaml")
    registry.upsert(ModelEntry(name="smollm2", source=str(smollm2)))
    steps = {
        "register": mlxd(home, "register", "pelican", str(lora), "--base", "smollm2"),
        "register_peft": mlxd(home, "register", "pelican-peft", str(peft)),  # base it names
        "fuse": mlxd(home, "convert", str(smollm2), "--fuse", "--adapter", str(lora),
                     "--out", str(root / "fused"), "--quiet"),
    }
    for name, step in steps.items():
        assert step.rc == 0, (name, step.stderr[-2000:])
    registry.upsert(ModelEntry(name="fused", source=str(root / "fused")))
    return Flow(home, lora, peft, {k: v.json for k, v in steps.items()})


def test_a_peft_adapter_converts_to_the_same_factors(flow: Flow) -> None:
    from safetensors.numpy import load_file

    manifest = flow.steps["register_peft"]
    converted = Path(manifest["artifact"]["path"])
    assert converted == flow.home / "models" / "adapters" / "pelican-peft"
    conversion = json.loads((converted / "conversion.json").read_text())
    assert conversion["recipe"]["converter"] == "peft-lora"
    assert conversion["status"] == "complete"
    assert manifest["inputs"][0]["manifest"] == str(converted / "conversion.json")
    ours, theirs = (load_file(str(f / "adapters.safetensors")) for f in (converted, flow.lora))
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value)
    config, original = (json.loads((f / "adapter_config.json").read_text())
                        for f in (converted, flow.lora))
    assert config["num_layers"] == original["num_layers"] == 8
    assert config["lora_parameters"]["rank"] == original["lora_parameters"]["rank"]
    assert config["lora_parameters"]["scale"] == pytest.approx(
        original["lora_parameters"]["scale"])


def test_inspect_says_an_adapter_and_the_base_it_names(flow: Flow, smollm2: Path) -> None:
    for folder, fmt in ((flow.peft, "peft"), (flow.lora, "mlx-lm")):
        out = mlxd(flow.home, "inspect", str(folder), "--no-hash")
        assert out.rc == 0, out.stderr
        report = out.json
        adapter = report["adapter"]
        assert report["format"] == f"{fmt}-adapter" and report["kind"] is None
        assert adapter["rank"] == 8 and adapter["base"] == str(smollm2)
        assert sorted(adapter["targets"]) == ["self_attn.q_proj", "self_attn.v_proj"]
        assert adapter["fit"] == {"base": str(smollm2), "checked": True, "fits": True}
    assert report["adapter"]["num_layers"] == 8
    assert (mlxd(flow.home, "inspect", str(flow.peft), "--no-hash").json["adapter"]["layers"]
            == 8)


@pytest.mark.parametrize(("base", "problem"), [
    ("smollm2", None), ("tiny", "trained for another"), ("nobody", "neither a model folder")])
def test_inspect_checks_an_adapter_against_a_base(flow: Flow, tiny_model: Path, base: str,
                                                  problem: str | None) -> None:
    from mlxd.models.registry import RegistryFile
    from mlxd.models.spec import ModelEntry

    registry = RegistryFile(flow.registry)
    if not any(m.name == "tiny" for m in registry.load().models):
        registry.upsert(ModelEntry(name="tiny", source=str(tiny_model)))
    out = mlxd(flow.home, "inspect", str(flow.peft), "--no-hash", "--base", base)
    if problem is None:
        assert out.rc == 0 and out.json["adapter"]["fit"]["fits"] is True
    else:
        assert out.rc == 2 and problem in out.json["error"]


def test_register_puts_the_adapters_on_their_base_entry(flow: Flow) -> None:
    from mlxd.models.registry import RegistryFile

    (entry,) = RegistryFile(flow.registry).load().models[:1]
    assert entry.name == "smollm2"
    assert entry.adapters == {"pelican": str(flow.lora),
                              "pelican-peft": flow.steps["register_peft"]["artifact"]["path"]}
    assert flow.steps["register"]["base"] == "smollm2"
    assert (flow.lora / "registration.json").is_file()


@pytest.fixture(scope="module")
def flow_server(flow: Flow) -> Iterator[Any]:
    from mlxd.config import ServerConfig
    from tests.helpers.server import running_server

    cfg = ServerConfig(models_config=str(flow.registry), home=flow.home, no_starter=True)
    with running_server(cfg) as srv:
        yield srv


def _answer(srv: Any, model: str) -> str:
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 12})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_the_converted_peft_adapter_and_the_fused_model_answer_like_the_adapter(
        flow_server: Any) -> None:
    answers = {m: _answer(flow_server, m) for m in ("pelican", "pelican-peft", "fused")}
    assert answers["pelican"] == ANSWERS["pelican"]  # and the base says otherwise: test_lora
    assert answers["pelican-peft"] == answers["fused"] == answers["pelican"]


def test_fuse_writes_a_manifest(flow: Flow, smollm2: Path) -> None:
    manifest = flow.steps["fuse"]
    assert manifest["recipe"]["converter"] == "mlx-lm-fuse"
    assert manifest["outputs"]["fused_layers"] == 16
    assert manifest["outputs"]["adapter"]["path"] == str(flow.lora)
    assert manifest["source"]["path"] == str(smollm2)
    fused = Path(manifest["outputs"]["artifact"])
    assert (fused / "conversion.json").is_file() and (fused / "config.json").is_file()


def test_qualify_runs_on_an_adapter(flow: Flow) -> None:
    out = mlxd(flow.home, "qualify", "pelican-peft", "--skip", "bench", "--skip",
               "perplexity", "--quiet")
    manifest = out.json
    assert manifest["kind"] == "adapter" and manifest["base"] == "smollm2"
    for check in ("load", "chat", "determinism", "stream"):
        assert manifest["checks"][check]["passed"] is True, manifest["checks"][check]
    folder = Path(flow.steps["register_peft"]["artifact"]["path"])
    assert json.loads((folder / "qualification.json").read_text())["name"] == "pelican-peft"
    assert out.rc == (0 if manifest["status"] == "pass" else 1)
    chain = mlxd(flow.home, "show", "pelican-peft").json
    assert chain["adapter_of"] == "smollm2"
    assert [c["step"] for c in chain["chain"]] == ["qualification", "registration", "conversion"]


# -- worst values: a clear error, and nothing written ------------------------------------

def _edit_config(folder: Path, **change: Any) -> None:
    path = folder / "adapter_config.json"
    data = json.loads(path.read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _state(root: Path) -> dict[str, Any]:
    """Every path under ``root``; a file's size and mtime (a folder's own mtime moves
    when a scratch folder comes and goes inside it: that writes nothing)."""
    return {k: None if (root / k).is_dir() else v for k, v in snapshot(root).items()}


def _bad_adapter(case: str, flow: Flow, tmp: Path) -> tuple[list[str], str]:
    lora, peft = tmp / "lora", tmp / "peft"
    shutil.copytree(flow.lora, lora)
    shutil.copytree(flow.peft, peft)
    for stale in lora.glob("*ation.json"):
        stale.unlink()
    if case == "architecture":
        return [str(lora), "--base", "tiny"], "trained for another"
    if case == "peft-architecture":
        return [str(peft), "--base", "tiny"], "trained for another"
    if case == "rank":
        _edit_config(lora, lora_parameters={"rank": 4})
        return [str(lora), "--base", "smollm2"], "rank 4"
    if case == "peft-rank":
        _edit_config(peft, r=4)
        return [str(peft), "--base", "smollm2"], "r = 4"
    if case == "layers":
        _edit_config(lora, num_layers=2)
        return [str(lora), "--base", "smollm2"], "outside its last 2 layers"
    if case == "missing-file":
        (lora / "adapters.safetensors").unlink()
        return [str(lora), "--base", "smollm2"], "not an adapter folder"
    if case == "missing-folder":
        return [str(tmp / "nowhere"), "--base", "smollm2"], "no such adapter folder"
    if case == "base-not-registered":
        return [str(lora), "--base", "nobody"], "'nobody' is not registered"
    if case == "base-unnamed":
        _edit_config(peft, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
        return [str(peft)], "pass --base NAME"
    if case == "dora":
        _edit_config(lora, fine_tune_type="dora")
        return [str(lora), "--base", "smollm2"], "--fuse --adapter"
    if case == "peft-dora":
        _edit_config(peft, use_dora=True)
        return [str(peft), "--base", "smollm2"], "it is DoRA"
    if case == "name-taken":
        return [str(lora), "--base", "smollm2"], "already a registered model name"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "architecture", "peft-architecture", "rank", "peft-rank", "layers", "missing-file",
    "missing-folder", "base-not-registered", "base-unnamed", "dora", "peft-dora", "name-taken"])
def test_a_bad_adapter_is_refused_and_nothing_is_written(
        case: str, flow: Flow, tiny_model: Path, tmp_path: Path) -> None:
    from mlxd.models.registry import RegistryFile
    from mlxd.models.spec import ModelEntry

    registry = RegistryFile(flow.registry)
    if not any(m.name == "tiny" for m in registry.load().models):
        registry.upsert(ModelEntry(name="tiny", source=str(tiny_model)))
    args, message = _bad_adapter(case, flow, tmp_path)
    name = "smollm2" if case == "name-taken" else f"bad-{case}"
    before = (flow.registry.read_text(), _state(flow.home), _state(tmp_path))
    out = mlxd(flow.home, "register", name, *args)
    assert out.rc == 2, out.stdout
    assert message in out.json["error"]
    assert (flow.registry.read_text(), _state(flow.home), _state(tmp_path)) == before


def test_fusing_an_adapter_of_another_model_is_refused(flow: Flow, tiny_model: Path,
                                                       tmp_path: Path) -> None:
    out = mlxd(flow.home, "convert", str(tiny_model), "--fuse", "--adapter", str(flow.lora),
               "--out", str(tmp_path / "fused"))
    assert out.rc == 2 and "trained for another" in out.json["error"]
    assert not (tmp_path / "fused").exists() and list(tmp_path.iterdir()) == []
    out = mlxd(flow.home, "convert", str(tiny_model), "--fuse", "--out", str(tmp_path / "x"))
    assert out.rc == 2 and "--fuse and --adapter PATH go together" in out.json["error"]


def test_convert_takes_a_half_precision_peft_adapter(flow: Flow, smollm2: Path,
                                                     tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    half = tmp_path / "half"
    shutil.copytree(flow.peft, half)
    weights = load_file(str(half / "adapter_model.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in weights.items()},
              str(half / "adapter_model.safetensors"))
    out = mlxd(flow.home, "convert", str(half), "--base", str(smollm2),
               "--out", str(tmp_path / "mlx"), "--quiet")
    assert out.rc == 0, out.stderr
    assert out.json["recipe"]["converter"] == "peft-lora"
    converted = load_file(str(tmp_path / "mlx" / "adapters.safetensors"))
    for name, value in load_file(str(flow.lora / "adapters.safetensors")).items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], value.astype(np.float16))


def test_a_dora_adapter_is_fused_with_its_magnitudes(flow: Flow, smollm2: Path,
                                                     tmp_path: Path) -> None:
    """mlx-lm's DoRA layer is W' = m * w / |w| per output row, w = W + scale * B^T A^T.
    With m = 2 |w| on one layer and m = |w| elsewhere, the fused model is the LoRA-fused
    one with that layer doubled: the magnitudes were read and applied."""
    from safetensors.numpy import load_file, save_file

    dora = tmp_path / "dora"
    shutil.copytree(flow.lora, dora)
    _edit_config(dora, fine_tune_type="dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    scale = config["lora_parameters"]["scale"]
    base = {k: v for f in smollm2.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    factors = load_file(str(dora / "adapters.safetensors"))
    doubled = "model.layers.29.self_attn.q_proj"
    for path in {k.rsplit(".", 1)[0] for k in list(factors)}:
        w = base[f"{path}.weight"] + scale * (factors[f"{path}.lora_b"].T
                                              @ factors[f"{path}.lora_a"].T)
        norm = np.linalg.norm(w, axis=1)
        factors[f"{path}.m"] = (2 * norm if path == doubled else norm).astype(np.float32)
    save_file(factors, str(dora / "adapters.safetensors"))
    out = mlxd(flow.home, "convert", str(smollm2), "--fuse", "--adapter", str(dora),
               "--out", str(tmp_path / "fused"), "--quiet")
    assert out.rc == 0, out.stderr
    ours = load_file(str(tmp_path / "fused" / "model.safetensors"))
    lora = load_file(str(Path(flow.steps["fuse"]["outputs"]["artifact"]) / "model.safetensors"))
    for name in (f"{doubled}.weight", "model.layers.29.self_attn.v_proj.weight",
                 "model.layers.3.self_attn.q_proj.weight"):
        want = lora[name] * (2 if name.startswith(doubled) else 1)
        np.testing.assert_allclose(ours[name], want, rtol=1e-4, atol=1e-5)
