"""``mlxd serve --hosts``: start the group through ``mlx.launch``, then play a rank.

Run by a person, ``mlxd serve --hosts H`` replaces itself with ``mlx.launch``,
which starts ``mlxd serve`` once per rank (``MLX_RANK`` set). Rank 0 goes on to
serve HTTP with text models sharded over the group; the other ranks follow
(``engines/distributed/follower.py``) and never open an HTTP port.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import MappingProxyType

from mlxd.config import ServerConfig
from mlxd.engines.registry import ENGINES, EngineSpec
from mlxd.models.spec import ModelKind
from mlxd.runtime.distributed import group_options, launch_command, rank_of_process

log = logging.getLogger(__name__)


def start_rank(config: ServerConfig, argv: list[str]) -> int | None:
    """Launch the group (never returns) or run a follower rank (its exit code); None on
    rank 0, which goes on to serve HTTP."""
    rank = rank_of_process()
    if rank is None:
        if not config.hosts:
            raise ValueError("start_rank needs --hosts")
        cmd = launch_command(config.hosts, config.backend, config.group_port, argv)
        log.info("starting the group: %s", " ".join(cmd))
        os.execv(cmd[0], cmd)
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
