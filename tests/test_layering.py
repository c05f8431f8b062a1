"""Architecture rules that must hold (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlxd"


def test_http_layer_does_not_import_mlx() -> None:
    code = ("import sys, mlxd.server, mlxd.cli.serve, mlxd.models.manager; "
            "bad = [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# Layers, highest first: a module imports only from its own layer or from a lower
# rank (CONTRIBUTING.md, "Layers"). Layers of one rank are peers and never import
# each other (server/ and workflow/; generation/ and models/; sources/, runtime/,
# benchmark/ and media/).
LAYERS: dict[str, int] = {
    "__main__": 8,
    "cli": 7,
    "qualify": 6,     # starts a server: above server/
    "server": 5, "workflow": 5,
    "protocol": 4,
    "engines": 3,     # the only layer importing mlx*
    "generation": 2, "models": 2,
    "sources": 1, "runtime": 1, "benchmark": 1, "media": 1,
    "mlxd": 0, "config": 0, "errors": 0, "jsonfile": 0, "blas": 0,  # foundation
}
_IMPORT_FUNCS = ("import_module", "__import__")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _string_target(node: ast.expr) -> str | None:
    """The constant part of an import_module / __import__ argument ("mlx_lm.x" or the
    leading text of f"mlx_lm.tool_parsers.{name}")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value.rstrip(".") or None
    return None


