"""TPGroup.close is bounded: a communicator whose abort never returns (NCCL's, while a CUDA
graph still holds it) must not hang the worker's shutdown. Stand-in process groups: a unit test
of engine/distributed/group.py alone."""

import logging
import threading
import time

from engine.distributed.group import TPGroup


class _PG:
    def __init__(self, blocks: bool) -> None:
        self.blocks, self.aborted = blocks, threading.Event()

    def abort(self) -> None:
        self.aborted.set()
        if self.blocks:
            threading.Event().wait()  # never returns


def _group(dev: _PG, host: _PG) -> TPGroup:
    group = TPGroup.__new__(TPGroup)  # no store, no real process groups
    group.rank, group.dev, group.host = 1, dev, host
    return group


def test_close_aborts_both_groups():
    dev, host = _PG(False), _PG(False)
    _group(dev, host).close(timeout_s=5)
    assert dev.aborted.is_set() and host.aborted.is_set()


def test_close_gives_up_on_an_abort_that_never_returns(caplog):
    dev, host = _PG(True), _PG(False)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        _group(dev, host).close(timeout_s=0.3)
    assert time.monotonic() - start < 3
    assert dev.aborted.is_set()
    assert "did not close within" in caplog.text
