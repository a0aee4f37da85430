"""pdserve.bench.grpc_ping: a round trip to a server process (a unary call, a message on a call
kept open), split there and back."""

from __future__ import annotations

import pytest

from pdserve.bench import grpc_ping


def test_each_call_is_split_at_the_handler() -> None:
    result = grpc_ping.main(["--calls", "5", "--gap-ms", "0"])
    assert result == 0
    out = grpc_ping.run(grpc_ping.argparse.Namespace(calls=5, payload_bytes=10, gap_ms=0,
                                                     modes="unary,stream"))
    assert set(out) == {"unary", "stream"}
    for mode in out.values():
        assert set(mode) == {"there", "back", "round_trip"}
        for part in mode.values():
            assert 0 < part["p50"] <= part["p90"] < 1000
        assert mode["round_trip"]["p50"] >= max(mode["there"]["p50"], mode["back"]["p50"])


def test_bad_arguments_are_refused() -> None:
    assert grpc_ping.main(["--calls", "0"]) == 2
    assert grpc_ping.main(["--modes", "unary,carrier-pigeon"]) == 2
    with pytest.raises(SystemExit):
        grpc_ping.main(["--gap-ms", "x"])
