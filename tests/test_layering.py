"""Architecture rules that must hold (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_engines_import_mlx_libraries() -> None:
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
    for folder in ("engines", "generation", "models"):
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
