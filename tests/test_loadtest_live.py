"""The load generator against a live `pdserve up` cluster (tiny random Llama, 1 prefill + 1 decode
worker) for a few seconds: its JSON report must be sane whatever the machine's speed (no
failures, TTFT <= E2E, exactly the tokens asked), and `pdserve bench serve` must reach it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from cluster import run_cluster

from loadtest.cli import main as loadtest_main
from pdserve.cli import main as pdserve_main

pytestmark = pytest.mark.slow
# tiny_llama_dir: 2 layers x (K, V) x 16 tokens x 2 kv heads x head dim 16 x float32
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("loadtest")
    with run_cluster(tmp, "--model", tiny_llama_dir, "--dtype", "float32", "--kv-cache-memory",
                     str(4 << 20), "--max-model-len", "512", "--log-level", "warning") as c:
        yield c


def _common(cluster, tiny_llama_dir: str, out: Path) -> list[str]:
    return ["--base-url", cluster.url, "--tokenizer", tiny_llama_dir, "--output-json", str(out),
            "--max-duration", "120", "--request-timeout", "60", "--no-progress", "--no-plots"]


def _check_run(run: dict[str, Any], num_prompts: int, template_tokens: bool = False) -> None:
    assert (run["completed"], run["failed"], run["not_sent"]) == (num_prompts, 0, 0)
    assert run["timed_out"] is False and run["output_tokens_short_of_max_tokens"] == 0
    for r in run["requests"]:
        assert r["error"] == "" and r["request_id"]
        assert r["completion_tokens"] == r["output_len"]  # ignore_eos: exactly max_tokens
        if template_tokens:  # chat: the template wraps the messages
            assert r["prompt_tokens"] > r["prompt_len"]
        else:  # token-id prompts: exactly the ids sent
            assert r["prompt_tokens"] == r["prompt_len"]
        assert 0 <= r["scheduled_at"] <= r["sent_at"] < r["chunk_at"][0]
        assert r["chunk_at"] == sorted(r["chunk_at"]) and r["chunk_at"][-1] <= r["done_at"]
    ttft, e2e = run["ttft_s"], run["e2e_s"]
    for key in ("mean", "median", "p90", "p99", "min", "max"):
        assert 0 < ttft[key] <= e2e[key]
    assert ttft["max"] <= e2e["max"] and run["tpot_s"]["min"] > 0
    assert run["output_tokens"] == sum(r["output_len"] for r in run["requests"])
    assert run["request_throughput"] == pytest.approx(num_prompts / run["duration_s"])
    assert run["goodput"] is not None and 0 <= run["goodput"] <= run["request_throughput"]


def test_a_sweep_of_completions_from_two_client_processes(cluster, tiny_llama_dir, tmp_path):
    out = tmp_path / "serve.json"
    decode = {w.role: f"http://{w.metrics_address}/metrics" for w in cluster.workers()}["decode"]
    rc = loadtest_main([
        *_common(cluster, tiny_llama_dir, out), "--request-rate", "8,inf", "--num-prompts", "6",
        "--input-len", "16-80", "--output-len", "4-12", "--max-concurrency", "2",
        "--client-processes", "2", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
        "--label", "tiny", "--metrics-url", decode])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["label"] == "tiny" and report["model"]
    assert [r["request_rate"] for r in report["runs"]] == [8.0, math.inf]
    for run in report["runs"]:
        _check_run(run, 6)
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs
        # the decode worker received every prompt's KV blocks, and counted them
        blocks = sum(math.ceil(r["prompt_len"] / 16) for r in run["requests"])
        kv = run["server_counters"][decode]
        assert kv["pdserve:kv_transfers_total"] == 6
        assert kv["pdserve:kv_transfer_bytes_total"] == blocks * BLOCK_BYTES
        assert kv["pdserve:kv_transfer_seconds_total"] > 0
    sent = [tuple(r["prompt_len"] for r in run["requests"]) for run in report["runs"]]
    assert sent[0] != sent[1]  # each rate its own requests


def test_pdserve_bench_serve_chat_with_shared_prefixes(cluster, tiny_llama_dir, tmp_path):
    out = tmp_path / "chat.json"
    rc = pdserve_main([
        "bench", "serve", *_common(cluster, tiny_llama_dir, out), "--endpoint", "chat",
        "--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "48",
        "--input-len", "8", "--output-len", "6", "--request-rate", "20", "--num-prompts", "4",
        "--arrival", "constant", "--slo-ttft-ms", "60000"])
    assert rc == 0
    [run] = json.loads(out.read_text())["runs"]
    _check_run(run, 4, template_tokens=True)
    assert len({r["prompt_tokens"] - r["prompt_len"] for r in run["requests"]}) == 1  # template
