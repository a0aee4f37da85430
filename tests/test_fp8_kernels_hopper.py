"""The FP8 kernels compiled for sm_90 by Triton's own ptxas, no GPU needed: the interpreter runs
what the compiler refuses, so each kernel the CPU tests run is also built as a Hopper launch
would build it (a process without TRITON_INTERPRET). The GEMM's fp8 dot must become wgmma."""

from __future__ import annotations

from hopper_compile import compile_for_hopper

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.fp8_gemm import _fp8_gemm_kernel
from kernels.fp8_quant import _quantize_rows_kernel
from kernels.rmsnorm import _rms_norm_kernel
from kernels.rmsnorm_fp8 import _rms_norm_fp8_kernel
from kernels.silu_mul import _silu_mul_kernel
from kernels.silu_mul_fp8 import _silu_mul_fp8_kernel

def ptx(fn, pointers, consts, warps):
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps}).asm["ptx"]

FP8 = dict(FP8_LIMIT=448.0, SCALE_FLOOR=1e-12, ROUND_FIRST=False)
for name, split, acc in (("gemm_split1", 1, 0), ("gemm_split4", 4, 0), ("gemm_acc32", 1, 32)):
    text = ptx(_fp8_gemm_kernel, {"xq_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                                  "sw_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
                                  "ticket_ptr": "*i32"},
               dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=split,
                    EVEN_K=True, UPCAST=False, IMPRECISE_ACC=acc), 8)
    print(name, text.count("wgmma.mma_async"))
rows = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
        "res_out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"}
print("rms_norm", len(ptx(_rms_norm_kernel, rows, dict(HAS_RESIDUAL=True, BLOCK=2048), 8)))
print("rms_norm_fp8", len(ptx(_rms_norm_fp8_kernel, rows,
                              dict(HAS_RESIDUAL=True, BLOCK=2048, **FP8), 8)))
print("silu_mul", len(ptx(_silu_mul_kernel, rows, dict(BLOCK=1024), 4)))
print("silu_mul_fp8", len(ptx(_silu_mul_fp8_kernel, rows, dict(BLOCK=8192, **FP8), 16)))
print("quantize_rows", len(ptx(_quantize_rows_kernel, rows, dict(BLOCK=2048, **FP8), 4)))
"""


def test_the_fp8_kernels_compile_for_hopper() -> None:
    built = compile_for_hopper(_COMPILE)
    assert list(built) == ["gemm_split1", "gemm_split4", "gemm_acc32", "rms_norm",
                           "rms_norm_fp8", "silu_mul", "silu_mul_fp8", "quantize_rows"]
    assert all(int(built[g]) > 0 for g in ("gemm_split1", "gemm_split4", "gemm_acc32"))  # wgmma
