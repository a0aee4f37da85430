"""The decode GEMV plan store (engine/models/gemv_plan_store.py): choices recorded per host, read
back by later processes, agreed on by processes planning at the same time."""

from __future__ import annotations

import json
import multiprocessing
import time

from engine.config import EngineConfig, default_gemv_cache
from engine.models.gemv_plan_store import PlanStore, plan_key

KEY = plan_key("linear", 2048, 8192, "bfloat16", "NVIDIA H100 sm90", "torch 2 triton 3")


def test_a_choice_is_written_and_read_back_as_recorded(tmp_path) -> None:
    path = tmp_path / "plans.json"
    with PlanStore(path).locked() as known:
        assert known == {}
        known[KEY] = {1: (2, 1024, 4, True), 2: None, 4: (4, 256, 4, False)}
    with PlanStore(path).locked() as known:
        assert known == {KEY: {1: (2, 1024, 4, True), 2: None, 4: (4, 256, 4, False)}}
    assert json.loads(path.read_text()) == {KEY: {"1": [2, 1024, 4, True], "2": None,
                                                  "4": [4, 256, 4, False]}}


def test_an_unreadable_file_is_replaced(tmp_path) -> None:
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    with PlanStore(path).locked() as known:
        assert known == {}
        known[KEY] = {1: None}
    with PlanStore(path).locked() as known:
        assert known == {KEY: {1: None}}


def test_an_unusable_place_plans_without_a_store(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with PlanStore(blocker / "sub" / "plans.json").locked() as known:  # a file as a folder
        known[KEY] = {1: None}
    assert not (blocker / "sub").exists()


def _plan(path: str, choice: int, delay_s: float, out: multiprocessing.Queue) -> None:
    """One process planning KEY: take the recorded choice, or time (sleep) and record its own."""
    with PlanStore(path).locked() as known:
        if KEY not in known:
            time.sleep(delay_s)
            known[KEY] = {1: (choice, 1024, 4, False)}
        out.put(known[KEY][1][0])


def test_processes_planning_together_take_the_first_ones_choice(tmp_path) -> None:
    """Two processes whose timings would choose differently: the lock makes the second wait
    for the first's record and take it."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    path = str(tmp_path / "plans.json")
    procs = [ctx.Process(target=_plan, args=(path, choice, 1.0, out)) for choice in (2, 4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    first, second = out.get(timeout=5), out.get(timeout=5)
    assert first == second and first in (2, 4)


def test_the_default_place_follows_the_cache_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_gemv_cache() == str(tmp_path / "decode_gemv_plans.json")
    assert EngineConfig(model="m").decode_gemv_cache == str(tmp_path / "decode_gemv_plans.json")
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_gemv_cache() == str(tmp_path / "xdg" / "pdserve" / "decode_gemv_plans.json")
