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
    finished, prefilled, phases = ttft_breakdown.read_log(log)
    assert phases == {}  # lines of a cluster that logged no parts
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


PARTS_LOG = """\
[gateway-0] 2026-12-01 10:00:00,309 INFO gateway.remote_backend: [cmpl-aa] first token in \
10.0 ms: route 0.5, reserve 2.5, prefill 7.0 (call at 100.0020-100.0090)
[prefill-0] 2026-12-01 10:00:00,308 INFO prefill_svc.service: [cmpl-aa] prefilled 10 tokens \
(0 cached) in 4.5 ms (into the engine 0.5, waiting 0.2, steps 3.0, back 0.8) at 100.0035, \
first token 7, KV to 127.0.0.1:1
[decode-0] 2026-12-01 10:00:00,320 INFO decode_svc.receiver: [cmpl-aa] KV received: 4096 \
bytes in 3.0 ms (reserved in 1.5 ms)
[gateway-0] 2026-12-01 10:00:01,300 INFO pdserve.gateway: cmpl-aa: finished in 1.100s, x
[prefill-0] 2026-12-01 10:00:00,400 INFO prefill_svc.service: [cmpl-bb] prefilled 12 tokens \
(0 cached) in 3.0 ms, first token 9, KV to 127.0.0.1:1
[gateway-0] 2026-12-01 10:00:01,400 INFO pdserve.gateway: cmpl-bb: finished in 1.100s, x
"""


def test_the_attempts_logged_parts_split_the_handlers_time(tmp_path) -> None:
    """aa: the handler at 10:00:00.200, its attempt from .299 (logged at .309, 10 ms long):
    99 ms before it; route 0.5, reserve 2.5, the Prefill call 7.0 of which the worker's 4.5
    (the way there 1.5, back 1.0).
    bb has no gateway line (a colocated-style log): its parts are not invented."""
    log = tmp_path / "cluster.log"
    log.write_text(PARTS_LOG)
    requests = [{"request_id": "cmpl-aa", "sent_at": 0.0, "chunk_at": [0.32], "done_at": 1.2},
                {"request_id": "cmpl-bb", "sent_at": 0.1, "chunk_at": [0.42], "done_at": 1.3}]
    finished, prefilled, phases = ttft_breakdown.read_log(log)
    assert phases["cmpl-bb"] == {"prefill_worker": 0.003}
    result = ttft_breakdown.breakdown({"runs": [{"requests": requests}]}, finished, prefilled,
                                      phases=phases)
    ms = result["ms"]
    assert result["requests"] == 2
    assert ms["before_attempt"] == {"p50": 99.0, "p90": 99.0, "requests": 1}
    assert (ms["route"]["p50"], ms["reserve"]["p50"]) == (0.5, 2.5)
    assert (ms["prefill_worker"]["p50"], ms["prefill_call_rest"]["p50"]) == (4.5, 2.5)
    assert [ms[k]["p50"] for k in ("into_engine", "engine_waiting", "engine_steps",
                                   "engine_back")] == [0.5, 0.2, 3.0, 0.8]
    assert (ms["decode_reserve"]["p50"], ms["reserve_call_rest"]["p50"]) == (1.5, 1.0)
    # sent at .0020, the handler from .0035 for 4.5 ms (to .0080), answered at .0090
    assert (ms["prefill_call_there"]["p50"], ms["prefill_call_back"]["p50"]) == (1.5, 1.0)


def test_an_attempt_beside_its_reservation_is_read_too(tmp_path) -> None:
    log = tmp_path / "cluster.log"
    log.write_text("[gateway-0] 2026-12-01 10:00:00,309 INFO gateway.remote_backend: [cmpl-aa] "
                   "first token in 10.0 ms: route 0.5, reserve 2.5 beside, prefill 9.5\n")
    _, _, phases = ttft_breakdown.read_log(log)
    assert phases["cmpl-aa"]["reserve"] == 0.0025 and phases["cmpl-aa"]["prefill_call"] == 0.0095


def test_a_colocated_servers_log_splits_at_the_handler(tmp_path, capsys) -> None:
    """No prefill worker logged: the client's time before the handler and the handler's to
    the first token, and no prefill steps."""
    log = tmp_path / "cluster.log"
    log.write_text("[gateway-1] 2026-12-01 10:00:01,600 INFO pdserve.gateway: cmpl-aa: "
                   "finished in 1.400s, x\n")
    report = {"runs": [{"requests": [
        {"request_id": "cmpl-aa", "sent_at": 0.0, "chunk_at": [0.25], "done_at": 1.6}]}]}
    result = ttft_breakdown.breakdown(report, *ttft_breakdown.read_log(log)[:2])
    assert result["requests"] == 1 and "prefill_steps" not in result
    assert result["ms"] == {"ttft": {"p50": 250.0, "p90": 250.0},
                            "before_handler": {"p50": 200.0, "p90": 200.0},
                            "handler_to_first_token": {"p50": 50.0, "p90": 50.0}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert ttft_breakdown.main([str(path), str(log), "--brief"]) == 0
    assert capsys.readouterr().out.split() == ["ttft", "250.0", "before_handler", "200.0",
                                               "handler_to_first_token", "50.0"]
