"""The throughput benchmark: its workload, and one tiny end-to-end run (structure, not speed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.throughput import add_arguments, make_workload, parse_range, run


class _FakeTokenizer:
    all_special_ids = [0, 1, 2]
    added_tokens_decoder = {0: "a", 1: "b", 2: "c", 3: "d"}

    def __len__(self) -> int:
        return 10


def test_parse_range() -> None:
    assert parse_range("16-256") == (16, 256)
    assert parse_range("5-5") == (5, 5)
    for bad in ("16", "0-4", "9-8", "a-b", "-3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_make_workload_is_seeded_and_avoids_special_tokens() -> None:
    w = make_workload(_FakeTokenizer(), 20, (2, 5), (3, 4), seed=7)
    assert w == make_workload(_FakeTokenizer(), 20, (2, 5), (3, 4), seed=7)
    assert w != make_workload(_FakeTokenizer(), 20, (2, 5), (3, 4), seed=8)
    assert len(w.prompts) == len(w.output_lens) == 20
    assert all(2 <= len(p) <= 5 for p in w.prompts)
    assert all(3 <= n <= 4 for n in w.output_lens)
    assert {t for p in w.prompts for t in p} <= set(range(4, 10))
    assert w.input_tokens == sum(map(len, w.prompts)) and w.output_tokens == sum(w.output_lens)


def _tiny_args(model: str, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--model", model, "--num-prompts", "3", "--input-len-range", "8-16",
        "--output-len-range", "4-6", "--skip-hf-sequential", "--no-tqdm",
        "--output-json", str(out),
    ])


def _check_system(r: dict[str, Any], workload: dict[str, Any]) -> None:
    assert r["output_tokens"] == workload["output_tokens"]
    assert r["total_tokens"] == workload["input_tokens"] + workload["output_tokens"]
    assert r["wall_s"] > 0
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    assert r["total_tokens_per_s"] == pytest.approx(r["total_tokens"] / r["wall_s"])


def test_run_tiny_workload(tiny_llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "results" / "throughput.json"
    report = run(_tiny_args(tiny_llama_dir, out))

    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    w = report["workload"]
    assert w["num_prompts"] == 3 and len(w["output_lens"]) == 3
    assert all(4 <= n <= 6 for n in w["output_lens"])
    assert 3 * 8 <= w["input_tokens"] <= 3 * 16
    assert w["output_tokens"] == sum(w["output_lens"])

    systems = report["systems"]
    assert set(systems) == {"pdserve", "hf_padded"}
    for r in systems.values():
        _check_system(r, w)
    assert systems["pdserve"]["generated_tokens"] == w["output_tokens"]
    assert systems["hf_padded"]["generated_tokens"] == 3 * max(w["output_lens"])

    assert report["ratios"]["pdserve_over_hf_padded"] > 0
    assert report["ratios"]["pdserve_over_hf_sequential"] is None
    sanity = report["sanity"]
    assert 0.0 <= sanity["greedy_match_vs_hf_padded"] <= 1.0
    assert sanity["greedy_match_vs_hf_sequential"] is None
    assert 0 <= sanity["pdserve_requests_emitting_eos"] <= 3
    env = report["environment"]
    assert env["torch_threads"] >= 1 and env["cpu_count"] >= 1 and env["torch_version"]
