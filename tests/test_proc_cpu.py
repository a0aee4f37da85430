"""pdserve/bench/proc_cpu.py: which processes it samples."""

from __future__ import annotations

import subprocess
import sys

from pdserve.bench.proc_cpu import matching


def test_matching_takes_any_of_the_comma_separated_parts() -> None:
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", tag])
                for tag in ("pdserve-test-marker-a", "pdserve-test-marker-b")]
    try:
        both = matching("pdserve-test-marker-a,pdserve-test-marker-b")
        one = matching("pdserve-test-marker-b")
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    assert sorted(both) == sorted(str(p.pid) for p in sleepers)
    assert list(one) == [str(sleepers[1].pid)]
