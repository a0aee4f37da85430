"""Where adapters live at run time: a host cache of loaded adapters and the device slots.

    host cache    up to max_cpu_loras adapters read from disk (engine/lora/adapter.py), least
                  recently used first out; an adapter some request still uses is never evicted
    device slots  max_loras of them in every wrapped projection (engine/lora/layers.py); an
                  adapter is copied into a free or least recently used slot the first step that
                  needs it, and stays there until another adapter needs the slot

The scheduler admits at most max_loras distinct adapters among running requests, so one step's
adapters always fit the slots. The runner calls `prepare(order)` before each forward: it places
the step's adapters and sets each token's slot in the shared `LoRAContext`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.layers import LoRAContext, LoRALinear
from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledRequest

_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
          "o_proj": "o_proj", "down_proj": "down_proj"}
_SLICE = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up",
          "o_proj": "o", "down_proj": "down"}


class LoRASlots:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.device = device
        self.ctx = LoRAContext()
        self.num_layers = 0
        # (layer, our module name) -> the wrapped projection
        self.modules: dict[tuple[int, str], LoRALinear] = {}
        self._wrap(model, dtype)
        self.cache: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recent first
        # the cached adapters' requests, replaced whole on each change: other threads read it
        self.loaded: tuple[LoRARequest, ...] = ()

    # ---- model -----------------------------------------------------------------------------
    def _wrap(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Replace each layer's dense projections by LoRALinear wrappers (after the weights are
        loaded: the base keeps its parameters and their names)."""
        cfg = self.config
        layers = model.model.layers
        self.num_layers = len(layers)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [(attn, "qkv_proj", model.config.hidden_size, attn.shard_slices()),
                     (attn, "o_proj", attn.q_size, {"o": model.config.hidden_size})]
            if hasattr(mlp, "gate_up_proj"):  # dense MLP; a mixture of experts has none
                parts += [(mlp, "gate_up_proj", model.config.hidden_size, mlp.shard_slices()),
                          (mlp, "down_proj", mlp.intermediate_size,
                           {"down": model.config.hidden_size})]
            for owner, name, in_features, slices in parts:
                widths = {k: (v.stop - v.start if isinstance(v, slice) else v)
                          for k, v in slices.items()}
                wrapped = LoRALinear(getattr(owner, name), in_features, widths, cfg.max_loras,
                                     cfg.max_lora_rank, self.ctx, dtype, self.device)
                setattr(owner, name, wrapped)
                self.modules[(i, name)] = wrapped

    # ---- host cache ------------------------------------------------------------------------
    def add(self, request: LoRARequest, in_use: Collection[str] = ()) -> LoRAAdapter:
        """Load `request`'s adapter into the host cache (a no-op if it is there, from the same
        path), evicting the least recently used adapter not in `in_use` when the cache is full.
        ValueError, changing nothing: a bad adapter, the name taken by another path, or every
        cached adapter in use."""
        name = request.lora_name
        cached = self.cache.get(name)
        if cached is not None:
            if cached.request.lora_path != request.lora_path:
                raise ValueError(f"LoRA adapter {name!r} is loaded from "
                                 f"{cached.request.lora_path}, not {request.lora_path}")
            self.cache.move_to_end(name)
            return cached
        adapter = load_adapter(request, self.config.max_lora_rank)
        self._check_fits(adapter)
        if len(self.cache) >= self.config.cpu_capacity:
            idle = [n for n in self.cache if n not in in_use]
            if not idle:
                raise ValueError(
                    f"cannot load LoRA adapter {name!r}: all {len(self.cache)} adapters held "
                    f"(max_cpu_loras) are in use by requests"
                )
            self.remove(idle[0])
        self.cache[name] = adapter
        self.loaded = tuple(a.request for a in self.cache.values())
        return adapter

    def remove(self, name: str) -> None:
        """Forget adapter `name` (KeyError if not loaded); its device slot is free again."""
        del self.cache[name]
        self.slot_of.pop(name, None)
        self.loaded = tuple(a.request for a in self.cache.values())

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        for (layer, proj), (a, b) in adapter.weights.items():
            where = f"LoRA adapter {adapter.name!r}: layers.{layer}.{proj}"
            if layer >= self.num_layers:
                raise ValueError(f"{where}: the model has {self.num_layers} layers")
            module = self.modules.get((layer, _FUSED[proj]))
            if module is None:
                raise ValueError(f"{where}: this model has no dense {proj} there (a "
                                 f"mixture-of-experts layer): only attention can be adapted")
            want = (module.slice_width(_SLICE[proj]), module.in_features)
            if (b.shape[0], a.shape[1]) != want:
                raise ValueError(f"{where} maps {a.shape[1]} -> {b.shape[0]} features, the "
                                 f"model's {want[1]} -> {want[0]}")

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, order: Sequence[ScheduledRequest]) -> None:
        """Place this step's adapters in device slots and set every token's slot (None when no
        request of the step has an adapter)."""
        names = {s.request.lora_name for s in order if s.request.lora_name is not None}
        if not names:
            self.ctx.slots = None
            return
        slots = {name: self._slot(name, names) for name in names}
        per_token: list[int] = []
        for s in order:
            slot = -1 if s.request.lora_name is None else slots[s.request.lora_name]
            per_token += [slot] * s.num_new_tokens
        self.ctx.slots = torch.tensor(per_token, dtype=torch.int32).to(self.device,
                                                                        non_blocking=True)

    def _slot(self, name: str, step: Collection[str]) -> int:
        """The device slot holding `name`, loading it into a free slot or the least recently
        used one no adapter of this step needs."""
        slot = self.slot_of.get(name)
        if slot is not None:
            self.slot_of.move_to_end(name)
            return slot
        taken = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self.slot_of if n not in step)  # fits: <= max_loras a step
            slot = self.slot_of.pop(victim)
        adapter = self.cache[name]
        per_module: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, proj), ab in adapter.weights.items():
            per_module.setdefault((layer, _FUSED[proj]), {})[_SLICE[proj]] = ab
        for key, module in self.modules.items():
            module.set_slot(slot, per_module.get(key, {}))
        self.slot_of[name] = slot
        return slot
