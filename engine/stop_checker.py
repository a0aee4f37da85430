"""When a sequence stops: stop strings over streamed text, and token-level rules.

Stop strings are matched on detokenized text, which arrives in deltas: a stop string may span
several of them. `StopStringMatcher` holds back the tail of the text that could still grow into a
stop string, so a streaming client never sees part of one. The winning stop string is the one
whose match ends first in the text (then the one starting first), so the result does not depend
on how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Collection


class StopStringMatcher:
    """Finds the first stop string in one sequence's text as it streams in."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool) -> None:
        if not stops or not all(stops):
            raise ValueError("stops must be a non-empty list of non-empty strings")
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._longest = max(len(s) for s in self.stops)
        self._held = ""  # not yet emitted: might be the start of a stop string
        self._context = ""  # emitted already, kept to find stop strings spanning deltas
        self.matched: str | None = None

    def feed(self, delta_text: str) -> tuple[str, str | None]:
        """Take the next piece of text; return (text safe to emit now, matched stop or None).

        On a match the emitted text ends before the stop string (or after it, when
        `include_stop_str_in_output`) and the matcher is done: later calls return ("", None).
        Otherwise a tail that could begin a stop string is held back until later text settles it.
        """
        if self.matched is not None:
            return "", None
        text = self._held + delta_text
        search = self._context + text
        match = _first_match(search, self.stops)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            emit = text[: end - len(self._context)]  # a match always ends inside `text`
            self._held = self._context = ""
            self.matched = stop
            return emit, stop
        if self.include_stop_str_in_output:
            # A partial stop string would be emitted anyway if it completed: nothing to hold.
            self._held = ""
            self._context = search[max(len(search) - self._longest + 1, 0) :]
            return text, None
        keep = _partial_suffix_len(text, self.stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Return the held-back text: the sequence ended without completing a stop string."""
        held, self._held = self._held, ""
        return held


def _first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string whose first occurrence in `text` ends first."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[1], best[2])


def _partial_suffix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for n in range(min(len(text), max(len(s) for s in stops) - 1), 0, -1):
        tail = text[len(text) - n :]
        if any(len(s) > n and s.startswith(tail) for s in stops):
            return n
    return 0


def check_token_stop(
    token_id: int,
    num_output_tokens: int,
    max_tokens: int,
    min_tokens: int,
    eos_token_ids: Collection[int],
    stop_token_ids: Collection[int],
    ignore_eos: bool,
) -> tuple[str | None, int | None]:
    """Whether the token just appended ends the sequence: (finish_reason, stop_reason).

    `num_output_tokens` counts `token_id`. Before `min_tokens` only `max_tokens` stops it (a
    prefill worker's request ends at its first token whatever min_tokens says). Then eos ends it
    with ("stop", None) unless `ignore_eos`; a stop token id with ("stop", token_id), even with
    `ignore_eos`; otherwise reaching `max_tokens` ends it with ("length", None). The stopping token
    stays in the output ids; its text is not part of the output (vLLM's rule), which the caller
    ensures by not detokenizing it.
    """
    if num_output_tokens < min_tokens:
        return ("length", None) if num_output_tokens >= max_tokens else (None, None)
    if token_id in eos_token_ids and not ignore_eos:
        return "stop", None
    if token_id in stop_token_ids:
        return "stop", token_id
    if num_output_tokens >= max_tokens:
        return "length", None
    return None, None
