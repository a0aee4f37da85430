"""Where pdserve keeps what it builds or measures once per machine (torch-free: the engine's
config reads it too)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve (read when
    called; vLLM keeps its caches under ~/.cache/vllm the same way)."""
    return os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
