"""The server's own counters around a run: Prometheus `/metrics` pages read before and after,
for what only the server knows (pdserve's workers: KV bytes and seconds moved; vLLM: its token
and preemption counters).

Only cumulative samples are kept (names ending in _total, _sum or _count: counters and
histogram sums), summed over their labels; the run reports after - before per page.
"""

from __future__ import annotations

import re

import httpx

CUMULATIVE = ("_total", "_sum", "_count")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")


def parse_counters(text: str) -> dict[str, float]:
    """Cumulative samples of a Prometheus text page, summed over labels, by sample name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or not match[1].endswith(CUMULATIVE):
            continue
        try:
            value = float(match[3])
        except ValueError:
            continue
        out[match[1]] = out.get(match[1], 0.0) + value
    return out


async def read_counters(http: httpx.AsyncClient, urls: tuple[str, ...]) -> dict[str, dict]:
    """url -> its counters now ({} for a page that could not be read)."""
    pages = {}
    for url in urls:
        try:
            r = await http.get(url, timeout=10)
            r.raise_for_status()
            pages[url] = parse_counters(r.text)
        except httpx.HTTPError:
            pages[url] = {}
    return pages


def deltas(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, float]]:
    """url -> counter -> after - before (counters seen on both reads only)."""
    return {url: {k: v - before[url][k] for k, v in after[url].items() if k in before[url]}
            for url in after}
