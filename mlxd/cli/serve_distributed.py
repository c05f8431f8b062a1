"""``mlxd serve --hosts``: start the group through ``mlx.launch``, then play a rank.

Run by a person, ``mlxd serve --hosts H`` runs ``mlx.launch``, which starts
``mlxd serve`` once per rank (``MLX_RANK`` set). Rank 0 goes on to serve HTTP
with text models sharded over the group; the other ranks follow
(``engines/distributed/follower.py``) and never open an HTTP port. The launcher
exits non-zero when any rank did: ``mlx.launch`` itself exits 0 whatever its
ranks did (mlx 0.32), so their statuses are read from the line it prints for
each rank that fails.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from types import MappingProxyType

from mlxd.config import ServerConfig
from mlxd.engines.registry import ENGINES, EngineSpec
from mlxd.models.spec import ModelKind
from mlxd.runtime.distributed import group_options, launch_command, rank_of_process

log = logging.getLogger(__name__)


# What mlx.launch prints (to stderr) for a rank that failed; a rank that ends well
# prints nothing at the default verbosity.
_RANK_FAILED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_launcher(cmd: list[str]) -> int:
    """Run ``mlx.launch`` (its output passed through, signals forwarded to it) until the
    group ends; its exit status, or 1 when it is 0 but a rank failed."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    previous = {sig: signal.signal(sig, lambda sig, _: proc.send_signal(sig))
                for sig in _FORWARDED}
    failed: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            match = _RANK_FAILED.search(line.decode(errors="replace"))
            if match:
                failed.append(f"rank {match[1]} " + (f"exited with code {match[2]}"
                                                     if match[2] else "was killed"))
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # mlx.launch itself ended by a signal
        return 128 - code
    if code == 0 and failed:
        log.error("the group failed: %s", ", ".join(failed))
        return 1
    return code


def start_rank(config: ServerConfig, argv: list[str]) -> int | None:
    """Launch the group and wait for it, or run a follower rank (either way the exit
    code); None on rank 0, which goes on to serve HTTP."""
    rank = rank_of_process()
    if rank is None:
        if not config.hosts:
            raise ValueError("start_rank needs --hosts")
        cmd = launch_command(config.hosts, config.backend, config.group_port, argv)
        log.info("starting the group: %s", " ".join(cmd))
        return run_launcher(cmd)
    if rank == 0:
        return None
    from mlxd.engines.distributed.follower import run_follower

    options = group_options(config)
    assert options is not None
    return run_follower(options)


def sharded_engines() -> Mapping[ModelKind, EngineSpec]:
    """The engine table of rank 0: text models are sharded over the group."""
    table = dict(ENGINES)
    table[ModelKind.TEXT] = EngineSpec("mlxd.engines.distributed.sharded:ShardedLanguageModel", None,
                                       "text")
    return MappingProxyType(table)
