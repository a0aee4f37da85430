"""What every `pdserve bench` command shares: writing its JSON report and its `main`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], output_json: str) -> Path:
    """Write `report` as indented JSON (creating the folder) and say where."""
    path = Path(output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def median_wall_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of one `fn()` over `repeats` calls after `warmup` untimed
    ones (host timing: nothing is synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command's arguments, for the report (without argparse's dispatch function)."""
    return {k: v for k, v in vars(args).items() if k != "func"}


def bench_main(
    module: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], object], argv: list[str] | None = None,
) -> int:
    """`python -m pdserve.bench.<module>`: parse, run; a ValueError is a usage error (exit 2)."""
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.bench.{module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
