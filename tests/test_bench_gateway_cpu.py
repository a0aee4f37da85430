"""pdserve.bench.gateway_cpu: the HTTP processes' event-loop CPU per token from a stack-samples
folder, and its variants' syntax (the live runs are the benchmark's, minutes long)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import gateway_cpu


def _cpu(path, threads) -> None:
    path.write_text(json.dumps({"samples": 10, "interval_s": 0.01, "threads_cpu_s": threads}))


def test_loop_cpu_sums_every_process_of_the_role_main_thread_only(tmp_path) -> None:
    _cpu(tmp_path / "gateway-11.cpu.json", {"MainThread [11]": 1.5, "python [12]": 9.0})
    _cpu(tmp_path / "gateway-13.cpu.json", {"MainThread [13]": 0.5, "event_engine [14]": 3.0})
    _cpu(tmp_path / "decode-15.cpu.json", {"MainThread [15]": 7.0})
    assert gateway_cpu.loop_cpu_us_per_token(tmp_path, "gateway", 1000) == pytest.approx(2000)
    with pytest.raises(ValueError, match="no serve CPU"):
        gateway_cpu.loop_cpu_us_per_token(tmp_path, "serve", 1000)
    with pytest.raises(ValueError, match="output tokens"):
        gateway_cpu.loop_cpu_us_per_token(tmp_path, "gateway", 0)


def test_variants_and_bad_arguments() -> None:
    assert gateway_cpu.parse_variant("off=PDSERVE_RESUME_TTL_SECONDS=0") == (
        "off", {"PDSERVE_RESUME_TTL_SECONDS": "0"})
    for bad in ("off", "off=", "=A=1", "off=A"):
        with pytest.raises(ValueError, match="NAME=ENV=VALUE"):
            gateway_cpu.parse_variant(bad)
    assert gateway_cpu.main(["--rounds", "0"]) == 2


def test_tokens_per_chunk_is_the_usage_over_the_chunks() -> None:
    run = {"requests": [{"completion_tokens": 8, "chunk_at": [0.1, 0.2, 0.4]},
                        {"completion_tokens": 4, "chunk_at": [0.3, 0.5]},
                        {"completion_tokens": None, "chunk_at": []}]}
    assert gateway_cpu.tokens_per_chunk(run) == pytest.approx(12 / 5)
    assert gateway_cpu.tokens_per_chunk({"requests": []}) == 0.0
