"""The GPU benchmark at its --small sizes on the CPU: its arithmetic, and each part end to end
(structure and positive figures, not speed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import cli
from pdserve.bench.gpu import add_arguments, resolve_sizes, run
from pdserve.bench.gpu_kernels import SMALL_KERNELS, kernels_unavailable, measure_kernels
from pdserve.bench.gpu_model import SMALL_MODEL, ModelShape, ModelSizes, llama_config, roofline
from pdserve.bench.gpu_tp import measure_tp, tp_sizes
from pdserve.bench.throughput import Workload


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sizes_are_the_issue_s_unless_small_or_overridden() -> None:
    kernels, model = resolve_sizes(_args())
    assert kernels.decode == ((64, 1024), (256, 1024), (32, 8192)) and kernels.matmul_n == 8192
    assert model == ModelSizes() and model.num_requests == 256 and model.output_len == 128
    kernels, model = resolve_sizes(_args("--small", "--num-requests", "3", "--copy-mib", "2"))
    assert model.num_requests == 3 and model.shape.hidden == 64 and kernels.copy_mib == 2
    with pytest.raises(ValueError):
        resolve_sizes(_args("--hf-batch-size", "0"))
    with pytest.raises(SystemExit):
        _args("--parts", "ceilings,nope")


@pytest.mark.parametrize("shape", [ModelShape(), SMALL_MODEL.shape], ids=["1B", "small"])
def test_parameter_count_matches_transformers(shape: ModelShape) -> None:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape))
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_llama_1b_weights_take_0_82_ms_at_3_tb_per_s() -> None:
    assert ModelShape().params * 2 / 3.0e12 == pytest.approx(0.824e-3, abs=1e-6)


def test_roofline_decode_reads_weights_and_live_kv_each_step() -> None:
    shape = ModelShape(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                       vocab=32)
    # prompt of 3, three outputs: the prefill gives the first, two decode steps read 4 then 5
    # tokens of KV; a near-infinite matmul rate leaves only the bytes
    workload = Workload([[1, 2, 3]], [3])
    roof = roofline(shape, workload, 2, {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e30})
    per_token = 2 * 1 * 1 * 4 * 2
    assert roof["kv_bytes_per_token"] == per_token and roof["weights_bytes"] == shape.params * 2
    assert roof["decode_s"] == pytest.approx((2 * shape.params * 2 + per_token * 9) / 1e9)
    assert roof["prefill_s"] < 1e-20
    assert roof["output_tokens_per_s"] == pytest.approx(3 / (roof["decode_s"] + roof["prefill_s"]))


def _positive(values: dict[str, Any], *keys: str) -> None:
    for key in keys:
        assert values[key] > 0, key


def test_small_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    report = run(_args("--small", "--parts", "throughput,latency", "--json", str(out),
                       "--no-tqdm", "--device", "cpu"))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert {"ceilings", "latency", "throughput", "environment", "sizes"} <= set(report)
    assert "kernels" not in report
    _positive(report["ceilings"], "copy_bytes_per_s", "matmul_flops_per_s")

    t = report["throughput"]
    assert "error" not in t, t.get("error")
    assert set(t["systems"]) == {"pdserve", "hf_padded", "hf_generate_batch"}
    small = SMALL_MODEL
    requests = {"pdserve": small.num_requests, "hf_padded": small.hf_padded_requests,
                "hf_generate_batch": small.hf_cb_requests}
    for name, system in t["systems"].items():
        assert "error" not in system, (name, system.get("error"))
        assert system["requests"] == requests[name]
        # every request ran to its full length (ignore_eos / min_new_tokens / eos disabled)
        assert system["output_tokens"] == requests[name] * small.output_len
        _positive(system, "wall_s", "output_tokens_per_s")
    assert set(t["ratios"]) == {"pdserve_over_hf_padded", "pdserve_over_hf_generate_batch"}
    _positive(t["ratios"], *t["ratios"])
    _positive(t["roofline"], "prefill_s", "decode_s", "output_tokens_per_s", "pdserve_fraction")
    runs = t["systems"]["pdserve"]["runs"]  # three runs on fresh prompts, the first compared
    assert len(runs) == 3 and runs[0]["wall_s"] == t["systems"]["pdserve"]["wall_s"]
    for one in runs:
        _positive(one, "wall_s", "output_tokens_per_s", "roofline_fraction")

    lat = report["latency"]
    assert "error" not in lat, lat.get("error")
    _positive(lat, "ms_per_token", "ms_per_token_engine_stamps", "weights_floor_ms", "ttft_ms")


def test_kernel_part_at_small_sizes() -> None:
    why = kernels_unavailable(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    result = measure_kernels(torch.device("cpu"), torch.bfloat16, SMALL_KERNELS)
    rows = result["decode_attention"] + result["prefill_attention"] + result["fused"]
    assert len(result["decode_attention"]) == len(SMALL_KERNELS.decode)
    assert {r["kernel"] for r in result["fused"]} == {
        "rms_norm", "rms_norm_residual", "silu_and_mul", "rotary"}
    for r in rows:
        assert "error" not in r and "ours_error" not in r, r
        _positive(r, "ours_ms", "peer_ms", "ours_rate", "peer_rate", "ratio")
        assert r["rel_err"] < 3e-2, r  # bf16 against SDPA / eager torch


def test_cli_registers_the_command(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    assert cli.main(["bench", "gpu", "--small", "--parts", "ceilings", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) >= {"ceilings", "environment", "config"}


def test_tp_part_on_the_cpu_and_its_skip_on_fewer_than_2_gpus(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    report = run(_args("--small", "--parts", "tp", "--device", "cpu", "--json", str(out),
                       "--no-tqdm"))
    tp = report["tp"]
    assert "error" not in tp and "skipped" not in tp, tp
    assert json.loads(out.read_text())["tp"]["correctness"] == tp["correctness"]
    assert set(tp["runs"]) == {"tp1", "tp2"} and "ceilings" not in report
    for name, size in (("tp1", 1), ("tp2", 2)):
        one = tp["runs"][name]
        assert one["tensor_parallel_size"] == size and one["cuda_graphs"] is False
        _positive(one["latency"], "ms_per_token", "ttft_ms")
        _positive(one["throughput"], "wall_s", "output_tokens_per_s")
        assert one["throughput"]["output_tokens"] == \
            SMALL_MODEL.num_requests * SMALL_MODEL.output_len
    _positive(tp["tp2_over_tp1"], "ms_per_token", "output_tokens_per_s")
    # fp32 on the CPU: the two ranks' partial sums round alike, every greedy token agrees
    check = tp["correctness"]
    assert check["requests"] == 8 and check["new_tokens"] == 32
    assert check["match_fraction"] == 1.0 and check["mean_common_prefix"] == 32
    assert check["logprobs_close_fraction"] == 1.0 and check["top_logprobs"] == 5
    hf = tp["hf_generate_batch"]
    assert "error" not in hf and hf["requests"] == 4, hf  # hf_cb_requests of the small sizes
    _positive(tp["over_hf_generate_batch"], "tp1", "tp2")

    skipped = measure_tp(tp_sizes(True, "1b"), torch.device("cuda"), 0, None, 0, False,
                         checkpoint=lambda partial: None)
    assert skipped == {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
