"""``--require-qualified`` trusts only a qualification manifest whose sha256s match the files
now, at startup and for ``PUT /v1/models`` alike."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mlxd.config import ServerConfig
from mlxd.models.catalog import build_catalog
from mlxd.models.qualification import FileHasher, check_qualified, qualification_problem
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelKind
from mlxd.qualify import checks as qc
from mlxd.qualify.run import finish_qualification, start_qualification
from mlxd.server.app import build_app
from mlxd.sources.manifest import artifact_files
from mlxd.workflow.register import find_entry, register
from tests.helpers.server import RunningServer, running_server


def _copy(tiny_model: Path, dest: Path) -> Path:
    shutil.copytree(tiny_model, dest)
    return dest


def _qualify_pass(registry: RegistryFile, home: Path, name: str) -> dict:
    """What ``mlxd model qualify`` writes when every check passes (the checks themselves are
    another test's business: a random tiny model cannot pass the perplexity check)."""
    entry = find_entry(registry, name)
    manifest = start_qualification(entry, ModelKind.TEXT, home, qc.QualifyOptions(), "test")
    return finish_qualification(manifest, [qc.CheckResult("load", True, "loaded")],
                                entry=entry, registry=registry, home=home)


def _flip_a_byte_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last weight byte: same size, other content
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A home with 'good' (qualified) and 'plain' (registered, never qualified)."""
    home = tmp_path_factory.mktemp("qual-home")
    registry = RegistryFile(home / "models.yaml")
    for name in ("good", "plain"):
        register(name, str(_copy(tiny_model, home / "models" / name)), registry=registry,
                 home=home)
    manifest = _qualify_pass(registry, home, "good")
    assert manifest["status"] == "pass" and manifest["artifact"]["files"]
    return home


def _config(home: Path) -> ServerConfig:
    return ServerConfig(home=home, models_config=home / "models.yaml", no_starter=True,
                        require_qualified=True)


def _catalog(home: Path, *names: str):  # type: ignore[no-untyped-def]
    catalog = build_catalog(_config(home))
    catalog.registrations = [r for r in catalog.registrations if r.entry.name in names]
    return catalog


def test_a_manifest_backed_pass_is_accepted_and_hashed_once(home: Path) -> None:
    hasher = FileHasher()
    check_qualified(_config(home), _catalog(home, "good"), hasher)
    assert hasher.hashed == len(artifact_files(home / "models" / "good"))
    before = hasher.hashed
    check_qualified(_config(home), _catalog(home, "good"), hasher)
    assert hasher.hashed == before  # unchanged files: answered from the cache


def test_a_hand_written_pass_without_a_manifest_is_refused(home: Path, tmp_path: Path,
                                                          tiny_model: Path) -> None:
    forged_home = tmp_path / "home"
    source = _copy(tiny_model, tmp_path / "forged")
    forged_home.mkdir()
    (forged_home / "models.yaml").write_text(yaml.safe_dump({"models": [{
        "name": "forged", "source": str(source),
        "qualification": {"status": "pass", "finished_at": "2099-01-01T00:00:00Z",
                          "source": str(source), "manifest": str(home / "x.json")}}]}))
    with pytest.raises(ValueError, match="forged: the registry says its qualification passed, "
                                         "but no qualification manifest backs it"):
        check_qualified(_config(forged_home), _catalog(forged_home, "forged"))


def test_a_same_size_change_with_the_mtime_reset_is_refused(home: Path, tmp_path: Path) -> None:
    registry = RegistryFile(home / "models.yaml")
    source = shutil.copytree(home / "models" / "good", tmp_path / "later")
    register("later", str(source), registry=registry, home=home)
    _qualify_pass(registry, home, "later")
    hasher = FileHasher()
    check_qualified(_config(home), _catalog(home, "later"), hasher)  # hashes now cached
    _flip_a_byte_keeping_size_and_mtime(source / "model.safetensors")
    with pytest.raises(ValueError, match=r"later: the artifact changed after it was qualified "
                                         r"\(model.safetensors: sha256 differs\)"):
        check_qualified(_config(home), _catalog(home, "later"), hasher)
    registry.remove("later")


def test_a_failed_or_foreign_manifest_is_refused(home: Path) -> None:
    entry = find_entry(RegistryFile(home / "models.yaml"), "good")
    other = entry.model_copy(update={"source": entry.source + "/"})
    assert "for another source" in str(qualification_problem(other, home))
    plain = find_entry(RegistryFile(home / "models.yaml"), "plain")
    assert qualification_problem(plain, home) == "no qualification (run `mlxd model qualify`)"


def test_startup_applies_the_gate_in_every_app(home: Path) -> None:
    app = build_app(_config(home))  # not only `mlxd serve`: any app built on this config

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(ValueError, match="plain: no qualification"):
        asyncio.run(start())


def test_qualify_own_server_ignores_require_qualified_from_the_environment(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxd.qualify.run import in_process_server

    monkeypatch.setenv("MLXD_REQUIRE_QUALIFIED", "1")  # else nothing could ever be qualified
    registry = RegistryFile(home / "models.yaml")
    with in_process_server(find_entry(registry, "plain"), registry, home) as url:
        assert httpx.get(url + "/health", timeout=30, trust_env=False).status_code == 200


# -- PUT /v1/models --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    empty = tmp_path_factory.mktemp("gated") / "served.yaml"
    empty.write_text("models: []\n")
    cfg = _config(home).model_copy(update={"models_config": empty, "allow_no_models": True})
    with running_server(cfg) as srv:
        yield srv


def _put(srv: RunningServer, entry: dict) -> tuple[int, dict]:
    with srv.client() as http:
        r = http.put("/v1/models", json=entry)
    return r.status_code, r.json()


def test_put_of_an_unqualified_model_is_refused(gated: RunningServer, home: Path) -> None:
    status, body = _put(gated, {"name": "plain", "source": str(home / "models" / "plain")})
    assert status == 400, body
    assert body["error"]["code"] == "model_not_qualified"
    assert "--require-qualified refuses 'plain': no qualification" in body["error"]["message"]
    assert "plain" not in gated.ctx.manager.names


def test_put_with_a_hand_written_pass_is_refused(gated: RunningServer, home: Path) -> None:
    source = str(home / "models" / "plain")
    status, body = _put(gated, {"name": "plain", "source": source, "qualification": {
        "status": "pass", "finished_at": "2099-01-01T00:00:00Z", "source": source}})
    assert status == 400, body
    assert "no qualification manifest backs it" in body["error"]["message"]


def test_put_of_a_qualified_model_is_accepted_until_its_bytes_change(
        gated: RunningServer, home: Path, tmp_path: Path) -> None:
    registry = RegistryFile(home / "models.yaml")
    source = shutil.copytree(home / "models" / "good", tmp_path / "put")
    register("put", str(source), registry=registry, home=home)
    _qualify_pass(registry, home, "put")
    status, body = _put(gated, {"name": "put", "source": str(source)})
    assert status == 200, body
    _flip_a_byte_keeping_size_and_mtime(source / "model.safetensors")
    status, body = _put(gated, {"name": "put2", "source": str(source)})
    assert status == 400, body
    assert "model.safetensors: sha256 differs" in body["error"]["message"]
    registry.remove("put")
