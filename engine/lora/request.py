"""What names an adapter in a request: vLLM's `LoRARequest` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter on disk, named for the API: `lora_name` is what clients pass as
    `model`, `lora_int_id` (>= 1) vLLM's numeric id, `lora_path` the adapter's folder
    (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an int >= 1, "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_request.lora_path must be a non-empty path")


class LoRAInUseError(ValueError):
    """An adapter cannot be removed: requests of it are running or waiting."""
