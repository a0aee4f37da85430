"""`pdserve bench gpu`, parts 1 and 2: the machine's ceilings, and each kernel against its peer.

NOTE: timing. On CUDA, triton's `do_bench` with `return_mode="median"`: CUDA events around each
call, as many calls as fit in ~100 ms, and the L2 cache flushed (a 256 MB write) before each call,
so an input that would fit in L2 is still read from HBM and the host launch overhead hides behind
the flush. On the CPU a host timer around synchronous calls: there these parts only show that the
code runs (tiny shapes; the Triton kernels through its interpreter, TRITON_INTERPRET=1).

Every comparison times the fastest of the peer's variants (each as a user would call torch) and
our kernel on the same tensors, and reports the relative L2 error of ours against that peer.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.report import median_wall_ms


@dataclass(frozen=True)
class KernelSizes:
    copy_mib: int = 1024  # source tensor of the copy; the copy moves twice this
    matmul_n: int = 8192  # bf16 [n, n] @ [n, n]
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    block_size: int = 16
    decode: tuple[tuple[int, int], ...] = ((64, 1024), (256, 1024), (32, 8192))  # (B, context)
    prefill: tuple[int, int] = (4, 2048)  # (sequences, tokens each)
    fused_tokens: tuple[int, ...] = (256, 8192)  # decode-ish and prefill-ish steps
    hidden: int = 2048
    intermediate: int = 8192
    max_positions: int = 2048
    rope_theta: float = 500000.0


SMALL_KERNELS = KernelSizes(
    copy_mib=16, matmul_n=256, heads=8, kv_heads=2, head_dim=16, block_size=16,
    decode=((2, 32), (3, 32), (2, 64)), prefill=(2, 32), fused_tokens=(4, 16), hidden=64,
    intermediate=128, max_positions=64,
)

Tensors = torch.Tensor | tuple[torch.Tensor, ...]


# ---- timing --------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], device: torch.device, cpu_reps: int = 3) -> float:
    """Median milliseconds of one `fn()` (see the module NOTE)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return median_wall_ms(fn, cpu_reps)


def rel_err(ours: Tensors, peer: Tensors) -> float:
    """||ours - peer|| / ||peer|| over all elements, in fp32."""
    a = torch.cat([t.float().flatten() for t in (ours if isinstance(ours, tuple) else (ours,))])
    b = torch.cat([t.float().flatten() for t in (peer if isinstance(peer, tuple) else (peer,))])
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _snapshot(out: Tensors) -> Tensors:
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def compare(
    ours: Callable[[], Tensors], peers: dict[str, Callable[[], Tensors]], work: float,
    unit: tuple[str, float], device: torch.device,
    peer_layout: Callable[[Any], Tensors] | None = None,
) -> dict[str, Any]:
    """Time every peer variant (one that raises is reported, not fatal) and our kernel; rates are
    `work` (bytes or FLOPs) per second in `unit` = (name, divisor). `peer_layout` turns a peer's
    output into ours for the error."""
    peer_ms, peer_out, failed = {}, {}, {}
    for label, fn in peers.items():
        try:
            peer_out[label] = _snapshot(fn())  # in-place peers change it again when timed
            peer_ms[label] = time_ms(fn, device)
        except RuntimeError as exc:
            failed[label] = str(exc).splitlines()[0][:200]
    if not peer_ms:
        raise RuntimeError(f"every peer variant failed: {failed}")
    best = min(peer_ms, key=peer_ms.__getitem__)
    name, divisor = unit
    result: dict[str, Any] = {
        "unit": name, "peer": best, "peer_ms": peer_ms[best],
        "peer_rate": work / (peer_ms[best] * 1e-3) / divisor,
        "peer_variants_ms": peer_ms, "peer_failures": failed,
    }
    try:
        out = _snapshot(ours())
        ours_ms = time_ms(ours, device)
    except Exception as exc:  # a kernel still being written: keep the peer's figure
        return {**result, "ours_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    peer = peer_out[best] if peer_layout is None else peer_layout(peer_out[best])
    return {
        **result, "ours_ms": ours_ms, "ours_rate": work / (ours_ms * 1e-3) / divisor,
        "ratio": peer_ms[best] / ours_ms, "rel_err": rel_err(out, peer),
    }


# ---- part 1: ceilings ----------------------------------------------------------------------------
def measure_ceilings(device: torch.device, dtype: torch.dtype, sizes: KernelSizes) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and a square matmul's FLOP rate."""
    moved, copy_ms = 2 * (sizes.copy_mib << 20), _copy_ms(sizes.copy_mib << 20, device)
    n, gen = sizes.matmul_n, torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    c = torch.empty_like(a)
    mm_ms = time_ms(lambda: torch.mm(a, b, out=c), device)
    return {
        "copy_bytes": moved, "copy_ms": copy_ms, "copy_bytes_per_s": moved / (copy_ms * 1e-3),
        "matmul_n": n, "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_ms": mm_ms,
        "matmul_flops_per_s": 2 * n**3 / (mm_ms * 1e-3),
    }


def _copy_ms(nbytes: int, device: torch.device) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device)


