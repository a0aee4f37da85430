"""The GPU serving comparison of docs/loadtest.md in one command: the colocated server against
1 prefill + 1 decode worker with the KV over grpc and over cuda_ipc, on one GPU, same load.

    python -m pdserve.bench.gpu_serve [--systems colocated,grpc,cuda_ipc] [--out-dir DIR]
    bash pdserve/bench/gpu_kit_run.sh [FLAGS]     # on a lent GPU machine (kit: gpu_kit.sh)
    python -m pdserve.bench.gpu_serve --shape tiny --num-prompts 6 --input-len 16-64 \\
        --output-len 8 --request-rate inf --kv-cache-memory 67108864   # a CPU dry run

Defaults are the docs' figures: the 1B-shaped random-weight model (16 layers, hidden 2048, 32/8
heads, vocab 128256, bf16), 8 GiB of KV per engine, 2048 tokens of context, and the load
`--request-rate 16,inf --num-prompts 96 --input-len 128-512 --output-len 128 --num-warmups 2
--slo-ttft-ms 500 --slo-tpot-ms 50 --seed 0`.

NOTE: what runs, in order, each system alone on the machine:

  model      built once into --model-dir (reused when it holds one of the same shape) by
             gpu_model.save_random_model in a child process, so this one never holds a CUDA
             context beside the servers: seeded random weights, a stand-in tokenizer.
  cluster    colocated: `pdserve up --colocated` (one in-process engine behind the gateway).
             grpc, cuda_ipc: a Redis of --redis-server on a free loopback port, then `pdserve
             up --redis-url ... --kv-transport SYSTEM` (tokenizer, 1 prefill and 1 decode
             worker sharing the GPU, --kv-cache-memory each, gateway). Both with --model,
             --kv-cache-memory, --max-model-len and a free --port; ready when /ready answers 200.
  load       `python -m loadtest` in a child process, sending from --client-processes
             processes (default 4): per --request-rate (inf: all at once)
             --num-prompts seeded Poisson arrivals after --num-warmups untimed ones, prompts of
             exactly --input-len tokens sent to /v1/completions as token ids of --tokenizer's
             word tokens (the SmolLM2 tokenizer: its 49152 ids are valid in the model's larger
             vocabulary), --output-len held with ignore_eos, greedy; goodput under the SLOs.
             Each worker's /metrics (addresses from the gateway's /workers) is a --metrics-url,
             so every rate's report carries the KV transfer counters' growth. With
             PDSERVE_STACK_SAMPLE_WHILE set, its path exists while the load runs (the servers'
             stack samplers and loop profiles look only then); --sample-rates, a subset of the
             rates, runs the load generator once per rate and opens it for those alone.
  transport  after the load, the workers' kv_transfer_bytes per data plane are read once more
             (warm-ups included): they show which plane carried the KV (a worker without CUDA
             falls back from cuda_ipc to grpc with a warning).
  stop       SIGTERM to `pdserve up` (gateway first, then the workers) and to Redis; wait.

Into --out-dir: loadtest_SYSTEM.json (the load generator's report, every request's timeline),
cluster_SYSTEM.log (the servers' output) and gpu_serve.json (config, rows, transfer bytes,
ratios), rewritten after each system so a call cut short keeps what finished: 7 files, under the
device's 8. The comparison table comes last. The flags and command lines: gpu_serve_plan.py;
the table: gpu_serve_table.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from engine import stack_sampler
from pdserve.bench.gpu_model import ModelShape, log
from pdserve.bench.gpu_serve_plan import (
    REPLICAS,
    LoadConfig,
    ServeConfig,
    add_arguments,
    config_of,
    loadtest_argv,
    redis_argv,
    up_argv,
)
from pdserve.bench.gpu_serve_table import format_table, summarize
from pdserve.bench.report import bench_main, write_report
from pdserve.launcher import Service, wait_healthy
from pdserve.ports import free_port


# ---- the model -----------------------------------------------------------------------------------
def ensure_model(shape: ModelShape, folder: Path, seed: int) -> None:
    """The random model in `folder`, built in a child process unless one of `shape` is there."""
    config = folder / "config.json"
    if config.is_file():
        have = json.loads(config.read_text())
        want = {"num_hidden_layers": shape.layers, "hidden_size": shape.hidden,
                "vocab_size": shape.vocab, "num_key_value_heads": shape.kv_heads}
        if any(have.get(k) != v for k, v in want.items()):
            raise ValueError(f"{folder} holds another model shape; pass another --model-dir")
        log(f"reusing the model in {folder}")
        return
    log(f"building the random model in {folder}")
    child = multiprocessing.get_context("spawn").Process(
        target=build_model, args=(shape, str(folder), seed))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"building the model failed (exit code {child.exitcode})")


def build_model(shape: ModelShape, folder: str, seed: int) -> None:
    """Child process: save the seeded random model (on the GPU when there is one)."""
    import torch
    from transformers.utils import logging as hf_logging

    from pdserve.bench.gpu_model import save_random_model

    hf_logging.set_verbosity_error()
    Path(folder).mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    save_random_model(shape, Path(folder), seed, device)


def check_tokenizer(load: LoadConfig, vocab: int) -> None:
    """The load generator's token ids must be valid in the model. Raises ValueError."""
    from loadtest.tokens import load_tokenizer

    size = len(load_tokenizer(load.tokenizer))
    if size > vocab:
        raise ValueError(f"the load generator's tokenizer has {size} ids, the model's "
                         f"vocabulary {vocab}: pass --vocab {size} or more")


