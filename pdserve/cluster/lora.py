"""Multi-LoRA serving flags, vLLM's names, shared by `pdserve serve`, `prefill`, `decode`,
`gateway` and `up`:

    --enable-lora                      serve LoRA adapters (workers and the colocated engine:
                                       the engine's enable_lora; the gateway: adapter routes)
    --lora-modules name=path ...       adapters served from the start; also vLLM's JSON form
                                       '{"name": ..., "path": ..., "base_model_name": ...}'
    --max-loras N                      distinct adapters in one step (engine slots)
    --max-lora-rank R                  the largest adapter rank accepted
    --max-cpu-loras N                  adapters kept in host memory (default: --max-loras)

Each falls back to PDSERVE_<FLAG>; PDSERVE_LORA_MODULES holds the modules separated by
whitespace (JSON objects may contain spaces).

An adapter's numeric id (vLLM's lora_int_id) is derived from its name (`lora_int_id`), so every
gateway and worker of a cluster gives a name the same id without asking each other.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.lora import LoRARequest
from pdserve.cluster.flags import add_flag

_MAX_ID = 2**31 - 1


@dataclass(frozen=True)
class LoRAModule:
    """One adapter the server offers: `name` (the API's model name), its folder, and the
    model it adapts as /v1/models shows it as `parent` (None: the served base model)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a LoRA module name must be non-empty without spaces, got "
                             f"{self.name!r}")
        if not self.path:
            raise ValueError(f"LoRA module {self.name!r} needs a path")

    def request(self) -> LoRARequest:
        return LoRARequest(self.name, lora_int_id(self.name), self.path)

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "path": self.path,
                           "base_model_name": self.base_model_name}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LoRAModule:
        return _module_from_dict(json.loads(text))


def lora_int_id(name: str) -> int:
    """The adapter's numeric id: a stable hash of its name in [1, 2**31 - 1]."""
    return zlib.crc32(name.encode()) % _MAX_ID + 1


def add_lora_flags(parser: argparse.ArgumentParser, engine: bool = True) -> None:
    """--enable-lora and --lora-modules; with `engine`, the engine's sizes too (the gateway of
    a disaggregated cluster holds no adapters: it takes only the first two)."""
    add_flag(parser, "--enable-lora", False, action="store_true",
             help="serve LoRA adapters: `model` may name one; POST /v1/load_lora_adapter and "
                  "/v1/unload_lora_adapter")
    add_flag(parser, "--lora-modules", None, nargs="+", metavar="NAME=PATH",
             help='adapters served from the start: name=path, or vLLM\'s JSON {"name": ..., '
                  '"path": ..., "base_model_name": ...}')
    if not engine:
        return
    add_flag(parser, "--max-loras", 1, type=int, help="distinct LoRA adapters in one batch")
    add_flag(parser, "--max-lora-rank", 16, type=int, help="largest LoRA rank accepted")
    add_flag(parser, "--max-cpu-loras", None, type=int,
             help="LoRA adapters kept in host memory, least recently used evicted (default: "
                  "--max-loras)")


def parse_lora_modules(value: Iterable[str] | str | None) -> list[LoRAModule]:
    """--lora-modules as given on the command line (a list of items) or in PDSERVE_LORA_MODULES
    (one string): each item `name=path` or a JSON object. ValueError naming the bad item, or a
    name given twice."""
    items = _split(value) if isinstance(value, str) else list(value or [])
    modules = [_parse_item(item) for item in items]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules names {m.name!r} twice")
        seen.add(m.name)
    return modules


def _parse_item(item: str) -> LoRAModule:
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not JSON: {exc}") from None
        return _module_from_dict(data)
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules takes name=path or a JSON object, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


def _module_from_dict(data: Any) -> LoRAModule:
    if not isinstance(data, dict) or not {"name", "path"} <= data.keys():
        raise ValueError(f"--lora-modules: a JSON module needs \"name\" and \"path\", got "
                         f"{data!r}")
    unknown = data.keys() - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)} in {data!r}")
    return LoRAModule(str(data["name"]), str(data["path"]), data.get("base_model_name"))


def _split(text: str) -> list[str]:
    """Whitespace-separated items, a `{...}` JSON object being one item whatever it holds."""
    decoder, items, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
        elif text[pos] == "{":
            try:
                _, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: {text[pos:]!r} is not JSON: {exc}") from None
            items.append(text[pos:end])
            pos = end
        else:
            end = pos
            while end < len(text) and not text[end].isspace():
                end += 1
            items.append(text[pos:end])
            pos = end
    return items


def lora_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """build_engine_config's LoRA arguments from the flags."""
    if not args.enable_lora and args.lora_modules:
        raise ValueError("--lora-modules needs --enable-lora")
    if not args.enable_lora:
        return {}
    return dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras)


def lora_argv(args: argparse.Namespace, engine: bool = True) -> list[str]:
    """The LoRA flags to hand a service `pdserve up` starts (none without --enable-lora);
    `engine`: also the engine's sizes (workers, the colocated engine; not the gateway)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return []
    argv = ["--enable-lora"]
    modules = parse_lora_modules(args.lora_modules)
    if modules:
        argv += ["--lora-modules", *(m.to_json() for m in modules)]
    if engine:
        argv += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
        if args.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(args.max_cpu_loras)]
    return argv
