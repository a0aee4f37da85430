"""NIXL's progress thread: the CPU it holds with nothing to move, and a write's time, by the
delay between its polls (pdserve/transport/nixl_agent.py).

    python -m pdserve.bench.nixl_progress [--delays-us 0,100,1000] [--rounds 3]

One process per delay: a target agent with the progress thread (as a decode worker's) and a
writer without (as a prefill worker's), host memory, UCX. Per delay: the process's CPU over 2 s
idle (the progress thread alone), then --rounds writes of 256 MiB in 64 descriptors of 4 MiB
from the writer into the target, the bytes checked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

CHILD = r"""
import json, os, sys, time
import torch
from pdserve.transport.nixl import nixl_module
from pdserve.transport.nixl_agent import progress_agent
delay, rounds = int(sys.argv[1]), int(sys.argv[2])
mod = nixl_module()
target = progress_agent(mod, "target", mod.nixl_agent_config(enable_prog_thread=True,
                        backends=["UCX"]), delay)
writer = progress_agent(mod, "writer", mod.nixl_agent_config(enable_prog_thread=False,
                        backends=["UCX"]), delay)
dst, src = torch.zeros(64, 1 << 20), torch.randn(64, 1 << 20)
target.register_memory(dst)
writer.register_memory(src)
peer = writer.add_remote_agent(target.get_agent_metadata())
cpu = lambda: sum(os.times()[:2])
c0 = cpu(); time.sleep(2.0); idle = (cpu() - c0) / 2.0
run = lambda t: writer.get_xfer_descs([(t.data_ptr() + i * (4 << 20), 4 << 20, 0)
                                      for i in range(64)], "DRAM")
src_descs, dst_descs = run(src), run(dst)
seconds = []
for _ in range(rounds):
    dst.zero_()
    handle = writer.initialize_xfer("WRITE", src_descs, dst_descs, peer)
    start = time.perf_counter()
    writer.transfer(handle)
    while (state := writer.check_xfer_state(handle)) not in ("DONE", "ERR"):
        pass
    seconds.append(time.perf_counter() - start)
    writer.release_xfer_handle(handle)
    assert state == "DONE" and torch.equal(dst, src), state
print("RESULT " + json.dumps({"idle_cores": idle, "write_s": seconds}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delays-us", default="0,100,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default="bench_results/nixl_progress.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for delay in [int(d) for d in args.delays_us.split(",")]:
        out = subprocess.run([sys.executable, "-c", CHILD, str(delay), str(args.rounds)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            raise RuntimeError(f"delay {delay}: exit {out.returncode}\n{out.stderr[-2000:]}")
        r = json.loads(line[len("RESULT "):])
        results[str(delay)] = r
        rates = ", ".join(f"{0.25 / s:.2f}" for s in r["write_s"])
        print(f"delay {delay:>5} us: idle {r['idle_cores']:.2f} cores; 256 MiB writes "
              f"{rates} GiB/s", flush=True)
        time.sleep(0.5)
    report = {"config": config_of(args), "delays": results}
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("nixl_progress", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
