"""pdserve.bench.ttft_breakdown: a request's time to first token split by the cluster's log."""

from __future__ import annotations

import json

from pdserve.bench import ttft_breakdown

LOG = """\
[gateway-0] 2026-12-01 10:00:01,600 INFO pdserve.gateway: cmpl-aa: finished in 1.400s, x
[prefill-0] 2026-12-01 10:00:00,500 INFO prefill_svc.service: [cmpl-aa] prefilled 10 tokens
[prefill-0] 2026-12-01 10:00:00,503 INFO prefill_svc.service: [cmpl-bb] prefilled 12 tokens
[prefill-0] 2026-12-01 10:00:00,600 INFO prefill_svc.service: [cmpl-cc] prefilled 12 tokens
[gateway-1] 2026-12-01 10:00:01,700 INFO pdserve.gateway: cmpl-bb: finished in 1.200s, x
"""


def test_parts_add_up_to_the_client_ttft(tmp_path) -> None:
    log = tmp_path / "cluster.log"
    log.write_text(LOG)
    requests = [  # aa: sent 0.0, handler at 0.2 (1.6 s e2e - 1.4 s), prefilled 0.3 after it
        {"request_id": "cmpl-aa", "sent_at": 0.0, "chunk_at": [0.55], "done_at": 1.6},
        {"request_id": "cmpl-bb", "sent_at": 0.1, "chunk_at": [0.45], "done_at": 1.5},
        {"request_id": "cmpl-zz", "sent_at": 0.1, "chunk_at": [0.45], "done_at": 1.5},  # no log
    ]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"runs": [{"requests": requests}]}))
    finished, prefilled = ttft_breakdown.read_log(log)
    result = ttft_breakdown.breakdown(json.loads(report.read_text()), finished, prefilled)
    assert result["requests"] == 2
    ms = result["ms"]
    # aa: 200 ms before the handler (10:00:00.200), prefilled at .500: 300 ms; rest 50
    # bb: 200 ms before, handler at .500, prefilled .503: 3 ms; rest 147
    assert ms["before_handler"] == {"p50": 200.0, "p90": 200.0}
    assert ms["handler_to_prefilled"]["p90"] == 300.0
    assert ms["ttft"] == {"p50": 450.0, "p90": 550.0}
    assert ms["rest"] == {"p50": 98.5, "p90": 147.0}
    assert result["prefill_steps"]["prompts"] == [2]  # aa and bb 3 ms apart; cc not in the run
    assert ttft_breakdown.main([str(report), str(log)]) == 0
    assert ttft_breakdown.main([str(report), str(tmp_path / "r.json")]) == 2  # no log lines
