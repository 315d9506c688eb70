"""One reading of a request's JSON schema: checked once, then used both to build the output grammar
(`server/structured.py`) and to type the tool-call arguments parsed back from the model's text
(`server/chat_output.py`), so what is generated and what is returned always agree.

- `check_schema` walks the whole schema (bounded in size and depth) and refuses, naming the keyword,
  what no grammar can use: a keyword of the wrong type (`"minLength": "abc"`), a number that is not
  finite (`1e400` reads as infinity), a `$ref` that is not a local JSON pointer or points nowhere.
- `Schema.types(node)` is the set of JSON types a subschema admits, through `type` (also a list),
  `enum`, `const`, `anyOf` / `oneOf` (union), `allOf` (intersection) and `$ref` (also recursive);
  a value is a *plain string* when that set is exactly {"string"}.
- `Schema.value(text, node)`: GLM writes a plain-string argument raw and every other one as JSON
  (the rule vLLM's GLM parsers follow): a plain string stays the text; anything else is decoded as
  JSON and kept when it is of an admitted type, else the text is kept (a string where strings are
  admitted, the model's text as written otherwise). Where no string is admitted, JSON the model wrote
  with escaped quotes (`[{\\"id\\": 1}]`, as inside a string) is decoded once they are unescaped.
- `Schema.standalone(pointer, options)`: the subschema at `pointer` as a self-contained schema for
  llguidance's `%json` (the definitions it references carried along), with objects that declare
  `properties` and say nothing of `additionalProperties` closed, as XGrammar's strict mode (vLLM's
  default backend) closes them: a generated object has only the keys the schema names.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
MAX_NODES = 20_000  # subschemas in one request's schemas: bounded work per request
MAX_DEPTH = 64

# keywords whose value is one subschema / a list of them / a name -> subschema map
ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
       "additionalItems", "unevaluatedItems", "unevaluatedProperties")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRINGS = ("pattern", "format", "$ref", "title", "description", "$schema", "$id", "$comment", "contentEncoding",
           "contentMediaType")
DEFS_PREFIXES = ("#/$defs/", "#/definitions/")
ROOT_ALIAS = "__openglm_root"  # where `standalone` puts the whole document when a pointer needs it


class SchemaError(ValueError):
    """A schema the server cannot use (the request's fault: a 400 naming the keyword at `path`)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}{reason}")
        self.path = path


def check_schema(schema: Any, where: str) -> None:
    """Raise SchemaError naming the first unusable keyword of `schema` (`where` names the schema)."""
    stack, nodes = [(schema, where, 0)], 0
    while stack:
        node, path, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SchemaError(where, f" is too large (more than {MAX_NODES} subschemas)")
        if depth > MAX_DEPTH:
            raise SchemaError(path, f" is nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError(path, f" must be a JSON schema (an object or a boolean), got {_show(node)}")
        for key, value in node.items():
            stack.extend((sub, p, depth + 1) for sub, p in _check_keyword(key, value, f"{path}.{key}"))
    _check_refs(schema, where)


def _check_keyword(key: str, value: Any, path: str) -> list[tuple[Any, str]]:
    """Check one keyword's value; return the subschemas under it to check next."""
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not names or any(not isinstance(t, str) or t not in JSON_TYPES for t in names):
            raise SchemaError(path, f" must be one of {sorted(JSON_TYPES)} or a non-empty list of them, "
                              f"got {_show(value)}")
    elif key in COUNTS:
        if not _is_count(value):
            raise SchemaError(path, f" must be a non-negative integer, got {_show(value)}")
    elif key in NUMBERS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SchemaError(path, f" must be a finite number, got {_show(value)}")
        if key == "multipleOf" and value <= 0:
            raise SchemaError(path, f" must be greater than 0, got {_show(value)}")
    elif key in STRINGS:
        if not isinstance(value, str):
            raise SchemaError(path, f" must be a string, got {_show(value)}")
    elif key == "enum":
        if not isinstance(value, list) or not value:
            raise SchemaError(path, f" must be a non-empty list, got {_show(value)}")
        _check_finite(value, path)
    elif key in ("const", "default", "examples"):
        _check_finite(value, path)
    elif key == "required":
        if not isinstance(value, list) or any(not isinstance(k, str) for k in value):
            raise SchemaError(path, f" must be a list of property names, got {_show(value)}")
    elif key == "uniqueItems":
        if not isinstance(value, bool):
            raise SchemaError(path, f" must be true or false, got {_show(value)}")
    elif key in ONE:
        if key == "items" and isinstance(value, list):  # draft 4's tuple form
            return [(sub, f"{path}[{i}]") for i, sub in enumerate(value)]
        return [(value, path)]
    elif key in LISTS:
        if not isinstance(value, list) or (not value and key != "prefixItems"):
            raise SchemaError(path, f" must be a non-empty list of schemas, got {_show(value)}")
        return [(sub, f"{path}[{i}]") for i, sub in enumerate(value)]
    elif key in MAPS:
        if not isinstance(value, dict):
            raise SchemaError(path, f" must be an object mapping names to schemas, got {_show(value)}")
        return [(sub, f"{path}.{name}") for name, sub in value.items()]
    return []


def _is_count(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 0 and float(value).is_integer()


def _check_finite(value, path: str) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise SchemaError(path, " holds a number that is not finite")
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _check_refs(schema, where: str) -> None:
    for ref, path in _refs_in(schema, where):
        if not ref.startswith("#"):
            raise SchemaError(f"{path}.$ref", f": only local references (#/...) are supported, got {ref!r}")
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaError(f"{path}.$ref", f": only JSON-pointer references (#/...) are supported, got {ref!r}")
        try:
            _pointer(schema, ref)
        except LookupError:
            raise SchemaError(f"{path}.$ref", f": {ref!r} points to nothing in the schema") from None


def _refs_in(schema, where: str = ""):
    """(ref, path of the object holding it) for every `$ref` in schema positions."""
    stack = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$ref"), str):
            yield node["$ref"], path
        for key, value in node.items():
            if key in ONE:
                stack.extend([(v, f"{path}.{key}[{i}]") for i, v in enumerate(value)] if isinstance(value, list)
                             else [(value, f"{path}.{key}")])
            elif key in LISTS and isinstance(value, list):
                stack.extend((v, f"{path}.{key}[{i}]") for i, v in enumerate(value))
            elif key in MAPS and isinstance(value, dict):
                stack.extend((v, f"{path}.{key}.{name}") for name, v in value.items())


def _pointer(root, ref: str):
    """The node a local `$ref` ("#" or "#/a/b") names; LookupError when there is none."""
    node = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = _unescape(raw)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise LookupError(ref)
    return node


def _unescape(part: str) -> str:
    part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
    return part.replace("~1", "/").replace("~0", "~")


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _show(value) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


# ---- the reading ----------------------------------------------------------------------------------
def json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _meet(a: frozenset | None, b: frozenset | None) -> frozenset | None:
    """Types admitted by both (None = any JSON value; an integer is also a number)."""
    if a is None or b is None:
        return b if a is None else a
    out = set(a & b)
    if ("number" in a and "integer" in b) or ("integer" in a and "number" in b):
        out.add("integer")
    return frozenset(out)


class Schema:
    """A checked JSON schema and the questions the grammar and the argument parser ask of it."""

    def __init__(self, root: Any, where: str):
        check_schema(root, where)
        self.root, self.where = root, where

    def types(self, node, seen: frozenset = frozenset()) -> frozenset | None:
        """The JSON types `node` admits (None: any)."""
        if node is True or node == {}:
            return None
        if node is False or not isinstance(node, dict):
            return frozenset()
        out = None
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:  # a recursive reference adds nothing new
            out = self.types(_pointer(self.root, ref), seen | {ref})
        if "type" in node:
            t = node["type"]
            out = _meet(out, frozenset(t if isinstance(t, list) else [t]))
        if "enum" in node:
            out = _meet(out, frozenset(json_type(v) for v in node["enum"]))
        if "const" in node:
            out = _meet(out, frozenset([json_type(node["const"])]))
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = [self.types(b, seen) for b in node[key]]
                union = None if any(b is None for b in branches) else frozenset().union(*branches)
                out = _meet(out, union)
        for branch in node.get("allOf", ()):
            out = _meet(out, self.types(branch, seen))
        return out

    def is_string(self, node) -> bool:
        """Whether every value `node` admits is a string (GLM writes such an argument raw)."""
        return self.types(node) == frozenset({"string"})

    def value(self, text: str, node):
        """An argument value as GLM wrote it, typed by `node` (see the module docstring)."""
        if node is not None and self.is_string(node):
            return text
        admitted = None if node is None else self.types(node)
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = _PYTHON_LITERALS.get(text.strip(), text)  # True / False / None, as Python writes them
            if decoded is text and admitted is not None and "string" not in admitted:
                decoded = _unescaped_json(text)  # JSON written escaped, as if inside a string
            if decoded is text:
                return text.strip() if admitted is None or "string" in admitted else text
        if admitted is None or json_type(decoded) in admitted or (
                json_type(decoded) == "integer" and "number" in admitted):
            return decoded
        return text if "string" in admitted else decoded

    # ---- objects (a tool's parameters)
    def object_view(self, pointer: str = "") -> tuple[list[tuple[str, str]], set[str], str | None]:
        """(declared properties as (name, pointer), required names, pointer of the schema of other
        names or None when only the declared names may appear). Follows `$ref` and merges `allOf`."""
        props: dict[str, str] = {}
        required: set[str] = set()
        extra: str | None = None
        stack, seen = [pointer], set()
        while stack:
            p = stack.pop(0)
            node = self.node(p)
            if not isinstance(node, dict):
                continue
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in seen:
                seen.add(ref)
                stack.append(ref[1:])
            for name in node.get("properties") or {}:
                props.setdefault(name, f"{p}/properties/{_escape(name)}")
            required.update(node.get("required") or ())
            ap = node.get("additionalProperties")
            if ap is True or isinstance(ap, dict):
                extra = f"{p}/additionalProperties"
            stack.extend(f"{p}/allOf/{i}" for i in range(len(node.get("allOf") or ())))
        return list(props.items()), required, extra

    def node(self, pointer: str | None):
        """The subschema at a JSON pointer ("" = the root; None = none)."""
        return None if pointer is None else _pointer(self.root, "#" + pointer)

    # ---- grammar side
    def standalone(self, pointer: str, options: dict) -> dict:
        """The subschema at `pointer` ("" = the root) as one self-contained schema for `%json`."""
        node = self.node(pointer)
        refs = _reachable_refs(self.root, node)
        if not pointer:
            out = close_objects(self.root)
        elif all(r.startswith(DEFS_PREFIXES) and r.count("/") == 2 for r in refs):  # pydantic's shape
            out = close_objects(node)
            out = out if isinstance(out, dict) else ({} if out else {"not": {}})
            for prefix in DEFS_PREFIXES:
                defs = {r[len(prefix):]: r for r in refs if r.startswith(prefix)}
                if defs:
                    out = {**out, prefix[2:-1]: {_unescape(name): close_objects(_pointer(self.root, r))
                                                 for name, r in defs.items()}}
        else:  # any other pointer: the document itself rides along, its references moved with it
            moved = close_objects(_move_refs(self.root, f"#/$defs/{ROOT_ALIAS}"))
            out = {"$defs": {ROOT_ALIAS: moved}, "$ref": f"#/$defs/{ROOT_ALIAS}{pointer}"}
        if isinstance(out, bool):
            out = {} if out else {"not": {}}
        return {**out, "x-guidance": options}


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def _unescaped_json(text: str):
    """`text` decoded as JSON once its escaped quotes (\\") are plain ones, else `text` itself."""
    if '\\"' not in text:
        return text
    try:
        return json.loads(text.replace('\\"', '"'))
    except ValueError:
        return text


def _reachable_refs(root, node) -> set[str]:
    refs, stack = set(), [node]
    while stack:
        for ref, _ in _refs_in(stack.pop()):
            if ref not in refs:
                refs.add(ref)
                stack.append(_pointer(root, ref))
    return refs


def _move_refs(node, prefix: str):
    """A copy of `node` whose local references point into `prefix` instead of the document root."""
    if isinstance(node, dict):
        out = {k: _move_refs(v, prefix) for k, v in node.items()}
        if isinstance(node.get("$ref"), str):
            out["$ref"] = prefix + node["$ref"][1:]
        return out
    if isinstance(node, list):
        return [_move_refs(v, prefix) for v in node]
    return node


def close_objects(node):
    """A copy of `node` in which every object schema that declares `properties` but says nothing of
    other keys (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) allows none."""
    if isinstance(node, list):
        return [close_objects(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ONE:
            out[key] = close_objects(value)
        elif key in LISTS:
            out[key] = [close_objects(v) for v in value]
        elif key in MAPS:
            out[key] = {name: close_objects(v) for name, v in value.items()}
        else:
            out[key] = value
    if "properties" in out and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                           "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out
