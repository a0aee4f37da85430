"""`pdserve` command line: one subcommand per job.

    pdserve up [--prefill N --decode M]   the whole local cluster (Redis, tokenizer, workers,
                                          gateway) answering OpenAI requests on localhost:8000
    pdserve up --colocated | serve        one in-process engine behind the same gateway
    pdserve status [--json]               registered workers and their load
    pdserve tokenizer|prefill|decode|gateway   one service (flags with PDSERVE_* env fallbacks)
    pdserve demo                          offline generation on the bundled model
    pdserve generate "prompt" ...         offline generation for prompts on the command line
    pdserve bench throughput              offline throughput against HF transformers
    pdserve bench transfer|pipeline       KV transfer throughput; handover and gateway overhead
    pdserve bench gpu                     ceilings, kernels vs peers, throughput, batch-1 latency
    pdserve bench serve                   load test an OpenAI endpoint (loadtest/)
    pdserve bench spec                    speculative decoding (ngram) vs plain decoding
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from engine.config import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
)
from engine.stack_sampler import start_from_env


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: bundled)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes) the model is sharded over")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: whole experts per tensor-parallel rank")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help=QUANTIZATION_HELP)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--speculative-config", default="",
                   help='speculative decoding as JSON, e.g. {"method": "ngram", '
                        '"num_speculative_tokens": 3}')


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from pdserve.cluster.worker import speculative_config

    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_expert_parallel=args.enable_expert_parallel, enforce_eager=args.enforce_eager,
        speculative_config=speculative_config(args.speculative_config),
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence what a KV cache is.",
        "List three prime numbers.",
    ]
    chats = [[{"role": "user", "content": q}] for q in questions]
    for q, out in zip(questions, llm.chat(chats, greedy)):
        print(f"\n### user: {q}\n### assistant: {out.outputs[0].text.strip()}")
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=1)
    for out in llm.generate(["Once upon a time,"], sampled, use_tqdm=False):
        print(f"\n### completion (T=0.8): Once upon a time,{out.outputs[0].text}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params) \
        if args.chat else llm.generate(args.prompts, params)
    for out in outs:
        print(f"{out.prompt or ''}{out.outputs[0].text}")
    return 0


# Subcommands whose arguments come from a module, imported only when the command is built:
# a gateway, the tokenizer service, `up` and `status` never import torch (2 s and ~200 MiB a
# process), which the workers' and the benchmarks' modules do. (name, module, help)
SERVICES = (
    ("tokenizer", "tokenizer_svc.server", "run the tokenizer service"),
    ("prefill", "prefill_svc.server", "run a prefill worker"),
    ("decode", "decode_svc.server", "run a decode worker"),
    ("gateway", "gateway.server", "run the OpenAI gateway in front of the workers"),
)
BENCHMARKS = (
    ("throughput", "pdserve.bench.throughput", "offline throughput vs HF transformers"),
    ("transfer", "pdserve.bench.transfer", "KV transfer throughput over gRPC vs raw grpcio"),
    ("pipeline", "pdserve.bench.pipeline", "handover and gateway overhead of a running cluster"),
    ("gpu", "pdserve.bench.gpu",
     "the GPU benchmark: ceilings, kernels vs peers, throughput, latency"),
    ("serve", "loadtest.cli", "load test an OpenAI endpoint: TTFT, TPOT, ITL, goodput (loadtest)"),
    ("kv-routing", "pdserve.bench.kv_routing", "kv_aware vs load routing on a multi-turn load"),
    ("spec", "pdserve.bench.spec_decode", "speculative decoding (ngram) vs plain decoding: tok/s"),
    ("cpu-gguf", "pdserve.bench.cpu_gguf",
     "CPU decode: a GGUF kept quantized vs de-quantized fp32 vs llama.cpp"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (the subcommand about to run; "" for none), the
    other subcommands are only named, their modules not imported."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def wanted(name: str) -> bool:
        return command is None or command == name

    demo = sub.add_parser("demo", help="offline generation demo on the bundled model")
    _add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate for prompts given on the command line")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.set_defaults(func=cmd_generate)

    _add_services(sub, wanted)

    bench = sub.add_parser("bench", help="benchmarks")
    if wanted("bench"):
        bench_sub = bench.add_subparsers(dest="bench", required=True)
        for name, module_name, text in BENCHMARKS:
            p = bench_sub.add_parser(name, help=text)
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=lambda a, m=module: 0 if m.run(a) else 1)
    return parser


def _add_services(sub: argparse._SubParsersAction, wanted: Callable[[str], bool]) -> None:
    up = sub.add_parser("up", help="start the whole local cluster")
    if wanted("up"):
        from pdserve import launcher

        launcher.add_arguments(up)
        up.set_defaults(func=launcher.run)
    st = sub.add_parser("status", help="registered workers and their load")
    if wanted("status"):
        from pdserve import status

        status.add_arguments(st)
        st.set_defaults(func=status.run)
    serve = sub.add_parser("serve", help="OpenAI server with one in-process engine")
    if wanted("serve"):
        from gateway import server as gateway_server

        gateway_server.add_colocated_arguments(serve)
        serve.set_defaults(func=lambda a: _logged(a, gateway_server.serve_colocated))
    for name, module_name, text in SERVICES:
        p = sub.add_parser(name, help=text)
        if wanted(name):
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=lambda a, m=module: _logged(a, m.run))


def _logged(args: argparse.Namespace, fn: Callable[[argparse.Namespace], object]) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fn(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    command = given[0] if given and not given[0].startswith("-") else None
    if command == "prefill":
        # before torch loads: a prefill worker's OpenMP workers sleep between its long
        # parallel regions, leaving the cores to a decode worker beside it
        from engine.omp_threads import wait_passively_by_default

        wait_passively_by_default()
    args = build_parser(command or "").parse_args(argv)  # `pdserve --help`: names only
    start_from_env(args.command)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
