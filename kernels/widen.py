"""Weights widened to fp32 in registers, by bit operations where the hardware's conversion is
the bound: the GEMV kernels' inner loops (kernels/gemv.py and its fused forms, fp8_gemv.py).

NOTE: a batch-1 GEMV does one multiply-add per weight, so the instructions that turn a stored
weight into fp32 set its speed once they outnumber it. On Hopper, Triton widens float8_e4m3fn
with a conversion pair (F2FP e4m3x2 -> f16x2, then f16 -> f32), both on the 16-lane conversion
path: an H200's FP8 gate_up GEMV streamed 2.45 TB/s where bf16's reached 3.3. The same value
comes out of integer and fp32 instructions, which run 4-8x wider:

    e4m3 byte  s eeee mmm  (bias 7)           fp32  s eeeeeeee mmm...  (bias 127)
    bits = sign_extend(byte) << 20  keeps  s at bit 31 (and copies of it at 30..27),
                                           eeee mmm at 26..20
    bits & 0x87F00000               clears the copies: the fp32 whose exponent field is eeee,
                                    i.e. the weight times 2^(7 - 127)
    widened = float(bits) * 2^120   exact, subnormals too (an e4m3 subnormal, eeee = 0, is an
                                    fp32 subnormal of the same scaled value; the multiply does
                                    not flush it: Triton emits FMUL without .FTZ)

e4m3fn's NaN (s 1111 111) becomes 480 instead: weights are finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_FIELDS = tl.constexpr(-2014314496)  # 0x87F00000 as an int32: sign, exponent, mantissa
E4M3_UNBIAS = tl.constexpr(1.329227995784916e36)  # 2^120 = 2^(127 - 7)


@triton.jit
def widen(w):
    """`w` as fp32: float8_e4m3fn by the bit operations above, any other dtype as `.to`."""
    if w.dtype == tl.float8e4nv:
        bits = (w.to(tl.int8, bitcast=True).to(tl.int32) << 20) & E4M3_FIELDS
        return bits.to(tl.float32, bitcast=True) * E4M3_UNBIAS
    else:
        return w.to(tl.float32)


MANTISSA_ONE = tl.constexpr(0x4B000000)  # the fp32 2^23: its mantissa's last bit weighs 1
TWO_23 = tl.constexpr(8388608.0)


@triton.jit
def nibble_times(packed, j: tl.constexpr):
    """The 4-bit codes at bits 4j..4j+3 of each int32 of `packed` (j <= 4), times 2^(4j), as
    fp32, without a conversion instruction (I2F is on the 16-lane path too):

        float(bits(2^23) | (packed & (15 << 4j))) - 2^23  =  q * 2^(4j)    exactly (< 2^23)

    one LOP3 and one FADD a code; the caller scales what multiplies it by 2^(-4j), and moves
    nibbles 5..7 down first (one shift for the three)."""
    field = (packed & (0xF << (4 * j))) | MANTISSA_ONE
    return field.to(tl.float32, bitcast=True) - TWO_23
