"""The request fields that constrain a completion's output, and the one `StructuredOutputsParams`
they become (engine/structured/params.py).

    response_format     {"type": "text"}                            no constraint
                        {"type": "json_object"}                     json_object
                        {"type": "json_schema", "json_schema":
                          {"name", "schema", "strict", "description"}}   json (the schema)
    structured_outputs  vLLM's: {"json" | "json_object" | "regex" | "choice" | "grammar"}
    guided_json, guided_regex, guided_choice, guided_grammar     vLLM's older names of the same
    guided_decoding_backend     "xgrammar" or "auto" (the one backend); anything else is a 400

The request models (gateway/protocol.py) check the fields' types; here, that at most one asks
for a constraint (two are a 400 naming both) and that a schema given as text parses to a JSON
object. Whether the constraint compiles is the engine's to say when the request is added: its
refusal comes back as `RequestRejected`, which the serving layer answers 400 naming the field
the constraint came from (`constraint_field`).
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured.params import StructuredOutputsParams
from gateway.errors import OpenAIError
from gateway.protocol import OpenAIRequest

BACKENDS = ("xgrammar", "auto")
# The fields that may carry a constraint, in the order a conflict names them.
SOURCES = ("response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_of(req: OpenAIRequest) -> StructuredOutputsParams | None:
    """The request's constraint, None without one. OpenAIError (400 naming the field) for two
    constraints, another backend than xgrammar, a schema that is not a JSON object, or a
    constraint that `StructuredOutputsParams` refuses (an empty regex, no choice)."""
    backend = req.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise OpenAIError(
            f"guided_decoding_backend {backend!r} is not supported: outputs are constrained "
            f"with xgrammar ({' or '.join(map(repr, BACKENDS))}).",
            param="guided_decoding_backend",
        )
    given = constraint_fields(req)
    if len(given) > 1:
        raise OpenAIError(f"Only one structured output constraint may be given; got "
                          f"{', '.join(given)}.", param=given[0])
    if not given:
        return None
    field = given[0]
    try:
        return StructuredOutputsParams(**_constraint_args(req, field))
    except ValueError as exc:
        raise OpenAIError(str(exc), param=field) from None


def constraint_field(req: OpenAIRequest) -> str | None:
    """The field the request's constraint came from (what a 400 for it names), if any."""
    given = constraint_fields(req)
    return given[0] if given else None


def constraint_fields(req: OpenAIRequest) -> list[str]:
    """The fields that ask for a constraint (`response_format` of type text does not)."""
    rf = req.response_format
    return [name for name in SOURCES if getattr(req, name) is not None
            and not (name == "response_format" and rf is not None and rf.type == "text")]


def _constraint_args(req: OpenAIRequest, field: str) -> dict[str, Any]:
    """`StructuredOutputsParams` arguments from the one field that asks for a constraint."""
    if field == "response_format":
        rf = req.response_format
        assert rf is not None
        if rf.type == "json_object" or rf.json_schema is None:
            return {"json_object": True}
        return {"json": rf.json_schema.schema_}
    if field == "structured_outputs":
        so = req.structured_outputs
        assert so is not None
        args = {"json": so.json_, "json_object": so.json_object or False, "regex": so.regex,
                "choice": so.choice, "grammar": so.grammar}
    else:
        args = {_GUIDED[field]: getattr(req, field)}
    if isinstance(args.get("json"), str):
        args["json"] = _schema_from_text(args["json"], field)
    return args


def _schema_from_text(text: str, field: str) -> dict[str, Any]:
    try:
        schema = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(f"{field}: the JSON schema is not valid JSON: {exc}",
                          param=field) from None
    if not isinstance(schema, dict):
        raise OpenAIError(f"{field}: a JSON schema must be a JSON object, got "
                          f"{type(schema).__name__}", param=field)
    return schema


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
