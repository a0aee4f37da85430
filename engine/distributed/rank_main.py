"""The life of a tensor-parallel rank other than 0: join the group, load this rank's shard of
the model and KV cache, then run every step rank 0 announces until told to stop. Any failure
(rank 0 gone, a collective timing out) ends the process with a non-zero exit code."""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor sharing for the pool

from engine.config import EngineConfig
from engine.distributed import step_channel
from engine.distributed.group import TPGroup, connect

logger = logging.getLogger(__name__)


def run_rank(config: EngineConfig, rank: int, port: int, conn: Connection) -> None:
    from engine.model_runner import ModelRunner, resolve_device

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    world, timeout = config.parallel.tensor_parallel_size, config.parallel.timeout_s
    device = resolve_device(config.device, rank)
    if device.type == "cpu":  # share the cores with the other ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:  # this process's GPU: CUDA graphs capture and replay on the current device's streams
        torch.cuda.set_device(device)
    try:
        group = TPGroup(rank, world, connect(port, world, timeout), device, timeout,
                        config.parallel.enable_expert_parallel)
        runner = ModelRunner(config, group=group)
        if config.role != "colocated":  # rank 0 moves KV in and out of this rank's pool
            conn.send(runner.kv_pool)
        while (item := step_channel.receive(conn)) is not None:
            if isinstance(item, tuple):  # a LoRA adapter for a device slot
                runner.lora.place(*item)  # type: ignore[union-attr]
            else:
                runner.follow(item)
    except EOFError:
        logger.error("tensor-parallel rank 0 is gone; rank %d exits", rank)
        sys.exit(1)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)
    runner.release_graphs()  # before the communicator they hold is closed
    group.close()
