"""Which threads of a process start OpenMP teams on the CPU: the engine's alone.

libgomp (torch's intra-op parallelism, and the C kernels in kernels/, which share torch's copy
of it) keeps a pool of worker threads for every thread that has started a parallel region and
counts them all; once it manages more threads than there are CPUs it stops spinning between
regions (`gomp_throttled_spin_count_var`, whatever GOMP_SPINCOUNT says), so every region's
workers wait to be woken by the kernel. A CPU decode step runs ~150 regions (the C kernels'
GEMMs and attention, five a layer of the bundled model): measured on the 2-core box, its single
stream took 27-28 ms a token instead of 8.4 once the thread that had loaded the weights (an
event loop's executor thread) kept its pool beside the engine thread's, and 8.4 when one thread
did both. So `AsyncLLMEngine` builds its engine on the thread that steps it, and a CPU server's
other threads that may run torch ops (the event loop: the grpc push's scatter; the executor:
the sender's gathers) run them without a team: `serial_thread`, `serial_executor`.

Spinning is what a decode step's short regions need, and what a host with more engine threads
than cores cannot afford: a prefill worker's regions are long (its prompts' GEMMs), so its
workers sleep between them (`wait_passively_by_default`, `pdserve prefill`), and on the 2-core
box the split cluster's decode worker then kept both its single-stream speed and most of its
throughput under load (docs/loadtest.md, "OpenMP teams on the CPU").
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (dlopen by its soname returns the copy in memory)."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def serial_thread() -> None:
    """The calling thread's torch ops (and the C kernels, which take torch's thread count) run
    on it alone from now on: its OpenMP team size is 1, so it never starts a pool."""
    import torch

    torch.get_num_threads()  # torch's per-thread lazy set-up first: it would undo what follows
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)
    if torch.get_num_threads() != 1:  # another runtime (not libgomp): leave it be
        logger.debug("OpenMP team size unchanged here (%d threads)", torch.get_num_threads())


def serial_executor() -> ThreadPoolExecutor:
    """An executor for an event loop's `to_thread` whose threads run torch ops serially."""
    return ThreadPoolExecutor(thread_name_prefix="pdserve-serial", initializer=serial_thread)


def wait_passively_by_default() -> None:
    """This process's OpenMP workers sleep between parallel regions instead of spinning, unless
    the environment already says how they wait. libgomp reads it when it loads (with torch):
    call before that."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
