"""Where adapters live at run time: a host cache of loaded adapters and the device slots.

    host cache    the weights of up to max_cpu_loras adapters read from disk
                  (engine/lora/adapter.py), least recently used idle ones first out (the ones
                  requests in flight use stay: more than max_cpu_loras while they do); every
                  adapter stays registered (name -> path) and is read again when named
    device slots  max_loras of them in every wrapped projection (engine/lora/layers.py); an
                  adapter is copied into a free or least recently used slot the first step that
                  needs it, and stays there until another adapter needs the slot

The scheduler admits at most max_loras distinct adapters among running requests, so one step's
adapters always fit the slots. Before each step rank 0's runner plans it (`plan`: which adapter
goes into which slot, each token's slot); every rank places the new adapters (`place`) and
reads the token slots from the step's inputs (engine/input_batch.py) into its `LoRAContext`.
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
        self.known: dict[str, LoRARequest] = {}  # registered adapters, by name
        self.cache: OrderedDict[str, LoRAAdapter] = OrderedDict()  # their weights, LRU first
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recent first
        # the registered adapters, replaced whole on each change: other threads read it
        self.loaded: tuple[LoRARequest, ...] = ()

    # ---- model -----------------------------------------------------------------------------
    def _wrap(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Replace each layer's dense projections by LoRALinear wrappers (after the weights are
        loaded: the base keeps its parameters and their names)."""
        cfg, hidden = self.config, model.config.hidden_size
        sharded = model.tp.world_size > 1
        layers = model.model.layers
        self.num_layers = len(layers)
        whole = range(hidden)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q_rows, q_full = attn.shard_rows["q"]
            parts = [(attn, "qkv_proj", hidden, attn.shard_rows, None),
                     (attn, "o_proj", q_full, {"o": (whole, hidden)},
                      q_rows if sharded else None)]
            if hasattr(mlp, "gate_up_proj"):  # dense MLP; a mixture of experts has none
                rows, full = mlp.shard_rows["gate"]
                parts += [(mlp, "gate_up_proj", hidden, mlp.shard_rows, None),
                          (mlp, "down_proj", full, {"down": (whole, hidden)},
                           rows if sharded else None)]
            for owner, name, in_features, slices, cols in parts:
                wrapped = LoRALinear(getattr(owner, name), in_features, slices, cfg.max_loras,
                                     cfg.max_lora_rank, self.ctx, dtype, self.device, cols)
                setattr(owner, name, wrapped)
                self.modules[(i, name)] = wrapped

    # ---- host cache ------------------------------------------------------------------------
    def add(self, request: LoRARequest, in_use: Collection[str] = ()) -> LoRAAdapter:
        """Register `request`'s adapter and hold its weights in the host cache (read from disk
        if they are not there), evicting the least recently used weights not `in_use` when the
        cache is full (none evictable: the cache holds one more for now). An evicted adapter
        stays registered and is read again when a request names it; the adapters of requests
        in flight stay cached, so a step never reads a disk. ValueError, changing nothing: a
        bad adapter, or the name registered with another path."""
        name = request.lora_name
        known = self.known.get(name)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"LoRA adapter {name!r} is loaded from {known.lora_path}, not "
                             f"{request.lora_path}")
        adapter = self.cache.get(name)
        if adapter is None:
            adapter = load_adapter(request, self.config.max_lora_rank)
            self._check_fits(adapter)
            idle = [n for n in self.cache if n not in in_use]
            for victim in idle[:max(len(self.cache) + 1 - self.config.cpu_capacity, 0)]:
                del self.cache[victim]
            self.cache[name] = adapter
        else:
            self.cache.move_to_end(name)
        if known is None:
            self.known[name] = request
            self.loaded = tuple(self.known.values())
        return adapter

    def remove(self, name: str) -> None:
        """Forget adapter `name` (KeyError if not registered); its device slot is free again."""
        del self.known[name]
        self.cache.pop(name, None)
        self.slot_of.pop(name, None)
        self.loaded = tuple(self.known.values())

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        for (layer, proj), (a, b) in adapter.weights.items():
            where = f"LoRA adapter {adapter.name!r}: layers.{layer}.{proj}"
            if layer >= self.num_layers:
                raise ValueError(f"{where}: the model has {self.num_layers} layers")
            module = self.modules.get((layer, _FUSED[proj]))
            if module is None:
                raise ValueError(f"{where}: this model has no dense {proj} there (a "
                                 f"mixture-of-experts layer): only attention can be adapted")
            want = (module.full_out[_SLICE[proj]], module.in_features)
            if (b.shape[0], a.shape[1]) != want:
                raise ValueError(f"{where} maps {a.shape[1]} -> {b.shape[0]} features, the "
                                 f"model's {want[1]} -> {want[0]}")

    # ---- one step ----------------------------------------------------------------------------
    def plan(self, order: Sequence[ScheduledRequest]) -> tuple[list[tuple[int, LoRARequest]],
                                                               list[int] | None]:
        """Rank 0: the device slot of each adapter of this step (a free one, or the least
        recently used one no adapter of the step needs) and each token's slot; returns the
        (slot, adapter) placements to make before the step (`place`, on every rank) and the
        per-token slots (None: no adapter this step)."""
        names = {s.request.lora_name for s in order if s.request.lora_name is not None}
        if not names:
            return [], None
        loads = []
        for name in names:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            taken = set(self.slot_of.values())
            free = [s for s in range(self.config.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # fits: the scheduler runs at most max_loras adapters
                victim = next(n for n in self.slot_of if n not in names)
                slot = self.slot_of.pop(victim)
            self.slot_of[name] = slot
            loads.append((slot, self.known[name]))
        per_token: list[int] = []
        for s in order:
            slot = -1 if s.request.lora_name is None else self.slot_of[s.request.lora_name]
            per_token += [slot] * s.num_new_tokens
        return loads, per_token

    def place(self, slot: int, request: LoRARequest) -> None:
        """Copy an adapter's weights (this rank's part) into device slot `slot`; a rank other
        than 0 reads it from disk first if its host cache lacks it."""
        known = self.known.get(request.lora_name)
        if known is not None and known != request:  # ranks > 0: removed and added anew
            self.remove(request.lora_name)
        adapter = self.add(request)
        per_module: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, proj), ab in adapter.weights.items():
            per_module.setdefault((layer, _FUSED[proj]), {})[_SLICE[proj]] = ab
        for key, module in self.modules.items():
            module.set_slot(slot, per_module.get(key, {}))
        for name, held in list(self.slot_of.items()):  # other ranks: the slot's old adapter
            if held == slot and name != request.lora_name:
                del self.slot_of[name]
        self.slot_of[request.lora_name] = slot
