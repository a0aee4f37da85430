"""Stop strings over streamed deltas, and the token-level stop rules (also as the gateway
reads them back when a prefill worker's first token ends the request)."""

from __future__ import annotations

import pytest

from engine.stop_checker import StopStringMatcher, check_token_stop
from gateway.remote_backend import first_token_stop_reason
from protos import common_pb2

EOS = frozenset({2})


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[tuple[str, str | None]]:
    return [matcher.feed(d) for d in deltas]


def test_stop_string_split_across_three_deltas() -> None:
    m = StopStringMatcher(["<END>"], include_stop_str_in_output=False)
    assert feed_all(m, ["Hello <E", "N", "D> ignored"]) == [
        ("Hello ", None),  # "<E" could begin the stop string: held
        ("", None),
        ("", "<END>"),
    ]
    assert m.flush() == ""


def test_stop_string_included() -> None:
    m = StopStringMatcher(["<END>"], include_stop_str_in_output=True)
    assert feed_all(m, ["Hello <E", "N", "D> ignored"]) == [
        ("Hello <E", None),  # emitted anyway if it completes: nothing to hold
        ("N", None),
        ("D>", "<END>"),
    ]


def test_held_tail_released_when_it_diverges() -> None:
    m = StopStringMatcher(["stop"], include_stop_str_in_output=False)
    assert m.feed("a st") == ("a ", None)
    assert m.feed("ar") == ("star", None)
    assert m.feed("s") == ("", None)
    assert m.flush() == "s"
    assert m.flush() == ""


def test_longest_possible_prefix_is_held() -> None:
    m = StopStringMatcher(["aab"], include_stop_str_in_output=False)
    assert m.feed("xaa") == ("x", None)
    assert m.feed("ab") == ("a", "aab")


@pytest.mark.parametrize(
    "deltas", [["xabcd"], ["xa", "b", "cd"], ["x", "a", "bc", "d"], ["xab", "cd"]]
)
def test_overlapping_candidates_first_to_end_wins(deltas: list[str]) -> None:
    m = StopStringMatcher(["abc", "ab"], include_stop_str_in_output=False)
    results = feed_all(m, deltas)
    assert "".join(text for text, _ in results) == "x"
    assert [stop for _, stop in results if stop] == ["ab"]


@pytest.mark.parametrize("deltas", [["xabcd"], ["xa", "b", "cd"], ["x", "ab", "c"]])
def test_same_end_the_earlier_start_wins(deltas: list[str]) -> None:
    m = StopStringMatcher(["bc", "abc"], include_stop_str_in_output=True)
    results = feed_all(m, deltas)
    assert "".join(text for text, _ in results) == "xabc"
    assert [stop for _, stop in results if stop] == ["abc"]


def test_flush_without_match() -> None:
    m = StopStringMatcher(["###", "\n\n"], include_stop_str_in_output=False)
    assert m.feed("line one\n") == ("line one", None)
    assert m.feed("line two ##") == ("\nline two ", None)
    assert m.flush() == "##"


def test_rejects_empty_stop_strings() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""], include_stop_str_in_output=False)


@pytest.mark.parametrize(
    ("token", "n_out", "min_tokens", "stop_ids", "ignore_eos", "expected"),
    [
        (5, 3, 0, [], False, (None, None)),
        (2, 3, 0, [], False, ("stop", None)),  # eos
        (2, 3, 0, [], True, (None, None)),  # eos ignored
        (2, 2, 3, [], False, (None, None)),  # eos before min_tokens
        (2, 3, 3, [], False, ("stop", None)),  # eos at min_tokens
        (7, 3, 0, [7], False, ("stop", 7)),  # stop token id
        (7, 3, 0, [7], True, ("stop", 7)),  # stop token ids stop even with ignore_eos
        (7, 1, 2, [7], True, (None, None)),  # ...but not before min_tokens
        (5, 10, 0, [], False, ("length", None)),  # max_tokens reached
        (2, 10, 0, [], True, ("length", None)),  # ignored eos at max_tokens: length
        (7, 10, 0, [7], False, ("stop", 7)),  # a stop token at max_tokens is a stop
    ],
)
def test_check_token_stop(
    token: int, n_out: int, min_tokens: int, stop_ids: list[int], ignore_eos: bool,
    expected: tuple[str | None, int | None],
) -> None:
    got = check_token_stop(token, n_out, 10, min_tokens, EOS, stop_ids, ignore_eos)
    assert got == expected


@pytest.mark.parametrize(
    ("token", "reason", "stop_ids", "ignore_eos", "expected"),
    [
        (2, "stop", [], False, None),  # eos first: null, as everywhere else (was 2)
        (2, "stop", [2], False, None),  # eos that is also a stop token id: eos wins
        (7, "stop", [7], False, 7),  # a stop token id first
        (2, "stop", [2], True, 2),  # eos ignored, listed as a stop token id
        (5, "stop", [], False, None),  # a grammar that completed at its first token
        (7, None, [7], False, None),  # not finished (a prefill worker's answer never says so)
    ],
)
def test_the_first_tokens_stop_reason_from_a_prefill_worker(
    token: int, reason: str | None, stop_ids: list[int], ignore_eos: bool, expected: int | None,
) -> None:
    """The prefill worker's answer says "stop" without the stop token: the gateway applies
    `check_token_stop` again, so the first token's stop_reason is the one the engine's has."""
    params = common_pb2.SamplingParams(stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    assert first_token_stop_reason(token, reason, params, EOS) == expected
