"""lm-evaluation-harness against the gateway (colocated, a real HTTP server): its
`local-completions` model scores a 3-item loglikelihood task through `echo` + `logprobs`, and
each item's loglikelihood equals HF's sum of the continuation's log-softmax. Skipped where
lm-eval is not installed (`pip install lm-eval`); runs offline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncLLMEngine
from gateway.app import build_app
from gateway.local_backend import LocalBackend

pytest.importorskip("lm_eval")

ITEMS = [
    {"context": "The quick brown fox", "continuation": " jumps over the lazy dog"},
    {"context": "One, two,", "continuation": " three"},
    {"context": "Water boils at", "continuation": " 100 degrees"},
]
TASK = """task: pdserve_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir: str) -> Iterator[str]:
    from test_gateway import Server

    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=16 << 20)
    with Server(build_app(LocalBackend(engine, "tiny"))) as url:
        yield url
    engine.shutdown()


def _hf_loglikelihood(model_dir: str, context: list[int], continuation: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = context + continuation
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
    return sum(lp[p - 1, ids[p]].item() for p in range(len(context), len(ids)))


def test_lm_eval_loglikelihood_task(base_url: str, tiny_llama_dir: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    args = (f"model=tiny,base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_llama_dir},num_concurrent=1,max_retries=1")
    out = simple_evaluate(model="local-completions", model_args=args, tasks=["pdserve_tiny_ll"],
                          task_manager=TaskManager(include_path=str(tmp_path)),
                          log_samples=True)
    samples = sorted(out["samples"]["pdserve_tiny_ll"], key=lambda s: s["doc_id"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert len(samples) == len(ITEMS)
    for item, sample in zip(ITEMS, samples):
        whole = tokenizer.encode(item["context"] + item["continuation"])
        context = tokenizer.encode(item["context"])
        got = sample["resps"][0][0][0]  # (loglikelihood, is_greedy)
        want = _hf_loglikelihood(tiny_llama_dir, context, whole[len(context):])
        assert got == pytest.approx(want, abs=1e-3)
