"""`pdserve` command line: one subcommand per job.

    pdserve demo                      offline generation on the bundled model (chat + completion)
    pdserve generate "prompt" ...     offline generation for prompts given on the command line
    pdserve bench throughput          offline throughput against HF transformers
"""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: bundled)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, seed=args.seed,
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

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput vs HF transformers")
    from pdserve.bench import throughput

    throughput.add_arguments(tp)
    tp.set_defaults(func=lambda a: 0 if throughput.run(a) else 1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