# ---- one system ----------------------------------------------------------------------------------
def run_system(cfg: ServeConfig, system: str) -> dict[str, Any]:
    """Start `system`, load it, read its transfer counters, stop it. Its summary entry."""
    work = cfg.work_dir or cfg.out_dir
    report = work / f"loadtest_{system}.json"
    procs: list[subprocess.Popen] = []
    with open(work / f"cluster_{system}.log", "w") as out, \
            tempfile.TemporaryDirectory(prefix="pdserve-gpu-serve-") as tmp:
        try:
            redis_url = "" if system in ("colocated", "replicas") else start_redis(
                cfg.redis_server, Path(tmp), out, procs)
            gpus = [str(i) for i in range(REPLICAS)] if system == "replicas" else [None]
            urls = [start_up(cfg, system, redis_url, Path(tmp), out, procs, gpu) for gpu in gpus]
            base_url = ",".join(urls)
            workers = worker_metrics(urls[0]) if redis_url else {}
            log(f"{system}: up at {base_url}; workers' metrics {workers or '-'}")
            code = run_load(cfg, system, base_url,
                            [f"http://{a}/metrics" for a in workers.values()], report)
            transfers = {role: transfer_bytes(a) for role, a in workers.items()}
        finally:
            stop(procs)
    if code != 0:
        return {"system": system, "error": f"loadtest exited with code {code}"}
    runs = json.loads(report.read_text())["runs"]
    return {"system": system, "report": str(report), "kv_bytes_by_transport": transfers,
            "runs": [{**{k: v for k, v in r.items() if k != "requests"},
                      "second_token_p50_s": second_token_p50(r["requests"])} for r in runs]}


def run_load(cfg: ServeConfig, system: str, base_url: str, metrics_urls: list[str],
             report: Path) -> int:
    """The load generator against `base_url`, its report into `report`; its exit code. With
    --sample-rates a subset of the rates, one run per rate (the i-th seeded seed + i: one
    seed would send every run the same prompts, which the prefix caches then serve), the
    samplers' gate open only in the chosen ones, and the runs' reports merged into one."""
    load = cfg.load
    if cfg.sample_rates is None or set(cfg.sample_rates) == set(load.request_rates):
        with sampling_window():
            return subprocess.run(loadtest_argv(load, system, base_url, metrics_urls,
                                                report)).returncode
    parts = []
    for rate in load.request_rates:
        part = report.with_name(f"{report.stem}.rate{len(parts)}.json")
        # its own seed: the same prompts again would be served from the prefix caches
        argv = loadtest_argv(dataclasses.replace(load, request_rates=(rate,),
                                                 seed=load.seed + len(parts)), system,
                             base_url, metrics_urls, part)
        with sampling_window(rate in cfg.sample_rates):
            code = subprocess.run(argv).returncode
        if code != 0:
            return code
        parts.append(part)
    merged = json.loads(parts[0].read_text())
    merged["runs"] = [run for part in parts for run in json.loads(part.read_text())["runs"]]
    report.write_text(json.dumps(merged, indent=1))
    for part in parts:
        part.unlink()
    return 0


@contextlib.contextmanager
def sampling_window(open_gate: bool = True) -> Any:
    """The load's run as the servers' stack samplers' window (engine/stack_sampler.py): the path
    PDSERVE_STACK_SAMPLE_WHILE names exists only meanwhile (not at all unless `open_gate`)."""
    gate = os.environ.get(stack_sampler.ENV_GATE) if open_gate else None
    if gate:
        Path(gate).touch()
    try:
        yield
    finally:
        if gate:
            Path(gate).unlink(missing_ok=True)


