"""The synchronous engine: add requests, call `step()` until none is left.

One step = schedule → forward + sample → advance requests → text and stop strings → outputs.
Used directly by the offline `LLM` and driven by a background task in `AsyncLLMEngine`. The
disaggregated roles' export and import of KV blocks are in `engine.kv_handoff`.

NOTE: asynchronous scheduling (vLLM's name). On a GPU the host's share of a step (scheduling,
building inputs, appending tokens, detokenizing) is as long as the forward pass itself for a
small model, and serially the GPU idles while the host works. So a step schedules and launches
step N+1 before it waits for step N's tokens:

    host   sched N+1 | launch N+1 | wait N, append N's tokens, outputs of N | sched N+2 | ...
    GPU    ... forward + sample N ...| forward + sample N+1 ...............| ...

Step N+1 is scheduled as if every request sampled in N got its token (the scheduler counts it
as pending); its input ids for those tokens are read on the device from N's results. A request
that N ends (eos, stop string) has one wasted row in N+1, whose token is discarded. A step with
grammar-constrained rows queues its sampling only once N's tokens are appended (its masks need
the matchers past them): that comes first when N lands, N's text and outputs after it. Steps
do not overlap while any request's sampling needs its full history (penalties, min_tokens), nor
in the prefill role, nor with speculative decoding (how many tokens a step emits is known only
after it).

Speculative decoding (engine/spec_decode/): before each step the proposer drafts tokens for
every decoding request; the scheduler verifies them with the request's decode in one forward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from engine import handover_trace
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.gc_heap import freeze_startup_heap, unfreeze_heap
from engine.gpu_step_marks import POLL_S as MARK_POLL_S
from engine.gpu_step_marks import StepMark, StepMarks
from engine.kv_handoff import KVHandoffMixin
from engine.kv_progress import KVWatch, StepNotes
from engine.lora.request import LoRAInUseError, LoRARequest
from engine.lora.slots import LoRASlots
from engine.model_loader import load_text_codec, load_tokenizer
from engine.model_runner import LaunchedStep, ModelRunner
from engine.output_processor import RequestGroup, SequenceState, mark_progress
from engine.output_wire import Wire, decode
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.request_checks import (
    PromptInput,
    check_prior,
    eos_token_ids,
    reads_history,
    resolve_max_tokens,
    tokenize_prompt,
)
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput, SchedulerStats
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.planner import DraftPlanner
from engine.stop_checker import StopStringMatcher
from engine.structured.manager import StructuredOutputs
from engine.token_controls import bad_words_token_ids

logger = logging.getLogger(__name__)


class LLMEngine(KVHandoffMixin):
    def __init__(self, config: EngineConfig, tokenizer: object | None = None):
        self.config = config
        self._tokenizer = tokenizer
        # what the engine encodes prompts and decodes outputs with: the `tokenizers` library
        # alone where that gives HF's results (engine/text_codec.py), else the HF tokenizer
        self.codec = tokenizer if tokenizer is not None else (
            load_text_codec(config.model) or self.tokenizer)
        self.runner = ModelRunner(config)
        self.max_model_len = config.scheduler.max_model_len
        capacity = self.runner.num_blocks * config.cache.block_size
        if capacity < self.max_model_len:
            self.runner.shutdown()
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"({self.max_model_len}): raise kv_cache_memory or lower max_model_len"
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, hold_finished=config.role == "prefill"
        )
        self.eos_token_ids = eos_token_ids(self.runner.hf_config, self.codec)
        self.vocab_size = self.runner.hf_config.vocab_size
        self._groups: dict[str, RequestGroup] = {}
        self.proposer: NgramProposer | DraftModel | None = self.runner.drafter
        if config.speculative is not None and config.role != "prefill" and self.proposer is None:
            self.proposer = NgramProposer(config.speculative)
        self.planner: DraftPlanner | None = None  # each step's drafts, cut to those that pay
        if self.proposer is not None and config.speculative is not None:
            self.planner = DraftPlanner(self.proposer, config.speculative.disable_by_batch_size)
        self._overlap = (config.async_scheduling and config.role != "prefill"
                         and self.proposer is None)
        self._history_bound: set[str] = set()  # requests whose sampling reads every token
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._kv_watches: dict[str, KVWatch] = {}  # prefill role: requests whose KV is shipped
        self._pace_s = config.scheduler.shared_gpu_pace_ms / 1e3
        marks = config.scheduler.shared_gpu_step_marks
        # prefill: its steps marked for the decode engine beside it; decode: those marks read
        self._step_mark = StepMark(marks) if marks and config.role == "prefill" else None
        self._neighbour_steps = (StepMarks(marks) if marks and self._pace_s
                                 and config.role == "decode" else None)
        self._step_started_at = 0.0  # time.perf_counter() of the last step's start
        freeze_startup_heap()  # the model, the block pool: out of full collections' walk

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        queue: bool = True,
        prior_output_token_ids: list[int] | None = None,
        kv_watch: KVWatch | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue one prompt (`params.n` sequences). Raises ValueError on bad input,
        queueing nothing. In the prefill role a request stops after its next token and keeps
        its blocks until `release`.

        `prior_output_token_ids`: tokens this request generated before, elsewhere (a decode
        worker that died). They are recomputed after the prompt and count as output (max_tokens,
        min_tokens, penalties, seeded draws) but are never output again.

        `kv_watch` (prefill role, n = 1): report the progress of the request's KV to it while
        its prompt is computed (see `engine.kv_progress`).

        `lora_request`: run under that LoRA adapter (loaded from its path if it is not yet;
        needs `enable_lora`), None for the base model."""
        params = params or SamplingParams()
        prior = list(prior_output_token_ids or [])
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if kv_watch is not None and (self.config.role != "prefill" or params.n != 1):
            raise ValueError("only a prefill-role request with n = 1 can have its KV watched")
        text, token_ids = tokenize_prompt(self.codec, self.vocab_size, prompt)
        max_tokens = resolve_max_tokens(self.max_model_len, len(token_ids), params)
        check_prior(prior, max_tokens, params.n, self.vocab_size)
        bad_words = bad_words_token_ids(self.codec, params.bad_words or [])
        if any(not 0 <= t < self.vocab_size for t in params.token_ids_used()):
            raise ValueError(f"logit_bias and allowed_token_ids take token ids in "
                             f"[0, {self.vocab_size})")
        grammar = self._compile(params)
        if params.prompt_logprobs is not None and self.config.parallel.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1")
        if (params.prompt_logprobs or 0) > self.vocab_size:
            raise ValueError(f"prompt_logprobs must be <= the vocabulary size {self.vocab_size}")
        if self.config.role == "prefill":
            max_tokens = len(prior) + 1
        lora_name = self._load_lora(lora_request)
        group = RequestGroup(
            request_id, text, token_ids, params.output_kind, tokenizer=self.codec,
            stream_interval=self.config.scheduler.stream_interval,
        )
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + index, n=1)
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}-{index}",
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                parent_id=request_id,
                index=index,
                prompt=text,
                output_token_ids=list(prior),
                lora_name=lora_name,
            )
            if arrival_time is not None:
                req.metrics.arrival_time = arrival_time
            if grammar is not None:
                req.grammar = self.structured().matcher(grammar, prior)
            req.bad_words_token_ids = bad_words
            seq = self._sequence_state(req, params)
            seq.sent_tokens = seq.seen_tokens = len(prior)  # the caller has them already
            group.seqs.append(seq)
        group.lazy = all(s.lazy for s in group.seqs)
        self._groups[request_id] = group
        if kv_watch is not None:
            self._kv_watches[request_id] = kv_watch
        if reads_history(params):
            self._history_bound.add(request_id)
        if queue:
            for s in group.seqs:
                self.scheduler.add_request(s.req)

    # ---- LoRA adapters ---------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter into the host cache now (ValueError if it is bad; a no-op if it is
        loaded from the same path)."""
        self._load_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter: KeyError if it is not loaded, LoRAInUseError (nothing changes)
        while requests of it are queued or running."""
        slots = self._lora_slots()
        if lora_name not in slots.known:
            raise KeyError(f"LoRA adapter {lora_name!r} is not loaded")
        users = sum(1 for g in self._groups.values() for s in g.seqs
                    if s.req.lora_name == lora_name)
        if users:
            raise LoRAInUseError(f"LoRA adapter {lora_name!r} is in use by {users} "
                                 f"request{'s' if users > 1 else ''}")
        slots.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters registered now; safe to call from any thread."""
        if self.runner.lora is None:
            return []
        return list(self.runner.lora.loaded)

    def _lora_slots(self) -> LoRASlots:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.runner.lora

    def _load_lora(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        in_use = {s.req.lora_name for g in self._groups.values() for s in g.seqs}
        self._lora_slots().add(lora_request, in_use)
        return lora_request.lora_name

    @property
    def tokenizer(self) -> Any:
        """The model's HF tokenizer (chat templates, the vocabulary for grammars, what users of
        `LLM.get_tokenizer()` expect), loaded at its first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    def structured(self) -> StructuredOutputs:
        """The structured-output manager, made at the first constrained request."""
        if self.runner.structured is None:
            self.runner.structured = StructuredOutputs.for_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_ids,
                pin_memory=self.runner.device.type == "cuda")
            if self.runner.drafter is not None:
                self.runner.drafter.structured = self.runner.structured
        return self.runner.structured

    def _compile(self, params: SamplingParams) -> object | None:
        """The request's compiled grammar, or None; ValueError if it does not compile."""
        if params.structured_outputs is None:
            return None
        return self.structured().compile(params.structured_outputs)

    def abort_request(self, request_ids: str | Iterable[str]) -> bool:
        """Finish the named prompts (all their sequences) as aborted and free their blocks, held
        ones included. True if any of them was known."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        found = False
        for request_id in ids:
            found |= self.release(request_id)
            group = self._groups.pop(request_id, None)
            if group is None:
                continue
            found = True
            self._history_bound.discard(request_id)
            for s in group.seqs:
                self.scheduler.finish(s.req, RequestStatus.FINISHED_ABORTED)
                self._forget(s.req)
        return found

    def step_delay_s(self) -> float:
        """Seconds before the next step may start: 0 unless the steps are paced now
        (`SchedulerConfig.shared_gpu_pace_ms`: a burst on its way, or a prefill step marked in
        flight beside it), then what is left of the period since the last step started, at
        most MARK_POLL_S while a mark holds it (looked at again then). The loop waits for
        commands meanwhile (arrivals join the paced step)."""
        if not self._pace_s:
            return 0.0
        marked = self._neighbour_steps is not None and self._neighbour_steps.busy()
        if not marked and not self.scheduler.paced():
            return 0.0
        left = max(0.0, self._step_started_at + self._pace_s - time.perf_counter())
        return min(left, MARK_POLL_S) if marked else left

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_work(self) -> bool:
        """Whether `step()` would run anything (requests waiting for KV do not count)."""
        return self._inflight is not None or self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.runner.structured is not None:
            g = self.runner.structured.stats
            stats = dataclasses.replace(
                stats, grammar_compiles=g.compiles, grammar_cache_hits=g.cache_hits,
                grammar_compile_seconds=g.compile_seconds,
                grammar_bitmask_seconds=g.bitmask_seconds,
            )
        return stats

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing to do without TP) and give the
        frozen start-up heap back to the garbage collector."""
        self.runner.shutdown()
        for marks in (self._step_mark, self._neighbour_steps):
            if marks is not None:
                marks.close()
        unfreeze_heap()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return an output for every prompt that progressed. With
        overlapping steps these are the outputs of the step launched by the previous call."""
        return [decode(w) for w in self.step_wire()]

    def step_wire(self) -> list[Wire]:
        """`step`, its outputs as the tuples the engine core process sends
        (engine/output_wire.py): no dataclass made per stream per step."""
        overlap = self._overlap and not self._history_bound
        if self._inflight is not None and not overlap:
            return self._complete(*self._take_inflight())
        started = self._step_started_at = time.perf_counter()
        if self.planner is not None:
            self.planner.propose(self.scheduler.running, len(self.scheduler.waiting))
        out = self.scheduler.schedule()
        handover_trace.mark_all("scheduled")
        if self.runner.drafter is not None:  # the step placed: the draft model guesses
            self.runner.drafter.fill(out, self.config.cache.block_size)
        notes = self._kv_notes(out) if self._kv_watches else None
        if self._step_mark is not None and not out.is_empty:
            self._step_mark.begin(out.num_batched_tokens)  # ended once its tokens are back
        if notes is None:
            launched = None if out.is_empty else self.runner.launch(out)
        else:
            notes.begin()
            launched = self.runner.launch(out, notes.on_layer)
            notes.end()
        handover_trace.mark_all("launched")
        landed = self._land(*self._take_inflight()) if self._inflight is not None else None
        handover_trace.mark_all("landed")
        if launched is not None:
            launched.start_sampling()  # constrained rows: their matchers have just advanced
            handover_trace.mark_all("sampling")
        outputs = self._outputs(landed) if landed is not None else []
        if launched is not None:
            if overlap:
                self._inflight = (out, launched)
            else:
                outputs = self._complete(out, launched)
                if self.planner is not None:
                    self.planner.measured(out, time.perf_counter() - started)
        return outputs

    def _kv_notes(self, out: SchedulerOutput) -> StepNotes | None:
        """The KV notes of this step's watched requests; first, the preempted ones' earlier
        notes made stale (their blocks are written by other requests from this step on)."""
        for req in out.preempted:
            if (watch := self._kv_watches.get(req.request_id)) is not None:
                watch.invalidate()
        chunks = [(w, s) for s in out.scheduled
                  if (w := self._kv_watches.get(s.request.request_id)) is not None]
        if not chunks:
            return None
        return StepNotes(chunks, len(self.runner.kv_caches), self.runner.mark_ready)

    def _take_inflight(self) -> tuple[SchedulerOutput, LaunchedStep]:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        return inflight

    def _complete(self, out: SchedulerOutput, launched: LaunchedStep) -> list[Wire]:
        """Wait for a launched step's tokens, append them, and make the outputs."""
        return self._outputs(self._land(out, launched))

    def _land(self, out: SchedulerOutput, launched: LaunchedStep) -> SchedulerOutput:
        """Wait for a launched step's tokens and append them: token-level stops applied, each
        constrained request's matcher advanced (what the next step's masks need first)."""
        result = launched.result()
        if self._step_mark is not None:
            self._step_mark.end()
        self.scheduler.update_from_output(out, result)
        return out

    def _outputs(self, out: SchedulerOutput) -> list[Wire]:
        """The outputs of a landed step: text, stop strings, finished requests forgotten."""
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            mark_progress(req, now)
            if s.samples:
                group = self._groups.get(req.parent_id)
                # None: aborted while the step ran; lazy: nothing to do before it finishes
                if group is not None and (req.is_finished or not group.lazy):
                    touched[req.parent_id] = group
        outputs = []
        for group in touched.values():
            self._process_text(group)
            output = group.make_wire()
            if output is not None:
                outputs.append(output)
            if group.finished:
                del self._groups[group.request_id]
                self._history_bound.discard(group.request_id)
                for seq in group.seqs:
                    self._forget(seq.req)
        return outputs

    def _process_text(self, group: RequestGroup) -> None:
        for seq in group.seqs:
            match = seq.absorb()
            if match is not None:
                seq.req.stop_reason = match
                self.scheduler.finish(seq.req, RequestStatus.FINISHED_STOPPED)
                mark_progress(seq.req)

    def _forget(self, req: Request) -> None:
        self.runner.release(req.request_id)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        watch = self._kv_watches.pop(req.request_id, None)
        if watch is not None and req.request_id not in self.scheduler.held:
            watch.invalidate()  # its blocks are free: nothing of it may be read any more

    def _sequence_state(self, req: Request, params: SamplingParams) -> SequenceState:
        detok = matcher = None
        if params.detokenize:
            detok = IncrementalDetokenizer(
                self.codec, req.prompt_token_ids, params.skip_special_tokens
            )
            if params.stop_list:
                matcher = StopStringMatcher(params.stop_list, params.include_stop_str_in_output)
        lazy = matcher is None and params.output_kind == RequestOutputKind.FINAL_ONLY
        return SequenceState(req, detok, matcher, lazy=lazy)
