"""What `python -m pdserve.bench.gpu_serve` would run (no process starts): its defaults are
docs/loadtest.md's GPU run, each system's `pdserve up` and the load generator's command lines
parse back to those figures; and the summary's rows and ratios from two fake reports."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

import loadtest.cli
from pdserve.bench.gpu_model import ModelShape
from pdserve.bench.gpu_serve_plan import (
    ServeConfig,
    add_arguments,
    config_of,
    loadtest_argv,
    up_argv,
)
from pdserve.bench.gpu_serve_table import format_table, ratios, summarize
from pdserve.cli import build_parser


def _config(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_of(parser.parse_args(list(argv)))


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PDSERVE_* fallbacks and no $OUT leak into the parsed flags."""
    for name in ("KV_TRANSPORT", "KV_CACHE_MEMORY", "MAX_MODEL_LEN", "MODEL", "PORT",
                 "REDIS_URL", "COLOCATED"):
        monkeypatch.delenv(f"PDSERVE_{name}", raising=False)
    monkeypatch.delenv("OUT", raising=False)


def test_defaults_are_the_docs_gpu_run() -> None:
    cfg = _config()
    assert cfg.systems == ("colocated", "grpc", "cuda_ipc")
    assert cfg.shape == ModelShape() and cfg.shape.vocab == 128256 and cfg.shape.layers == 16
    assert (cfg.kv_cache_memory, cfg.max_model_len) == (8589934592, 2048)
    assert cfg.load.request_rates == (16.0, math.inf) and cfg.load.num_prompts == 96
    assert (cfg.load.input_len, cfg.load.output_len) == ((128, 512), (128, 128))
    assert (cfg.load.num_warmups, cfg.load.slo_ttft_ms, cfg.load.slo_tpot_ms, cfg.load.seed) == (
        2, 500.0, 50.0, 0)
    assert cfg.model_dir.name == "pdserve-L16-H2048-A32x8x64-I8192-V128256-P2048"
    assert cfg.out_dir == Path("bench_results/gpu_serve") and cfg.redis_server == "redis-server"


def test_tiny_shape_with_overrides_and_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", "/out")
    cfg = _config("--shape", "tiny", "--layers", "3", "--max-model-len", "256",
                  "--systems", "grpc, colocated", "--model-dir", "/m")
    assert cfg.shape == ModelShape(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16,
                                   intermediate=128, vocab=49152, max_positions=256)
    assert cfg.systems == ("grpc", "colocated") and cfg.model_dir == Path("/m")
    assert cfg.out_dir == Path("/out")
    with pytest.raises(ValueError, match="--systems"):
        _config("--systems", "colocated,nvlink")
    with pytest.raises(ValueError, match="--num-prompts"):
        _config("--num-prompts", "0")
    with pytest.raises(SystemExit):
        _config("--request-rate", "0")


def test_sample_rates_are_some_of_the_load_s() -> None:
    assert _config().sample_rates is None
    assert _config("--sample-rates", "inf").sample_rates == (math.inf,)
    with pytest.raises(ValueError, match="--sample-rates"):
        _config("--sample-rates", "8")


