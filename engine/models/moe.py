"""Mixture-of-experts pieces shared by the MoE families: the router, the stacked experts, the
sparse block (router + experts + optional shared expert) and the loader of HF expert tensors.

    x [T, H] ─▶ router ─▶ top-k (weights [T, K], expert ids [T, K])
             └▶ experts: for each (token, k): down_e(silu(gate_e(x)) * up_e(x)) * weight
                         summed over k  ─▶ [T, H]   (+ sigmoid(gate_s(x)) * shared(x))

The experts are stacked: `w13 [E, 2*I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]`. On CUDA one fused Triton path runs them all (kernels/fused_moe.py); on the CPU a
loop over the experts that received tokens, in transformers' op order, so fp32 matches HF.

Tensor parallelism: without expert parallelism every rank holds its slice of every expert's
intermediate rows (like LlamaMLP: gate/up column-parallel, down row-parallel) and the summed
output is all-reduced. With it (`expert_parallel`), rank r holds experts even_split(E, tp, r)
whole; every rank already has every token (the residual stream is whole), so each computes its
experts' share and the same all-reduce brings the shares together. The router is replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import SingleRank
from engine.distributed.sharding import even_split
from engine.lazy_kernels import has_triton, kernel
from engine.models.layers import use_fused_kernels
from engine.models.llama import LlamaMLP

_fused_moe = kernel("fused_moe", "fused_moe") if has_triton() else None

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# HF per-expert tensors: (prefix).experts.(expert).(part).weight; Mixtral names w1/w3/w2
EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# transformers >= 5 in-memory names: every expert in one tensor
STACKED_RE = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
PARTS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


# ---- router --------------------------------------------------------------------------------------
def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] fp32, [T, K] int64)
    """Mixtral / Qwen-MoE: softmax over all experts in fp32, keep the top k, optionally
    renormalise them to sum to 1."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GraniteMoE: the top k logits first, then a softmax over those k only."""
    top_logits, ids = logits.float().topk(top_k, dim=-1)  # [T, K]
    return torch.softmax(top_logits, dim=-1), ids


# ---- experts -------------------------------------------------------------------------------------
def moe_loop(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2*I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]; ids outside [0, E) (other ranks' experts) are skipped
) -> torch.Tensor:  # [T, H]
    """The reference path: one pass per expert that received tokens, in ascending expert order
    (transformers' loop; syncs with the host, so the CPU's path)."""
    out = torch.zeros_like(x)
    local = (topk_ids >= 0) & (topk_ids < w13.shape[0])
    for expert in torch.unique(topk_ids[local]).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        h = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        h = h * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """This rank's experts, stacked. `forward` returns the whole (all-reduced) MoE output."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: SingleRank,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp, self.num_experts, self.full_intermediate = tp, num_experts, intermediate_size
        ranks, rank = tp.world_size, tp.rank
        if expert_parallel and num_experts < ranks:
            raise ValueError(
                f"expert parallelism needs >= 1 expert per rank: {num_experts} "
                f"experts, {ranks} ranks"
            )
        self.experts = (
            even_split(num_experts, ranks, rank) if expert_parallel else range(num_experts)
        )
        self.rows = (
            range(intermediate_size)
            if expert_parallel
            else even_split(intermediate_size, ranks, rank)
        )
        e, i = len(self.experts), len(self.rows)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size))  # [E_local, 2*I_local, H]
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i))  # [E_local, H, I_local]
        self.loaded: set[tuple[int, str]] = set()  # (local expert, part) since the last load

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K]
        topk_ids: torch.Tensor,  # [T, K] global expert ids
    ) -> torch.Tensor:  # [T, H]
        ids = topk_ids - self.experts.start if len(self.experts) < self.num_experts else topk_ids
        if _fused_moe is not None and use_fused_kernels(x):
            out = _fused_moe(x, self.w13, self.w2, topk_weights, ids)
        else:
            out = moe_loop(x, self.w13, self.w2, topk_weights, ids)
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)

    # ---- loading ---------------------------------------------------------------------------------
    def load_expert(self, expert: int, part: str, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's part of HF expert `expert`'s gate [I, H], up [I, H] or down [H, I]
        (nothing when another rank holds that expert)."""
        if expert not in self.experts:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"weight {name!r}: expert {expert} of {self.num_experts}")
            return
        local, i = expert - self.experts.start, len(self.rows)
        full, r = self.full_intermediate, self.rows
        if part == "down":
            _copy(self.w2.data[local], _narrow(tensor, 1, r, full, name), name)
        else:
            half = slice(0, i) if part == "gate" else slice(i, 2 * i)
            _copy(self.w13.data[local, half], _narrow(tensor, 0, r, full, name), name)
        self.loaded.add((local, part))

    def load_stacked(self, part: str, tensor: torch.Tensor, name: str) -> None:
        """Every expert at once: gate_up [E, 2I, H] (gate rows then up rows) or down [E, H, I]."""
        if tensor.shape[0] != self.num_experts:
            raise ValueError(
                f"weight {name!r} has {tensor.shape[0]} experts, expected {self.num_experts}"
            )
        for expert in self.experts:
            if part == "down":
                self.load_expert(expert, "down", tensor[expert], name)
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                self.load_expert(expert, "gate", gate, name)
                self.load_expert(expert, "up", up, name)

    def missing(self) -> list[str]:
        return [
            f"expert {e}.{p}"
            for e in range(len(self.experts))
            for p in ("gate", "up", "down")
            if (e, p) not in self.loaded
        ]


