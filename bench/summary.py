"""The markdown report of one side-by-side run, with the issue's targets checked."""

from __future__ import annotations

import itertools
from typing import Any


def _f(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}"


def _level(server: dict[str, Any], c: int) -> dict[str, Any] | None:
    return next((lv for lv in server.get("throughput", []) if lv["concurrency"] == c), None)


def _raw_batch(raw: dict[str, Any], b: int) -> dict[str, Any] | None:
    return next((r for r in raw.get("batch_generate", []) if r["batch"] == b), None)


def throughput_table(results: dict[str, Any]) -> list[str]:
    rows = ["| contender | streams | output tok/s | per-stream tok/s | TTFT p50 / p95 ms "
            "| ITL p50 / p99 ms | ok/sent | errors |", "|---|---|---|---|---|---|---|---|"]
    for name, server in results["servers"].items():
        if server.get("error"):
            rows.append(f"| {name} | - | failed: {server['error'][:80]} | | | | | |")
            continue
        for lv in server.get("throughput", []):
            errors = ", ".join(f"{k}: {v}" for k, v in lv["errors"].items()) or "0"
            rows.append(
                f"| {name} | {lv['concurrency']} | {_f(lv['aggregate_tok_s'])} "
                f"| {_f(lv['per_stream_decode_tok_s']['p50'])} "
                f"| {_f(lv['ttft_s']['p50'], 0, 1e3)} / {_f(lv['ttft_s']['p95'], 0, 1e3)} "
                f"| {_f(lv['itl_s']['p50'], 0, 1e3)} / {_f(lv['itl_s']['p99'], 0, 1e3)} "
                f"| {lv['ok']}/{lv['requests_sent']} | {errors} |")
    raw = results.get("raw") or {}
    for r in raw.get("batch_generate", []):
        rows.append(f"| raw BatchGenerator | {r['batch']} | {_f(r['e2e_tok_s'])} "
                    f"(decode only {_f(r['decode_tok_s'])}) | | | | | |")
    sg = raw.get("stream_generate")
    if sg:
        rows.append(f"| raw stream_generate | 1 | {_f(sg['decode_tok_s'])} (decode) | "
                    f"{_f(sg['decode_tok_s'])} | {_f(sg['ttft_s'], 0, 1e3)} | | | |")
    return rows


def _errors(result: dict[str, Any]) -> str:
    if result.get("error"):
        return str(result["error"])[:80]
    return ", ".join(f"{k}: {v}" for k, v in result.get("errors", {}).items()) or "0"


