"""The dense bf16 matrix behind torch's packed CPU int4 weights, for steps of many tokens.

NOTE: torch's int4 CPU GEMM (`_weight_int4pack_mm_for_cpu`) widens every weight to fp32 and
multiplies on the vector units; its cost grows with the rows of x as a plain fp32 GEMM's does.
On a CPU with bf16 dot products (AVX512-BF16, AMX) a bf16 GEMM is ~3x faster than that at
prefill sizes, so a step of `DENSE_MIN_TOKENS` or more rows de-quantizes the weight into a
transient bf16 [K, N] and multiplies that; smaller steps (decodes) keep the int4 GEMM, which
reads a quarter of the bytes. Nothing dense is held: the matrix lives for one call.

`python -m pdserve.bench.cpu_int4_gemm` times the three ways (2026-12-01 on the 2-core EPYC
pdserve is developed on, docs/benchmarks.md): gate_up 3072 x 576 at 128 / 256 / 2048 rows
1.37 / 2.70 / 21.9 ms int4 against 1.15 / 1.62 / 8.88 de-quantized (0.61 ms of it the
de-quantization); down 576 x 1536 0.68 / 1.37 / 10.9 against 0.67 / 0.90 / 4.29. At 128 rows
the two are about even; 256 leaves a margin.

torch packs the nibbles of each block of B rows (B = 64 with AVX-512, 32 with AVX2) as bytes
[K, B / 2]: byte j of column k holds row j in its low nibble and row j + B / 2 in its high one.

    packed [N / B, K, B / 2] --(& 15, >> 4)--> nib [N / B, K, B]      (= W^T per block of rows)
    W^T[k, n] = nib * s[k / 32, n] + (z - 8 s)[k / 32, n]             (torch's (nib - 8) s + z)

written straight into a [K, N] tensor through a permuted view. The same layout gives single
rows back (`nibble_rows`: an embedding lookup in the lm_head's packed table). The layout is
torch's private business, so `pack_block_rows` finds B by packing a probe and unpacking it,
once per process; if neither size reproduces the probe nothing here is used, and without a bf16
dot product on the CPU the GEMMs stay int4.
"""

from __future__ import annotations

import functools

import torch

DENSE_MIN_TOKENS = 256
_GROUP = 32  # one GGUF block: the int4 kernels' group size


@functools.cache
def pack_block_rows() -> int | None:
    """Rows per block of torch's CPU int4 packing (64 or 32), None for a packing this module
    does not read back exactly (or no packing op)."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return None
    generator = torch.Generator().manual_seed(0)
    nibbles = torch.randint(0, 16, (128, 64), generator=generator, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    for rows in (64, 32):
        if torch.equal(unpack_nibbles(packed, rows).permute(0, 2, 1).reshape(128, 64), nibbles):
            return rows
    return None


@functools.cache
def has_bf16_dot() -> bool:
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def unpack_nibbles(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """packed [N, K / 2] uint8 -> nibbles [N / rows, K, rows] uint8 (W^T of each block)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // rows, k, rows // 2)
    out = torch.empty(n // rows, k, rows, dtype=torch.uint8)
    torch.bitwise_and(blocks, 15, out=out[..., : rows // 2])
    torch.bitwise_right_shift(blocks, 4, out=out[..., rows // 2 :])
    return out


def nibble_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """packed [N, K / 2] uint8, ids [R] -> the nibbles of rows `ids`, [R, K] uint8
    (`pack_block_rows` not None, N whole blocks)."""
    rows = pack_block_rows()
    half = rows // 2
    blocks = packed.view(packed.shape[0] // rows, packed.shape[1] * 2, half)
    within = ids % rows
    data = blocks[ids // rows, :, within % half]  # [R, K]: the bytes holding each row
    return torch.where((within >= half)[:, None], data >> 4, data & 15)


def whole_blocks(packed: torch.Tensor) -> bool:
    """Whether this module reads `packed` [N, K / 2]: a known layout and whole blocks of rows."""
    rows = pack_block_rows()
    return rows is not None and packed.shape[0] % rows == 0


def dense_supported(packed: torch.Tensor) -> bool:
    """Whether `dense_weight_t` takes this packed weight: whole blocks of rows, whole groups,
    and a CPU with a bf16 dot product (else the int4 GEMM is the faster one)."""
    return has_bf16_dot() and whole_blocks(packed) and (packed.shape[1] * 2) % _GROUP == 0


def dense_weight_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """packed [N, K / 2] and torch's scales and zeros [K / 32, N, 2] bf16 -> W^T [K, N] bf16,
    W = (nibble - 8) * s + z per group of 32 along K (`dense_supported` first)."""
    rows = pack_block_rows()
    n, k = packed.shape[0], packed.shape[1] * 2
    groups, blocks = k // _GROUP, n // rows
    s = scales_and_zeros[..., 0].float()  # [K / 32, N]
    z = scales_and_zeros[..., 1].float() - 8 * s

    def by_block(t: torch.Tensor) -> torch.Tensor:  # [K / 32, N] -> [N / B, K / 32, 1, B] bf16
        return t.to(torch.bfloat16).view(groups, blocks, rows).permute(1, 0, 2)[:, :, None]

    nibbles = unpack_nibbles(packed, rows).view(blocks, groups, _GROUP, rows)
    weight_t = torch.empty(k, n, dtype=torch.bfloat16)
    into = weight_t.view(groups, _GROUP, blocks, rows).permute(2, 0, 1, 3)  # [N/B, K/32, 32, B]
    torch.addcmul(by_block(z).contiguous(), nibbles, by_block(s).contiguous(), out=into)
    return weight_t
