"""Speculative decoding on the decode worker of a running split cluster (`pdserve up`, tiny
model, real Redis and gRPC): a draft model (the target itself: every draft must pass) verifies
on the decode worker after the KV handover, and the tokens equal the colocated engine's."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from cluster import run_cluster
from live_checks import metric

from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = [[1, 17, 230, 58, 901, 44, 12, 7] * 3, [1, 505, 13, 99, 1000, 4]]


def test_the_decode_worker_speculates_and_equals_colocated(tiny_llama_dir, tmp_path):
    want = [o.outputs[0].text for o in LLM(
        tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=16 << 20).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    spec = json.dumps({"model": tiny_llama_dir, "num_speculative_tokens": 3})
    with run_cluster(tmp_path, "--model", tiny_llama_dir, "--dtype", "float32",
                     "--speculative-config", spec) as c:
        got = []
        for p in PROMPTS:
            r = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
                "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        (decode,) = c.workers("decode")
        page = f"http://{decode.metrics_address}/metrics"
        deadline = time.monotonic() + 20  # the counters are the last heartbeat's snapshot
        while not (drafts := metric(page, "pdserve:spec_decode_num_draft_tokens_total")):
            assert time.monotonic() < deadline, "no drafts on the decode worker"
            time.sleep(0.3)
        accepted = metric(page, "pdserve:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted == drafts  # the target as its own draft
    assert got == want and all(want)