def _narrow(t: torch.Tensor, dim: int, part: range, full: int, name: str) -> torch.Tensor:
    if t.shape[dim] != full:
        raise ValueError(
            f"weight {name!r} has {t.shape[dim]} entries along dim {dim}, expected {full}"
        )
    return t.narrow(dim, part.start, len(part))


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(tensor)


# ---- the sparse block ----------------------------------------------------------------------------
class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated), experts, and Qwen2-MoE's shared expert when
    `shared_intermediate_size` > 0. `routing`: "softmax_topk" or "topk_softmax" (GraniteMoE);
    `fp32_weights`: keep the routing weights in fp32 (Mixtral) or cast them to x's dtype."""

    def __init__(
        self,
        config: PretrainedConfig,
        tp: SingleRank,
        *,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool = True,
        routing: str = "softmax_topk",
        fp32_weights: bool = False,
        shared_intermediate_size: int = 0,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        if routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown routing {routing!r}")
        self.top_k, self.renormalize, self.routing = top_k, renormalize, routing
        self.fp32_weights = fp32_weights
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            num_experts, config.hidden_size, intermediate_size, tp, expert_parallel
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size > 0:
            self.shared_expert = LlamaMLP(config, tp, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, K] each
        logits = self.gate(x)  # [T, E]
        if self.routing == "topk_softmax":
            weights, ids = topk_softmax(logits, self.top_k)
        else:
            weights, ids = softmax_topk(logits, self.top_k, self.renormalize)
        return (weights if self.fp32_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer is sparse, but `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


# ---- weight loading ------------------------------------------------------------------------------
class MoEWeightsMixin:
    """Put before LlamaForCausalLM in the bases: expert tensors go to their FusedMoE (per
    expert, or stacked), everything else through Llama's loader. `HF_RENAMES`: (HF name piece,
    ours) pairs applied first (e.g. Mixtral's `.block_sparse_moe.` is our `.mlp.`)."""

    HF_RENAMES: tuple[tuple[str, str], ...] = ()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for module in self._fused_moes().values():
            module.loaded.clear()
        super().load_weights(self._load_experts(weights))  # type: ignore[misc]

    def _load_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Load the expert tensors, yield the others (renamed)."""
        moes = self._fused_moes()
        for hf_name, tensor in weights:
            name = hf_name
            for hf_piece, piece in self.HF_RENAMES:
                name = name.replace(hf_piece, piece)
            if m := EXPERT_RE.match(name):
                self._experts(moes, m[1], hf_name).load_expert(
                    int(m[2]), PARTS[m[3]], tensor, hf_name
                )
            elif m := STACKED_RE.match(name):
                part = "gate_up" if m[2] == "gate_up_proj" else "down"
                self._experts(moes, m[1], hf_name).load_stacked(part, tensor, hf_name)
            else:
                yield name, tensor

    @staticmethod
    def _experts(moes: dict[str, FusedMoE], prefix: str, hf_name: str) -> FusedMoE:
        if prefix not in moes:
            raise ValueError(f"unknown weight {hf_name!r}")
        return moes[prefix]

    def _fused_moes(self) -> dict[str, FusedMoE]:
        return {n: m for n, m in self.named_modules() if isinstance(m, FusedMoE)}  # type: ignore[attr-defined]

    def _check_all_loaded(self, params: dict, loaded: set) -> None:
        moes = self._fused_moes()
        dense = {n: p for n, p in params.items() if n.rsplit(".", 1)[0] not in moes}
        super()._check_all_loaded(dense, loaded)  # type: ignore[misc]
        missing = [f"{n}: {x}" for n, m in moes.items() for x in m.missing()]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing}")
