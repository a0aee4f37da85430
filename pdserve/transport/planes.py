"""Building a data plane by name (either side); the modules load only when used."""

from __future__ import annotations

import torch

from pdserve.transport.base import CUDA_IPC, NIXL, DataPlane


def make_plane(name: str, pool: torch.Tensor, agent_name: str, serve: bool = False) -> DataPlane:
    """A data plane over `pool` ([L, 2, N, block_size, Hkv, D], one allocation); `agent_name`
    names this worker's NIXL agent; `serve`: peers write into this pool (the decode side)."""
    if name == CUDA_IPC:
        from pdserve.transport.cuda_ipc import CudaIpcPlane

        return CudaIpcPlane(pool)
    if name == NIXL:
        from pdserve.transport.nixl import NixlPlane

        return NixlPlane(pool, agent_name, serve)
    raise ValueError(f"no data plane named {name!r}")
