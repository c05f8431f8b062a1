"""``mlxd model qualify NAME``: prove a registered model works through the real server.

The model is loaded by the same ``ModelManager`` the server uses: either a
server built in this process with ``build_app`` (on 127.0.0.1, a free port,
only this entry registered) or a running one given with ``--url``. The checks
for its kind (``mlxd.qualify.checks``) run against the HTTP endpoints, then a short
``mlxd bench`` run (text). ``qualification.json`` records every check, the
figures, the versions of mlx, mlx-lm and mlxd, and the size and sha256 of every
model file (hashed before the checks); ``mlxd serve --require-qualified`` re-hashes
the files against those. The registry entry gets a summary for people to read.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mlxd.config import ServerConfig
from mlxd.models.memory import parse_budget, read_config
from mlxd.models.registry import RegistryFile
from mlxd.models.spec import ModelEntry, ModelKind
from mlxd.qualify import checks as qc
from mlxd.sources.manifest import (
    finish_manifest,
    inventory,
    link_to,
    manifest_dir,
    manifest_path,
    new_manifest,
    utc_now,
    write_manifest,
)
from mlxd.workflow import WorkflowError
from mlxd.workflow.register import find_entry

StepFn = Callable[[str], None]
FIGURE_KEYS = ("load_s", "memory_bytes", "perplexity", "perplexity_shuffled", "perplexity_ratio",
               "ttft_s", "decode_tok_s", "aggregate_tok_s", "dimension", "ordering_accuracy",
               "mean_margin", "texts_per_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def in_process_server(entry: ModelEntry, registry: RegistryFile, home: Path,
                      overrides: dict[str, Any] | None = None) -> Iterator[str]:
    """Serve only ``entry`` from a server built with ``build_app``; yields its base URL."""
    import uvicorn

    from mlxd.models.catalog import Catalog, CatalogError, registration_for
    from mlxd.models.manager import ManagerPolicy
    from mlxd.server.app import build_app

    # require_qualified off even if MLXD_REQUIRE_QUALIFIED is set: this run is what qualifies.
    config = ServerConfig(**{"home": home, "no_starter": True, "host": "127.0.0.1",
                             "port": _free_port(), "api_key": None, "admin_api_key": None,
                             "models_config": None, **(overrides or {}),
                             "require_qualified": False})
    manager = registry.load().manager
    budget = parse_budget(config.memory_budget if config.memory_budget is not None
                          else manager.memory_budget)
    try:
        reg = registration_for(entry, config, budget)
    except CatalogError as e:
        raise WorkflowError(str(e)) from None
    policy = ManagerPolicy(budget_bytes=budget, contention="wait", wait_timeout_s=300.0)
    adapters = dict.fromkeys(entry.adapters, entry.name)  # served as names of their base
    app = build_app(config, catalog=Catalog([reg], policy, None, adapters, []))
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="mlxd-qualify", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise WorkflowError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def bench_text(url: str, model: str, api_key: str | None, opts: qc.QualifyOptions,
               api: str = "chat") -> qc.CheckResult:
    """A short ``mlxd bench`` run: one stream alone, then ``bench_concurrency`` at once."""
    from mlxd.benchmark.loadgen import Target, Workload, run_levels
    from mlxd.benchmark.prompts import PromptSpec
    from mlxd.benchmark.report import summarize_level

    target = Target(url, model, "chat" if api == "chat" else "completions", api_key)
    workload = Workload(spec=PromptSpec(prompt_tokens=64, seed=7), max_tokens=opts.bench_tokens,
                        temperature=0.0, timeout=300.0, max_duration=300.0)
    conc = max(1, opts.bench_concurrency)
    levels = asyncio.run(run_levels(target, workload, [1, conc],
                                    requests=lambda c: 2 if c == 1 else c, warmup=0))
    single, many = (summarize_level(lv) for lv in levels)
    ok = single["ok"] == single["requests_sent"] and many["ok"] == many["requests_sent"]
    decode = single["per_stream_decode_tok_s"]["p50"]
    figures = {"decode_tok_s": decode, "aggregate_tok_s": many["aggregate_tok_s"],
               "ttft_p50_s": single["ttft_s"]["p50"], "bench_concurrency": conc,
               "bench_levels": [single, many]}
    detail = f"{decode} tok/s one stream, {many['aggregate_tok_s']} tok/s at {conc} streams"
    if not ok:
        detail = f"errors: {single['errors'] or many['errors']}"
    return qc.CheckResult("bench", ok, detail, figures)


def _first_text_check(client: httpx.Client, model: str, opts: qc.QualifyOptions,
                      step: StepFn) -> list[qc.CheckResult]:
    """chat (or, for a base model without a chat template, completion) + the answer check."""
    step("chat")
    first = qc.timed("chat", qc.check_generate, client, model, opts, "chat")
    if first.passed is False and qc.NO_TEMPLATE in first.detail:
        step("completion")
        first = qc.timed("completion", qc.check_generate, client, model, opts, "completions")
        answer = qc.CheckResult("answer", None, "skipped: base model without a chat template "
                                "(completions only)")
        return [first, answer]
    if "answer" in opts.skip:
        return [first, qc.CheckResult("answer", None, "skipped (--skip answer)")]
    return [first, qc.check_answer(first)]


def run_text_checks(client: httpx.Client, url: str, model: str, api_key: str | None,
                    opts: qc.QualifyOptions, step: StepFn) -> list[qc.CheckResult]:
    """chat, answer, determinism, stream, perplexity, coherence, [json, tools], bench."""
    results = _first_text_check(client, model, opts, step)
    first = results[0]
    api = str(first.figures.get("api", "chat"))
    if first.passed:
        step("determinism")
        results.append(qc.timed("determinism", qc.check_determinism, client, model, opts, first))
        step("stream")
        results.append(qc.timed("stream", qc.check_stream, client, model, opts, first))
    if "perplexity" not in opts.skip:
        step("perplexity")
        t0 = time.perf_counter()
        try:
            pair = list(qc.check_perplexity(client, model, opts))
        except (qc.CheckFailed, httpx.HTTPError, KeyError, ValueError) as e:
            pair = [qc.CheckResult("perplexity", False, f"{type(e).__name__}: {e}")]
        for r in pair:
            r.seconds = (time.perf_counter() - t0) / len(pair)
        results.extend(pair)
    if opts.check_json:
        step("json")
        results.append(qc.timed("json", qc.check_json_output, client, model, opts))
    if opts.check_tools:
        step("tools")
        results.append(qc.timed("tools", qc.check_tool_call, client, model, opts))
    if "bench" not in opts.skip:
        step("bench")
        results.append(qc.timed("bench", bench_text, url, model, api_key, opts, api))
    return results


def run_encoder_checks(client: httpx.Client, model: str, kind: ModelKind,
                       opts: qc.QualifyOptions, step: StepFn) -> list[qc.CheckResult]:
    """Embedding or rerank checks, then a throughput figure."""
    step(str(kind))
    fn = qc.check_embeddings if kind == ModelKind.EMBEDDING else qc.check_rerank
    t0 = time.perf_counter()
    try:
        results = fn(client, model, opts)
    except (qc.CheckFailed, httpx.HTTPError, KeyError, ValueError) as e:
        results = [qc.CheckResult(str(kind), False, f"{type(e).__name__}: {e}")]
    for r in results:
        r.seconds = (time.perf_counter() - t0) / len(results)
    if "bench" not in opts.skip:
        step("bench")
        results.append(qc.timed("bench", qc.bench_encoder, client, model, str(kind)))
    return results


def _run_checks(url: str, name: str, kind: ModelKind, api_key: str | None,
                opts: qc.QualifyOptions, step: StepFn,
                load_name: str | None = None) -> list[qc.CheckResult]:
    """The checks of ``kind`` on the served ``name``, after loading ``load_name`` (the
    model itself, or an adapter's base: loading it attaches its adapters)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=600.0, trust_env=False) as client:
        step("load")
        load = qc.timed("load", qc.check_load, client, load_name or name)
        if not load.passed:
            return [load]
        if kind == ModelKind.TEXT:
            rest = run_text_checks(client, url, name, api_key, opts, step)
        elif kind in (ModelKind.EMBEDDING, ModelKind.RERANK):
            rest = run_encoder_checks(client, name, kind, opts, step)
        else:
            rest = [qc.CheckResult(str(kind), False, f"no qualification checks for {kind} "
                                   "models yet (text, embedding and rerank have them)")]
        return [load, *rest]


def _entry_kind(entry: ModelEntry, home: Path) -> ModelKind:
    from mlxd.models.catalog import local_path_of
    from mlxd.models.detection import DetectionError, detect

    if entry.kind is not None:
        return entry.kind
    try:
        return detect(local_path_of(entry, home), name=entry.name).kind
    except DetectionError as e:
        raise WorkflowError(str(e)) from None


def _figures(results: list[qc.CheckResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        out.update({k: v for k, v in r.figures.items() if k in FIGURE_KEYS})
    return out


def artifact_record(entry: ModelEntry, home: Path) -> dict[str, Any] | None:
    """Path, sizes and sha256 of the files that are served for ``entry`` (None when they
    are not on this machine yet); ``--require-qualified`` re-hashes them before serving."""
    from mlxd.models.qualification import artifact_path

    path = artifact_path(entry, home)
    if path is None:
        return None
    return {"path": str(path), "files": [f.as_dict() for f in inventory(path)]}


def start_qualification(entry: ModelEntry, kind: ModelKind, home: Path,
                        opts: qc.QualifyOptions, server: str,
                        command: list[str] | None = None) -> dict[str, Any]:
    """The qualification manifest before the checks run: inputs and the artifact's hashes."""
    manifest = new_manifest("qualification", command=command)
    registration = manifest_path(manifest_dir(entry, home), "registration")
    manifest.update(name=entry.name, kind=str(kind), source=entry.source, entry=entry.public(),
                    server=server, options={
                        k: sorted(v) if isinstance(v, frozenset) else v
                        for k, v in vars(opts).items()},
                    inputs=[link_to(registration)] if registration.is_file() else [])
    # Hashed before the checks, so the hashes are of the bytes that were checked.
    manifest["artifact"] = artifact_record(entry, home)
    return manifest


def finish_qualification(manifest: dict[str, Any], results: list[qc.CheckResult], *,
                         entry: ModelEntry, registry: RegistryFile,
                         home: Path) -> dict[str, Any]:
    """Stamp the results and the status, write the manifest and record it in the registry."""
    if manifest.get("artifact") is None:  # a hub model downloaded by the checks themselves
        manifest["artifact"] = artifact_record(entry, home) or {"path": None, "files": []}
    ran = [r for r in results if r.passed is not None]
    status = "pass" if ran and all(r.passed for r in ran) else "fail"
    manifest["checks"] = {r.name: r.as_dict() for r in results}
    manifest["figures"] = _figures(results)
    finish_manifest(manifest, status)
    path = write_manifest(manifest_path(manifest_dir(entry, home), "qualification"), manifest)
    record_in_registry(registry, entry.name, entry.source, manifest, path)
    return manifest


def qualify(name: str, *, registry: RegistryFile, home: Path,
            options: qc.QualifyOptions | None = None, url: str | None = None,
            api_key: str | None = None, server_overrides: dict[str, Any] | None = None,
            command: list[str] | None = None,
            step: StepFn | None = None) -> dict[str, Any]:
    """Qualify a registered model, or an adapter (over its base, by its name); returns
    (and writes) the qualification manifest."""
    from mlxd.workflow.adapters import find_adapter

    adapter = find_adapter(registry, name)
    if adapter is not None:
        return _qualify_adapter(name, *adapter, registry=registry, home=home,
                                options=options or qc.QualifyOptions(), url=url,
                                api_key=api_key, server_overrides=server_overrides,
                                command=command, step=step or (lambda _s: None))
    entry = find_entry(registry, name)
    opts = options or qc.QualifyOptions()
    kind = _entry_kind(entry, home)
    if entry.tool_call_parser:
        opts.check_tools = True
    if kind == ModelKind.EMBEDDING and opts.expected_dimension is None:
        cfg = read_config(Path(entry.source)) if Path(entry.source).is_dir() else {}
        opts.expected_dimension = cfg.get("hidden_size")
    manifest = start_qualification(entry, kind, home, opts, url or "in-process", command)
    say = step or (lambda _s: None)
    if url:
        results = _run_checks(url, entry.name, kind, api_key, opts, say)
    else:
        with in_process_server(entry, registry, home, server_overrides) as local_url:
            results = _run_checks(local_url, entry.name, kind, None, opts, say)
    return finish_qualification(manifest, results, entry=entry, registry=registry, home=home)


def _qualify_adapter(name: str, base: ModelEntry, folder: Path, *, registry: RegistryFile,
                     home: Path, options: qc.QualifyOptions, url: str | None,
                     api_key: str | None, server_overrides: dict[str, Any] | None,
                     command: list[str] | None, step: StepFn) -> dict[str, Any]:
    """The text checks on the adapter's served name, over its base (loaded with every
    adapter the base entry names, as the server serves it). ``qualification.json`` goes
    in the adapter's folder; the registry keeps no summary for an adapter."""
    manifest = new_manifest("qualification", command=command)
    registration = manifest_path(folder, "registration")
    manifest.update(name=name, kind="adapter", base=base.name, source=str(folder),
                    entry=base.public(), server=url or "in-process",
                    options={k: sorted(v) if isinstance(v, frozenset) else v
                             for k, v in vars(options).items()},
                    inputs=[link_to(registration)] if registration.is_file() else [],
                    artifact={"path": str(folder), "files": [f.as_dict()
                                                             for f in inventory(folder)]})
    if url:
        results = _run_checks(url, name, ModelKind.TEXT, api_key, options, step, base.name)
    else:
        with in_process_server(base, registry, home, server_overrides) as local_url:
            results = _run_checks(local_url, name, ModelKind.TEXT, None, options, step,
                                  base.name)
    ran = [r for r in results if r.passed is not None]
    manifest["checks"] = {r.name: r.as_dict() for r in results}
    manifest["figures"] = _figures(results)
    finish_manifest(manifest, "pass" if ran and all(r.passed for r in ran) else "fail")
    write_manifest(manifest_path(folder, "qualification"), manifest)
    return manifest


def record_in_registry(registry: RegistryFile, name: str, source: str,
                       manifest: dict[str, Any], path: Path) -> None:
    """Store the qualification summary on the entry (when it still has the same source)."""
    current = next((m for m in registry.load().models if m.name == name), None)
    if current is None or current.source != source:
        return  # re-registered meanwhile: this result is about another artifact
    summary = {"status": manifest["status"], "finished_at": manifest["finished_at"],
               "source": source, "manifest": str(path), "server": manifest["server"],
               "checks": {k: v["passed"] for k, v in manifest["checks"].items()},
               "figures": {k: v for k, v in manifest["figures"].items()
                           if not isinstance(v, (list, dict))},
               "mlxd": manifest["tools"].get("mlxd"), "recorded_at": utc_now()}
    registry.upsert(current.model_copy(update={"qualification": summary}))
