"""What ``mlxd model``'s parser (``cli/model.py``) and its actions (``cli/model_actions.py``)
share: both import this module, never each other."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from mlxd.config import default_home

REGISTRY_ENV = "MLXD_MODELS_CONFIG"
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "max_context", "max_num_seqs")


def home_of(args: argparse.Namespace) -> Path:
    return Path(args.home).expanduser() if args.home else default_home()


def registry_of(args: argparse.Namespace) -> Any:
    from mlxd.models.registry import RegistryFile

    path = args.models_config or os.environ.get(REGISTRY_ENV) or home_of(args) / "models.yaml"
    return RegistryFile(Path(path).expanduser())
