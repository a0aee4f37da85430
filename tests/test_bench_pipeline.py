"""The pipeline benchmark end to end on the tiny random Llama: the report's structure and values
that must hold whatever the machine's speed (no timing thresholds)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.pipeline import add_arguments, run

HANDOVER_LEN = 40
PROMPT_LENS = (16, 33)
# tiny_llama_dir: 2 layers x 2 kv heads x head dim 16, float32, blocks of 16 tokens
CELL_BYTES = 2 * 16 * 2 * 16 * 4


def _args(model: str, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--model", model, "--handover-len", str(HANDOVER_LEN), "--repeats", "1",
        "--prompt-lens", ",".join(map(str, PROMPT_LENS)), "--max-model-len", "256",
        "--kv-cache-memory", str(4 << 20), "--dtype", "float32", "--output-json", str(out),
    ])


def _check_handover(h: dict[str, Any]) -> None:
    assert h["prompt_tokens"] == HANDOVER_LEN and len(h["runs"]) == 1
    m = h["median"]
    assert m == h["runs"][0]
    assert m["transfer_bytes"] == math.ceil(HANDOVER_LEN / 16) * 2 * CELL_BYTES  # all blocks
    assert 0 < m["ttft_s"] < m["second_token_s"]
    assert m["reserved_at_s"] > 0 and m["prefill_s"] > 0 and m["handover_s"] > 0
    assert m["transfer_s"] > 0 and m["sender_transfer_s"] > 0
    assert m["transfer_share_of_ttft"] == pytest.approx(m["transfer_s"] / m["ttft_s"])
    assert m["transfer_share_of_second_token"] == pytest.approx(
        m["transfer_s"] / m["second_token_s"])


def test_pipeline_benchmark_on_a_tiny_cluster(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "results" / "pipeline.json"
    report = run(_args(tiny_llama_dir, out))

    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["cluster_started"] is True
    _check_handover(report["handover"])
    assert [t["prompt_tokens"] for t in report["ttft"]] == list(PROMPT_LENS)
    for t in report["ttft"]:
        assert len(t["pipeline_s"]) == len(t["in_process_s"]) == 1
        assert t["pipeline_median_s"] > 0 and t["in_process_median_s"] > 0
        assert t["overhead_median_s"] == pytest.approx(
            t["pipeline_median_s"] - t["in_process_median_s"])
        assert 0 < t["beside_prefill_median_s"] < t["pipeline_median_s"]
