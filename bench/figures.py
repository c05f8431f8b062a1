"""Small measurements quoted in issue notes, each in one run on this machine.

    python -m bench.figures cold-load     # ModelManager cold load vs mlx_lm.load
    python -m bench.figures memory        # estimated vs measured memory of the test models
    python -m bench.figures constrained   # JSON-schema-constrained vs free decode tok/s

Servers run in-process on 127.0.0.1 (``tests/helpers/server.py``); run under
``mlxd serve``'s BLAS by setting ``LD_PRELOAD`` to OpenBLAS as ``mlxd/blas.py`` does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.model import smollm2_float32
from mlxd.config import ServerConfig, default_home
from tests.helpers.server import running_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": {
              "type": "object", "additionalProperties": False, "required": ["name", "qty"],
              "properties": {"name": {"type": "string", "maxLength": 30},
                             "qty": {"type": "integer", "minimum": 0, "maximum": 999}}}}}}


def cold_load(folder: Path, rounds: int) -> None:
    import mlx.core as mx
    from mlx_lm import load

    for _ in range(rounds):
        t0 = time.perf_counter()
        model, _tok = load(str(folder))
        mx.eval(model.parameters())
        raw = time.perf_counter() - t0
        del model, _tok
        mx.clear_cache()
        cfg = ServerConfig(model=str(folder), served_model_name="m", no_starter=True)
        with running_server(cfg) as srv, srv.client() as http:
            t0 = time.perf_counter()
            http.post("/v1/models/load", json={"model": "m"}).raise_for_status()
            managed = time.perf_counter() - t0
        print(f"cold load: mlx_lm.load {raw:.2f} s, ModelManager (POST /v1/models/load) "
              f"{managed:.2f} s")


def memory(folder: Path) -> None:
    from mlxd.models.starter import STARTER_EMBEDDING
    from tests.helpers.tiny_models import build_llama

    tmp = Path(tempfile.mkdtemp())
    a = build_llama(tmp / "a", hidden=64, layers=2, heads=4, seed=0)
    b = build_llama(tmp / "b", hidden=96, layers=3, heads=4, seed=1, tokenizer_from=a)
    c = build_llama(tmp / "c", hidden=48, layers=1, heads=4, seed=2, tokenizer_from=a)
    models = [{"name": n, "source": str(p)} for n, p in
              (("tiny-a", a), ("tiny-b", b), ("tiny-c", c), ("smollm2-f32", folder))]
    models.append({"name": "all-minilm-l6-v2", "source": STARTER_EMBEDDING.source})
    registry = tmp / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": models}))
    cfg = ServerConfig(models_config=registry, home=tmp / "home", no_starter=True)
    print("| model | estimate = weights + reserve | measured after load |\n|---|---|---|")
    with running_server(cfg) as srv, srv.client() as http:
        for m in models:
            card = http.post("/v1/models/load", json={"model": m["name"]}).json()
            reserve = srv.ctx.manager.get(m["name"]).reserve
            weights = card["estimated_bytes"] - reserve
            print(f"| {m['name']} | {weights / 2**20:.1f} MiB + {reserve / 2**20:.0f} MiB "
                  f"| {card['measured_bytes'] / 2**20:.1f} MiB |")


def _decode_rate(http: httpx.Client, extra: dict[str, Any]) -> float:
    body = {"model": "m", "max_tokens": 96, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "List ten grocery items as JSON."}], **extra}
    times = []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def constrained(folder: Path, rounds: int) -> None:
    fmt = {"response_format": {"type": "json_schema",
                               "json_schema": {"name": "groceries", "schema": SCHEMA}}}
    cfg = ServerConfig(model=str(folder), served_model_name="m", no_starter=True,
                       prefix_cache_bytes=0)
    with running_server(cfg) as srv, srv.client() as http:
        _decode_rate(http, {})  # warm up
        for _ in range(rounds):
            free, json_ = _decode_rate(http, {}), _decode_rate(http, fmt)
            print(f"decode tok/s: unconstrained {free:.1f}, json_schema {json_:.1f} "
                  f"(ratio {json_ / free:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cold-load", "memory", "constrained"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    folder = smollm2_float32(default_home())
    if args.what == "cold-load":
        cold_load(folder, args.rounds)
    elif args.what == "memory":
        memory(folder)
    else:
        constrained(folder, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
