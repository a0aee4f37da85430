"""The model of `pdserve bench gpu` (parts 3 and 4): a random-weight Llama-3.2-1B shape on disk,
the one pdserve `LLM` loaded from it, and its arithmetic (parameters, KV bytes, FLOPs, roofline).

NOTE: the model reaches pdserve as a user's would: transformers initialises it (seeded), saves it
with `save_pretrained` beside a stand-in tokenizer (a WordLevel vocabulary "t0".."tN" with bos and
eos as the last two ids: `LLM` loads a tokenizer from the folder, and no real one may be
downloaded), and `LLM(model=folder)` loads it through pdserve's own loader. Prompts are token ids
(`make_workload` of the throughput benchmark), so the tokenizer only detokenizes outputs.

The roofline of a workload: its prompts at the measured matmul rate (2 FLOPs per weight per token
and causal attention; one lm_head row per prompt), then one decode step per output token after the
first, all requests together, each step reading the weights and every live sequence's KV once at
the measured copy bandwidth (or its FLOPs at the matmul rate, if that is slower).
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.bench.throughput import Workload

if TYPE_CHECKING:
    from pdserve import LLM

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    intermediate: int = 8192
    vocab: int = 128256
    max_positions: int = 2048
    rope_theta: float = 500000.0

    @property
    def layer_weights(self) -> int:
        """Matmul weights of one decoder layer (q, k, v, o, gate, up, down)."""
        attention = self.hidden * self.head_dim * 2 * (self.heads + self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """Every parameter; the embedding is also the (tied) lm_head, stored once."""
        return self.layers * (self.layer_weights + 2 * self.hidden) + self.hidden \
            + self.vocab * self.hidden

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def attention_flops(self, queries: int, context: int) -> float:
        """QK^T and PV of `queries` tokens over `context` keys each, every layer."""
        return 4 * self.layers * self.heads * self.head_dim * queries * context

    def prefill_flops(self, length: int) -> float:
        """One prompt: causal attention (half the square) and logits for its last token only."""
        return 2 * self.layers * self.layer_weights * length + 2 * self.vocab * self.hidden \
            + self.attention_flops(length, length) / 2


@dataclass(frozen=True)
class ModelSizes:
    shape: ModelShape = field(default_factory=ModelShape)
    num_requests: int = 256
    input_len_range: tuple[int, int] = (128, 512)
    output_len: int = 128
    max_num_seqs: int = 256
    hf_padded_requests: int = 128  # HF runs on the first N requests only: it is slow
    hf_batch_size: int = 64
    hf_cb_requests: int = 256
    hf_cb_num_blocks: int | None = None  # None: generate_batch sizes its cache from free memory
    kv_cache_memory: int | None = None  # None: pdserve sizes its cache from free GPU memory
    latency_prompt_len: int = 128
    latency_decode_tokens: int = 256
    latency_repeats: int = 3


SMALL_MODEL = ModelSizes(
    shape=ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     vocab=512, max_positions=256),
    num_requests=6, input_len_range=(8, 24), output_len=6, max_num_seqs=4, hf_padded_requests=4,
    hf_batch_size=2, hf_cb_requests=4, hf_cb_num_blocks=16, kv_cache_memory=8 << 20,
    latency_prompt_len=8, latency_decode_tokens=8, latency_repeats=2,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the model on disk ---------------------------------------------------------------------------
def llama_config(shape: ModelShape) -> Any:
    """The transformers LlamaConfig of `shape`: tied embeddings, bos and eos the last two ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True, bos_token_id=shape.vocab - 2, eos_token_id=shape.vocab - 1,
    )


def save_random_model(shape: ModelShape, folder: Path, seed: int, device: torch.device) -> None:
    """A seeded random-weight Llama in bf16 and a stand-in tokenizer, saved in `folder`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape)).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    save_stand_in_tokenizer(shape.vocab, folder)


def save_stand_in_tokenizer(vocab: int, folder: Path) -> None:
    """A fast tokenizer over `vocab` made-up words; the last two ids are bos and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 2)}
    words.update({"<|begin_of_text|>": vocab - 2, "<|end_of_text|>": vocab - 1})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")),
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
    )
    tokenizer.save_pretrained(folder)


class RandomModel:
    """The benchmark's model folder (built on first use; a temporary one unless `model_dir`) and
    the one pdserve `LLM` loaded from it, shared by the latency and throughput parts."""

    def __init__(self, sizes: ModelSizes, device: torch.device, seed: int,
                 model_dir: str | None, llm_kwargs: dict[str, Any]) -> None:
        self.sizes, self.device, self.seed, self.llm_kwargs = sizes, device, seed, llm_kwargs
        self._keep = model_dir is not None
        self._folder = Path(model_dir) if model_dir else None
        self._llm: LLM | None = None

    @property
    def folder(self) -> str:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="pdserve-bench-gpu-"))
        if not (self._folder / "config.json").is_file():
            log(f"building the random model in {self._folder}")
            self._folder.mkdir(parents=True, exist_ok=True)
            save_random_model(self.sizes.shape, self._folder, self.seed, self.device)
        return str(self._folder)

    def llm(self) -> LLM:
        if self._llm is None:
            from pdserve import LLM

            log("loading it into pdserve")
            self._llm = LLM(model=self.folder, **self.llm_kwargs)
        return self._llm

    def close_llm(self) -> None:
        """Shut the LLM down (stopping its other tensor-parallel ranks, if any), drop it and
        give its KV cache back to the device before anything else loads."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.shutdown()
        del llm
        free_device_memory()

    def remove(self) -> None:
        self.close_llm()
        if self._folder is not None and not self._keep:
            shutil.rmtree(self._folder, ignore_errors=True)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_memory() -> dict[str, float] | None:
    if not torch.cuda.is_available():
        return None
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def roofline(shape: ModelShape, workload: Workload, elem: int, ceilings: dict) -> dict[str, Any]:
    """Seconds and output tokens/s of `workload` at the ceilings (see the module NOTE)."""
    bandwidth, flop_rate = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    prefill_s = sum(shape.prefill_flops(len(p)) for p in workload.prompts) / flop_rate
    weights, per_token = shape.params * elem, shape.kv_bytes_per_token(elem)
    decode_s = 0.0
    for step in range(1, max(workload.output_lens)):  # the prefill gave each its first token
        contexts = [len(p) + step for p, n in zip(workload.prompts, workload.output_lens)
                    if n > step]
        flops = 2 * shape.params * len(contexts) + shape.attention_flops(1, sum(contexts))
        decode_s += max((weights + per_token * sum(contexts)) / bandwidth, flops / flop_rate)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "weights_bytes": weights,
            "kv_bytes_per_token": per_token,
            "output_tokens_per_s": workload.output_tokens / (prefill_s + decode_s)}
