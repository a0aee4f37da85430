"""engine/step_timeline.py notes steps and collections in time order; pdserve.bench.step_gaps
finds the longest steps, the widest gaps and the collections."""

from __future__ import annotations

import gc
import json
import time

import pytest

from engine import step_timeline
from engine.gc_heap import serving_process_ready, unfreeze_heap
from engine.step_timeline import ENV_DIR, StepTimeline, watch_collections
from pdserve.bench import step_gaps


def test_steps_and_collections_are_noted_and_written(tmp_path) -> None:
    timeline = StepTimeline(str(tmp_path), "decode")
    try:
        assert timeline.step(lambda: [1, 2, 3]) == [1, 2, 3]
        time.sleep(0.03)  # a gap
        timeline.step(lambda: time.sleep(0.02) or [])  # a long step
        gc.collect()
    finally:
        timeline.close()
    data = json.loads(timeline.path.read_text())
    assert data["role"] == "decode" and [s[2] for s in data["steps"]] == [3, 0]
    assert data["steps"][1][1] >= 0.02
    assert data["steps"][1][3] == 0.0  # no device wait: CPU steps
    assert data["steps"][1][4] < 0.01  # asleep: the thread's CPU did not run
    assert any(g == 2 for _, _, g in data["gc"])
    summary = step_gaps.report(tmp_path, top=1, min_gc_ms=0.0)[0]
    assert summary["steps"] == 2 and summary["longest_steps"][0]["ms"] >= 20
    assert summary["widest_gaps"][0]["ms"] >= 30
    assert summary["collections"]


def test_a_window_keeps_its_steps_and_sums_them(tmp_path) -> None:
    steps = [[10.000, 0.002, 5, 0.001, 0.002], [10.010, 0.003, 5, 0.002, 0.003],
             [10.050, 0.004, 5, 0.003, 0.004]]
    (tmp_path / "decode-1.timeline.json").write_text(json.dumps(
        {"role": "decode", "pid": 1, "steps": steps, "gc": []}))
    (summary,) = step_gaps.report(tmp_path, window=(5.0, 40.0))  # the second step only
    assert (summary["steps"], summary["in_steps_ms"], summary["waiting_ms"]) == (1, 3.0, 2.0)
    assert step_gaps.brief_lines([summary])[0] == (
        "decode 1 window 5-40 ms: 1 steps, 3.0 ms in steps, 2.0 ms waiting")
    assert step_gaps.parse_window("0-12.5") == (0.0, 12.5)
    for bad in ("5-5", "a-b", "7"):
        with pytest.raises(ValueError, match="--window"):
            step_gaps.parse_window(bad)


def test_no_timeline_is_an_error(tmp_path) -> None:
    assert step_gaps.main([str(tmp_path)]) == 2


def test_steps_by_outputs_give_the_median_step_and_period() -> None:
    # [start s, duration s, outputs]: three steps of 96 outputs 3 ms apart, one of 50, one of 2
    steps = [[0.000, 0.002, 96], [0.003, 0.002, 96], [0.006, 0.0025, 96], [0.010, 0.001, 50],
             [0.020, 0.004, 2]]
    assert step_gaps.by_outputs(steps, 90, 1000) == {
        "outputs": [90, 1000], "steps": 3, "step_ms_p50": 2.0, "period_ms_p50": 3.0}
    assert step_gaps.by_outputs(steps, 40, 60)["period_ms_p50"] == 10.0
    assert step_gaps.by_outputs(steps, 1, 8) == {  # the last step: no period
        "outputs": [1, 8], "steps": 1, "step_ms_p50": 4.0, "period_ms_p50": None}
    assert step_gaps.by_outputs(steps, 200, 300)["steps"] == 0
    # with the device wait and CPU: the host's part is the step less its wait
    timed = [[0.000, 0.003, 96, 0.002, 0.003], [0.004, 0.005, 96, 0.001, 0.002]]
    assert step_gaps.by_outputs(timed, 90, 1000) == {
        "outputs": [90, 1000], "steps": 2, "step_ms_p50": 4.0, "period_ms_p50": 4.0,
        "wait_ms_p50": 1.5, "host_ms_p50": 2.5, "cpu_ms_p50": 2.5}
    summary = {"role": "decode", "pid": 7, "steps": 2,
               "by_outputs": [step_gaps.by_outputs(timed, 90, 1000)]}
    assert step_gaps.brief_lines([summary]) == [
        "decode 7 outputs 90-1000: 2 steps step_ms 4.0 period_ms 4.0 wait_ms 1.5 host_ms 2.5 "
        "cpu_ms 2.5"]
    assert step_gaps.parse_buckets("1-8,90-1000") == ((1, 8), (90, 1000))
    for bad in ("8-1", "90", "a-b"):
        with pytest.raises(ValueError, match="--buckets"):
            step_gaps.parse_buckets(bad)


def test_a_serving_process_freezes_its_heap_and_notes_its_collections(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server without a step loop (a gateway, a worker whose engine runs in a process of its
    own) freezes what it built before serving, and with PDSERVE_STEP_TIMELINE set notes its
    collections as a timeline without steps (one per process)."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    built = [[i] for i in range(5000)]  # the start-up heap
    assert not step_timeline._timelines
    try:
        serving_process_ready("decode-server")
        assert gc.get_freeze_count() >= len(built)
        (timeline,) = step_timeline._timelines
        assert watch_collections("again") is None  # one timeline notes this process's
        gc.collect()
        timeline.close()
    finally:
        unfreeze_heap()
    assert not step_timeline._timelines
    data = json.loads(timeline.path.read_text())
    assert data["role"] == "decode-server" and data["steps"] == []
    assert any(g == 2 for _, _, g in data["gc"])


def test_an_async_engine_closes_its_timeline_at_shutdown(
        tmp_path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: str) -> None:
    import asyncio

    from engine.async_engine import AsyncLLMEngine
    from pdserve import SamplingParams

    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", max_model_len=256,
                                      kv_cache_memory=8 << 20)

    async def one() -> None:
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=3), "r"):
            pass

    try:
        asyncio.run(one())
        assert len(step_timeline._timelines) == 1
    finally:
        engine.shutdown()
    assert not step_timeline._timelines  # its gc callback removed
    (path,) = tmp_path.glob("*.timeline.json")
    assert len(json.loads(path.read_text())["steps"]) >= 3  # the prefill and the decodes
