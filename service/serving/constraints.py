"""A request's output constraint: OpenAI's `response_format`, or vLLM's `structured_outputs`.

    response_format {"type": "text"}                      no constraint
                    {"type": "json_object"}               any JSON object
                    {"type": "json_schema",
                     "json_schema": {"name", "schema", "strict"}}   that schema
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar
                       vLLM's older names for the same, honoured as vLLM did

The result is the engine's StructuredOutputsParams. A malformed field, or a
schema, regex or grammar that does not compile, is a 400 naming the field;
compiling runs off the event loop, before the request reaches the engine.
A schema is priced first (engine/sampling/compile_price.py: its properties,
enum values, nesting), on a light prep thread, so one too costly to compile
is refused without waiting for the compile lane; the compile then runs in its
tenant's turn (service/serving/lanes.py).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from engine.errors import ValidationError
from engine.sampling.structured_outputs import ConstraintError, StructuredOutputsParams
from service.errors import bad_request


# vLLM's older request fields, each the structured_outputs key it stands for.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def constraint_of(body) -> tuple[StructuredOutputsParams | None, str]:
    """The body's constraint and the field it came from (for error messages)."""
    response_format = getattr(body, "response_format", None)
    guided = [name for name in GUIDED if getattr(body, name, None) is not None]
    given = [name for name, present in (
        ("structured_outputs", body.structured_outputs is not None),
        ("response_format", response_format is not None
         and response_format.get("type") != "text"),
        *((name, True) for name in guided)) if present]
    if len(given) > 1:
        raise bad_request(f"set one of response_format, structured_outputs and the guided_* "
                          f"fields; got {', '.join(given)}", param=given[0])
    if body.structured_outputs is not None:
        return _params(body.structured_outputs, "structured_outputs"), "structured_outputs"
    if guided:
        name = guided[0]
        return _params({GUIDED[name]: getattr(body, name)}, name), name
    if response_format is None:
        return None, "response_format"
    return _from_response_format(response_format)


def _from_response_format(response_format: dict[str, Any]
                          ) -> tuple[StructuredOutputsParams | None, str]:
    kind = response_format.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                          f"got {kind!r}", param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema must be an object with a name",
                          param="response_format.json_schema")
    param = "response_format.json_schema.schema"
    return _params({"json": spec.get("schema", {"type": "object"})}, param), param


def _params(fields, param: str) -> StructuredOutputsParams:
    if not isinstance(fields, dict):
        raise bad_request(f"{param} must be an object", param=param)
    # The engine names "structured_outputs"; the field here is the one the
    # constraint came from, which only the request knows.
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValidationError) as exc:  # TypeError: a field it does not have
        raise bad_request(f"{param}: {exc}", param=param) from None


def compile_tenant(request: Request) -> str:
    """Whose turn a compile waits for on the compile lane: the API key's tenant,
    else the client's address (as uvicorn reports it, behind a trusted proxy
    the forwarded one)."""
    key = getattr(request.state, "api_key", None)
    if key is not None:
        return "key " + key
    return "peer " + (request.client.host if request.client is not None else "")


async def check_constraint(state, constraint: StructuredOutputsParams | None, param: str,
                           tenant: str = "") -> None:
    """Price the constraint on a light prep thread, then compile it on the compile lane in
    `tenant`'s turn (service/serving/lanes.py; cached for the engine); 400 if it is invalid
    or too costly to compile."""
    if constraint is None:
        return
    compiler = state.engine.engine.structured_outputs
    try:
        await state.off_loop(compiler.price, constraint)
        await state.prep.heavy.run(compiler.compile, constraint, tenant=tenant)
    except ConstraintError as exc:
        raise bad_request(f"{param} is invalid: {exc.detail}", param=param) from None
    except ValidationError as exc:  # no tokenizer to compile against
        raise bad_request(f"{param}: {exc}", param=param) from None
