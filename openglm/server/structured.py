"""`tool_choice` and `response_format` -> the llguidance grammar the engine decodes under.

- `tool_choice` "none" / "auto": no constraint (as in vLLM; "none" also hides the tools from the prompt).
- "required" / a named function: the answer is one or more (one with `parallel_tool_calls: false`)
  GLM tool calls, `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, of the
  listed tools (of the named one): the required arguments of the tool's schema always, the optional
  ones optionally, each value in the form its schema types it (string within min/maxLength, enum,
  integer, number, boolean, null; objects and arrays by their JSON schema).
- `response_format` json_object / json_schema: the answer is JSON (matching the schema).

With thinking on the constraint starts after the reasoning: free text, then `</think>`, then the answer.
The markers are referenced as tokens (`<[id]>`), so text in a value can never be read as a marker.
"""

from __future__ import annotations

import json

from openglm.server.protocol import ChatCompletionRequest, NamedToolChoice

JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
SCALAR_RULES = {
    "integer": r"/-?(0|[1-9][0-9]*)/",
    "number": f"/{JSON_NUMBER}/",
    "boolean": '"true" | "false"',
    "null": '"null"',
}


def request_grammar(req: ChatCompletionRequest, tokenizer, thinking: bool) -> str | None:
    """The Lark grammar (llguidance dialect) for this request, or None when it is unconstrained."""
    if not req.constrained():
        return None
    mark = _marker_refs(tokenizer)
    if req.forced_tool_call():
        choice = req.effective_tool_choice()
        tools = [t.function for t in req.tools or []]
        if isinstance(choice, NamedToolChoice):
            tools = [f for f in tools if f.name == choice.function.name]
        body = tool_calls_grammar(tools, mark, parallel=req.parallel_tool_calls)
    else:  # a JSON response_format
        rf = req.response_format
        schema = rf.json_schema.schema_ if rf.type == "json_schema" else {"type": "object"}
        body = f"start: answer\nanswer: %json {json.dumps(schema or {'type': 'object'})}\n"
    if thinking:  # reasoning is free text; the constraint holds from </think> on
        body = body.replace("start: ", f"start: REASONING {mark('</think>')} ", 1) + "REASONING: /(.|\\n)*/\n"
    return body


def tool_calls_grammar(functions, mark, parallel: bool) -> str:
    lines = ["start: call" + ("+" if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        params = fn.parameters or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"v_{i}_{j}"
            lines.append(f"{rule}: {value_rule(schema if isinstance(schema, dict) else {})}")
            pair = (f"{mark('<arg_key>')} {json.dumps(key)} {mark('</arg_key>')} "
                    f"{mark('<arg_value>')} {rule} {mark('</arg_value>')}")
            parts.append(pair if key in required else f"({pair})?")
        lines.append(f"call_{i}: {mark('<tool_call>')} {json.dumps(fn.name)} {' '.join(parts)} {mark('</tool_call>')}")
    return "\n".join(lines) + "\n"


def value_rule(schema: dict) -> str:
    """An argument value as GLM writes it: strings raw, everything else as JSON."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"])
    if "const" in schema:
        v = schema["const"]
        return json.dumps(v if isinstance(v, str) else json.dumps(v))
    types = schema.get("type", "string")
    types = types if isinstance(types, list) else [types]
    alts = []
    for t in types:
        if t == "string":
            lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
            alts.append(f"/(.|\\n){{{lo},{'' if hi is None else int(hi)}}}/")
        elif t in SCALAR_RULES:
            alts.append(SCALAR_RULES[t])
        else:  # object, array (and anything else): JSON by its schema
            alts.append(f"%json {json.dumps({**schema, 'type': t})}")
    return alts[0] if len(alts) == 1 else " | ".join(f"({a})" for a in alts)


def _marker_refs(tokenizer):
    """marker -> its grammar form: the token `<[id]>` where it is one token, else the literal text."""
    def ref(marker: str) -> str:
        idx = tokenizer.marker_id(marker)
        return f"<[{idx}]>" if idx is not None else json.dumps(marker)
    return ref