def _imports_of_source(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module ``source`` imports: ``import``, ``from ... import``
    (relative ones resolved against ``module``), function-level and TYPE_CHECKING
    imports included, plus the string targets of ``importlib.import_module`` and
    ``__import__``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            target = _string_target(node.args[0]) if called in _IMPORT_FUNCS else None
            if target:
                names.add(target)
    return names


def _imports(path: Path) -> set[str]:
    return _imports_of_source(path.read_text(), _module_of(path), path.name == "__init__.py")


def _layer(module: str) -> str | None:
    """``mlxd.models.catalog`` -> ``models``; None for modules outside mlxd."""
    parts = module.split(".")
    if parts[0] != "mlxd":
        return None
    return parts[1] if len(parts) > 1 else "mlxd"


def test_only_engines_import_mlx_libraries() -> None:
    """Static imports and importlib string targets alike (generation/ loads no mlx_lm
    parser module by name)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("engines/"):
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "mlx" or top.startswith("mlx_"):
                offenders.append(f"{rel}: {name}")
    assert offenders == []


def test_engines_and_generation_do_not_import_fastapi() -> None:
    offenders = []
    for folder in ("engines", "generation", "models", "sources", "runtime"):
        for path in (PACKAGE / folder).rglob("*.py"):
            for name in _imports(path):
                if name.split(".")[0] in ("fastapi", "starlette", "uvicorn"):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []


def test_generation_layer_is_backend_free() -> None:
    def forbidden(name: str) -> bool:
        top = name.split(".")[0]
        return top == "mlx" or top.startswith("mlx_") or name.startswith(
            ("mlxd.engines", "mlxd.server", "mlxd.models"))

    offenders = [f"{p.name}: {n}" for p in (PACKAGE / "generation").rglob("*.py")
                 for n in _imports(p) if forbidden(n)]
    assert offenders == []


def test_the_http_layer_knows_engines_only_by_their_protocols() -> None:
    """Routes import the family protocols (``engines/base.py``), never an engine module;
    only the app factory picks the engine registry and the loader."""
    composition = {"mlxd.engines.registry", "mlxd.engines.factory"}
    offenders = []
    for path in (PACKAGE / "server").rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = {"mlxd.engines.base"} | (composition if rel == "server/app.py" else set())
        offenders += [f"{rel}: {n}" for n in _imports(path)
                      if n.startswith("mlxd.engines") and n not in allowed]
    assert offenders == []


def test_import_scanner_sees_importlib_relative_and_lazy_imports() -> None:
    source = """
import importlib
from typing import TYPE_CHECKING
from ..engines import text
from . import spec
if TYPE_CHECKING:
    from mlxd.server.app import build_app
def f(name):
    import mlx.core
    importlib.import_module("mlx_lm.tool_parsers")
    importlib.import_module(f"mlx_vlm.models.{name}")
    __import__("mlx_embeddings")
    importlib.import_module(name)  # not a constant: nothing to check
"""
    found = _imports_of_source(source, "mlxd.models.catalog")
    assert {"mlxd.engines", "mlxd.models", "mlxd.server.app", "mlx.core",
            "mlx_lm.tool_parsers", "mlx_vlm.models", "mlx_embeddings"} <= found
    assert "mlxd.engines" in _imports_of_source("from ..engines import x", "mlxd.models.catalog")
    assert "mlxd.models.spec" in _imports_of_source("from .spec import x", "mlxd.models",
                                                    is_package=True)


def test_every_package_has_a_layer() -> None:
    tops = {p.stem for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert tops - set(LAYERS) == set(), "place the new package in LAYERS (and CONTRIBUTING.md)"


def test_imports_point_down_the_layers() -> None:
    """cli > qualify > server | workflow > protocol > engines > generation | models >
    sources | runtime | benchmark > foundation (config, errors, jsonfile, blas)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        own = _layer(_module_of(path))
        assert own is not None
        for name in _imports(path):
            layer = _layer(name)
            if layer is None or layer == own:
                continue
            if LAYERS[layer] >= LAYERS[own]:
                offenders.append(f"{path.relative_to(PACKAGE)} ({own}) imports {name} ({layer})")
    assert sorted(offenders) == []


def test_named_arrows_stay_removed() -> None:
    """The upward arrows issue 10 removed, each by name (the rank test covers them too)."""
    def imports_of(folder: str) -> set[str]:
        return {n for p in (PACKAGE / folder).rglob("*.py") for n in _imports(p)}

    assert not {n for n in imports_of("models") if n.startswith(("mlxd.workflow",
                                                                 "mlxd.engines"))}
    assert not {n for n in imports_of("workflow") if n.startswith("mlxd.server")}
    assert not {n for n in imports_of("sources") if n.startswith(("mlxd.models", "mlxd.engines",
                                                                  "mlxd.workflow"))}
    assert not {n for n in imports_of("generation") if n == "mlx" or n.startswith(("mlx.", "mlx_"))}
    # cli/model.py (the parser) calls into cli/model_actions.py, never the reverse
    assert "mlxd.cli.model" not in _imports(PACKAGE / "cli" / "model_actions.py")
    assert "mlxd.cli.model" not in _imports(PACKAGE / "cli" / "model_common.py")



def test_schedulers_and_prompt_preparation_do_not_know_the_decoding_library() -> None:
    """Text and vision engines share the schedulers and the input processor: only the
    decoder implementations (``engines/text/mlx_lm_decoder.py``, ...) import mlx-lm or mlx-vlm."""
    shared = ("scheduler.py", "decoder.py", "input_processor.py")
    offenders = [f"{name}: {n}" for name in shared
                 for n in _imports(PACKAGE / "engines" / "text" / name)
                 if n.split(".")[0] in ("mlx_lm", "mlx_vlm")]
    assert offenders == []


# Inside engines/, highest first: the composition modules pick engine classes; the
# families are peers that build on the text core (vision, distributed) and the kernels,
# never on each other; the upstream adapters and the protocols are at the bottom.
ENGINE_RANKS: dict[str, int] = {
    "factory": 7,  # builds the loader over the registry
    "registry": 6, "mlx_convert": 6,
    "vision": 5, "audio": 5, "encoders": 5, "distributed": 5,
    "text": 4,
    "kernels": 3,
    "upstream": 2,
    "base": 1, "device": 1,
    "engines": 0,  # the package's __init__
}


def _runtime_imports_of_source(source: str, module: str, is_package: bool = False) -> set[str]:
    """Like ``_imports_of_source`` without the ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                setattr(node, field, [s for s in block if not (
                    isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test))] or
                    [ast.Pass()])
    return _imports_of_source(ast.unparse(tree), module, is_package)


def _engine_part(module: str) -> str | None:
    """``mlxd.engines.text.scheduler`` -> ``text``; None outside engines/."""
    parts = module.split(".")
    if parts[:2] != ["mlxd", "engines"]:
        return None
    return parts[2] if len(parts) > 2 else "engines"


def test_every_engines_module_has_a_rank() -> None:
    parts = {_engine_part(_module_of(p)) for p in (PACKAGE / "engines").rglob("*.py")}
    assert parts - set(ENGINE_RANKS) == set(), "place it in ENGINE_RANKS (and CONTRIBUTING.md)"


def test_engine_families_use_the_text_core_and_the_adapters_never_each_other() -> None:
    """factory > registry | mlx_convert > vision | audio | encoders | distributed > text > kernels >
    upstream > base | device. ``base.py`` names family value types for type checking
    only: those imports do not count."""
    offenders = []
    for path in (PACKAGE / "engines").rglob("*.py"):
        module = _module_of(path)
        own = _engine_part(module)
        assert own is not None
        names = (_runtime_imports_of_source(path.read_text(), module, path.name == "__init__.py")
                 if own == "base" else _imports(path))
        for name in names:
            part = _engine_part(name)
            if part is None or part == own:
                continue
            if ENGINE_RANKS[part] >= ENGINE_RANKS[own]:
                offenders.append(f"{path.relative_to(PACKAGE)} ({own}) imports {name} ({part})")
    assert sorted(offenders) == []


def _module_graph() -> dict[str, set[str]]:
    """Every mlxd module -> the mlxd modules it imports (``from pkg import mod`` counts
    as importing ``pkg.mod``; lazy and TYPE_CHECKING imports included)."""
    paths = {_module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        names = _imports(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names |= {f"{node.module}.{a.name}" for a in node.names}
        graph[module] = {n for n in names if n in paths and n != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or around a loop, not even lazily or for
    type checking only: a cycle means the two belong together or a shared part belongs
    below both (``shared_prefix.Sequence``, ``audio/speech_backend.py``,
    ``models/file_hasher.py``)."""
    assert _cycles(_module_graph()) == []


def test_cycle_check_sees_a_lazy_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_managers_private_state_is_read_outside_models_only_through_methods() -> None:
    """``ctx.manager._aliases`` and the like: a package's private state is read through a
    public method (``ModelManager.aliases_of``), not across packages."""
    pattern = re.compile(r"\b(?:ctx\.manager|manager|self\.manager)\._[a-z]")
    offenders = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}"
                 for p in PACKAGE.rglob("*.py") if p.parent.name != "models"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