def scenario_tables(results: dict[str, Any]) -> list[str]:
    rows = ["", "### Prefix cache: TTFT cold vs cached prefix", "",
            "| contender | prefix tokens | cold TTFT ms | cached TTFT ms | speed-up "
            "| cached_tokens reported | errors |", "|---|---|---|---|---|---|---|"]
    for name, s in results["servers"].items():
        p = s.get("prefix_ttft")
        if p and p.get("error"):
            rows.append(f"| {name} | failed: {p['error'][:100]} |")
        elif p:
            rows.append(f"| {name} | {p['prefix_tokens']} | {_f(p['cold_ttft_s'], 0, 1e3)} "
                        f"| {_f(p['cached_ttft_s'], 0, 1e3)} | {_f(p['speedup'])}x "
                        f"| {p['cached_tokens']} | {_errors(p)} |")
    rows += ["", "### Multi-turn conversation (cached_tokens per turn)", "",
             "| contender | turn: prompt tokens / cached tokens / TTFT ms |", "|---|---|"]
    for name, s in results["servers"].items():
        conv = s.get("conversation")
        if conv and conv.get("error"):
            rows.append(f"| {name} | failed: {conv['error'][:100]} |")
        elif conv:
            cells = "; ".join(f"{t['turn']}: {_f(t['prompt_tokens_mean'], 0)} / "
                              f"{_f(t['cached_tokens_mean'], 0)} / {_f(t['ttft_p50_s'], 0, 1e3)}"
                              for t in conv["turns"])
            rows.append(f"| {name} | {cells} |")
    rows += ["", "### Inter-token latency of running streams while a long prompt arrives", "",
             "| contender | streams | long prompt tokens | ITL p50 ms | ITL p99 ms | p99/p50 "
             "| max gap ms | p50 before / during arrival ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in results["servers"].items():
        i = s.get("itl_long_prompt")
        if i and i.get("error"):
            rows.append(f"| {name} | failed: {i['error'][:100]} |")
        elif i:
            rows.append(f"| {name} | {i['streams']} | {i['long_prompt_tokens']} "
                        f"| {_f(i['itl_p50_s'], 0, 1e3)} | {_f(i['itl_p99_s'], 0, 1e3)} "
                        f"| {_f(i['p99_over_p50'], 2)} | {_f(i['itl_max_s'], 0, 1e3)} "
                        f"| {_f(i['before_p50_s'], 0, 1e3)} / {_f(i['during_p50_s'], 0, 1e3)} "
                        f"| {_errors(i)} |")
    rows += ["", "### Soak", "", "| contender | streams | seconds | sent | ok | 503 (with "
             "Retry-After) | lost | RSS before / peak / after MB | prefix cache held MB "
             "| after without cache / before |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in results["servers"].items():
        k = s.get("soak")
        if k and k.get("error"):
            rows.append(f"| {name} | failed: {k['error'][:100]} |")
        elif k:
            rows.append(f"| {name} | {k['concurrency']} | {k['seconds']:.0f} | {k['sent']} "
                        f"| {k['ok']} | {k['http_503']} ({k['http_503_with_retry_after']}) "
                        f"| {k['lost']} | {k['rss_before_mb']} / {k['rss_peak_mb']} / "
                        f"{k['rss_after_mb']} | {k.get('prefix_cache_growth_mb', '-')} "
                        f"| {k.get('rss_after_without_cache_over_before', '-')} |")
    return rows


def _usable(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """A scenario's result unless it failed."""
    return None if not result or result.get("error") else result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _check(ok: bool | None, text: str) -> str:
    mark = "n/a" if ok is None else ("met" if ok else "NOT met")
    return f"- **{mark}**: {text}"


def target_checks(results: dict[str, Any]) -> list[str]:
    """The issue's targets, each with the measured ratio."""
    servers = results["servers"]
    mlxd = servers.get("mlxd", {})
    raw = results.get("raw") or {}
    out = []
    for c in (8, 16):
        lv, rb = _level(mlxd, c), _raw_batch(raw, c)
        mine = lv["aggregate_tok_s"] if lv else None
        r = _ratio(mine, rb["e2e_tok_s"] if rb else None)
        out.append(_check(None if r is None else r >= 0.9,
                          f"c{c}: mlxd {_f(mine)} tok/s = {_f(r, 2)}x raw BatchGenerator (>= 0.9x)"))
        for peer in ("mlx_lm.server", "vllm-mlx"):
            other = _level(servers.get(peer, {}), c)
            r = _ratio(mine, other["aggregate_tok_s"] if other else None)
            out.append(_check(None if r is None else r > 1.0,
                              f"c{c}: mlxd = {_f(r, 2)}x {peer} (> 1x, aim 1.2x)"))
    lv1, sg = _level(mlxd, 1), raw.get("stream_generate")
    r = _ratio(lv1["per_stream_decode_tok_s"]["p50"] if lv1 else None,
               sg["decode_tok_s"] if sg else None)
    out.append(_check(None if r is None else r >= 0.95,
                      f"single stream: mlxd decode = {_f(r, 2)}x raw stream_generate (>= 0.95x)"))
    p = _usable(mlxd.get("prefix_ttft")) or {}
    out.append(_check(None if not p.get("speedup") else p["speedup"] >= 5,
                      f"cached {p.get('prefix_tokens')}-token prefix: TTFT {_f(p.get('speedup'))}x"
                      " faster than cold (>= 5x)"))
    out.append(_conversation_check(_usable(mlxd.get("conversation"))))
    i = _usable(mlxd.get("itl_long_prompt")) or {}
    out.append(_check(None if not i.get("p99_over_p50") else i["p99_over_p50"] < 3,
                      f"ITL p99/p50 with a long prompt arriving: {_f(i.get('p99_over_p50'), 2)} "
                      "(< 3)"))
    out.append(_soak_check(_usable(mlxd.get("soak"))))
    return out


def _conversation_check(conv: dict[str, Any] | None) -> str:
    if not conv or len(conv["turns"]) < 2:
        return _check(None, "multi-turn cached_tokens")
    turns = conv["turns"]
    covered = [(t["cached_tokens_mean"] or 0) >= 0.9 * (prev["prompt_tokens_mean"] or 1)
               for prev, t in itertools.pairwise(turns)]
    return _check(all(covered), "turns 2-N report cached_tokens >= 90% of the previous turn's "
                                f"prompt: {covered}")


def _soak_check(k: dict[str, Any] | None) -> str:
    if not k:
        return _check(None, "soak")
    ratio = k.get("rss_after_without_cache_over_before") or k["rss_after_over_before"]
    drained = k.get("running_after") in (0, 0.0, None) and k.get("waiting_after") in (0, 0.0, None)
    ok = (k["lost"] == 0 and k["http_503"] == k["http_503_with_retry_after"]
          and (ratio or 9) <= 1.10 and drained)
    return _check(ok, f"soak {k['concurrency']} streams {k['seconds']:.0f} s: lost {k['lost']}, "
                      f"503 {k['http_503']} (all with Retry-After: "
                      f"{k['http_503'] == k['http_503_with_retry_after']}), queue and batch empty "
                      f"after: {drained}, RSS after/before {k['rss_after_over_before']} with the "
                      f"prefix cache's {k.get('prefix_cache_growth_mb', '-')} MB, {ratio} "
                      "without it (<= 1.10)")


def markdown(results: dict[str, Any]) -> str:
    """The whole report."""
    env = results["environment"]
    head = [f"# Side-by-side benchmark ({results['mode']})", "",
            f"{results['started_at']}; {env['cpu']} ({env['cores']} cores); BLAS for every "
            f"contender: {env['blas']}; model: {env['model']}; workload: {results['workload']}.",
            "Ratios from this one run are what count: absolute numbers on shared machines "
            "swing 30-50% between runs.", "", "### Throughput", ""]
    body = throughput_table(results) + scenario_tables(results)
    checks = ["", "### Targets (issue 4)", "", *target_checks(results)]
    extra = [f"\n{k}: {v}" for k, v in results.get("notes", {}).items()]
    return "\n".join(head + body + checks + extra) + "\n"
