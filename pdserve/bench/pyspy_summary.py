"""Where a profiled process spent its samples below one frame: a summary of py-spy's raw output.

    py-spy record --nonblocking --idle -r 500 -f raw -o prof.txt -- python -m ...
    python -m pdserve.bench.pyspy_summary prof.txt "structured.py:97)" [--top 40]

Keeps the stacks that pass through a frame whose text contains `--under` (e.g. the line that
runs the constrained rounds), and prints each function's share of those samples, inclusive
(anywhere in the stack below that frame) and self (the sampled line itself). `prof.txt` may be
gzipped.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path


def summarise(path: str, under: str) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples below `under`, inclusive counts per function, self counts per line)."""
    opener = gzip.open if Path(path).suffix == ".gz" else open
    total, inclusive, own = 0, collections.Counter(), collections.Counter()
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            hits = [i for i, frame in enumerate(frames) if under in frame]
            if not hits or not count.isdigit():
                continue
            n, below = int(count), frames[hits[0] + 1:]
            total += n
            own[below[-1] if below else "<the frame itself>"] += n
            for function in {re.sub(r":\d+\)$", ")", frame) for frame in below}:
                inclusive[function] += n
    return total, inclusive, own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("under", help="text of the frame to look below, e.g. 'structured.py:97)'")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    total, inclusive, own = summarise(args.path, args.under)
    print(f"{total} samples below {args.under!r}")
    if not total:
        return
    print("inclusive, per function:")
    for name, n in inclusive.most_common(args.top):
        print(f"{n / total:7.1%}  {name}")
    print("self, per line:")
    for name, n in own.most_common(args.top // 2):
        print(f"{n / total:7.1%}  {name}")


if __name__ == "__main__":
    main()
