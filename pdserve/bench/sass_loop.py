"""The W4A16 GEMV's inner loop as the GPU would run it, read on the CPU: the kernel compiled for
sm_90 by Triton's own ptxas with a launch's specializations (pointers, sizes and strides
divisible by 16, M = 1), then `cuobjdump -sass`; prints each loop's instruction count and its
opcodes by count.

    PYTHONPATH=. python -m pdserve.bench.sass_loop PAIRS=1            # codes in fp16 pairs
    PYTHONPATH=. python -m pdserve.bench.sass_loop PAIRS=0 BLOCK_N=16 ROWS=16 warps=1
    PYTHONPATH=. python -m pdserve.bench.sass_loop TMA=1 STAGES=3 warps=8  # codes by TMA

Any KEY=VALUE overrides a constexpr of the kernel (or `warps`); `dump=1` prints the SASS.
Without the divisibility specializations the loop reads 2-3x larger (scalar loads, 64-bit
address arithmetic per element): those are not what a launch compiles.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

DEFAULTS = dict(BLOCK_N=64, ROWS=64, GROUP_ROWS=16, SPLIT_K=1, FORM=0, PRO_BLOCK=1024,
                PREFETCH=0, LINES=2, M=1, PAIRS=1, PAIRS_ASM=1, EVEN_N=1, STAGES=1, TMA=0)
POINTERS = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "s_out_ptr": "*bf16",
            "xc_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
            "out_ptr": "*bf16", "part_ptr": "*fp32", "ticket_ptr": "*i32", "eps": "fp32"}
UNALIGNED = ("eps", "group_size")  # arguments a launch does not specialize


def gemv_source(consts: dict[str, int], divisible: bool = True) -> object:
    """The W4A16 GEMV as Triton's compiler takes it (an ASTSource): `consts` its constexprs
    (every one), bf16 activations' pointer types, the codes' descriptor where TMA is on;
    `divisible`: pointers, sizes and strides marked divisible by 16, as a launch specializes
    them (tests/test_kernel_w4a16_gemv_inputs.py compiles without)."""
    from triton.compiler import ASTSource

    from kernels.w4a16_gemv import _w4a16_gemv_kernel as fn

    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32")
                 for n in fn.arg_names}
    signature["q_desc"] = (f"tensordesc<i32[{consts['ROWS']}, {consts['BLOCK_N']}]>"
                           if consts["TMA"] else "*i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if divisible and n not in consts and n not in UNALIGNED
             and not (n == "q_desc" and consts["TMA"])}
    return ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                     attrs)


def sass(overrides: dict[str, int]) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    from kernels.w4a16_gemv import _w4a16_gemv_kernel as fn

    consts = {**DEFAULTS, **{k: v for k, v in overrides.items() if k in fn.arg_names}}
    source = gemv_source(consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": overrides.get("warps", 4)})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def loops(text: str) -> list[list[str]]:
    """Each loop's opcodes: from a backward branch's target to the branch."""
    ops = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(3), m.group(4)))
    spans = []
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    return [[op for addr, op, _ in ops if start <= addr <= stop] for start, stop in spans]


def main(argv: list[str] | None = None) -> int:
    overrides = {k: int(v) for k, v in (arg.split("=") for arg in (argv or sys.argv[1:]))}
    text = sass(overrides)
    if overrides.get("dump"):
        print(text)
    for body in loops(text):
        counts = collections.Counter(op.split(".")[0] for op in body)
        print(f"loop: {len(body)} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
