"""`tool_choice` and `response_format` -> the llguidance grammar the engine decodes under.

- `tool_choice` "none" / "auto": no constraint (as in vLLM; "none" also hides the tools from the prompt).
- "required": the answer is one or more (one with `parallel_tool_calls: false`) GLM tool calls,
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, of the listed tools; a named
  function: exactly one call of it (as vLLM decodes a named choice). A call holds the required arguments of the
  tool's schema always, the optional ones optionally, in the schema's order. A value whose schema admits only
  strings is written raw (GLM's format), within its `minLength`/`maxLength`, `enum`/`const` and `pattern`; every
  other value is JSON matching its schema (`server/json_schema.py` reads the schema once for the grammar and for
  the parser that types the arguments back).
- `response_format` json_object / json_schema: the answer is JSON (matching the schema).

JSON is compact by default (no whitespace between tokens, so a weak model cannot pad forever);
`JsonLayout("flexible")` (`--json-whitespace flexible`) or a request's whitespace pattern allows it.
With thinking on the constraint starts after the reasoning: free text, then `</think>`, then the answer
(where the prompt leaves the `<think>` to the model, as GLM-4.5/4.6's do, the reasoning block is optional).
The markers are referenced as tokens (`<[id]>`), so text in a value can never be read as a marker.
Every schema of the request (tools, response format) is checked, even when no grammar is built: an
unusable keyword is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce

from openglm.server.errors import APIError
from openglm.server.json_schema import Schema, SchemaError
from openglm.server.protocol import ChatCompletionRequest, NamedToolChoice

MAX_STRING_ALTERNATIVES = 64  # raw-string alternatives (enum x anyOf x allOf) before falling back to the plain bound
EXTRA_KEY = r"/[A-Za-z0-9_.\-]{1,64}/"  # names of arguments a schema allows beyond its properties


@dataclass(frozen=True)
class JsonLayout:
    """Whitespace between JSON tokens: "compact" (none), "flexible" (llguidance's default: any run of
    JSON whitespace), or `pattern`, a regex for it (vLLM's `whitespace_pattern`)."""

    whitespace: str = "compact"
    pattern: str | None = None

    def options(self) -> dict:
        # oneOf as anyOf (exclusivity cannot be enforced token by token); keywords llguidance cannot
        # enforce are ignored rather than refused (docs/serving.md lists them)
        out = {"coerce_one_of": True, "lenient": True}
        if self.pattern is not None:
            return {**out, "whitespace_flexible": True, "whitespace_pattern": self.pattern}
        return {**out, "whitespace_flexible": self.whitespace == "flexible"}


def json_layout(req: ChatCompletionRequest, default: str = "compact") -> JsonLayout:
    """The request's JSON layout: its `structured_outputs` options, else the server's default."""
    so = req.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        return JsonLayout(pattern=so.whitespace_pattern)
    if so is not None and so.disable_any_whitespace is not None:
        return JsonLayout("compact" if so.disable_any_whitespace else "flexible")
    return JsonLayout(default)


def request_grammar(req: ChatCompletionRequest, tokenizer, thinking: bool | str,
                    layout: JsonLayout = JsonLayout()) -> str | None:
    """The Lark grammar (llguidance dialect) for this request, or None when it is unconstrained. `thinking` is
    the answer's reasoning mode (chat_output.py): "open" (True), "optional" or "off" (False)."""
    schemas = tool_schemas(req)  # checked even when unconstrained: the parser types arguments with them
    rf = req.response_format
    rf_schema = None
    if rf is not None and rf.type != "text":
        raw = rf.json_schema.schema_ if rf.type == "json_schema" else {"type": "object"}
        rf_schema = _checked(raw or {"type": "object"}, "response_format.json_schema.schema")
    mark = _marker_refs(tokenizer)
    if req.forced_tool_call():
        choice = req.effective_tool_choice()
        names = [t.function.name for t in req.tools or []]
        named = isinstance(choice, NamedToolChoice)  # exactly one call of it, as vLLM decodes a named choice
        if named:
            names = [choice.function.name]
        body = tool_calls_grammar([(n, schemas[n]) for n in names], mark, req.parallel_tool_calls and not named,
                                  layout)
    elif rf_schema is not None:
        body = f"start: answer\nanswer: %json {json.dumps(rf_schema.standalone('', layout.options()))}\n"
    else:
        return None
    mode = {True: "open", False: "off"}.get(thinking, thinking)
    if mode == "open":  # reasoning is free text; the constraint holds from </think> on
        body = body.replace("start: ", f"start: REASONING {mark('</think>')} ", 1) + "REASONING: /(.|\\n)*/\n"
    elif mode == "optional":  # the model may open a reasoning block first (after a newline, as GLM-4.5 writes)
        body = (body.replace("start: ", "start: reasoning? ", 1) + "REASONING: /(.|\\n)*/\n"
                + f"reasoning: \"\\n\"? {mark('<think>')} REASONING {mark('</think>')}\n")
    return body


def tool_schemas(req: ChatCompletionRequest) -> dict[str, Schema]:
    """Each listed tool's parameter schema, checked (a 400 naming the keyword when unusable)."""
    return {t.function.name: _checked(t.function.parameters, f"tools[{i}].function.parameters")
            for i, t in enumerate(req.tools or [])}


def _checked(raw, where: str) -> Schema:
    try:
        return Schema(raw, where)
    except SchemaError as exc:
        raise APIError(400, str(exc), param=exc.path) from exc


# ---- GLM tool calls ---------------------------------------------------------------------------------
def tool_calls_grammar(tools: list[tuple[str, Schema]], mark, parallel: bool, layout: JsonLayout) -> str:
    lines = ["start: call" + ("+" if parallel else ""), "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, schema) in enumerate(tools):
        props, required, extra = schema.object_view()
        props += [(key, None) for key in sorted(required - {k for k, _ in props})]  # required, undeclared
        parts = []
        for j, (key, pointer) in enumerate(props):
            value = _value_expr(schema, pointer, f"{i}_{j}", lines, layout)
            pair = (f"{mark('<arg_key>')} {json.dumps(key, ensure_ascii=False)} {mark('</arg_key>')} "
                    f"{mark('<arg_value>')} {value} {mark('</arg_value>')}")
            parts.append(pair if key in required else f"({pair})?")
        if extra is not None:  # the schema allows other names: any number of them, each by its schema
            value = _value_expr(schema, extra, f"{i}_extra", lines, layout)
            parts.append(f"({mark('<arg_key>')} {EXTRA_KEY} {mark('</arg_key>')} "
                         f"{mark('<arg_value>')} {value} {mark('</arg_value>')})*")
        lines.append(f"call_{i}: {mark('<tool_call>')} {json.dumps(name)} {' '.join(parts)} {mark('</tool_call>')}")
    return "\n".join(lines) + "\n"


def _value_expr(schema: Schema, pointer: str | None, tag: str, lines: list[str], layout: JsonLayout) -> str:
    """The grammar of one argument value: raw text for a plain string, else JSON by its schema."""
    node = {} if pointer is None else schema.node(pointer)
    if pointer is not None and schema.is_string(node):
        return _raw_string(_string_alternatives(schema, node), tag, lines)
    standalone = schema.standalone(pointer, layout.options()) if pointer is not None else \
        {"x-guidance": layout.options()}
    return f"%json {json.dumps(standalone, ensure_ascii=False)}"


# A raw string's alternatives: a literal (enum/const) or (minLength, maxLength, patterns).
def _string_alternatives(schema: Schema, node, depth: int = 0) -> list:
    if depth > 32 or not isinstance(node, dict):
        return [(0, None, ())]
    parts = []
    if isinstance(node.get("$ref"), str):
        parts.append(_string_alternatives(schema, schema.node(node["$ref"][1:]), depth + 1))
    for key in ("anyOf", "oneOf"):
        if key in node:
            branches = [b for b in node[key] if (t := schema.types(b)) is None or "string" in t]
            parts.append([alt for b in branches for alt in _string_alternatives(schema, b, depth + 1)])
    parts += [_string_alternatives(schema, b, depth + 1) for b in node.get("allOf", ())]
    if "enum" in node:
        parts.append([v for v in node["enum"] if isinstance(v, str)])
    if "const" in node and isinstance(node["const"], str):
        parts.append([node["const"]])
    pattern = (node["pattern"],) if isinstance(node.get("pattern"), str) else ()
    hi = node.get("maxLength")
    parts.append([(int(node.get("minLength", 0)), None if hi is None else int(hi), pattern)])
    alts = reduce(_both, parts)
    return alts if len(alts) <= MAX_STRING_ALTERNATIVES else parts[-1]


def _both(a: list, b: list) -> list:
    """Alternatives satisfying one of `a` and one of `b`."""
    out = []
    for x in a:
        for y in b:
            if isinstance(x, str) or isinstance(y, str):
                lit, other = (x, y) if isinstance(x, str) else (y, x)
                if isinstance(other, str) and other != lit:
                    continue
                if not isinstance(other, str) and not (other[0] <= len(lit) and (other[1] is None or
                                                                                 len(lit) <= other[1])):
                    continue
                out.append(lit)
            else:
                hi = x[1] if y[1] is None else y[1] if x[1] is None else min(x[1], y[1])
                out.append((max(x[0], y[0]), hi, x[2] + y[2]))
            if len(out) > MAX_STRING_ALTERNATIVES:
                return out
    return list(dict.fromkeys(out))


def _raw_string(alts: list, tag: str, lines: list[str]) -> str:
    exprs = []
    for k, alt in enumerate(alts):
        if isinstance(alt, str):
            exprs.append(json.dumps(alt, ensure_ascii=False))
            continue
        lo, hi, patterns = alt
        name = f"S_{tag}_{k}".upper().replace("-", "_")
        regexes = [f"/(?s:.{{{lo},{'' if hi is None else hi}}})/"] + [_search_regex(p) for p in patterns]
        lines.append(f"{name}: {' & '.join(regexes)}")
        exprs.append(name)
    if not exprs:  # no string satisfies the schema: llguidance reports an empty alternative
        return '""'
    return exprs[0] if len(exprs) == 1 else "(" + " | ".join(exprs) + ")"


def _search_regex(pattern: str) -> str:
    """A JSON-schema `pattern` (a search, unless anchored with ^ / $) as a Lark regex of the whole string."""
    import llguidance  # the grammar engine's regex dialect (loaded with the first constrained request)

    start = pattern.startswith("^")
    end = pattern.endswith("$") and not _escaped(pattern, len(pattern) - 1)
    core = pattern[1 if start else 0: len(pattern) - 1 if end else len(pattern)]
    body = llguidance.regex_to_lark(core, "dw")  # JSON Schema's \d and \w are ASCII
    return f"/{'' if start else '(?s:.*)'}(?:{body}){'' if end else '(?s:.*)'}/"


def _escaped(text: str, i: int) -> bool:
    """Whether text[i] is escaped by an odd run of backslashes."""
    n = 0
    while i - n - 1 >= 0 and text[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _marker_refs(tokenizer):
    """marker -> its grammar form: the token `<[id]>` where it is one token, else the literal text."""
    def ref(marker: str) -> str:
        idx = tokenizer.marker_id(marker)
        return f"<[{idx}]>" if idx is not None else json.dumps(marker)
    return ref
