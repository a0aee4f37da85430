"""engine/handover_trace.py: a committed request's stamps, logged once its second message
leaves, read back by `parse` and `in_batch_at` (what bench transfer's `to_batch_s` uses)."""

from __future__ import annotations

import logging

import pytest

from engine import handover_trace


@pytest.fixture
def tracing(monkeypatch):
    monkeypatch.setattr(handover_trace, "TRACE", True)
    monkeypatch.setattr(handover_trace, "_marks", {})


def test_stamps_are_logged_after_the_second_message_and_parse_back(tracing, caplog):
    caplog.set_level(logging.INFO, logger="engine.handover_trace")
    handover_trace.mark("r1", "step")  # not committed yet: ignored
    handover_trace.mark("r1", "commit_in")
    handover_trace.mark_all("launched")  # the step in flight when the commit came
    handover_trace.mark("r1", "commit_run")
    handover_trace.mark_all("scheduled")
    handover_trace.mark("other", "yield")  # never committed here: nothing
    assert handover_trace.traced() == ["r1"]
    handover_trace.mark("r1", "yield")
    assert not caplog.records
    handover_trace.mark("r1", "yield")
    assert handover_trace.traced() == []
    (record,) = caplog.records
    request_id, stamps = handover_trace.parse(record.getMessage())
    assert request_id == "r1"
    assert [p for p, _ in stamps] == ["commit_in", "launched", "commit_run", "scheduled",
                                      "yield", "yield"]
    times = [t for _, t in stamps]
    assert times == sorted(times)
    assert handover_trace.in_batch_at(stamps) == stamps[3][1]


def test_in_batch_at_is_the_first_schedule_after_the_commit_ran():
    stamps = [("commit_in", 1.0), ("scheduled", 1.1), ("commit_run", 1.2), ("scheduled", 1.3)]
    assert handover_trace.in_batch_at(stamps) == 1.3
    assert handover_trace.in_batch_at(stamps[:3]) is None
    assert handover_trace.parse("some other line") is None


def test_off_it_keeps_nothing(monkeypatch):
    monkeypatch.setattr(handover_trace, "TRACE", False)
    monkeypatch.setattr(handover_trace, "_marks", {})
    handover_trace.mark("r1", "commit_in")
    handover_trace.mark_all("step")
    assert handover_trace.traced() == [] and handover_trace._marks == {}


def test_the_lines_of_two_processes_merge_into_one_request_s_stamps():
    """The decode worker's process (commit read, messages to gRPC) and its engine core
    process (commit run, steps, outputs sent) log a line each for the request."""
    server = "x handover [r1] commit_in=10.000000 yield=+3.000 yield=+4.000"
    core = "y handover [r1] commit_in=10.001000 commit_run=+0.100 scheduled=+0.500 yield=+2.000"
    merged = handover_trace.merge([server, "unrelated", core])
    assert list(merged) == ["r1"]
    stamps = merged["r1"]
    assert [p for p, _ in stamps] == ["commit_in", "commit_in", "commit_run", "scheduled",
                                      "yield", "yield", "yield"]
    assert handover_trace.in_batch_at(stamps) == pytest.approx(10.0015)
