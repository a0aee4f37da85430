"""`pdserve bench transfer` end to end on the CPU, small: a real decode worker, pushes over grpc
and nixl (host memory), the raw grpcio ceiling; a data-plane push reports its writes apart from
the rest of the push (the control plane); pushes at once (`--concurrency`) report together, with
the CPU time per push on both sides."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench import transfer
from pdserve.transport.nixl import nixl_module


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(nixl_module() is None, reason="needs NIXL (pdserve[nixl])")
def test_pushes_over_grpc_and_nixl_with_the_writes_timed_apart(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    report = transfer.run(_args("--kv-tokens", "64", "--transport", "grpc,nixl", "--slab-mib",
                                "1", "--repeats", "2", "--concurrency", "2",
                                "--output-json", str(out)))
    assert json.loads(out.read_text())["pdserve"] == report["pdserve"]
    by_transport = {s["transport"]: s for s in report["pdserve"]}
    assert set(by_transport) == {"grpc", "nixl"}
    kv_bytes = report["workload"][0]["kv_bytes"]
    for s in by_transport.values():
        assert s["push"]["bytes"] == kv_bytes and len(s["push"]["seconds"]) == 2
        assert s["push"]["gib_per_s"] > 0 and s["ratio_to_raw"] > 0
    assert "write" not in by_transport["grpc"] and "serialize" in by_transport["grpc"]
    nixl = by_transport["nixl"]
    assert len(nixl["write"]["seconds"]) == 2  # the warm-up's write left out
    assert all(0 < w < p for w, p in zip(nixl["write"]["seconds"], nixl["push"]["seconds"]))
    assert 0 < nixl["control_s"] < nixl["push"]["median_s"]
    for s in by_transport.values():  # the commit is sent before the reply comes
        assert 0 < s["commit_to_reply_s"] < s["push"]["median_s"]
        assert s["decode_step_s"] > 0 and isinstance(s["handover_s"], float)
    # two pushes at once, each its own request: twice the bytes, one time for both
    assert {c["transport"] for c in report["concurrent"]} == {"grpc", "nixl"}
    for c in report["concurrent"]:
        assert c["concurrency"] == 2 and c["push"]["bytes"] == 2 * kv_bytes
        assert len(c["push"]["seconds"]) == 2 and c["push"]["gib_per_s"] > 0
        cpu = c["cpu_ms_per_push"]  # both sides' CPU while they ran (the sender's never 0)
        assert cpu["sender"] > 0 and cpu["decode"] >= 0


def test_handover_reads_the_first_decode_token_less_a_step():
    # tokens 1..4 from the decode worker's steps, 0.5 s apart; the first 1.25 s after the commit
    assert transfer.handover([(1, 10.25), (2, 10.75), (3, 11.25), (4, 11.75)], 9.0) == (0.75, 0.5)
    # a message carrying two tokens at once: both arrived then
    assert transfer.handover([(2, 10.0), (3, 10.5), (4, 11.0)], 9.0) == (0.5, 0.5)
    assert transfer.handover([(1, 10.0), (2, 10.5)], 9.0) is None  # no gap between later tokens


def test_to_batch_reads_the_decode_workers_stamps(tmp_path):
    from pdserve.bench.transfer_cases import Case

    log = tmp_path / "decode-worker.log"
    log.write_text("2026-11-29 INFO engine.handover_trace: handover [bench-2] commit_in=10.000500 "
                   "commit_run=+0.300 step=+0.310 scheduled=+0.400 yield=+1.5 yield=+2.5\n"
                   "an unrelated line\n")
    case = Case("push", 1, None, commits=[("bench-1", 5.0), ("bench-2", 10.0)])  # type: ignore[arg-type]
    transfer.to_batch(log, [case], repeats=1)  # the timed rounds' pushes: the last one
    assert case.to_batch == [pytest.approx(0.0009)]  # 10.0005 + 0.0004 - 10.0
