"""What a request's output must match: vLLM's `StructuredOutputsParams`, torch-free.

Exactly one of the constraints is set:

    json         a JSON schema (dict or its JSON text): the output is one JSON value valid for it
    json_object  any JSON object (OpenAI's response_format {"type": "json_object"})
    regex        a regular expression the whole output matches
    choice       one of these strings, exactly
    grammar      an EBNF grammar (xgrammar's GBNF dialect, root rule `root`)

Whether the constraint compiles (a bad schema, regex or grammar) is checked when the request is
added, with the compiler's message (engine/structured/xgrammar_backend.py).
"""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The constraint as text (the compile cache's key with `kind`, the wire format)."""
        if self.json is not None:
            # key order kept: xgrammar emits properties in the schema's order
            return self.json if isinstance(self.json, str) else json_lib.dumps(
                self.json, separators=(",", ":"))
        if self.choice is not None:
            return json_lib.dumps(list(self.choice))
        if self.json_object:
            return ""
        return self.regex if self.regex is not None else str(self.grammar)

    @classmethod
    def from_spec(cls, kind: str, spec: str) -> StructuredOutputsParams:
        """The inverse of (`kind`, `spec()`): how the services carry it."""
        if kind not in KINDS:
            raise ValueError(f"unknown structured output kind {kind!r} (one of {KINDS})")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            return cls(choice=json_lib.loads(spec))
        return cls(**{kind: spec})
