"""The routing benchmark's arithmetic and command lines (pure: no cluster; the benchmark itself
runs as `python -m pdserve.bench.kv_routing`)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.kv_routing import add_arguments, format_rows, loadtest_argv, ratios, row, up_argv


def _load(ttft: float, hit_rate: float) -> dict:
    return {"completed": 8, "failed": 0, "ttft_s": {"median": ttft, "p99": 2 * ttft},
            "tpot_s": {"median": 0.1}, "output_token_throughput": 50.0,
            "prefix_hit_rate": hit_rate, "reused_prompt_tokens": 1000,
            "prefix_cache_hit_tokens": 1000 * hit_rate}


def test_rows_divide_kv_bytes_by_turns_and_ratios_compare_the_routings():
    kv = {"pdserve:kv_transfer_bytes_total": 3000.0, "pdserve:kv_transfers_total": 4.0,
          "pdserve:kv_transfer_skipped_blocks_total": 9.0}
    fast = row("kv_aware", _load(0.1, 0.9), kv, {"prefill:prefix_hit": 7.0}, 1000)
    assert fast["kv_pushed_bytes_per_turn"] == 750 and fast["kv_reused_bytes_per_turn"] == 2250
    assert fast["kv_pushed_share"] == 0.25
    slow = row("load", _load(0.3, 0.5), kv, {}, 1000)
    got = ratios([fast, slow])
    assert got["ttft_p50_load_over_kv_aware"] == pytest.approx(3.0)
    assert (got["hit_rate_kv_aware"], got["hit_rate_load"]) == (0.9, 0.5)
    assert ratios([fast]) == {} and ratios([fast, {"routing": "load", "error": "x"}]) == {}
    table = format_rows([fast, slow], got)
    assert "90.0%" in table and "ttft_p50_load_over_kv_aware 3.00" in table


def test_command_lines_name_the_routing_and_the_multi_turn_load(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--num-turns", "3", "--model", "/m"])
    up = up_argv(args, "load", 8123)
    assert up[up.index("--routing") + 1] == "load" and up[up.index("--model") + 1] == "/m"
    assert up[up.index("--prefill") + 1] == "2"
    load = loadtest_argv(args, "http://x", ["http://a/metrics", "http://b/metrics"],
                         tmp_path / "r.json")
    assert load[load.index("--workload") + 1] == "multi-turn"
    assert load[load.index("--num-turns") + 1] == "3"
    assert load.count("--metrics-url") == 2 and load[load.index("--tokenizer") + 1] == "/m"
