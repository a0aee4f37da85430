"""A NIXL agent whose progress thread sleeps between its polls.

NOTE: the side of a NIXL transfer that is written into needs its agent's progress thread (on
host memory over UCX the writes do not complete without it). NIXL's Python `nixl_agent` builds
its C++ agent with that thread's delay (`nixlAgentConfig.pthrDelay`, microseconds between polls)
fixed at 0: the thread polls without pause and holds a whole core for the life of the process,
measured at 1.00 cores with nothing to move (`python -m pdserve.bench.nixl_progress`). A decode
worker on a CPU host then loses a core to it (on the 2-core box the grpc push fell from ~1.1 to
~0.7 GiB/s beside it). `progress_agent` builds the agent with PROGRESS_DELAY_US instead, by
handing `nixl_agent` a constructor of the C++ agent that sets the delay first: 0.01 cores idle,
and 256 MiB written between two agents at the same rate as with the busy poll.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)
PROGRESS_DELAY_US = 100  # a write waits at most this much longer for the target's progress
_building = threading.Lock()  # the binding's constructor is swapped while one agent is built


def progress_agent(mod: ModuleType, name: str, config: Any,
                   delay_us: int = PROGRESS_DELAY_US) -> Any:
    """`mod.nixl_agent(name, config)` with its progress thread (if `config` enables one)
    pausing `delay_us` between polls. A NIXL whose Python API is laid out otherwise gets the
    agent as it builds it (logged)."""
    api = sys.modules.get(mod.nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    if bind is None or not hasattr(bind, "nixlAgent"):
        logger.warning("NIXL's progress thread polls without pause (this NIXL's Python API "
                       "gives no way to set its delay)")
        return mod.nixl_agent(name, config)
    build = bind.nixlAgent

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = delay_us
        return build(agent_name, agent_config)

    with _building:
        bind.nixlAgent = with_delay
        try:
            return mod.nixl_agent(name, config)
        finally:
            bind.nixlAgent = build
