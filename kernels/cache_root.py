"""Where pdserve keeps what it builds or measures once per machine: converted GGUF files, built
CPU kernels, the GEMV plan, `pdserve up`'s cluster file (torch-free: the engine's config and the
launcher read it too)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve (read when
    called; vLLM keeps its caches under ~/.cache/vllm the same way)."""
    return os.path.expanduser(os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "pdserve"))
