"""Tool calls: OpenAI's ``tools`` and ``tool_choice``, served as a structured-output constraint.

A chat request may list functions (``tools``) and say whether the answer must call one:

- ``tool_choice: {"type": "function", "function": {"name": F}}``: the output is F's arguments, constrained to its
  ``parameters`` schema; the answer is one call of F.
- ``"required"``: the output is a JSON list of at least one ``{"name": ..., "parameters": ...}``, each the name of
  a listed function and arguments of its schema (one call at most with ``parallel_tool_calls: false``), as vLLM
  builds it; the answer is those calls.
- ``"none"``: plain text; the tools still reach the chat template.
- ``"auto"`` (OpenAI's default when tools are given): refused. Whether a free answer is a call is decided by a
  parser of each model family's own call syntax, which dsi does not have.

The constraint is a :class:`~dsi.constraints.Constraint` like ``response_format``'s, so the calls are exact under
speculation as any constrained output is. The tools are given to the chat template (``tools=``), so a model trained
for tool use sees them as it was trained to. An output that does not parse as calls (cut by ``max_tokens`` or a
stop string) is answered as text, with its ``finish_reason``: never as a call with missing arguments.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any

from dsi.server.protocol import APIError, ChatCompletionRequest

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """How a request's answer must call its tools: ``function`` names the one to call (None: ``"required"``, any of
    them); ``schema`` is what the output is constrained to."""

    function: str | None
    schema: dict

    def opening_call(self) -> dict:
        """A named function's call as a stream opens it: its id and name, its arguments still to come."""
        return _call(self.function, "")

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls an output makes, as OpenAI's message gives them; None where it does not parse."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # not JSON (cut short), a number of over 4300 digits, nested too deep
            return None
        if self.function is not None:
            return [_call(self.function, text)]
        if not isinstance(value, list) or not value or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in value):
            return None
        return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calling(request: ChatCompletionRequest) -> ToolCalling | None:
    """What ``request``'s tools ask of its answer (None: plain text); a 400 naming the field for a choice that
    cannot be served."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise APIError(400, f"tool_choice={_shown(choice)} needs tools", param="tool_choice",
                           code="invalid_value")
        return None
    names = [t.function.name for t in request.tools]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise APIError(400, f"tools lists the function {twice!r} twice", param="tools", code="invalid_value")
    if choice is None or choice == "auto":
        raise APIError(400, "tool_choice 'auto' (the default with tools) needs a parser of the model's own tool-call "
                            "syntax, which dsi does not have: send tool_choice 'required' or "
                            "{'type': 'function', 'function': {'name': ...}} (the output is then constrained to a "
                            "call), or 'none'", param="tool_choice", code="unsupported_value")
    if choice == "none":
        return None
    parameters = {t.function.name: t.function.parameters or NO_ARGUMENTS for t in request.tools}
    if choice != "required":
        name = choice.function.name
        if name not in parameters:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools "
                                f"({', '.join(names)})", param="tool_choice", code="invalid_value")
        return ToolCalling(name, parameters[name])
    return ToolCalling(None, _calls_schema(parameters, request.parallel_tool_calls is not False))


def _calls_schema(parameters: dict[str, dict], parallel: bool) -> dict:
    """A JSON list of calls, each one of the functions with its arguments. Each function's ``$defs`` move to the
    top, where its ``$ref``s point."""
    defs: dict[str, Any] = {}
    calls = []
    for name, schema in parameters.items():
        schema = copy.deepcopy(schema)
        for key, value in schema.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise APIError(400, f"two tools define $defs.{key} differently; with tool_choice 'required' their "
                                    "definitions share one namespace", param="tools", code="invalid_value")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())
