"""What each ``mlxd model`` subcommand does: parse flags into workflow calls, then render."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from mlxd.cli.model_common import DEFAULT_FIELDS, home_of, registry_of
from mlxd.cli.model_render import (
    print_json,
    progress_bar,
    render_chain,
    render_inspect,
    render_manifest,
    render_plan,
    render_qualification,
    render_registration,
)


def _command() -> list[str]:
    return ["mlxd", *sys.argv[1:]] if sys.argv and sys.argv[0] else ["mlxd"]


def _server_config(args: argparse.Namespace, **extra: Any) -> Any:
    from mlxd.config import ServerConfig

    values = {k: v for k, v in extra.items() if v is not None}
    if getattr(args, "memory_budget", None):
        values["memory_budget"] = args.memory_budget
    return ServerConfig(home=home_of(args), no_starter=True, **values)


def do_inspect(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxd.models.memory import parse_budget
    from mlxd.workflow.inspect import inspect_source

    config = _server_config(args, max_context=args.max_context, max_num_seqs=args.max_num_seqs)
    registry = registry_of(args)
    manager = registry.load().manager if registry.exists() else None
    budget = parse_budget(config.memory_budget if config.memory_budget is not None
                          else manager.memory_budget if manager else None)
    with progress_bar(err, "inspect", bytes_=True, enabled=not args.quiet) as progress:
        report = inspect_source(args.source, config=config, budget=budget,
                                hashes=not args.no_hash, progress=progress)
    if args.base is not None:
        from mlxd.workflow.adapters import fit_base

        report = fit_base(report, args.base, registry, home_of(args))
    if args.json:
        print_json(report)
    else:
        render_inspect(out, report)
    return 0


def do_acquire(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxd.workflow.acquire import acquire

    with progress_bar(err, "acquire", bytes_=True, enabled=not args.quiet) as progress:
        manifest = acquire(args.source, home=home_of(args), out=args.out, name=args.name,
                           revision=args.revision, link=args.link, sha256=args.sha256,
                           join=args.join, gguf_file=args.gguf_file, kind=args.kind,
                           trust_remote_code=args.trust_remote_code, force=args.force,
                           command=_command(), progress=progress)
    if args.json:
        print_json(manifest)
    else:
        render_manifest(out, "acquired", manifest, [
            ("sources", [s["spec"] for s in manifest["sources"]]),
            ("verification", manifest.get("verification"))])
    return 0


def do_convert(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxd.workflow.convert import Quantization, plan_conversion, run_conversion

    quant = Quantization(args.q_bits, args.q_group_size, args.q_mode) if args.quantize else None
    if not args.quantize and (args.q_bits or args.q_group_size):
        raise ValueError("--q-bits / --q-group-size need --quantize")
    dtype = args.dtype
    if dtype is None:
        from mlxd.engines.device import preferred_float_dtype

        dtype = preferred_float_dtype()  # what the server would pick for this machine
    if args.fuse != (args.adapter is not None):
        raise ValueError("--fuse and --adapter PATH go together: `mlxd model convert BASE "
                         "--fuse --adapter PATH` writes BASE with the adapter fused in")
    plan = plan_conversion(args.source, home=home_of(args), out=args.out, dtype=dtype,
                           quantize=quant, trust_remote_code=args.trust_remote_code,
                           adapter=args.adapter, base=args.base)
    if args.register:
        _check_name_free(args, args.register, str(plan.output))
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, "plan": plan.as_dict()})
        else:
            render_plan(out, plan.as_dict())
        return 0
    with progress_bar(err, "convert", enabled=not args.quiet) as progress:
        manifest = run_conversion(plan, force=args.force, command=_command(), progress=progress)
    result: dict[str, Any] = {"conversion": manifest}
    if args.register:
        from mlxd.workflow.register import register

        result["registration"] = register(args.register, str(plan.output),
                                          registry=registry_of(args), home=home_of(args),
                                          replace=args.force, command=_command())
    if args.json:
        print_json(result if args.register else manifest)
    else:
        render_manifest(out, "converted", manifest, [("converter", plan.converter),
                                                     ("dtype", plan.dtype)])
        if args.register:
            render_registration(out, result["registration"])
    return 0


def _check_name_free(args: argparse.Namespace, name: str, source: str) -> None:
    """Refuse ``--register NAME`` before converting when NAME points elsewhere."""
    registry = registry_of(args)
    existing = next((m for m in registry.load().models if m.name == name), None)
    if existing is not None and existing.source != source and not args.force:
        raise ValueError(f"name clash: '{name}' is already registered for {existing.source}; "
                         "choose another name (or --force to replace it)")


def do_register(args: argparse.Namespace, out: Console, err: Console) -> int:
    from pathlib import Path

    from mlxd.models.spec import ModelKind
    from mlxd.workflow.adapters import adapter_format
    from mlxd.workflow.register import register
    from mlxd.workflow.register_adapter import register_adapter

    if args.base is not None or adapter_format(Path(args.source).expanduser()) is not None:
        manifest = register_adapter(args.name, args.source, base=args.base,
                                    registry=registry_of(args), home=home_of(args),
                                    replace=args.replace, command=_command())
        if args.json:
            print_json(manifest)
        else:
            render_registration(out, manifest)
        return 0

    defaults = {f: getattr(args, f) for f in DEFAULT_FIELDS}
    manifest = register(
        args.name, args.source, registry=registry_of(args), home=home_of(args),
        kind=ModelKind(args.kind) if args.kind else None, replace=args.replace, url=args.url,
        api_key=args.api_key, command=_command(), revision=args.revision, defaults=defaults,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        pinned=args.pinned or None, preload=args.preload or None,
        ttl_seconds=args.ttl_seconds, description=args.description, aliases=args.alias,
        trust_remote_code=args.trust_remote_code or None)
    if args.json:
        print_json(manifest)
    else:
        render_registration(out, manifest)
    return 0


def do_qualify(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxd.qualify.checks import QualifyOptions
    from mlxd.qualify.run import qualify

    opts = QualifyOptions(max_perplexity=args.max_perplexity,
                          min_perplexity_ratio=args.min_perplexity_ratio,
                          check_json=args.check_json, check_tools=args.check_tools,
                          skip=frozenset(args.skip), bench_tokens=args.bench_tokens,
                          bench_concurrency=args.bench_concurrency)
    overrides = {"memory_budget": args.memory_budget} if args.memory_budget else None
    status = None if args.quiet else err.status(f"qualifying {args.name}")
    if status is not None:
        status.start()

    def step(what: str) -> None:
        if status is not None:
            status.update(f"qualifying {args.name}: {what}")

    try:
        manifest = qualify(args.name, registry=registry_of(args), home=home_of(args),
                           options=opts, url=args.url, api_key=args.api_key,
                           server_overrides=overrides, command=_command(), step=step)
    finally:
        if status is not None:
            status.stop()
    if args.json:
        print_json(manifest)
    else:
        render_qualification(out, manifest)
    return 0 if manifest["status"] == "pass" else 1


def do_show(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxd.workflow.chain import show_chain

    data = show_chain(args.name, registry=registry_of(args), home=home_of(args),
                      verify=args.verify)
    if args.json:
        print_json(data)
    else:
        render_chain(out, data)
    return 1 if args.verify and data["problems"] else 0
