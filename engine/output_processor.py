"""From sampled tokens to `RequestOutput`s: incremental text, stop strings, `n` > 1 gathering.
A step's outputs are built as the wire's tuples (engine/output_wire.py), which the engine core
process sends as they are and everything else turns into the dataclasses.

Each prompt is one `RequestGroup`; each of its `n` sequences is one `SequenceState` holding the
detokenizer and stop-string matcher that turn its token ids into text as they arrive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.output_wire import Wire, decode
from engine.outputs import Logprob, PromptLogprobs, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind
from engine.stop_checker import StopStringMatcher


@dataclass
class SequenceState:
    req: Request
    detok: IncrementalDetokenizer | None
    matcher: StopStringMatcher | None
    text: str = ""
    sent_text: int = 0  # characters already sent in delta mode
    sent_tokens: int = 0  # tokens already sent in delta mode
    seen_tokens: int = 0  # tokens already turned into text
    closed: bool = False  # text is final
    # Nobody reads this sequence's text before it finishes (final-only output, no stop strings):
    # detokenize once at the end instead of every step. Same text: the detokenizer's deltas
    # concatenate to the same string however the tokens are grouped into steps.
    lazy: bool = False

    def absorb(self) -> str | None:
        """Detokenize tokens sampled since the last call; return a matched stop string, if any.

        When the request finished on a token (eos, length), flushes everything held back."""
        if self.closed or (self.lazy and not self.req.is_finished):
            return None
        if self.detok is None:  # no text to make (a worker's requests): just keep count
            self.seen_tokens = len(self.req.output_token_ids)
            self.closed = self.req.is_finished
            return None
        start = self.seen_tokens
        new = self.req.output_token_ids[start:]
        self.seen_tokens = len(self.req.output_token_ids)
        self.closed = self.req.is_finished
        if self.closed and new and self.req.stop_reason == new[-1]:
            new = new[:-1]  # a stop token ends the sequence; its text is not output (vLLM)
        if self.matcher is not None and len(new) > 1:  # several tokens in a step: spec decoding
            for i in range(len(new) - 1):  # token by token, as if each came in its own step
                match = self._feed(self.detok.step(new[i : i + 1]))
                if match is not None:
                    self._cut(start + i + 1)
                    return match
            new = new[-1:]
        delta = self.detok.step(new) if new else ""
        if self.req.is_finished:
            delta += self.detok.flush()
        if self.matcher is None:
            self.text += delta
            return None
        match = self._feed(delta)
        if match is None and self.req.is_finished:
            self.text += self.matcher.flush()
        return match

    def _feed(self, delta: str) -> str | None:
        assert self.matcher is not None
        emitted, match = self.matcher.feed(delta)
        self.text += emitted
        self.closed = self.closed or match is not None
        return match

    def _cut(self, num_tokens: int) -> None:
        """A stop string ended at output token `num_tokens - 1`, before the last one appended
        (speculative decoding appends several a step): drop the tokens after it, as if the
        sequence had stopped there. A request already finished by a later token (eos, length)
        ends by the stop string instead."""
        req = self.req
        cut = len(req.output_token_ids) - num_tokens
        del req.output_token_ids[num_tokens:]
        if req.output_logprobs:
            del req.output_logprobs[len(req.output_logprobs) - cut :]
        self.seen_tokens = num_tokens
        if req.is_finished:
            req.status = RequestStatus.FINISHED_STOPPED


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    seqs: list[SequenceState] = field(default_factory=list)
    tokenizer: object = None
    prompt_logprobs_sent: bool = False
    # Every sequence lazy (final-only output, no stop strings): nothing to do for the group
    # in a step that finishes none of them.
    lazy: bool = False
    stream_interval: int = 1  # SchedulerConfig.stream_interval
    streamed_at: int | None = None  # the longest sequence's length at the last output sent

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # noqa: SIM110 (a plain loop: asked for every request every step)
            if not s.req.is_finished:
                return False
        return True

    def make_output(self) -> RequestOutput | None:
        """The group's output for this step, shaped by its output kind (None: nothing to send)."""
        wire = self.make_wire()
        return None if wire is None else decode(wire)

    def make_wire(self) -> Wire | None:
        """`make_output` as the plain tuple the engine core process sends
        (engine/output_wire.py), no dataclass made: what a served stream costs every step."""
        seqs = self.seqs
        # (every stream's every step: one sequence's status read directly, no property loop)
        finished = seqs[0].req.status.finished if len(seqs) == 1 else self.finished
        kind = self.kind
        if not finished and (kind == RequestOutputKind.FINAL_ONLY
                             or (self.stream_interval != 1 and not self._due())):
            return None
        delta = kind == RequestOutputKind.DELTA
        first = seqs[0].req
        completions = ([self._completion(seqs[0], delta)] if len(seqs) == 1
                       else [self._completion(s, delta) for s in seqs])
        return (self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
                self._metrics(finished), first.num_cached_tokens,
                self._prompt_logprobs(first, delta))

    def _due(self) -> bool:
        """`stream_interval`: outputs go at once until one carries text (tokens whose text is
        held back, or empty, do not count as the first), then one every `stream_interval`
        tokens of the longest sequence; a finished one always goes. An output held back is not
        lost: the next delta starts where the last one sent ended."""
        if self.stream_interval == 1:
            return True
        made = max(len(s.req.output_token_ids) for s in self.seqs)
        if self.streamed_at is not None and made - self.streamed_at < self.stream_interval:
            return False
        if any(s.text or s.detok is None for s in self.seqs):  # something to read: count
            self.streamed_at = made
        return True

    def _prompt_logprobs(self, req: Request, delta: bool) -> PromptLogprobs | None:
        """vLLM's shape: None for the first prompt token, then {token: Logprob} with the top
        alternatives; once every prompt position is computed (in delta mode: once)."""
        entries = req.prompt_logprobs
        if req.sampling_params.prompt_logprobs is None or len(entries) < len(
                req.prompt_token_ids) - 1 or (delta and self.prompt_logprobs_sent):
            return None
        self.prompt_logprobs_sent = True
        out: PromptLogprobs = [None]
        for token_id, (chosen, rank, top) in zip(req.prompt_token_ids[1:], entries):
            d = {t: Logprob(lp, rank=j + 1) for j, (t, lp) in enumerate(top.items())}
            d[token_id] = Logprob(chosen, rank=rank)
            out.append(d)
        return out

    def _completion(self, s: SequenceState, delta: bool) -> tuple:
        """A `CompletionOutput`'s fields, in order."""
        req = s.req
        tok_from = s.sent_tokens if delta else 0
        text_from = s.sent_text if delta else 0
        if delta:
            s.sent_tokens, s.sent_text = len(req.output_token_ids), len(s.text)
        logprobs = None
        cumulative = None
        if req.sampling_params.logprobs is not None:
            # Prior output tokens (generated elsewhere, before a migration or a resumed stream)
            # have no logprobs here: entry j of output_logprobs is output token `prior + j`.
            prior = len(req.output_token_ids) - len(req.output_logprobs)
            steps = range(max(tok_from, prior), len(req.output_token_ids))
            logprobs = [self._logprob_dict(req, i, prior) for i in steps]
            cumulative = sum(lp for lp, _ in req.output_logprobs)
        return (req.index, s.text[text_from:], req.output_token_ids[tok_from:],
                req.status.finish_reason, req.stop_reason, logprobs, cumulative)

    def _logprob_dict(self, req: Request, i: int, prior: int) -> dict[int, Logprob]:
        chosen_lp, top = req.output_logprobs[i - prior]
        chosen = req.output_token_ids[i]
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        result = {chosen: Logprob(chosen_lp, rank=None, decoded_token=self._decode(chosen))}
        for rank, (token_id, lp) in enumerate(ranked, start=1):
            if token_id == chosen:
                result[chosen].rank = rank
            else:
                result[token_id] = Logprob(lp, rank=rank, decoded_token=self._decode(token_id))
        return result

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _metrics(self, finished: bool) -> tuple:
        """A `RequestMetrics`' fields, in order, over the group's sequences."""
        if len(self.seqs) == 1:  # every stream's every step: its request's own, no lists
            req = self.seqs[0].req
            m = req.metrics
            return (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                    m.finished_time if finished else None, req.num_cached_tokens,
                    req.num_preemptions)
        reqs = [s.req for s in self.seqs]
        first_token = [r.metrics.first_token_time for r in reqs if r.metrics.first_token_time]
        scheduled = [r.metrics.first_scheduled_time for r in reqs if r.metrics.first_scheduled_time]
        done = [r.metrics.finished_time for r in reqs if r.metrics.finished_time]
        return (reqs[0].metrics.arrival_time,
                min(scheduled) if scheduled else None,
                min(first_token) if first_token else None,
                max(done) if finished and done else None,
                reqs[0].num_cached_tokens,
                sum(r.num_preemptions for r in reqs))


def mark_progress(req: Request, now: float | None = None) -> None:
    """Stamp first-scheduled / first-token / finished times the first time each is reached."""
    now = time.monotonic() if now is None else now
    m = req.metrics
    if m.first_scheduled_time is None:
        m.first_scheduled_time = now
    if m.first_token_time is None and req.output_token_ids:
        m.first_token_time = now
    if m.finished_time is None and req.is_finished:
        m.finished_time = now