def start_up(cfg: ServeConfig, system: str, redis_url: str, tmp: Path, out: IO[str],
             procs: list[subprocess.Popen], gpu: str | None) -> str:
    """`pdserve up` for `system` on a free port (on GPU `gpu` alone, when given), once ready;
    its URL."""
    port = free_port()
    env = {**os.environ, "PDSERVE_CLUSTER_FILE": str(tmp / f"cluster-{port}.json")}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    procs.append(subprocess.Popen(up_argv(cfg, system, port, redis_url), stdout=out,
                                  stderr=subprocess.STDOUT, env=env, **own_group()))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(Service("pdserve up", [], f"http:{url}/ready", procs[-1]),
                 time.monotonic() + cfg.startup_timeout_s)
    return url


def second_token_p50(requests: list[dict[str, Any]]) -> float | None:
    """The median time from sending a request to its second streamed chunk: what a KV
    handover delays (the first token comes from the prefill worker)."""
    times = sorted(r["chunk_at"][1] - r["sent_at"] for r in requests
                   if len(r.get("chunk_at") or []) > 1)
    return times[len(times) // 2] if times else None


def start_redis(binary: str, workdir: Path, out: IO[str] | int,
                procs: list[subprocess.Popen]) -> str:
    """A Redis of `binary` on a free loopback port, once it answers PING (added to `procs`,
    for `stop`); its URL."""
    port = free_port()
    proc = subprocess.Popen(redis_argv(binary, port, workdir), stdout=out,
                            stderr=subprocess.STDOUT, **own_group())
    procs.append(proc)
    wait_healthy(Service("redis", [], f"redis:{port}", proc), time.monotonic() + 30)
    return f"redis://127.0.0.1:{port}/0"


def worker_metrics(base_url: str, timeout_s: float = 30.0) -> dict[str, str]:
    """role -> metrics host:port of the prefill and decode workers, from the gateway."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{base_url}/workers", timeout=10) as r:
            workers = json.loads(r.read())["workers"]
        found = {w["role"]: w["metrics_address"] for w in workers
                 if w["role"] in ("prefill", "decode") and w.get("metrics_address")}
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


_BYTES = re.compile(r'^pdserve:kv_transfer_bytes_total\{[^}]*transport="([^"]+)"[^}]*\}\s+(\S+)',
                    re.MULTILINE)


def transfer_bytes(address: str) -> dict[str, float]:
    """transport -> KV bytes a worker's /metrics counts ({} when unreadable)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {transport: float(value) for transport, value in _BYTES.findall(text)}


def stop(procs: list[subprocess.Popen], grace_s: float = 120.0) -> None:
    """SIGTERM, last started first (`pdserve up` stops its services, then Redis goes); SIGKILL
    to a child's whole process group after `grace_s`, or at once when interrupted meanwhile
    (a second Ctrl-C or SIGTERM), which is raised again once every child is gone."""
    interrupted = False
    for proc in reversed(procs):
        if proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=0 if interrupted else grace_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            interrupted = interrupted or isinstance(exc, KeyboardInterrupt)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if interrupted:
        raise KeyboardInterrupt


def own_group() -> dict[str, Any]:
    """Popen arguments: the child leads a process group of its own (so `stop` can kill what it
    started too) without leaving the caller's terminal (setpgid, not setsid: whatever ends the
    caller still ends it)."""
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


# ---- the whole run -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system in turn; the summary JSON after each; the comparison table last."""
    cfg = config_of(args)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed call still stops its servers
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.work_dir or cfg.out_dir).mkdir(parents=True, exist_ok=True)
    check_tokenizer(cfg.load, cfg.shape.vocab)
    ensure_model(cfg.shape, cfg.model_dir, cfg.load.seed)
    results, path = [], str(cfg.out_dir / "gpu_serve.json")
    for system in cfg.systems:
        log(f"== {system}")
        start = time.perf_counter()
        try:
            result = run_system(cfg, system)
        except (RuntimeError, TimeoutError, OSError) as exc:
            result = {"system": system, "error": f"{type(exc).__name__}: {exc}"}
        result["elapsed_s"] = time.perf_counter() - start
        result["log"] = str((cfg.work_dir or cfg.out_dir) / f"cluster_{system}.log")
        log(f"== {system}: {result.get('error') or 'done'} in {result['elapsed_s']:.0f} s")
        results.append(result)
        summary = summarize(results)
        write_report({"config": _plain(cfg), **summary}, path)
    print(format_table(summary), flush=True)
    return summary


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _plain(cfg: ServeConfig) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def main(argv: list[str] | None = None) -> int:
    try:
        return bench_main("gpu_serve", __doc__, add_arguments, run, argv)
    except KeyboardInterrupt:
        log("gpu_serve: interrupted; the servers it started are stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