@pytest.mark.parametrize("system", ["colocated", "grpc", "cuda_ipc"])
def test_each_system_s_pdserve_up(system: str) -> None:
    cfg = _config("--model-dir", "/m")
    argv = up_argv(cfg, system, 8123, "redis://127.0.0.1:7000/0")
    assert argv[:4] == [sys.executable, "-m", "pdserve.cli", "up"]
    up = build_parser().parse_args(argv[3:])
    assert (up.model, up.kv_cache_memory, up.max_model_len, up.port) == ("/m", 8 << 30, 2048, 8123)
    assert up.colocated == (system == "colocated")
    if system == "colocated":
        assert "--redis-url" not in argv and "--kv-transport" not in argv
        assert up.engine_core == "process"
        argv = up_argv(_config("--engine-core", "thread"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).engine_core == "thread"
        assert up.api_server_count == 1
        argv = up_argv(_config("--colocated-api-servers", "4", "--api-server-count", "2"),
                       system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).api_server_count == 4
    else:
        assert (up.redis_url, up.kv_transport) == ("redis://127.0.0.1:7000/0", system)
        assert up.generate_streams == "shared"
        assert (up.engine_core, up.prefill_engine_core) == (None, None)  # the workers' auto
        argv = up_argv(_config("--prefill-engine-core", "thread"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).prefill_engine_core == "thread"
        argv = up_argv(_config("--generate-streams", "per-request"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).generate_streams == "per-request"
        assert up.prefill_streams == "shared"
        argv = up_argv(_config("--prefill-streams", "per-request"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).prefill_streams == "per-request"
        assert up.engine_core is None  # auto: the decode workers resolve their default
        argv = up_argv(_config("--decode-engine-core", "process"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).engine_core == "process"
        assert (up.shared_gpu_pace_ms, up.shared_gpu_pace_tokens) == (4.0, 0)
        argv = up_argv(_config("--shared-gpu-pace-ms", "0"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).shared_gpu_pace_ms == 0.0  # said, not left
        argv = up_argv(_config("--shared-gpu-pace-ms", "15"), system, 1, "redis://r")
        assert build_parser().parse_args(argv[3:]).shared_gpu_pace_ms == 15.0
        argv = up_argv(_config("--shared-gpu-pace-ms", "4", "--shared-gpu-pace-tokens", "1"),
                       system, 1, "redis://r")
        paced = build_parser().parse_args(argv[3:])
        assert (paced.shared_gpu_pace_ms, paced.shared_gpu_pace_tokens) == (4.0, 1)
        two = up_argv(_config("--shared-gpu-pace-ms", "15"), f"split_{system}", 1, "redis://r")
        assert "--shared-gpu-pace-ms" not in two  # prefill and decode on GPUs of their own
    assert up.stream_interval == 1
    argv = up_argv(_config("--stream-interval", "4"), system, 8123, "redis://127.0.0.1:7000/0")
    assert build_parser().parse_args(argv[3:]).stream_interval == 4


def test_the_load_generator_gets_the_docs_flags() -> None:
    cfg = _config("--tokenizer", "/kit/tok")
    metrics = ["http://a:1/metrics", "http://b:2/metrics"]
    argv = loadtest_argv(cfg.load, "grpc", "http://127.0.0.1:8123", metrics,
                         Path("/o/loadtest_grpc.json"))
    assert argv[:3] == [sys.executable, "-m", "loadtest"]
    parser = argparse.ArgumentParser()
    loadtest.cli.add_arguments(parser)
    lt = parser.parse_args(argv[3:])
    assert lt.request_rate == (16.0, math.inf) and lt.num_prompts == 96
    assert (lt.input_len, lt.output_len, lt.num_warmups) == ((128, 512), (128, 128), 2)
    assert (lt.slo_ttft_ms, lt.slo_tpot_ms, lt.seed, lt.max_duration) == (500.0, 50.0, 0, 60.0)
    assert (lt.workload, lt.endpoint, lt.prompt_format, lt.ignore_eos) == (
        "random", "completions", "ids", True)
    assert lt.metrics_url == metrics
    assert (lt.tokenizer, lt.label, lt.output_json) == ("/kit/tok", "grpc",
                                                        "/o/loadtest_grpc.json")
    assert not lt.plots and not lt.progress
    assert lt.client_processes == 4  # one process was the bound at saturation
    one = loadtest_argv(_config("--client-processes", "1").load, "grpc", "http://h:1", [],
                        Path("/o/x.json"))
    assert parser.parse_args(one[3:]).client_processes == 1


def _run(rate: float, req_s: float, goodput: float, out_tok_s: float, ttft: float) -> dict:
    """A loadtest run with the fields the summary reads (latencies in seconds)."""
    def stats(median: float) -> dict:
        return {"median": median, "p99": 2 * median}

    return {"request_rate": rate, "completed": 96, "failed": 0, "request_throughput": req_s,
            "goodput": goodput, "output_token_throughput": out_tok_s, "ttft_s": stats(ttft),
            "tpot_s": stats(0.002), "itl_s": stats(0.001), "requests": ["left out"]}


def test_rows_and_ratios_over_colocated() -> None:
    results = [
        {"system": "colocated", "runs": [_run(16.0, 13.0, 13.0, 1600.0, 0.016),
                                         _run(math.inf, 50.0, 25.0, 6400.0, 0.5)]},
        {"system": "grpc", "runs": [_run(16.0, 13.0, 13.0, 1600.0, 0.040),
                                    _run(math.inf, 30.0, 5.0, 3200.0, 1.0)],
         "kv_bytes_by_transport": {"decode": {"grpc": 3 * 2**20}}},
        {"system": "cuda_ipc", "error": "RuntimeError: pdserve up exited with code 1",
         "log": "/o/cluster_cuda_ipc.log"},
    ]
    summary = summarize(results)
    assert summary["ratios"] == {"grpc": {
        "baseline": "colocated", "saturation_rate": math.inf, "ttft_rate": 16.0,
        "out_tok_s": 0.5, "goodput": 0.2, "ttft_p50": 2.5, "tpot_p99": 1.0}}
    grpc = summary["systems"][1]
    assert grpc["rows"][0] == {
        "rate": 16.0, "done": 96, "fail": 0, "req_s": 13.0, "goodput": 13.0, "out_tok_s": 1600.0,
        "ttft_p50_ms": 40.0, "ttft_p99_ms": 80.0, "tpot_p50_ms": 2.0, "tpot_p99_ms": 4.0,
        "itl_p50_ms": 1.0, "itl_p99_ms": 2.0, "second_token_p50_ms": None, "handover_ms": None,
        "kv_share": None}
    assert summary["systems"][2]["rows"] == []
    table = format_table(summary).splitlines()
    assert table[0].startswith("| system | rate | done | fail | req/s | goodput | out tok/s |")
    assert "| grpc | inf | 96 | 0 | 30.00 | 5.00 | 3200 | 1000.0 | 2000.0 | 2.0 | 4.0 | 1.0 | " \
        "2.0 | - | - | - |" in table
    assert "  grpc over colocated: out tok/s at inf 0.50x, goodput at inf 0.20x, TTFT p50 at " \
        "16 2.50x, TPOT p99 at inf 1.00x" in table
    assert "  grpc decode: grpc 3.0 MiB" in table
    assert table[-1] == ("cuda_ipc: RuntimeError: pdserve up exited with code 1 "
                         "(log: /o/cluster_cuda_ipc.log)")


def test_repeated_rates_are_averaged_and_reports_pool(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Three bursts a side: the ratio of the means, not of the last bursts; two reports (run
    in turns) pool each system's rows; FILE#SYSTEM takes that system's alone."""
    from pdserve.bench.gpu_serve_table import main, pooled

    colocated = {"system": "colocated", "runs": [
        _run(16.0, 13.0, 13.0, 1600.0, 0.020), *(_run(math.inf, 50.0, 50.0, t, 0.2)
                                                 for t in (6000.0, 8000.0, 7000.0))]}
    split = {"system": "cuda_ipc", "runs": [
        _run(16.0, 13.0, 13.0, 1600.0, 0.030), *(_run(math.inf, 40.0, 40.0, t, 0.3)
                                                 for t in (7000.0, 5000.0, 9000.0))]}
    first = summarize([colocated, split])
    assert first["ratios"]["cuda_ipc"]["out_tok_s"] == pytest.approx(1.0)  # 7000 / 7000
    assert first["ratios"]["cuda_ipc"]["ttft_p50"] == pytest.approx(1.5)
    later = summarize([{**split, "runs": [_run(16.0, 13.0, 13.0, 1600.0, 0.030),
                                          _run(math.inf, 1.0, 1.0, 1000.0, 0.3)]},
                       {**colocated, "runs": [_run(math.inf, 1.0, 1.0, 3000.0, 0.2)]}])
    both = pooled([first, later])
    assert [s["system"] for s in both] == ["colocated", "cuda_ipc"]
    assert [len(s["rows"]) for s in both] == [5, 6]
    # means over four bursts a side: colocated 6000, split 5500
    assert ratios(both)["cuda_ipc"]["out_tok_s"] == pytest.approx(5500 / 6000)
    paths = []
    for name, report in (("a", first), ("b", later)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report, default=str).replace("Infinity", "1e999"))
    assert main([str(p) for p in paths]) == 0
    assert "cuda_ipc over colocated: out tok/s at inf 0.92x" in capsys.readouterr().out
    assert main([f"{paths[0]}#colocated", f"{paths[1]}#cuda_ipc"]) == 0  # 7000 vs 1000
    assert "cuda_ipc over colocated: out tok/s at inf 0.14x" in capsys.readouterr().out


def test_no_ratios_without_the_colocated_server() -> None:
    systems = summarize([{"system": "grpc", "runs": [_run(16.0, 13.0, 13.0, 1.0, 0.01)]}])
    assert systems["ratios"] == {} and ratios(systems["systems"]) == {}
    assert "over colocated" not in format_table(systems)


def test_two_gpu_systems_and_mixes() -> None:
    """split_*: prefill on GPU 0, decode on GPU 1; replicas: colocated servers (one per GPU,
    by CUDA_VISIBLE_DEVICES, set where they start); a mix sets the lengths and the context."""
    cfg = _config("--systems", "replicas,split_cuda_ipc,split_grpc", "--mix", "prefill_heavy",
                  "--work-dir", "/w")
    assert cfg.systems == ("replicas", "split_cuda_ipc", "split_grpc")
    assert (cfg.load.input_len, cfg.load.output_len, cfg.max_model_len) == (
        (1024, 4096), (64, 256), 4608)
    assert cfg.work_dir == Path("/w")
    split = up_argv(cfg, "split_cuda_ipc", 8000, "redis://r")
    assert split[split.index("--kv-transport") + 1] == "cuda_ipc"
    assert split[split.index("--prefill-gpus") + 1] == "0"
    assert split[split.index("--decode-gpus") + 1] == "1"
    assert "--colocated" in up_argv(cfg, "replicas", 8000, "")
    decode = _config("--mix", "decode_heavy")
    assert (decode.load.input_len, decode.load.output_len) == ((128, 512), (256, 512))


def test_split_rows_report_the_handover_against_the_replicas() -> None:
    def with_handover(run: dict, seconds: float, second_token: float) -> dict:
        return {**run, "second_token_p50_s": second_token, "server_counters": {
            "http://p/metrics": {"pdserve:kv_transfer_first_token_to_commit_seconds_total":
                                 seconds}}}

    results = [
        {"system": "replicas", "runs": [_run(4.0, 4.0, 4.0, 900.0, 0.2),
                                        _run(math.inf, 8.0, 2.0, 1800.0, 0.9)]},
        {"system": "split_cuda_ipc", "runs": [
            with_handover(_run(4.0, 4.0, 4.0, 900.0, 0.1), 0.192, 0.02),
            with_handover(_run(math.inf, 9.0, 4.0, 2000.0, 0.6), 0.96, 0.05)]},
    ]
    summary = summarize(results)
    row = summary["systems"][1]["rows"][0]
    assert row["handover_ms"] == pytest.approx(2.0) and row["kv_share"] == pytest.approx(0.1)
    assert summary["ratios"]["split_cuda_ipc"]["baseline"] == "replicas"
    assert summary["ratios"]["split_cuda_ipc"]["goodput"] == 2.0


def test_sampled_rates_run_apart_with_their_own_seeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--sample-rates: one load-generator run per rate, each seeded apart (one seed sent every
    run the same prompts, which the prefix caches then served), the gate open only in the
    sampled ones, the reports merged in rate order."""
    from pdserve.bench import gpu_serve

    gate = tmp_path / "gate"
    monkeypatch.setenv("PDSERVE_STACK_SAMPLE_WHILE", str(gate))
    calls = []

    def fake_run(argv: list[str]) -> object:
        parser = argparse.ArgumentParser()
        loadtest.cli.add_arguments(parser)
        lt = parser.parse_args(argv[3:])
        calls.append((lt.request_rate, lt.seed, gate.exists()))
        Path(lt.output_json).write_text(json.dumps({"runs": [{"rate": lt.request_rate}]}))
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(gpu_serve.subprocess, "run", fake_run)
    cfg = _config("--request-rate", "16,inf,inf", "--sample-rates", "inf", "--seed", "7")
    report = tmp_path / "loadtest.json"
    assert gpu_serve.run_load(cfg, "grpc", "http://x", [], report) == 0
    assert [(seed, sampled) for _, seed, sampled in calls] == [(7, False), (8, True), (9, True)]
    assert [r["rate"] for r in json.loads(report.read_text())["runs"]] == [
        [16.0], [math.inf], [math.inf]]
    assert not gate.exists()
