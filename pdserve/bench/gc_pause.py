"""What one full garbage collection costs a server process, before and after its start-up heap
is frozen (engine/gc_heap.py `serving_process_ready`).

    python -m pdserve.bench.gc_pause [--role decode-server] [--repeats 3]

NOTE: a process pauses for a full (generation 2) collection whenever the objects that survived
two younger ones reach a quarter of the old ones, and the pause walks every tracked object. A
role's server imports what its process imports when serving (`ROLES`: a decode worker whose
engine runs in a process of its own, a gateway, ...), then this times `gc.collect()` a few
times, freezes the heap as the servers do, and times it again. Printed and written as JSON:
the tracked objects, and each collection's milliseconds before and after.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from typing import Any

from pdserve.bench.report import bench_main, config_of, write_report

# what each server process imports to serve (its `pdserve <role>` module and what that loads)
ROLES = {
    "decode-server": ["decode_svc.server", "decode_svc.core_client", "torch"],
    "prefill-server": ["prefill_svc.server", "prefill_svc.core_client", "torch"],
    "gateway": ["gateway.server", "gateway.app", "gateway.remote_backend"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", default="decode-server", choices=sorted(ROLES))
    parser.add_argument("--repeats", type=int, default=3, help="collections timed each way")
    parser.add_argument("--output-json", default="bench_results/gc_pause.json")


def _collections(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(round(1e3 * (time.perf_counter() - start), 2))
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.gc_heap import freeze_startup_heap, unfreeze_heap

    for module in ROLES[args.role]:
        importlib.import_module(module)
    objects = len(gc.get_objects())
    before = _collections(args.repeats)
    freeze_startup_heap()
    try:
        after = _collections(args.repeats)
        frozen = gc.get_freeze_count()
    finally:
        unfreeze_heap()
    report = {"config": config_of(args), "tracked_objects": objects, "frozen": frozen,
              "full_collection_ms": before, "full_collection_ms_frozen": after}
    print(f"{args.role}: {objects} tracked objects; a full collection {before} ms, "
          f"{after} ms once frozen")
    write_report(report, args.output_json)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main("gc_pause", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
