"""Draft-model proposer: a smaller model of the same tokenizer guesses the next k tokens.

NOTE: how it shares the paged cache. The draft model has its own KV tensors (its layers, its
heads) with as many blocks as the target's, and each request uses the same block table in both:
block b of the draft cache holds the draft's K/V for the tokens whose target K/V is in block b of
the target cache. So the draft needs no block manager of its own, prefix caching and preemption
free and share its blocks with the target's, and the slots a verification step writes are
exactly those the draft writes while proposing for it.

Proposals are made after the scheduler has placed the step (it reserves 1 + k slots for a
decode with k drafts; the engine first marks each decoding request with k placeholder drafts, and
the scheduler may cut them to what the token budget and max_tokens leave). Then, for the
requests that kept k' > 0 drafts, k' forward passes of the draft, batched over requests:

    pass 0      tokens [done, n): what the draft has not seen (the whole prompt the first time,
                else the tokens accepted since), sampled greedily at the end -> d1
    pass j > 0  d_j at position n - 1 + j (read on the device from pass j - 1) -> d_{j+1}

On CUDA a pass replays the draft's own decode graphs when its chunks have at most k + 1 tokens
(every pass j > 0; pass 0 once the prompt is in), one row per token (engine/spec_graphs.py).

Draft tokens are greedy (a constrained request's within its grammar: one wait per pass then), a
proposal of probability 1 (q = 1 on the token, like n-gram drafts), so the rejection sampler
keeps the target's distribution exactly. Pass j wrote the draft's K/V of d_j at position
n - 1 + j; after verification the draft's K/V is right up to the first position whose token
differs from what it used: done = min(n + k' - 1, num_tokens - 1) (position num_tokens - 1
holds the token sampled by the target, which the draft has not seen).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from engine import zero_pages
from engine.attention.backend import AttentionBackend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import PendingTokens, pack_step, step_tensors
from engine.model_loader import load_hf_config, resolve_model
from engine.models import load_model
from engine.models.llama import head_dim_of
from engine.quant import resolve_quantization
from engine.request import Request
from engine.scheduler_output import SchedulerOutput
from engine.spec_graphs import forward_step
from engine.structured.bitmask import mask_logits
from engine.structured.manager import StructuredOutputs


@dataclass
class DraftChunk:
    """One request's tokens [start, start + num_new_tokens) in a draft pass: what
    `engine.input_batch.pack_step` reads of a scheduled request."""

    request: Request
    start: int
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = True


class DraftModel:
    """The draft model, its KV cache, and how far each request's draft K/V is right."""

    def __init__(self, config: EngineConfig, target_config: object, device: torch.device,
                 dtype: torch.dtype, backend: AttentionBackend) -> None:
        assert config.speculative is not None and config.speculative.model is not None
        path = resolve_model(config.speculative.model)
        self.hf_config = load_hf_config(path)
        if self.hf_config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({self.hf_config.vocab_size} "
                f"tokens) differs from the target's ({target_config.vocab_size}): it must share "
                f"the target's tokenizer"
            )
        self.device, self.dtype = device, dtype
        # the draft is quantized as the checkpoint and the target's dtype say (a GGUF: kept)
        quant = resolve_quantization(None, path, config.device, config.dtype, 1)
        draft = dataclasses.replace(config, model=path, quantization=quant)
        self.model = load_model(draft, self.hf_config, backend, device, dtype)
        self.k = config.speculative.num_speculative_tokens or 0
        self.backend = backend
        self.kv_caches: list[torch.Tensor] = []
        self.structured: StructuredOutputs | None = None  # the runner's, once constrained
        # CUDA: its decode graphs (set by the runner); passes of chunks of <= k + 1 tokens replay
        self.graphs: DecodeGraphs | None = None
        self._done: dict[str, tuple[int, int]] = {}  # request id -> (preemptions, done)

    def _pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, K/V, blocks, block_size, kv heads, head dim] of the draft's KV cache."""
        cfg = self.hf_config
        return (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads,
                head_dim_of(cfg))

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of the draft's KV cache over its layers (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return math.prod(self._pool_shape(1, block_size)) * elem

    def allocate(self, num_blocks: int, block_size: int) -> None:
        shape = self._pool_shape(num_blocks, block_size)
        self.kv_caches = list(zero_pages.zeros(shape, self.dtype, self.device).unbind(0))

    def propose(self, req: Request) -> list[int]:
        """Placeholders for `req`'s k drafts: the scheduler sizes the step by them, `fill`
        writes the tokens once it has."""
        return [0] * self.k

    def forget(self, request_id: str) -> None:
        self._done.pop(request_id, None)

    @torch.inference_mode()
    def fill(self, out: SchedulerOutput, block_size: int) -> None:
        """Replace the placeholder drafts of `out`'s scheduled requests by the draft model's."""
        steps = [s for s in out.scheduled if s.spec_token_ids]
        if not steps:
            return
        passes: list[PendingTokens] = []
        walked: dict[str, int] = {}  # constrained requests: drafts their matcher accepted
        for j in range(max(len(s.spec_token_ids) for s in steps)):
            chunks = []
            for s in steps:
                req, n = s.request, s.request.num_tokens
                if j >= len(s.spec_token_ids):
                    continue
                if j == 0:
                    done = self._valid(req)
                    chunks.append(DraftChunk(req, done, n - done))
                else:
                    chunks.append(DraftChunk(req, n - 1 + j, 1))
            passes.append(self._pass(chunks, block_size, passes[-1] if passes else None,
                                     walked))
        for s in steps:  # the matchers back where the requests' outputs end
            if walked.get(s.request.request_id):
                s.request.grammar.rollback(walked[s.request.request_id])  # type: ignore[union-attr]
        drafted: dict[str, list[int]] = {s.request.request_id: [] for s in steps}
        host = torch.cat([p.token_ids for p in passes]).tolist()  # the step's one wait
        offset = 0
        for p in passes:
            for rid, row in p.rows.items():
                drafted[rid].append(host[offset + row])
            offset += p.token_ids.shape[0]
        for s in steps:
            req = s.request
            s.spec_token_ids[:] = drafted[req.request_id]
            self._done[req.request_id] = (req.num_preemptions,
                                          req.num_tokens + len(s.spec_token_ids) - 1)

    def _valid(self, req: Request) -> int:
        """How many leading positions of `req` have the right draft K/V."""
        preemptions, done = self._done.get(req.request_id, (req.num_preemptions, 0))
        if preemptions != req.num_preemptions:
            return 0  # its blocks were freed and filled again
        return min(done, req.num_tokens - 1)

    def _pass(self, chunks: list[DraftChunk], block_size: int, pending: PendingTokens | None,
              walked: dict[str, int]) -> PendingTokens:
        """One forward of the draft over `chunks`; its greedy tokens, still on the device. A
        grammar-constrained request drafts within its grammar: its row is masked by its matcher,
        which then accepts the draft (counted in `walked`; the caller rolls it back)."""
        host, order = pack_step(SchedulerOutput(scheduled=chunks), block_size,  # type: ignore[arg-type]
                                pending)
        inp = step_tensors(host, block_size, self.device,
                           pending.token_ids if pending is not None else None)
        hidden = forward_step(self.model, self.kv_caches, self.backend, self.graphs,
                              inp.input_ids, inp.positions, inp.meta, self.k + 1)
        logits = self.model.compute_logits(hidden[inp.sample_rows], upcast=False)
        matchers = [c.request.grammar for c in order]
        if self.structured is not None and any(m is not None for m in matchers):
            logits = mask_logits(logits, self.structured.bitmask(matchers))
            ids = logits.argmax(dim=-1)
            for c, m, token in zip(order, matchers, ids.tolist(), strict=True):
                if m is not None and not m.is_terminated() and m.accept(token):
                    walked[c.request.request_id] = walked.get(c.request.request_id, 0) + 1
        else:
            ids = logits.argmax(dim=-1)
        return PendingTokens(ids, {c.request.request_id: i for i, c in enumerate(order)})

