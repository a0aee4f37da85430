"""4-bit codes multiplied two at a time in packed fp16 arithmetic: the W4A16 GEMV's inner
product for bf16 and fp16 activations on CUDA (kernels/w4a16_gemv.py, `PAIRS`).

NOTE: in fp32 a code costs three instructions (kernels/widen.py `nibble_times`: a LOP3 and an
FADD to widen it, an FFMA to multiply it); a batch-1 GEMV that streams 0.5 bytes a weight runs
out of issue slots before it runs out of bandwidth (the 2048 x 16384 gate_up: 5.4 SASS
instructions a code in fp32, half the H200's issue rate at 10.8 us). A 16-bit pair register
holds two codes, so one instruction of each kind serves two. An int32 of the layout holds the
codes of k = 8 i + j, j = 0..7 (bits 4j..4j+3) for one column; pair p = (j = p, j = p + 4)
sits at bits 4p and 16 + 4p, so one mask takes both:

    t = (w >> 8 (p // 2)) & (0x000F000F << 4 (p % 2)) | 0x64006400
            two fp16 1024 + q, or 1024 + 16 q for odd p (the mantissa's unit is 1 from 1024:
            exact, and its 10 bits hold the higher nibble too: one shift for four pairs)
    c = t * 2^-6 - (16 + z / 64),  or t * 2^-10 - (1 + z / 64) for odd p
            (q - z) / 64 exactly: one FMA, rounded once
    a = c * (x[8 i + p], x[8 i + p + 4]) + a        over p = 0..3: two lanes of four products

then the two lanes are widened to fp32 and added: one partial dot a word, which the caller
scales per group (and by 64 once at the end). fp16, not bf16, for bf16 models too: bf16's 8
bits made the output's error 3x the fp32 loop's (1.1% against 0.35% relative, random weights
and x, the emulation below in the interpreter); with fp16's 11 bits bf16 x is as accurate as
the fp32 loop (the output's own rounding dominates) and fp16 x gains about fp16's unit
(0.03-0.07% against 0.02%). x is rounded to fp16 (bf16 x: exact within fp16's range; beyond
+-65504 it saturates); the 1/64 keeps a lane's sum of four products (|q - z| <= 16) within
|x|; x below 2^-8 loses bits to fp16's subnormals, where its products are as small.

Per word (8 codes): 16 instructions (a shift, 4 LOP3, 8 HFMA2, 3 to widen and add) against
the fp32 loop's 24 and its zeros' term; bf16 x pays 3 a pair of x entries to convert, once a
row of the thread's tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

PAIR_SCALE = tl.constexpr(64.0)  # the dots come out divided by it

# $1 the codes, $2 -(16 + z / 64) twice, $3 -(1 + z / 64) twice, $4..$7 x's pairs (fp16x2);
# 0x2400 is fp16 2^-6, 0x1400 2^-10
_DOTS = tl.constexpr("""{
.reg .b32 w, t, c, a, s6, s10;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 s6, 0x24002400;
mov.b32 s10, 0x14001400;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
fma.rn.f16x2 c, t, s6, $2;
mul.rn.f16x2 a, c, $4;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 c, t, s10, $3;
fma.rn.f16x2 a, c, $5, a;
shr.u32 w, $1, 8;
lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA;
fma.rn.f16x2 c, t, s6, $2;
fma.rn.f16x2 a, c, $6, a;
lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 c, t, s10, $3;
fma.rn.f16x2 a, c, $7, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 flo, flo, fhi;
mov.b32 $0, flo;
}""")



def _bf16_pair(widen: str) -> tl.constexpr:
    """PTX for x's fp16 pair from bf16 words `$1`, `$2`: the half each `widen`s to fp32
    (exact), the two rounded to fp16 by one saturating conversion."""
    return tl.constexpr("{\n.reg .b32 lo, hi;\n" + widen.format("lo", "$1")
                        + widen.format("hi", "$2") + "cvt.rn.satfinite.f16x2.f32 $0, hi, lo;\n}")


# x's pair (x[p], x[p + 4]) from the int32 words holding them (`$1` x[p - p % 2 ..], `$2` four
# entries on), p even: their low halves, odd: their high halves. fp16: one byte permute.
_BF16_EVEN = _bf16_pair("shl.b32 {}, {}, 16;\n")
_BF16_ODD = _bf16_pair("and.b32 {}, {}, 0xFFFF0000;\n")
_FP16_EVEN = tl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")
_FP16_ODD = tl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")


@triton.jit
def zero_pairs(z):
    """What `pair_dots` subtracts for zeros `z` (int32 0..16), each twice as an fp16 pair in an
    int32, by their bits: -(16 + z / 64) is 0xCC00 | z (16's exponent, the mantissa's unit
    1/64), -(1 + z / 64) is 0xBC00 | z << 4 (1's exponent, the unit 1/1024), the second made
    from the first (one shift, one LOP3)."""
    even = z * 0x10001 | -872363008  # 0xCC00CC00
    odd = ((even << 4) & 0x0FF00FF0) | -1140802560  # 0xBC00BC00
    return even, odd


@triton.jit
def x_pair(low, high, ODD: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """The fp16 pair (x[8 r + p], x[8 r + p + 4]) as an int32, from the int32 words of x
    holding x[8 r + p - p % 2 ..] (`low`) and 4 entries on (`high`): p even takes their low
    halves, odd their high halves. bf16 x is rounded to fp16 (by PTX with ASM; else left
    bf16: `pair_dots`' emulation rounds it)."""
    if ASM:
        if IS_BF16:
            code: tl.constexpr = _BF16_ODD if ODD else _BF16_EVEN
        else:
            code: tl.constexpr = _FP16_ODD if ODD else _FP16_EVEN
        return tl.inline_asm_elementwise(code, "=r,r,r", [low, high], dtype=tl.int32,
                                         is_pure=True, pack=1)
    if ODD:
        return ((low >> 16) & 0xFFFF) | (high & -65536)
    else:
        return (low & 0xFFFF) | (high << 16)


@triton.jit
def _lane(bits, IS_BF16: tl.constexpr):
    """The 16-bit float in the low half of int32 `bits` rounded to fp16 (saturating), as fp32."""
    if IS_BF16:
        v = tl.clamp((bits << 16).to(tl.float32, bitcast=True), -65504.0, 65504.0)
        return v.to(tl.float16).to(tl.float32)
    else:
        return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _emulated_dots(packed, zp, x0, x1, x2, x3, IS_BF16: tl.constexpr):
    """`pair_dots`' arithmetic in Triton's own operations (the interpreter): each lane's
    products and sums rounded to fp16 as the packed FMAs round them (fp32 holds each exact
    product and sum before its one rounding, but for sums far apart in size)."""
    z = ((zp & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) + 16.0) * -64.0
    low = tl.zeros(packed.shape, dtype=tl.float32)
    high = tl.zeros(packed.shape, dtype=tl.float32)
    for p in tl.static_range(4):
        x = x0 if p == 0 else (x1 if p == 1 else (x2 if p == 2 else x3))
        c_low = (((packed >> (4 * p)) & 0xF).to(tl.float32) - z) * (1.0 / PAIR_SCALE)
        c_high = (((packed >> (16 + 4 * p)) & 0xF).to(tl.float32) - z) * (1.0 / PAIR_SCALE)
        low = (c_low * _lane(x, IS_BF16) + low).to(tl.float16).to(tl.float32)
        high = (c_high * _lane(x >> 16, IS_BF16) + high).to(tl.float16).to(tl.float32)
    return low + high


@triton.jit
def pair_dots(packed, zp, zq, x0, x1, x2, x3, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """fp32 sum over j of x_j (q_j - z) / 64 for each int32 of `packed` (8 codes), x_p the
    pair (x[p], x[p + 4]) from `x_pair`, zp / zq from `zero_pairs`. ASM: by inline PTX
    (CUDA), else emulated by Triton's operations."""
    if ASM:
        dots = tl.inline_asm_elementwise(_DOTS, "=r,r,r,r,r,r,r,r",
                                         [packed, zp, zq, x0, x1, x2, x3], dtype=tl.int32,
                                         is_pure=True, pack=1)
        return dots.to(tl.float32, bitcast=True)
    else:
        return _emulated_dots(packed, zp, x0, x1, x2, x3, IS_BF16)
