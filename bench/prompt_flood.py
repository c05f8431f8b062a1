"""Cost of refusing oversized prompts: peak RSS growth and time to the 400.

Starts mlxd on a model folder as a subprocess, warms it with one normal request,
resets the kernel's peak-RSS counter (``/proc/PID/clear_refs``), then sends
``--concurrent`` chat requests whose prompt is ``--mb`` megabytes at once and
polls ``VmHWM``/``VmRSS`` until they are answered.

    .venv/bin/python -m bench.prompt_flood MODEL_FOLDER --mb 20 --concurrent 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import SERVED_NAME, ServerProcess, free_port, mlxd_spec


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _post(url: str, body: bytes, out: list[Any]) -> None:
    start = time.monotonic()
    with httpx.Client(trust_env=False, timeout=600.0) as client:
        r = client.post(url, content=body, headers={"content-type": "application/json"})
    out.append((r.status_code, time.monotonic() - start, r.text[:160]))


def flood(pid: int, url: str, mb: float, concurrent: int) -> dict[str, Any]:
    """Send ``concurrent`` prompts of ``mb`` MB at once; the memory and time they cost."""
    words = "lorem ipsum dolor sit amet " * int(mb * 1024 * 1024 / 27)
    body = json.dumps({"model": SERVED_NAME, "max_tokens": 4,
                       "messages": [{"role": "user", "content": words}]}).encode()
    try:  # reset VmHWM to the current RSS (Linux >= 4.0)
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    base_rss = _status_kb(pid, "VmRSS")
    base_hwm = _status_kb(pid, "VmHWM")
    results: list[Any] = []
    threads = [threading.Thread(target=_post, args=(url + "/v1/chat/completions", body, results))
               for _ in range(concurrent)]
    start = time.monotonic()
    for t in threads:
        t.start()
    peak = base_rss
    while any(t.is_alive() for t in threads):
        peak = max(peak, _status_kb(pid, "VmRSS"))
        time.sleep(0.02)
    elapsed = time.monotonic() - start
    hwm = _status_kb(pid, "VmHWM")
    return {"mb": mb, "concurrent": concurrent, "wall_s": round(elapsed, 2),
            "base_rss_mb": base_rss // 1024, "base_hwm_mb": base_hwm // 1024,
            "peak_hwm_mb": hwm // 1024, "growth_mb": (max(hwm, peak) - base_rss) // 1024,
            "responses": [(s, round(t, 2), text) for s, t, text in results]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--mb", type=float, default=20.0)
    p.add_argument("--concurrent", type=int, default=3)
    args = p.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as home:
        spec = mlxd_spec(args.model, port, Path(home), "off")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with ServerProcess(spec, port, env, Path(home) / "server.log") as srv:
            with httpx.Client(trust_env=False, timeout=120.0) as c:
                c.post(srv.url + "/v1/chat/completions", json={
                    "model": SERVED_NAME, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
            print(json.dumps(flood(srv.pid, srv.url, args.mb, args.concurrent), indent=1))


if __name__ == "__main__":
    main()
