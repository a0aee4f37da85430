"""Several load-test reports side by side, as one markdown table (one row per report and rate).

    python -m loadtest.compare disaggregated.json colocated.json
"""

from __future__ import annotations

import sys

from loadtest.report import load_json, markdown_table


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m loadtest.compare REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    print(markdown_table([load_json(p) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