# Ways a thread reaches the event loop. ``runtime/channel.py`` (``LoopChannel``,
# ``Reply``, ``send_all``) is the one place that does it; thread pools that only run
# work between worker threads (``engines/kernels/prefill.py``) never touch a loop.
LOOP_HOPS = {"call_soon_threadsafe", "wrap_future", "run_coroutine_threadsafe"}


def _loop_hops_of_source(source: str) -> list[str]:
    """Each use of a thread-to-loop hop in ``source``: the ``LOOP_HOPS`` methods and
    functions, and ``concurrent.futures.Future`` (however imported)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr in LOOP_HOPS or (
                node.attr == "Future" and ast.unparse(node.value).endswith("futures"))):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.module in ("asyncio", "concurrent.futures"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name in LOOP_HOPS or (a.name == "Future"
                                                 and node.module == "concurrent.futures")]
    return found


def test_only_the_channel_hands_results_from_a_thread_to_the_event_loop() -> None:
    """One channel for every family (issue 28): worker jobs, text events, embedding
    batches, transcribed uploads and a sharded group's failure all reach the loop
    through ``runtime/channel.py``, one thread hop per loop per batch."""
    offenders = [f"{p.relative_to(PACKAGE)}: {hop}" for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).as_posix() != "runtime/channel.py"
                 for hop in _loop_hops_of_source(p.read_text())]
    assert offenders == []


def test_loop_hop_scanner_sees_each_form() -> None:
    source = """
import asyncio, concurrent.futures
from asyncio import wrap_future
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
def f(loop, fut):
    loop.call_soon_threadsafe(print)
    asyncio.wrap_future(fut)
    asyncio.run_coroutine_threadsafe(fut, loop)
    a: concurrent.futures.Future[int] = futures.Future()
    b = asyncio.Future()  # the loop's own future: not a hop
    ThreadPoolExecutor(2).submit(print)  # between threads: not a hop
"""
    assert sorted(_loop_hops_of_source(source)) == sorted([
        "from asyncio import wrap_future", "from concurrent.futures import Future",
        "loop.call_soon_threadsafe", "asyncio.wrap_future", "asyncio.run_coroutine_threadsafe",
        "concurrent.futures.Future", "futures.Future"])
