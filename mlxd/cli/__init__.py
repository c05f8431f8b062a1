"""The ``mlxd`` command line: serve, ps/load/unload, model ..., bench."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

# (command, module, help). Each module defines add_parser(sub, name, help_text), which adds
# the subcommand and sets its ``run`` default: run(args) -> exit code.
COMMANDS = (
    ("serve", "mlxd.cli.serve", "start the server"),
    ("ps", "mlxd.cli.admin", "list models of a running server"),
    ("load", "mlxd.cli.admin", "load a model in a running server"),
    ("unload", "mlxd.cli.admin", "unload a model from a running server"),
    ("model", "mlxd.cli.model", "inspect / acquire / convert / register / qualify models"),
    ("bench", "mlxd.cli.bench", "benchmark an OpenAI-compatible server"),
)


class Parser(argparse.ArgumentParser):
    """No prefix matching: ``--model`` must not be read as ``--models-config``.

    Subcommand parsers are made by ``add_subparsers``, which uses the parent's class,
    so every parser of the CLI is one of these.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from mlxd import __version__

    parser = Parser(prog="mlxd", description="One inference server for every "
                                     "MLX model family.")
    parser.add_argument("--version", action="version", version=f"mlxd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        importlib.import_module(module_name).add_parser(sub, name, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers warns "PyTorch was not found. Models won't be available ..." when it is
    # imported without torch. mlxd uses only its tokenizers and configs (the models are
    # MLX), so the warning is noise that reads as fatal during a conversion. It is one of
    # transformers' "advisory" warnings: set the variable to an empty string to see them.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
