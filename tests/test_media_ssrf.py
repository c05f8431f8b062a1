"""Media URLs cannot reach private, loopback or link-local hosts (issue 11 item 2).

The checks run in a network namespace of their own (``unshare -n``; root is
available here and on CI): 10.1.2.3, 169.254.169.254 and a public stand-in,
1.1.1.1, live on the namespace's loopback with nothing behind them, and a
tripwire listens on every forbidden address, so a broken guard fails these
tests without ever sending a packet to a real private or link-local host.
The checks themselves are in tests/helpers/ssrf_netns.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ADDRESSES = ("10.1.2.3/32", "169.254.169.254/32", "1.1.1.1/32")
CHECKS = (
    "loopback", "private_10_8", "link_local_metadata", "loopback_ipv6", "ipv4_mapped_ipv6",
    "localhost_by_name", "redirect_to_loopback", "redirect_to_private", "redirect_to_metadata",
    "public_fetch_works", "connects_to_the_checked_address", "any_private_answer_refuses",
    "https_to_the_checked_address_with_the_name_verified",
    "server_chat_metadata", "server_anthropic_private", "server_responses_redirect",
    "tripwires_untouched",
)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    if sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs Linux, root and unshare for a private network namespace")
    setup = " && ".join(["ip link set lo up"]
                        + [f"ip addr add {a} dev lo" for a in ADDRESSES])
    script = f"{setup} && exec {sys.executable} -m tests.helpers.ssrf_netns"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out: dict[str, str] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("check", CHECKS)
def test_ssrf_guard(results: dict[str, str], check: str) -> None:
    assert results.get(check) == "ok", results.get(check, "not run")


def test_every_check_ran(results: dict[str, str]) -> None:
    assert set(results) - {"_stop_server"} == set(CHECKS)
