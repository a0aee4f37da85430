"""engine/gpu_step_marks.py: a prefill engine marks its steps in flight in a folder; a decode
engine beside it on the GPU reads the marks (another process: the mapping is shared) and
holds its steps while one is up (the engine core's loop: tests/test_decode_engine_core.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

from engine import gpu_step_marks
from engine.gpu_step_marks import StepMark, StepMarks
from engine.llm import build_engine_config
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _mark_and_wait(folder: str, begun, release) -> None:  # a prefill engine's process
    mark = StepMark(folder)
    mark.begin(1)  # a small step
    begun.set()
    release.wait(30)
    mark.end()
    begun.clear()
    release.wait(30)  # released twice: stays, marked nothing, until told to close
    mark.close()


def test_a_mark_in_another_process_is_read_until_it_ends(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    begun, release = ctx.Event(), ctx.Event()
    reader = StepMarks(str(tmp_path))
    assert not reader.busy()  # no writer yet (nor a folder's worth of files)
    writer = ctx.Process(target=_mark_and_wait, args=(str(tmp_path), begun, release))
    writer.start()
    try:
        assert begun.wait(30)
        reader._scanned_at = float("-inf")  # its file listed now, not a second later
        assert reader.busy()
        release.set()
        deadline = time.monotonic() + 10
        while reader.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not reader.busy()
    finally:
        release.set()
        writer.join(30)
    assert writer.exitcode == 0 and not tmp_path.exists()  # closed: its file and folder gone
    reader.close()


def test_a_dead_writers_mark_goes_stale(tmp_path, monkeypatch) -> None:
    mark = StepMark(str(tmp_path))
    reader = StepMarks(str(tmp_path))
    mark.begin(1)  # a small step
    assert reader.busy()
    monkeypatch.setattr(gpu_step_marks, "STALE_S", 0.05)  # its process died mid-step
    time.sleep(0.1)
    assert not reader.busy()
    mark.close()
    reader.close()


def test_a_prefill_engine_marks_each_small_step_until_its_tokens_are_back(
        tiny_llama_dir, tmp_path, monkeypatch) -> None:
    import engine.gpu_step_marks as gpu_step_marks

    monkeypatch.setattr(gpu_step_marks, "MARK_MAX_TOKENS", 20)  # a burst's step: more tokens
    config = build_engine_config(tiny_llama_dir, dtype="float32", role="prefill", device="cpu",
                                 num_kv_blocks=8, block_size=16, max_model_len=128,
                                 shared_gpu_step_marks=str(tmp_path))
    engine = LLMEngine(config)
    reader = StepMarks(str(tmp_path))
    seen = []
    launch = engine.runner.launch

    def launch_seen(*args, **kwargs):
        seen.append(reader.busy())
        return launch(*args, **kwargs)

    engine.runner.launch = launch_seen
    try:
        for request_id, first, tokens in (("a", 10, 20), ("b", 40, 30), ("c", 80, 12)):
            engine.add_request(request_id, list(range(first, first + tokens)),  # no shared
                               SamplingParams(max_tokens=1))                      # prefix
            while engine.has_work():
                engine.step()
            assert not reader.busy()  # its step's tokens are back
    finally:
        engine.shutdown()
    assert seen == [True, False, True]  # the step of 30 tokens went unmarked
    assert not tmp_path.exists()
    reader.close()
