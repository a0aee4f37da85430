"""This decode worker's KV pool as the data planes reach it: what DescribeKV publishes.

The pool gets a new id per process start, so a prefill worker holding a handle of an earlier
process is refused (KVTarget) before it writes anything. Data planes start on demand: the CUDA
IPC handle is exported when asked for, a NIXL agent is created on the first DescribeKV that
names nixl (an agent costs a UCX context; most CPU deployments never use one). A description
with a data plane's export also names the worker's commit doorbell, if it has one
(pdserve/transport/doorbell.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from engine.kv_transfer import pool_layout
from pdserve.transport.base import (
    GRPC,
    DataPlane,
    PoolInfo,
    host_id,
    nixl_wanted,
    offered_transports,
)
from pdserve.transport.planes import make_plane

logger = logging.getLogger(__name__)


class PoolExporter:
    def __init__(self, pool: torch.Tensor, configured: str):
        self.pool = pool  # [L, 2, N, block_size, Hkv, D]
        self.pool_id = uuid.uuid4().hex
        self.layout = pool_layout(pool)
        self.offered = offered_transports(configured, pool.device.type, nixl_wanted(configured))
        self._planes: dict[str, DataPlane] = {}
        self._exports: dict[str, dict[str, Any]] = {}
        self.doorbell = ""  # the commit doorbell's name, published with a data plane's export

    def describe(self, wanted: list[str]) -> PoolInfo:
        """The pool, with the exports of the planes both sides have (started if need be). A
        plane that fails to start is logged and no longer offered."""
        fields: dict[str, Any] = {}
        for name in [t for t in self.offered if t != GRPC and t in wanted]:
            try:
                fields.update(self._export(name))
            except Exception as exc:  # noqa: BLE001 - a plane that cannot start is not offered
                logger.warning("KV transport %s unavailable: %s", name, exc)
                self.offered = tuple(t for t in self.offered if t != name)
        if fields:  # a data plane's push may ring the doorbell with its commit
            fields["doorbell"] = self.doorbell
        return PoolInfo(
            pool_id=self.pool_id, host_id=host_id(), layout=self.layout,
            num_blocks=self.pool.shape[2], device_type=self.pool.device.type,
            transports=self.offered, push_streams=True, **fields,
        )

    def accepts(self, transport: str) -> bool:
        return transport in self.offered and transport in self._exports

    def _export(self, name: str) -> dict[str, Any]:
        if name not in self._exports:
            self._planes[name] = plane = make_plane(name, self.pool, f"decode-{self.pool_id}",
                                                    serve=True)
            self._exports[name] = plane.export()
        return self._exports[name]

    def close(self) -> None:
        for plane in self._planes.values():
            plane.close()

