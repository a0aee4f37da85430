"""Tensor parallelism in the running pipeline (`pdserve up`, real processes, gloo on the CPU):
prefill TP=2 -> decode TP=1 answers as the colocated TP=1 engine does; a decode worker of two
whose rank dies leaves the registry and exits non-zero within its collective timeout, and the
cluster serves on with the other one, prefill TP=1 -> decode TP=2 answering as colocated.
(Both directions in one process, each rank's shards checked: tests/test_tp_disagg.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from cluster import run_cluster

PROMPTS = ["The history of the Roman Empire spans many centuries and", "def quicksort(items):\n",
           "Q: What is the boiling point of water at sea level?\nA:"]
TOKENS = 16


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[str]:
    from pdserve import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _complete(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=None, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_prefill_tp2_to_decode_tp1_answers_as_colocated(tiny_llama_dir, expected, tmp_path):
    with run_cluster(tmp_path, "--model", tiny_llama_dir, "--prefill-tp", "2",
                     "--decode-tp", "1", "--kv-cache-memory", str(8 << 20),
                     "--dtype", "float32") as c:
        assert [_complete(c.url, p) for p in PROMPTS] == expected
        tps = {w.role: w.tensor_parallel_size for w in c.workers() if w.role != "tokenizer"}
        assert tps == {"prefill": 2, "decode": 1}


def _children(pid: int) -> list[int]:
    """Child processes of `pid` (listed under the thread that started each)."""
    return [int(x) for task in Path(f"/proc/{pid}/task").iterdir()
            for x in (task / "children").read_text().split()]


def test_a_dead_rank_takes_its_worker_out_and_the_cluster_serves_on(tiny_llama_dir, expected,
                                                                    tmp_path):
    env = {"PDSERVE_DISTRIBUTED_TIMEOUT_SECONDS": "5"}
    with run_cluster(tmp_path, "--model", tiny_llama_dir, "--decode", "2", "--decode-tp", "2",
                     "--kv-cache-memory", str(8 << 20), "--dtype", "float32", env=env) as c:
        tps = {w.role: w.tensor_parallel_size for w in c.workers() if w.role != "tokenizer"}
        assert tps == {"prefill": 1, "decode": 2}
        victim = c.pids()["decode-0"]
        rank1 = next(p for p in _children(victim)
                     if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{victim}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{victim}").exists(), "the decode worker did not exit"
        assert "decode-0 exited (1)" in c.log.read_text()
        deadline = time.monotonic() + 10
        while len(c.workers("decode")) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(c.workers("decode")) == 1
        # prefill TP=1 -> decode TP=2 (the survivor) answers as colocated
        assert [_complete(c.url, p) for p in PROMPTS] == expected
