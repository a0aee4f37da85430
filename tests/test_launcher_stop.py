"""pdserve up's stop: a second SIGINT / SIGTERM during the graceful stop kills every service
still running instead of interrupting the stop (no service is left behind, no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.launcher import Service, kill_on_signal, stop_all

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(1, flush=True); time.sleep(60)")


def _stubborn(name: str) -> Service:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"1"  # its SIGTERM handler is set
    return Service(name, [], "", proc)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_the_stop_kills_what_is_left(signum: int) -> None:
    services = [_stubborn("gateway"), _stubborn("prefill-0"), _stubborn("redis")]
    before = signal.getsignal(signum)
    threading.Timer(0.5, os.kill, (os.getpid(), signum)).start()
    started = time.monotonic()
    with kill_on_signal(services):
        stop_all(services, grace_s=30.0)  # they ignore SIGTERM: only the signal ends this
    assert time.monotonic() - started < 10
    assert all(s.proc.poll() is not None for s in services)
    assert signal.getsignal(signum) is before
