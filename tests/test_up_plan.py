"""What `pdserve up` starts (no process runs): internal services listen on loopback whatever
the gateway's --host, every service gets the cluster's Redis namespace and TLS files, and the
prefill and decode workers its --kv-transport, their --<role>-tp and GPUs dealt by it, the
prefill workers its --kv-push-streams and the decode workers its --kv-doorbell and
--stream-interval (with --colocated, the engine)."""

from __future__ import annotations

import argparse
import re

import pytest

from pdserve.cli import build_parser
from pdserve.launcher import add_arguments, plan, remove_step_marks


def _up(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    for name in ("HOST", "REDIS_NAMESPACE", "TLS_CERT", "TLS_KEY", "TLS_CA", "PREFILL_GPUS",
                 "DECODE_GPUS", "KV_TRANSPORT", "PREFILL_TP", "DECODE_TP", "COLOCATED",
                 "CHAT_TEMPLATE", "TOOL_CALL_PARSER", "NO_AUTO_TOOL_CHOICE", "STREAM_INTERVAL",
                 "GENERATE_STREAMS",
                 "ENABLE_AUTO_TOOL_CHOICE", "API_KEY", "ENABLE_EXPERT_PARALLEL", "API_SERVER_COUNT",
                 "REUSE_PORT", "KV_PUSH_STREAMS", "KV_DOORBELL"):
        monkeypatch.delenv(f"PDSERVE_{name}", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_workers_on_loopback_with_the_cluster_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _up(["--host", "0.0.0.0", "--redis-namespace", "blue", "--tls-cert", "c.pem",
                "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--tls-server-name", "pd.internal"],
               monkeypatch)
    services = plan(args, "redis://127.0.0.1:6379/0", None)
    assert [s.name for s in services] == ["tokenizer", "prefill-0", "decode-0", "gateway"]
    for s in services:
        parsed = build_parser().parse_args(s.argv[3:])  # after `python -m pdserve.cli`
        assert parsed.host == ("0.0.0.0" if s.name == "gateway" else "127.0.0.1"), s.name
        assert parsed.redis_namespace == "blue"
        assert (parsed.tls_cert, parsed.tls_key, parsed.tls_ca, parsed.tls_server_name) == (
            "c.pem", "k.pem", "ca.pem", "pd.internal")


def test_defaults_are_plaintext_in_the_default_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    services = plan(_up([], monkeypatch), "redis://127.0.0.1:6379/0", None)
    for s in services:
        parsed = build_parser().parse_args(s.argv[3:])
        assert parsed.host == "127.0.0.1" and parsed.redis_namespace == "pdserve"
        assert (parsed.tls_cert, parsed.tls_key, parsed.tls_ca, parsed.tls_server_name) == (
            "", "", "", "")


@pytest.mark.parametrize("colocated", [False, True])
def test_tool_calling_flags(monkeypatch: pytest.MonkeyPatch, colocated: bool) -> None:
    """The gateway serves tool_choice "auto" with hermes unless told otherwise; the chat
    template goes where conversations are rendered (the tokenizer, or the one engine)."""
    mode = ["--colocated"] if colocated else []
    cases = {(): (True, "hermes"), ("--tool-call-parser", "llama3_json"): (True, "llama3_json"),
             ("--no-auto-tool-choice",): (False, "")}
    for flags, expected in cases.items():
        services = plan(_up([*mode, *flags, "--chat-template", "t.jinja"], monkeypatch),
                        "redis://127.0.0.1:6379/0", None)
        parsed = {s.name: build_parser().parse_args(s.argv[3:]) for s in services}
        gateway = parsed["gateway"]
        assert (gateway.enable_auto_tool_choice, gateway.tool_call_parser) == expected
        renders = parsed["gateway" if colocated else "tokenizer"]
        assert renders.chat_template == "t.jinja"


def test_gpus_are_dealt_to_the_workers_of_each_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill on GPU 0, decode on GPUs 1 and 2 (three decode workers: the third shares GPU 1);
    the tokenizer and gateway see what the shell sees."""
    args = _up(["--prefill", "1", "--decode", "3", "--prefill-gpus", "0",
                "--decode-gpus", "1, 2"], monkeypatch)
    env = {s.name: s.env.get("CUDA_VISIBLE_DEVICES") for s in plan(args, "redis://x:1/0", None)}
    # each worker's own GPU first, then the cluster's others (visible for cuda_ipc)
    assert env == {"tokenizer": None, "prefill-0": "0,1,2", "decode-0": "1,0,2",
                   "decode-1": "2,0,1", "decode-2": "1,0,2", "gateway": None}
    default = plan(_up([], monkeypatch), "redis://x:1/0", None)
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in default)
    with pytest.raises(SystemExit, match="--decode-gpus takes GPU indices"):
        plan(_up(["--decode-gpus", "cuda:1"], monkeypatch), "redis://x:1/0", None)


@pytest.mark.parametrize("argv, streams, doorbell", [
    ([], "shared", "on"), (["--kv-push-streams", "per-request", "--kv-doorbell", "off"],
                           "per-request", "off")])
def test_push_streams_reach_the_prefill_workers_and_the_doorbell_the_decode_workers(
        argv: list[str], streams: str, doorbell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for s in plan(_up(["--prefill", "2", "--decode", "1", *argv], monkeypatch), "", None):
        role = s.name.split("-")[0]
        for flag in ("--kv-push-streams", "--kv-doorbell"):
            wanted = {"prefill": "--kv-push-streams", "decode": "--kv-doorbell"}.get(role)
            assert (flag in s.argv) == (flag == wanted), (s.name, flag)
        if role in ("prefill", "decode"):
            parsed = build_parser().parse_args(s.argv[3:])
            seen[s.name] = parsed.kv_push_streams if role == "prefill" else parsed.kv_doorbell
    assert seen == {"prefill-0": streams, "prefill-1": streams, "decode-0": doorbell}


@pytest.mark.parametrize("argv, interval", [([], 1), (["--stream-interval", "4"], 4)])
def test_the_stream_interval_reaches_the_engines_that_decode(
        argv: list[str], interval: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for s in plan(_up(["--prefill", "1", "--decode", "2", *argv], monkeypatch), "", None):
        assert ("--stream-interval" in s.argv) == s.name.startswith("decode"), s.name
        if s.name.startswith("decode"):
            seen[s.name] = build_parser().parse_args(s.argv[3:]).stream_interval
    assert seen == {"decode-0": interval, "decode-1": interval}
    (serve,) = plan(_up(["--colocated", *argv], monkeypatch), "", None)
    assert build_parser().parse_args(serve.argv[3:]).stream_interval == interval


def test_the_shared_gpu_pace_reaches_the_decode_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--prefill", "1", "--decode", "2", "--shared-gpu-pace-ms", "12.5",
            "--shared-gpu-pace-tokens", "4096"]
    seen = {}
    for s in plan(_up(argv, monkeypatch), "", None):
        assert ("--shared-gpu-pace-ms" in s.argv) == s.name.startswith("decode"), s.name
        if s.name.startswith("decode"):
            parsed = build_parser().parse_args(s.argv[3:])
            seen[s.name] = (parsed.shared_gpu_pace_ms, parsed.shared_gpu_pace_tokens)
    assert seen == {"decode-0": (12.5, 4096), "decode-1": (12.5, 4096)}


@pytest.mark.parametrize("gpus, marked", [
    ([], {"prefill-0": "default", "decode-0": "default", "decode-1": "default"}),
    (["--prefill-gpus", "0", "--decode-gpus", "0,1"], {"prefill-0": "0", "decode-0": "0"}),
    (["--prefill-gpus", "0", "--decode-gpus", "1"], {}),
])
def test_workers_sharing_a_gpu_share_a_step_marks_folder(
        gpus: list[str], marked: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for s in plan(_up(["--prefill", "1", "--decode", "2", *gpus], monkeypatch), "", None):
        if "--shared-gpu-step-marks" in s.argv:
            folder = build_parser().parse_args(s.argv[3:]).shared_gpu_step_marks
            seen[s.name] = folder.rsplit("-", 1)[1]
            assert f"-{_up([], monkeypatch).port}-" in folder  # the cluster's own
    assert seen == marked


def test_the_step_marks_folders_go_with_the_cluster(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "marks"
    folder.mkdir()
    (folder / "prefill-1.mark").write_bytes(bytes(8))  # a worker killed mid-way left it
    services = plan(_up(["--prefill", "1", "--decode", "1"], monkeypatch), "", None)
    for s in services:
        if "--shared-gpu-step-marks" in s.argv:
            s.argv[s.argv.index("--shared-gpu-step-marks") + 1] = str(folder)
    remove_step_marks(services)
    assert not folder.exists()


@pytest.mark.parametrize("argv, expected",
                         [([], "process"), (["--engine-core", "thread"], "thread")])
def test_the_engine_core_reaches_the_colocated_server(argv: list[str], expected: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (serve,) = plan(_up(["--colocated", *argv], monkeypatch), "", None)
    assert build_parser().parse_args(serve.argv[3:]).engine_core == expected
    assert all("--engine-core" not in s.argv for s in plan(_up([], monkeypatch), "", None))


@pytest.mark.parametrize("argv, decode, prefill", [
    ([], "auto", "auto"), (["--engine-core", "thread"], "thread", "auto"),
    (["--prefill-engine-core", "process"], "auto", "process")])
def test_each_role_gets_its_own_engine_core_flag(argv: list[str], decode: str, prefill: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for s in plan(_up(["--prefill", "2", *argv], monkeypatch), "", None):
        role = s.name.split("-")[0]
        if role in ("prefill", "decode"):
            seen[s.name] = build_parser().parse_args(s.argv[3:]).engine_core
    assert seen == {"prefill-0": prefill, "prefill-1": prefill, "decode-0": decode}


def test_colocated_api_servers_share_one_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = plan(_up(["--colocated", "--api-server-count", "3"], monkeypatch), "", None)
    assert [s.name for s in servers] == ["gateway", "gateway-1", "gateway-2"]
    parsed = [build_parser().parse_args(s.argv[3:]) for s in servers]
    core = parsed[0].engine_core_listen
    assert core and all(p.reuse_port for p in parsed) and not parsed[0].engine_core_address
    assert [p.engine_core_address for p in parsed[1:]] == [core, core]
    assert not any(p.engine_core_listen for p in parsed[1:])
    with pytest.raises(SystemExit, match="drop --engine-core thread"):
        plan(_up(["--colocated", "--api-server-count", "2", "--engine-core", "thread"],
                 monkeypatch), "", None)


@pytest.mark.parametrize("argv, expected",
                         [([], "auto"), (["--engine-core", "process"], "process"),
                          (["--engine-core", "thread"], "thread")])
def test_the_engine_core_reaches_every_decode_worker_of_a_split_cluster(
        argv: list[str], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    services = plan(_up(["--prefill", "1", "--decode", "2", *argv], monkeypatch),
                    "redis://x:1/0", None)
    seen = {s.name: build_parser().parse_args(s.argv[3:]).engine_core
            for s in services if s.name.startswith("decode")}
    assert seen == {"decode-0": expected, "decode-1": expected}
    prefill = next(s for s in services if s.name.startswith("prefill"))
    assert "--engine-core" not in prefill.argv


@pytest.mark.parametrize("flag", ["--generate-streams", "--prefill-streams"])
@pytest.mark.parametrize("mode", [None, "shared", "per-request"])
def test_the_shared_calls_modes_reach_every_gateway(
        flag: str, mode: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    args = _up(["--api-server-count", "2", *([flag, mode] if mode else [])], monkeypatch)
    gateways = [s for s in plan(args, "", None) if s.name.startswith("gateway")]
    assert len(gateways) == 2
    name = flag[2:].replace("-", "_")
    for s in gateways:
        assert getattr(build_parser().parse_args(s.argv[3:]), name) == (mode or "shared")
    assert all(flag not in s.argv for s in plan(args, "", None)
               if not s.name.startswith("gateway"))


@pytest.mark.parametrize("argv, expected", [([], "auto"), (["--kv-transport", "nixl"], "nixl")])
def test_kv_transport_reaches_every_worker_and_only_them(argv: list[str], expected: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _up(["--prefill", "2", "--decode", "2", *argv], monkeypatch)
    assert args.kv_transport == expected
    seen: dict[str, str] = {}
    for s in plan(args, "redis://x:1/0", None):
        if s.name in ("tokenizer", "gateway"):
            assert "--kv-transport" not in s.argv, s.name
        else:
            seen[s.name] = build_parser().parse_args(s.argv[3:]).kv_transport
    assert seen == {"prefill-0": expected, "prefill-1": expected, "decode-0": expected,
                    "decode-1": expected}


def test_kv_transport_from_the_environment_and_its_choices(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("PDSERVE_KV_TRANSPORT", "cuda_ipc")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).kv_transport == "cuda_ipc"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "rdma"])
    err = capsys.readouterr().err
    assert "--kv-transport" in err and "rdma" in err


def _tp_and_gpus(services: list) -> dict[str, tuple[int, str | None]]:
    """Each worker's parsed --tensor-parallel-size and its CUDA_VISIBLE_DEVICES."""
    return {s.name: (build_parser().parse_args(s.argv[3:]).tensor_parallel_size,
                     s.env.get("CUDA_VISIBLE_DEVICES"))
            for s in services if s.name not in ("tokenizer", "gateway")}


def test_each_worker_gets_its_roles_tp_size_and_as_many_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill on GPU 0 with TP 1; decode TP 2 over GPUs 1, 2, 3: the second decode worker wraps
    around to GPU 1, the third starts where the list wrapped."""
    args = _up(["--prefill", "1", "--decode", "3", "--prefill-tp", "1", "--decode-tp", "2",
                "--prefill-gpus", "0", "--decode-gpus", "1,2,3"], monkeypatch)
    assert _tp_and_gpus(plan(args, "redis://x:1/0", None)) == {
        "prefill-0": (1, "0,1,2,3"), "decode-0": (2, "1,2,0,3"), "decode-1": (2, "3,1,0,2"),
        "decode-2": (2, "2,3,0,1")}
    exact = _up(["--prefill", "2", "--decode", "1", "--prefill-tp", "2", "--decode-tp", "4",
                 "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7"], monkeypatch)
    assert _tp_and_gpus(plan(exact, "redis://x:1/0", None)) == {
        "prefill-0": (2, "0,1,2,3,4,5,6,7"), "prefill-1": (2, "2,3,0,1,4,5,6,7"),
        "decode-0": (4, "4,5,6,7,0,1,2,3")}


def test_tp_without_a_gpu_list_inherits_the_shells_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _up(["--decode", "2", "--decode-tp", "2"], monkeypatch)
    assert _tp_and_gpus(plan(args, "redis://x:1/0", None)) == {
        "prefill-0": (1, None), "decode-0": (2, None), "decode-1": (2, None)}


@pytest.mark.parametrize("argv, reason", [
    (["--decode-tp", "2", "--decode-gpus", "1"],
     "--decode-tp 2 needs 2 GPUs per worker but --decode-gpus lists 1: 1"),
    (["--prefill-tp", "4", "--prefill-gpus", "0,1,2"],
     "--prefill-tp 4 needs 4 GPUs per worker but --prefill-gpus lists 3: 0,1,2"),
    (["--prefill-tp", "0"], "--prefill-tp must be >= 1, got 0"),
    (["--colocated", "--decode-tp", "2", "--decode-gpus", "0"], "--decode-tp 2 needs 2 GPUs"),
    (["--colocated", "--prefill-tp", "2"], "--colocated runs one engine, sized by --decode-tp"),
])
def test_a_gpu_list_shorter_than_the_tp_size_is_refused(argv: list[str], reason: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match=re.escape(f"pdserve up: {reason}")):
        plan(_up(argv, monkeypatch), "redis://x:1/0", None)


def test_colocated_is_sized_by_decode_tp_and_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _up(["--colocated", "--decode-tp", "2", "--decode-gpus", "2,3"], monkeypatch)
    [gateway] = plan(args, "", None)
    assert build_parser().parse_args(gateway.argv[3:]).tensor_parallel_size == 2
    assert gateway.env == {"CUDA_VISIBLE_DEVICES": "2,3", "PDSERVE_API_KEY": ""}
    [default] = plan(_up(["--colocated"], monkeypatch), "", None)
    assert build_parser().parse_args(default.argv[3:]).tensor_parallel_size == 1
    assert default.env == {"PDSERVE_API_KEY": ""}


def test_colocated_takes_no_kv_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    [gateway] = plan(_up(["--colocated", "--kv-transport", "grpc"], monkeypatch), "", None)
    assert "--kv-transport" not in gateway.argv
    build_parser().parse_args(gateway.argv[3:])  # `pdserve serve` parses what it is given


@pytest.mark.parametrize("colocated", [False, True])
def test_api_key_reaches_the_gateway_in_its_environment(monkeypatch: pytest.MonkeyPatch,
                                                        colocated: bool) -> None:
    """--api-key (or PDSERVE_API_KEY) goes to the gateway (or `pdserve serve`) as its
    PDSERVE_API_KEY, never in an argv that `ps` shows; no other service gets it. Without one,
    the gateway's PDSERVE_API_KEY is set empty: a key left in the shell does not apply."""
    mode = ["--colocated"] if colocated else []
    for argv, key in (([*mode, "--api-key", "sesame"], "sesame"), (mode, "")):
        services = plan(_up(argv, monkeypatch), "redis://x:1/0", None)
        assert {s.name: s.env.get("PDSERVE_API_KEY") for s in services if s.name != "redis"} == {
            s.name: key if s.name == "gateway" else None for s in services}
        for s in services:
            assert "sesame" not in s.argv and "--api-key" not in s.argv, s.name
            monkeypatch.setenv("PDSERVE_API_KEY", s.env.get("PDSERVE_API_KEY", ""))
            parsed = build_parser().parse_args(s.argv[3:])
            assert getattr(parsed, "api_key", "") == (key if s.name == "gateway" else ""), s.name
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).api_key == "from-env"


@pytest.mark.parametrize("colocated", [False, True])
def test_expert_parallel_and_eager_reach_every_engine(monkeypatch: pytest.MonkeyPatch,
                                                        colocated: bool) -> None:
    argv = ["--enable-expert-parallel", "--enforce-eager", "--decode-tp", "2"] + (
        ["--colocated"] if colocated else [])
    services = plan(_up(argv, monkeypatch), "redis://127.0.0.1:6379/0", None)
    engines = [s for s in services if s.name != "tokenizer" and
               (colocated or s.name != "gateway")]
    assert engines
    for s in engines:
        parsed = build_parser().parse_args(s.argv[3:])
        assert parsed.enable_expert_parallel and parsed.enforce_eager, s.name


def test_api_server_count_starts_gateways_sharing_the_port(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    services = plan(_up(["--port", "8123"], monkeypatch), "redis://127.0.0.1:6379/0", None)
    (gateway,) = [s for s in services if s.name.startswith("gateway")]
    assert not build_parser().parse_args(gateway.argv[3:]).reuse_port  # one: as before
    services = plan(_up(["--port", "8123", "--api-server-count", "3"], monkeypatch),
                    "redis://127.0.0.1:6379/0", None)
    gateways = [s for s in services if s.name.startswith("gateway")]
    assert [s.name for s in gateways] == ["gateway", "gateway-1", "gateway-2"]
    for s in gateways:
        parsed = build_parser().parse_args(s.argv[3:])
        assert parsed.reuse_port and parsed.port == 8123
    with pytest.raises(SystemExit, match="api-server-count"):
        plan(_up(["--api-server-count", "0"], monkeypatch), "redis://127.0.0.1:6379/0", None)


def test_reuse_port_sockets_share_one_port_and_both_accept() -> None:
    """Two processes' gateways bind the same port this way; connections reach either."""
    import select
    import socket
    import time

    from gateway.server import reuse_port_socket
    from pdserve.ports import free_port

    port = free_port()
    a, b = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)
    try:
        for s in (a, b):
            s.listen(64)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        accepted, deadline = {a: 0, b: 0}, time.monotonic() + 10
        while sum(accepted.values()) < 32 and time.monotonic() < deadline:
            ready, _, _ = select.select([a, b], [], [], 0.5)
            for s in ready:
                s.accept()[0].close()
                accepted[s] += 1
        assert sum(accepted.values()) == 32 and min(accepted.values()) > 0, accepted
        for c in clients:
            c.close()
    finally:
        a.close()
        b.close()
