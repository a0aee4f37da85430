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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

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

    _add_services(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput vs HF transformers")
    from pdserve.bench import throughput

    throughput.add_arguments(tp)
    tp.set_defaults(func=lambda a: 0 if throughput.run(a) else 1)
    import loadtest.cli as serve
    from pdserve.bench import cpu_gguf, gpu, kv_routing, pipeline, spec_decode, transfer

    for name, module, text in (
        ("transfer", transfer, "KV transfer throughput over gRPC vs raw grpcio"),
        ("pipeline", pipeline, "handover and gateway overhead of a running cluster"),
        ("gpu", gpu, "the GPU benchmark: ceilings, kernels vs peers, throughput, latency"),
        ("serve", serve, "load test an OpenAI endpoint: TTFT, TPOT, ITL, goodput (loadtest)"),
        ("kv-routing", kv_routing, "kv_aware vs load routing on a multi-turn load"),
        ("spec", spec_decode, "speculative decoding (ngram) vs plain decoding: tok/s"),
        ("cpu-gguf", cpu_gguf,
         "CPU decode: a GGUF kept quantized vs de-quantized fp32 vs llama.cpp"),
    ):
        p = bench_sub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=lambda a, m=module: 0 if m.run(a) else 1)
    return parser


def _add_services(sub: argparse._SubParsersAction) -> None:
    from decode_svc import server as decode_server
    from gateway import server as gateway_server
    from pdserve import launcher, status
    from prefill_svc import server as prefill_server
    from tokenizer_svc import server as tokenizer_server

    up = sub.add_parser("up", help="start the whole local cluster")
    launcher.add_arguments(up)
    up.set_defaults(func=launcher.run)
    st = sub.add_parser("status", help="registered workers and their load")
    status.add_arguments(st)
    st.set_defaults(func=status.run)
    serve = sub.add_parser("serve", help="OpenAI server with one in-process engine")
    gateway_server.add_colocated_arguments(serve)
    serve.set_defaults(func=lambda a: _logged(a, gateway_server.serve_colocated))
    for name, module, text in (
        ("tokenizer", tokenizer_server, "the tokenizer service"),
        ("prefill", prefill_server, "a prefill worker"),
        ("decode", decode_server, "a decode worker"),
        ("gateway", gateway_server, "the OpenAI gateway in front of the workers"),
    ):
        p = sub.add_parser(name, help=f"run {text}")
        module.add_arguments(p)
        p.set_defaults(func=lambda a, m=module: _logged(a, m.run))


def _logged(args: argparse.Namespace, fn: Callable[[argparse.Namespace], object]) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fn(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["prefill"]:
        # before torch loads: a prefill worker's OpenMP workers sleep between its long
        # parallel regions, leaving the cores to a decode worker beside it
        from engine.omp_threads import wait_passively_by_default

        wait_passively_by_default()
    args = build_parser().parse_args(argv)
    start_from_env(args.command)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
