"""pdserve/bench/proc_cpu.py: which processes it samples."""

from __future__ import annotations

import subprocess
import sys
import time

from pdserve.bench.proc_cpu import matching


def test_matching_takes_any_of_the_comma_separated_parts() -> None:
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", tag])
                for tag in ("pdserve-test-marker-a", "pdserve-test-marker-b")]
    try:  # a child shows its own command line once it has exec'd: wait for both
        deadline = time.monotonic() + 10
        while (len(both := matching("pdserve-test-marker-a,pdserve-test-marker-b")) < 2
               and time.monotonic() < deadline):
            time.sleep(0.05)
        one = matching("pdserve-test-marker-b")
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    assert sorted(both) == sorted(str(p.pid) for p in sleepers)
    assert list(one) == [str(sleepers[1].pid)]


def test_a_spinning_process_shows_in_its_share_and_the_machine_s(tmp_path) -> None:
    import json
    import signal
    import time

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass",
                                "pdserve-test-marker-spin"])
    out = tmp_path / "cpu.json"
    sampler = subprocess.Popen([sys.executable, "-m", "pdserve.bench.proc_cpu", "--match",
                                "pdserve-test-marker-spin", "--interval", "0.25", "--out",
                                str(out)])
    try:
        time.sleep(1.5)
        sampler.send_signal(signal.SIGTERM)
        assert sampler.wait(timeout=10) == 0
    finally:
        spinner.kill()
        spinner.wait()
        sampler.kill()
    report = json.loads(out.read_text())
    assert list(report["processes"]) == [str(spinner.pid)]
    pairs = [(s["cpu"][str(spinner.pid)], s["machine"]) for s in report["samples"]
             if str(spinner.pid) in s["cpu"]]
    assert pairs and max(share for share, _ in pairs) > 0.6  # one core, the whole interval
    for share, machine in pairs:  # the machine's busy cores include the spinner's
        assert share - 0.15 <= machine["busy"] <= report["cpus"] + 0.1
        assert machine["steal"] >= 0
