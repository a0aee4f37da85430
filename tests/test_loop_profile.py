"""engine/loop_profile.py: cProfile of a loop's thread, only while the gate's path exists."""

from __future__ import annotations

import pstats

from engine import loop_profile


def _busy() -> int:
    return sum(range(1000))


def _idle() -> int:
    return sum(range(10))


def test_profiles_only_while_the_gate_exists(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loop_profile, "GATE_CHECK_S", 0.0)
    gate = tmp_path / "gate"
    prof = loop_profile.LoopProfile(tmp_path / "core-1.prof", str(gate))
    prof.tick()
    _idle()  # before the gate: not counted
    gate.touch()
    prof.tick()
    for _ in range(3):
        _busy()
    gate.unlink()
    prof.tick()
    _idle()  # after it: not counted
    prof.close()
    stats = pstats.Stats(str(tmp_path / "core-1.prof")).stats  # type: ignore[attr-defined]
    calls = {func[2]: row[1] for func, row in stats.items()}
    assert calls["_busy"] == 3 and "_idle" not in calls


def test_nothing_is_written_when_the_gate_never_opened(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(loop_profile.ENV_DIR, str(tmp_path / "out"))
    monkeypatch.setenv(loop_profile.ENV_GATE, str(tmp_path / "never"))
    prof = loop_profile.from_env("core")
    assert prof is not None
    prof.tick()
    prof.close()
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.delenv(loop_profile.ENV_DIR)
    assert loop_profile.from_env("core") is None
