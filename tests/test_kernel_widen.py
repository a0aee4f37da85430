"""kernels/widen.py: the bit-pattern widenings equal the conversions they replace, on every
code (run under the Triton interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.widen import nibble_times, widen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _widen_kernel(w_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out_ptr + r, widen(tl.load(w_ptr + r)))


@triton.jit
def _nibbles_kernel(q_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    packed = tl.load(q_ptr + r)
    high = (packed >> 20) & 0xFFF
    for j in tl.static_range(8):
        codes = nibble_times(packed if j < 5 else high, j % 5) * 2.0 ** (-4 * (j % 5))
        tl.store(out_ptr + j * N + r, codes)


def test_every_e4m3_code_widens_to_its_value() -> None:
    w = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    _widen_kernel[(1,)](w, out, N=256)
    ref = w.float()
    finite = ~torch.isnan(ref)  # 0x7f and 0xff: e4m3fn's NaNs
    assert torch.equal(out[finite], ref[finite])  # subnormals and signed zeros included
    assert torch.equal(out[~finite].cpu(), torch.tensor([480.0, -480.0]))


def test_other_dtypes_widen_as_a_conversion() -> None:
    w = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = torch.empty(64, device=DEVICE)
    _widen_kernel[(1,)](w.to(DEVICE), out, N=64)
    assert torch.equal(out.cpu(), w.float())


def test_every_nibble_of_a_word_comes_out_as_its_code() -> None:
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (128,), generator=gen, dtype=torch.int32)
    words[:2] = torch.tensor([-1, 0], dtype=torch.int32)  # all codes 15, all 0
    out = torch.empty(8, 128, device=DEVICE)
    _nibbles_kernel[(1,)](words.to(DEVICE), out, N=128)
    expect = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)]).float()
    assert torch.equal(out.cpu(), expect)
