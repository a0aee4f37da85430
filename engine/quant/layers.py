"""Modules holding GGUF weights kept quantized: the linear layers and the (tied) embedding.

They stand where `nn.Linear` / `RowParallelLinear` / `VocabParallelEmbedding` stand in a
Llama-family model (engine/quant/factories.py builds them when `is_gguf_quantized(config)`), with
one rank only. Each has an empty `weight` parameter (its dtype: the model's, set by `.to`)
whose `weight_loader` takes a `QuantWeight` (or a dense tensor for
F32/F16 GGUF tensors) for rows `rows` of the whole matrix. Fused q/k/v and gate/up arrive as
row ranges; once every row is in, the kernels are built and the unpacked codes dropped.
Adjacent shards of the same format share one kernel; others get their own, outputs concatenated.

The kernels compute with activations in `activation_dtype` (the config's quantization_config
says it; default the model's dtype): bfloat16 takes torch's packed int4 kernels, the residual
stream, norms, attention and KV cache staying in the model's dtype; float32 de-quantizes
exactly (kernels.py). On CUDA (the layer's `weight` there when it loads) the kernels are
engine/quant/gguf_cuda.py's Triton GEMMs, in the model's dtype, and lookups de-quantize the
rows they gather from the lm_head kernel's codes (the table is held once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.blocks import QuantWeight, dequantize
from engine.quant.gguf_cuda import CudaKernel, make_cuda_kernel
from engine.quant.int4_dense import DENSE_MIN_TOKENS
from engine.quant.kernels import (
    DenseKernel,
    DequantKernel,
    Int4PackKernel,
    Kernel,
    NibbleKernel,
    SplitInt8Kernel,
    make_kernel,
)
from engine.token_choice import top_ids
from kernels import cpu_nibble

# activations (and for torch's kernels, outputs) rounded to bf16
_ROUNDING_KERNELS = (NibbleKernel, Int4PackKernel, SplitInt8Kernel)


Part = QuantWeight | torch.Tensor


def _concat(parts: list[Part]) -> Part:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    return QuantWeight(
        parts[0].qtype,
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        bias,
        parts[0].group,
    )


def _same_kind(a: Part, b: Part) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return (a.qtype, a.group, a.bias is None) == (b.qtype, b.group, b.bias is None)


class _RowCollector:
    """Rows of a [out, in] matrix arriving in pieces; `complete()` once all are in."""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.shape = (out_features, in_features)
        self.parts: dict[int, Part] = {}

    def add(self, rows: slice, part: Part, name: str) -> None:
        start, stop, _ = rows.indices(self.shape[0])
        if tuple(part.shape) != (stop - start, self.shape[1]):
            raise ValueError(
                f"weight {name!r} has shape {tuple(part.shape)}, expected "
                f"{(stop - start, self.shape[1])}"
            )
        self.parts[start] = part

    def complete(self) -> bool:
        return sum(p.shape[0] for p in self.parts.values()) == self.shape[0]

    def segments(self) -> list[Part]:
        """The parts in row order, adjacent ones of one kind concatenated."""
        merged: list[list[Part]] = []
        for start in sorted(self.parts):
            part = self.parts[start]
            if merged and _same_kind(merged[-1][-1], part):
                merged[-1].append(part)
            else:
                merged.append([part])
        self.parts = {}
        return [_concat(group) for group in merged]


class GGUFLinear(nn.Module):
    """y = x W^T (+ b), W [out, in] in GGUF blocks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        activation_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation_dtype = activation_dtype
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.loads_shards = True  # takes fused q/k/v and gate/up rows itself
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._rows = _RowCollector(out_features, in_features)
        self.kernels: list[Kernel | CudaKernel] = []

    def _load(self, param: nn.Parameter, rows: slice, tensor: Part, name: str) -> None:
        self._rows.add(rows, tensor, name)
        if self._rows.complete():
            self.kernels = [_kernel(p, self.weight, self.activation_dtype)
                            for p in self._rows.segments()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if len(self.kernels) == 1:
            y = self.kernels[0](x)
        else:
            y = torch.cat([k(x) for k in self.kernels], dim=-1)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return sum(k.nbytes() for k in self.kernels)

    # The decode layer's fusions (engine/models/tp_layers.py calls these where a layer defines
    # them): on the CPU, a norm or SwiGLU and this projection in one C call
    # (kernels/cpu_nibble.py `Gemm.rmsnorm` / `silu_mul`) where one NibbleKernel holds the
    # weight and the rows are fp32; None elsewhere, and the caller runs the plain ops.

    def rmsnorm_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (self(norm(x + residual)), x + residual)
        gemm = self._fusable(x)
        if gemm is None or not gemm.takes_rows(x, residual, norm.weight):
            return None
        y, r = gemm.rmsnorm(x, residual, norm.weight, norm.eps)
        return (y if self.bias is None else y + self.bias), r

    def silu_mul_linear(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) for gate_up [T, 2 * in_features]."""
        gemm = self._fusable(gate_up)
        if gemm is None or not gemm.takes_rows(gate_up):
            return None
        y = gemm.silu_mul(gate_up)
        return y if self.bias is None else y + self.bias

    @property
    def nibble_gemm(self) -> cpu_nibble.Gemm | None:
        """The C GEMM holding the whole weight (one NibbleKernel), else None."""
        kernels = self.kernels
        if len(kernels) != 1 or not isinstance(kernels[0], NibbleKernel):
            return None
        return kernels[0].gemm

    def _fusable(self, x: torch.Tensor) -> cpu_nibble.Gemm | None:
        if x.dim() != 2 or x.shape[0] >= DENSE_MIN_TOKENS:
            return None
        return self.nibble_gemm


class GGUFEmbedding(nn.Module):
    """Token embeddings [V, hidden] in GGUF blocks. A lookup de-quantizes the rows it gathers,
    exactly. `logits` (the tied lm_head) reads the quantized table too, no de-quantized copy:
    with bf16 kernels and fp32 hidden states it refines the `REFINE` highest logits of each row
    exactly in fp32 from the table's codes, so that greedy choices do not turn on bf16
    rounding (the int4 kernels round their outputs to bf16: ~0.4% of a logit). With the
    split-int8 lm_head kernel, lookups read the codes back from its packed nibbles: the table
    is held once."""

    REFINE = 8

    def __init__(
        self, vocab_size: int, hidden_size: int, activation_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.activation_dtype = activation_dtype
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.weight.weight_loader = self._load
        self.table: Part | None = None  # codes dropped (empty) when the head holds them;
        # None on CUDA once loaded quantized: lookups read the head's codes
        self.head: Kernel | CudaKernel | None = None

    def _load(self, param: nn.Parameter, rows: slice, tensor: Part, name: str) -> None:
        if tuple(tensor.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{(self.vocab_size, self.hidden_size)}"
            )
        dtype = self.weight.dtype
        if uses_cuda_kernels(self.weight):
            self.head = _kernel(tensor, self.weight, self.activation_dtype)
            is_dense = isinstance(tensor, torch.Tensor)
            self.table = self.head.weight if is_dense else None
            return
        self.table = tensor.to(dtype) if isinstance(tensor, torch.Tensor) else tensor
        self.head = make_kernel(self.table, self.activation_dtype or dtype)
        if isinstance(self.head, (SplitInt8Kernel, NibbleKernel)) and _codes_read_back(
                self.head, self.table):
            if isinstance(self.head, NibbleKernel) and _scales_read_back(self.head, self.table):
                self.table.scale = self.table.scale.new_empty((0, *self.table.scale.shape[1:]))
            # a fresh empty tensor: a [:0] view would keep the whole codes' storage alive
            self.table.codes = self.table.codes.new_empty((0, *self.table.codes.shape[1:]))

    def _rows(self, ids: torch.Tensor) -> QuantWeight:
        table = self.table
        if table.codes.shape[0] == self.vocab_size:
            return table.rows(ids)
        scale = table.scale[ids] if table.scale.shape[0] else self.head.scales(ids)
        return QuantWeight(table.qtype, self.head.codes(ids), scale, None, table.group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if isinstance(self.table, torch.Tensor):
            return F.embedding(ids, self.table)
        if self.table is None:
            return self.head.rows(ids, self.weight.dtype)
        return dequantize(self._rows(ids), self.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        logits = self.head(hidden)
        rounded = isinstance(self.head, _ROUNDING_KERNELS) and hidden.dtype == torch.float32
        if isinstance(self.table, QuantWeight) and rounded:
            top = top_ids(logits, min(self.REFINE, self.vocab_size))  # [N, R]
            rows = dequantize(self._rows(top.flatten()))  # [N * R, hidden] fp32
            exact = (rows.view(*top.shape, -1) @ hidden.unsqueeze(-1)).squeeze(-1)
            logits = logits.scatter(-1, top, exact)
        return logits

    def weight_bytes(self) -> int:
        """Bytes held: the table the lookups read, plus the lm_head kernel's own copy if any."""
        table, head = self.table, self.head
        if table is None:
            return head.nbytes()
        if isinstance(table, torch.Tensor):
            return table.nbytes
        held = table.codes.nbytes + table.scale.nbytes
        held += 0 if table.bias is None else table.bias.nbytes
        return held if isinstance(head, (DequantKernel, DenseKernel)) else held + head.nbytes()


def uses_cuda_kernels(weight: nn.Parameter) -> bool:
    """Whether a layer whose `weight` this is builds engine/quant/gguf_cuda.py's kernels (the
    tests also take them on the CPU, under the Triton interpreter)."""
    return weight.device.type == "cuda"


def _kernel(part: Part, weight: nn.Parameter, activation: torch.dtype | None
            ) -> Kernel | CudaKernel:
    """The CPU kernel (activations in `activation`, default the model's dtype) or, with the
    layer's `weight` on CUDA, the Triton one (the model's dtype)."""
    if uses_cuda_kernels(weight):
        return make_cuda_kernel(part, weight.dtype, weight.device)
    return make_kernel(part, activation or weight.dtype)


def _codes_read_back(head: SplitInt8Kernel | NibbleKernel, table: QuantWeight) -> bool:
    """Whether the head's packed codes give back the table's (checked on the first and last
    blocks and a spread of rows)."""
    if not head.codes_readable() or table.shape[0] < 64:
        return False
    ids = _spread(table.shape[0])
    return torch.equal(head.codes(ids), table.codes[ids])


def _scales_read_back(head: NibbleKernel, table: QuantWeight) -> bool:
    """Whether the head's packed scales give back the table's exactly (the same rows)."""
    ids = _spread(table.shape[0])
    return table.bias is None and torch.equal(head.scales(ids), table.scale[ids].float())


def _spread(rows: int) -> torch.Tensor:
    return torch.cat([torch.arange(64), torch.arange(rows - 64, rows), torch.arange(0, rows, 997)])
