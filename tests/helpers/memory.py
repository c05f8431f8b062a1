"""Peak memory and event-loop stalls of an in-process server, for the bomb tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

MiB = 1024 * 1024


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS; the RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """This process's peak RSS (VmHWM) in bytes since the last reset."""
    return _status_kib("VmHWM") * 1024


@dataclass
class Watch:
    """What ``watch`` saw: the peak RSS growth and the slowest /health answer."""

    rss_before: int = 0
    peak_growth: int = 0
    health_seconds: list[float] = field(default_factory=list)

    @property
    def slowest_health(self) -> float:
        return max(self.health_seconds, default=0.0)


@contextmanager
def watch(url: str, interval: float = 0.05) -> Iterator[Watch]:
    """Poll ``url``/health every ``interval`` s while the block runs (each answer must be a
    200), and record the growth of peak RSS over the block."""
    seen = Watch(rss_before=reset_peak_rss())
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                start = time.monotonic()
                r = client.get(url + "/health")
                seen.health_seconds.append(time.monotonic() - start)
                assert r.status_code == 200, r.text
                stop.wait(interval)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield seen
    finally:
        stop.set()
        poller.join(60)
        seen.peak_growth = peak_rss() - seen.rss_before