# ---- part 2: kernels -----------------------------------------------------------------------------
def kernels_unavailable(device: torch.device) -> str | None:
    """Why the kernel part cannot run here, or None."""
    try:
        import kernels.paged_decode_attention  # noqa: F401
    except ImportError as exc:
        return f"kernels not importable ({exc})"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels need CUDA (or TRITON_INTERPRET=1 at tiny sizes, e.g. --small)"
    return None


def measure_kernels(device: torch.device, dtype: torch.dtype, sizes: KernelSizes) -> dict:
    """Decode and prefill attention against SDPA; the small fused kernels against eager torch."""
    gen = torch.Generator(device=device).manual_seed(0)
    args = sizes, device, dtype, gen
    seqs, length = sizes.prefill
    return {
        "decode_attention": [row for b, n in sizes.decode
                             for row in _rows(decode_case, b, n, *args, batch=b, context=n)],
        "prefill_attention": _rows(prefill_case, seqs, length, *args, sequences=seqs,
                                   tokens_each=length),
        "fused": [row for t in sizes.fused_tokens
                  for row in _rows(fused_cases, t, *args, kernel="fused", tokens=t)],
    }


def _rows(fn: Callable[..., Any], *args: Any, **labels: Any) -> list[dict[str, Any]]:
    """`fn(*args)` as a list of rows, or one row of `labels` and the error."""
    try:
        result = fn(*args)
    except Exception as exc:  # one shape failing must not lose the others
        traceback.print_exc()
        return [{**labels, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
    return result if isinstance(result, list) else [result]


def _paged_copy(
    kv: torch.Tensor, sizes: KernelSizes, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [2, S, L, Hkv, D] -> (cache [2, num_blocks, block_size, Hkv, D], block tables
    [S, L / block_size] int32): the same tokens in blocks placed by a random permutation."""
    _, seqs, length, kv_heads, head_dim = kv.shape
    if length % sizes.block_size:
        raise ValueError(f"context {length} is not a multiple of block_size {sizes.block_size}")
    per_seq = length // sizes.block_size
    tables = torch.randperm(seqs * per_seq, generator=gen, device=kv.device).view(seqs, per_seq)
    cache = torch.empty(2, seqs * per_seq, sizes.block_size, kv_heads, head_dim,
                        dtype=kv.dtype, device=kv.device)
    cache[:, tables.flatten()] = kv.reshape(2, seqs * per_seq, sizes.block_size, kv_heads, -1)
    return cache, tables.int()


def decode_case(
    batch: int, context: int, sizes: KernelSizes, device: torch.device, dtype: torch.dtype,
    gen: torch.Generator,
) -> dict[str, Any]:
    """One query token per sequence over `context` cached tokens, in TB/s of K, V, q and out."""
    from kernels.paged_decode_attention import default_num_splits, paged_decode_attention

    h, hkv, d = sizes.heads, sizes.kv_heads, sizes.head_dim
    kv = torch.randn(2, batch, context, hkv, d, generator=gen, device=device, dtype=dtype)
    cache, tables = _paged_copy(kv, sizes, gen)
    k, v = kv.transpose(2, 3).contiguous().unbind(0)  # [B, Hkv, L, D] each, as SDPA wants
    del kv
    q = torch.randn(batch, h, d, generator=gen, device=device, dtype=dtype)  # [B, H, D]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = d**-0.5
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else os.cpu_count() or 1
    splits = default_num_splits(batch, hkv, context, sms)
    peers = {
        "sdpa_enable_gqa": lambda: F.scaled_dot_product_attention(
            q.view(batch, h, 1, d), k, v, scale=scale, enable_gqa=True),
        "sdpa_grouped_q": lambda: F.scaled_dot_product_attention(  # q rows of one KV head
            q.view(batch, hkv, h // hkv, d), k, v, scale=scale),
    }
    ours = lambda: paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, scale,
                                          num_splits=splits)
    elem = q.element_size()
    work = 2 * batch * context * hkv * d * elem + 2 * batch * h * d * elem
    row = compare(ours, peers, work, ("TB/s", 1e12), device,
                  lambda out: out.reshape(batch, h, d))
    return {"batch": batch, "context": context, "num_splits": splits, **row}


def prefill_case(
    seqs: int, length: int, sizes: KernelSizes, device: torch.device, dtype: torch.dtype,
    gen: torch.Generator,
) -> dict[str, Any]:
    """Causal attention over `seqs` new sequences of `length` tokens, in TFLOP/s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.kv_store import store_kv
    from kernels.prefill_attention import prefill_attention

    h, hkv, d, tokens = sizes.heads, sizes.kv_heads, sizes.head_dim, seqs * length
    q = torch.randn(tokens, h, d, generator=gen, device=device, dtype=dtype)  # [T, H, D]
    kv = torch.randn(2, tokens, hkv, d, generator=gen, device=device, dtype=dtype)
    cache, tables = _paged_copy(torch.zeros_like(kv).view(2, seqs, length, hkv, d), sizes, gen)
    pos = torch.arange(length, device=device)
    slots = tables.long()[:, pos // sizes.block_size] * sizes.block_size + pos % sizes.block_size
    store_kv(kv[0], kv[1], cache[0], cache[1], slots.flatten())  # [T] int64 slot per token
    starts = torch.arange(0, tokens + 1, length, dtype=torch.int32, device=device)  # [S + 1]
    seq_lens = torch.full((seqs,), length, dtype=torch.int32, device=device)
    qs = q.view(seqs, length, h, d).transpose(1, 2).contiguous()  # [S, H, L, D]
    ks, vs = kv.view(2, seqs, length, hkv, d).transpose(2, 3).contiguous().unbind(0)
    ks_wide, vs_wide = ks.repeat_interleave(h // hkv, 1), vs.repeat_interleave(h // hkv, 1)
    scale = d**-0.5

    def flash(k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)

    peers = {"flash_enable_gqa": lambda: flash(ks, vs, True),
             "flash_expanded_kv": lambda: flash(ks_wide, vs_wide, False)}
    ours = lambda: prefill_attention(q, cache[0], cache[1], tables, starts, seq_lens, scale,
                                     length)
    flops = 4 * seqs * h * d * length * length / 2
    row = compare(ours, peers, flops, ("TFLOP/s", 1e12), device,
                  lambda out: out.transpose(1, 2).reshape(tokens, h, d))
    return {"sequences": seqs, "tokens_each": length, **row}


# ---- the small fused kernels and their eager peers ----------------------------------------------
def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_eager(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_eager(summed, weight, eps), summed


def silu_and_mul_eager(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_eager(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like the kernel: x1, x2 halves -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = q.shape[-1] // 2
    cos_sin = cache[positions].to(q.dtype)  # [T, D]: cos | sin
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].clone(), x[..., half:]
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half:] = x2 * cos + x1 * sin
    return q, k


def fused_cases(
    tokens: int, sizes: KernelSizes, device: torch.device, dtype: torch.dtype,
    gen: torch.Generator,
) -> list[dict[str, Any]]:
    """RMSNorm (alone and with the residual add), SiLU-and-mul and rotary at `tokens` tokens, in
    GB/s of the bytes each must move."""
    from kernels.rmsnorm import rms_norm
    from kernels.rotary import cos_sin_cache, rotary_embedding
    from kernels.silu_mul import silu_and_mul

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    hid, inter, h, hkv, d = sizes.hidden, sizes.intermediate, sizes.heads, sizes.kv_heads, \
        sizes.head_dim
    x, res, w = randn(tokens, hid), randn(tokens, hid), randn(hid)
    gate_up = randn(tokens, 2 * inter)
    q, k = randn(tokens, h, d), randn(tokens, hkv, d)
    q2, k2 = q.clone(), k.clone()  # each side rotates its own copy in place, again every call
    positions = torch.randint(sizes.max_positions, (tokens,), generator=gen, device=device)
    inv_freq = 1.0 / sizes.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    table = cos_sin_cache(inv_freq, sizes.max_positions, device)  # [max_positions, D] fp32

    def rotary() -> tuple[torch.Tensor, torch.Tensor]:
        rotary_embedding(positions, q, k, table)
        return q, k

    eps, elem = 1e-5, x.element_size()
    cases = {  # name: (ours, eager, bytes moved)
        "rms_norm": (lambda: rms_norm(x, w, eps), lambda: rms_norm_eager(x, w, eps),
                     (2 * tokens + 1) * hid * elem),
        "rms_norm_residual": (lambda: rms_norm(x, w, eps, residual=res),
                              lambda: add_rms_norm_eager(x, res, w, eps),
                              (4 * tokens + 1) * hid * elem),
        "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: silu_and_mul_eager(gate_up),
                         3 * tokens * inter * elem),
        "rotary": (rotary, lambda: rotary_eager(positions, q2, k2, table),
                   2 * tokens * (h + hkv) * d * elem + tokens * (d * 4 + 8)),
    }
    return [{"kernel": name, "tokens": tokens,
             **compare(ours, {"eager": eager}, work, ("GB/s", 1e9), device)}
            for name, (ours, eager, work) in cases.items()]
