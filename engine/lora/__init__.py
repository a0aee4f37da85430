"""Multi-LoRA: many PEFT adapters of one base model served together, mixed in one batch.

    adapter.py  PEFT folder -> per-projection (A, B·scale) tensors, checked against the model
    layers.py   LoRALinear: base projection + the delta of each token's adapter slot (at
                decode sizes the shrink folded into the base GEMV: kernels/lora_fold.py)
    slots.py    the device slots (max_loras) and the host cache (max_cpu_loras) of adapters
    request.py  LoRARequest, LoRAInUseError (torch-free)

The scheduler keeps at most `max_loras` distinct adapters among the running requests, so every
step's adapters fit the slots; the prefix cache keys each block by its request's adapter
(engine/block_manager.py), so no block computed under one adapter serves another.
"""

from engine.lora.request import LoRAInUseError, LoRARequest

__all__ = ["LoRAInUseError", "LoRARequest"]
