"""pdserve.bench.burst_timeline: a run's requests by stage over time, from the load
generator's report and the cluster's log."""

from __future__ import annotations

import json

from pdserve.bench import burst_timeline

# the gateway logs each request's end 10.000 s (wall) after the report's clock's origin
LOG = """\
[prefill-0] 2026-12-01 10:00:10,040 INFO prefill_svc.service: [cmpl-aa] prefilled 10 tokens
[prefill-0] 2026-12-01 10:00:10,080 INFO prefill_svc.service: [cmpl-bb] prefilled 12 tokens
[gateway-0] 2026-12-01 10:00:10,200 INFO pdserve.gateway: cmpl-aa: finished in 0.200s, x
[gateway-1] 2026-12-01 10:00:10,300 INFO pdserve.gateway: cmpl-bb: finished in 0.300s, x
"""


def _report() -> dict:
    # aa: first token 0.050, second 0.060, then a token every 10 ms to 0.200 (16 tokens);
    # bb: first 0.100, second 0.120, every 20 ms to 0.300 (11 tokens)
    aa = [0.05] + [0.06 + 0.01 * i for i in range(15)]
    bb = [0.10] + [0.12 + 0.02 * i for i in range(10)]
    return {"runs": [{"requests": [
        {"request_id": "cmpl-aa", "sent_at": 0.0, "chunk_at": aa, "done_at": 0.2},
        {"request_id": "cmpl-bb", "sent_at": 0.0, "chunk_at": bb, "done_at": 0.3},
        {"request_id": "cmpl-zz", "sent_at": 0.0, "chunk_at": [], "done_at": 0.1,
         "error": "HTTP 500"},  # failed: left out
    ]}]}


def test_stages_and_steps_from_the_report_and_the_log(tmp_path) -> None:
    log = tmp_path / "cluster.log"
    log.write_text(LOG)
    result = burst_timeline.timeline(_report(), -1, log, bin_ms=20.0)
    assert result["requests"] == 2 and result["span_ms"] == 300
    assert result["last_first_token_ms"] == 100
    assert result["prefilled_span_ms"] == [40, 80]  # the log on the report's clock
    assert result["prefill_to_client_ms"]["p50"] == 20.0  # bb: prefilled 0.080, first 0.100
    bins = {r["t_ms"]: r for r in result["bins"]}
    # at 30 ms both wait for the prefill worker; at 50 ms aa has its first token, not its
    # second; at 90 aa decodes and bb is between the prefill worker and the client
    assert (bins[30]["to_prefill"], bins[30]["to_client"]) == (2, 0)
    assert (bins[50]["to_prefill"], bins[50]["handover"]) == (1, 1)
    assert (bins[90]["to_client"], bins[90]["decoding"]) == (1, 1)
    assert (bins[110]["handover"], bins[110]["decoding"]) == (1, 1)
    # 160-180 ms: aa gets 2 tokens, bb 1, with 2 streams decoding: a step of 20 * 2 / 3 ms
    assert bins[170]["tokens"] == 3 and bins[170]["step_ms"] == 13.33
    assert bins[250]["decoding"] == 1 and bins[250]["step_ms"] == 20.0  # bb alone
    assert result["decode_after"] is None  # never 8 streams at once


def test_without_a_log_and_bad_input(tmp_path) -> None:
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report()))
    result = burst_timeline.timeline(_report(), -1, None, bin_ms=50.0)
    assert result["prefilled_span_ms"] is None and result["prefill_to_client_ms"] is None
    assert result["handover_ms"]["p50"] == 20.0  # bb: 0.100 -> 0.120 (aa's 10 below it)
    assert burst_timeline.main([str(report)]) == 0
    assert burst_timeline.main([str(report), "--run", "3"]) == 2
    assert burst_timeline.main([str(report), "--bin-ms", "0"]) == 2
    log = tmp_path / "other.log"
    log.write_text("[gateway-0] 2026-12-01 10:00:10,200 INFO x: cmpl-qq: finished in 1.0s\n")
    assert burst_timeline.main([str(report), str(log)]) == 2  # none of the run's requests
