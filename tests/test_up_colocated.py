"""`pdserve up --colocated`: the same gateway in front of one in-process engine (the baseline
that disaggregation is measured against)."""

from __future__ import annotations

import openai
import pytest
from cluster import http_get, run_cluster

pytestmark = pytest.mark.slow


def test_colocated_cluster_answers_like_the_engine(tmp_path, tiny_llama_dir):
    from pdserve import LLM, SamplingParams

    prompt = "Colocated serving runs prefill and decode in one process"
    expected = LLM(tiny_llama_dir, dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    with run_cluster(tmp_path, "--colocated", "--model", tiny_llama_dir, "--dtype", "float32",
                     "--kv-cache-memory", str(4 << 20)) as c:
        assert c.redis_url == ""
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == expected
        assert http_get(c.url + "/ready")[0] == 200
