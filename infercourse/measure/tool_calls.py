"""Is this a tool call, and a valid one? A model's call parsed, checked against the tools
offered, and tool sets of any size.

A call is **valid** when three things hold, checked in this order (`call_validity` says which
failed first):

1. it **parses**: the template's call format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n
   </tool_call>`, the course's ChatML templates) around one JSON object with a string `name`
   and an object of `arguments`;
2. it **names a tool that was offered**: a small model offered many tools invents names, or
   writes a neighbour's name half-way;
3. its **arguments are valid** against that tool's JSON schema: required fields present, each
   of the right type.

Arguments are checked with the `jsonschema` package where it is installed (the course's
extras bring it); without it, `_check` covers what these schemas use: `type` (object, string,
integer, number, boolean, array), `required`, `properties`, `enum`, `items`, and
`additionalProperties: false`. Both say why an argument set is invalid.

`synthetic_tools(n)` gives n schemas in the OpenAI shape: the course's 15 coding-agent tools
(data/coding_agent_tools.json) first, then generated ones shaped like the tools MCP servers
expose (a service, an action on a resource, two or three typed arguments, a one-line
description; compact, so that a hundred fit the embedded model's window), seeded: the same n always gives the same tools, and n tools are a prefix of n+1.
"""
from __future__ import annotations

import json
import random
from typing import Any, Sequence

from infercourse.measure.workloads import DATA_DIR

__all__ = ["CALL_OPEN", "CALL_CLOSE", "parse_call", "check_arguments", "call_validity", "synthetic_tools",
           "tool_name"]

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "</tool_call>"   # the course's templates' call format
_PLACEHOLDERS = ("<function name>", "<arguments object>")   # the example those templates show the model

_SERVICES = ("github", "gitlab", "jira", "linear", "slack", "notion", "confluence", "postgres", "sqlite", "redis",
             "docker", "kubernetes", "aws_s3", "gcs", "sentry", "datadog", "pagerduty", "calendar", "gmail", "drive",
             "figma", "stripe", "browser", "npm", "pypi")
_ACTIONS = {"list": "List {r} in {s}.", "get": "Get one {r1} from {s} by id.", "search": "Search {s} {r} by text.",
            "create": "Create a {r1} in {s}.", "update": "Update a {r1} in {s}.", "delete": "Delete a {r1} from {s}."}
_RESOURCES = ("issues", "comments", "pull_requests", "branches", "messages", "pages", "tables", "rows", "keys",
              "containers", "pods", "buckets", "objects", "alerts", "events", "files", "payments", "packages")
# arguments per action (name, JSON type); the first is required, with the service's `scope`
_ARGS = {"list": (("limit", "integer"), ("cursor", "string")), "get": (("id", "string"),),
         "search": (("query", "string"), ("limit", "integer")), "create": (("title", "string"), ("body", "string")),
         "update": (("id", "string"), ("fields", "object")), "delete": (("id", "string"), ("confirm", "boolean"))}


def tool_name(tool: dict[str, Any]) -> str:
    """The name of a tool in either shape (OpenAI `function`, Anthropic `name`)."""
    return tool["function"]["name"] if tool.get("type") == "function" else tool["name"]


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters", {}) if tool.get("type") == "function" else tool.get("input_schema", {})


def synthetic_tools(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` tool schemas (OpenAI shape): the course's 15 first, then generated ones (module
    docstring), with distinct names. The same (n, seed) always gives the same list.

    Args:
        n: how many (1 or more).
        seed: the generator's seed (the generated part only).
    """
    if n < 1:
        raise ValueError(f"need at least one tool, got {n}")
    course = json.loads((DATA_DIR / "coding_agent_tools.json").read_text())
    out = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                             "parameters": t["input_schema"]}} for t in course[:n]]
    rng, seen = random.Random(seed), {tool_name(t) for t in out}
    while len(out) < n:
        s, a, r = rng.choice(_SERVICES), rng.choice(sorted(_ACTIONS)), rng.choice(_RESOURCES)
        name = f"{s}_{a}_{r}"
        if name in seen:
            continue
        seen.add(name)
        # compact on purpose (no per-argument descriptions): 100 of them must fit the
        # embedded model's 8,192-token window beside the course's 15 (~110 tokens each)
        props = {"scope": {"type": "string"}, **{k: {"type": t} for k, t in _ARGS[a]}}
        desc = _ACTIONS[a].format(s=s.replace("_", " "), r=r.replace("_", " "), r1=r.rstrip("s").replace("_", " "))
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": props, "required": ["scope", _ARGS[a][0][0]]}}})
    return out


def parse_call(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The first call in `text`, as {"name", "arguments"}: (call, None), or (None, why not).

    Args:
        text: the model's output, with or without the opening `<tool_call>` tag (a call
            opened by a prefill continues without it); anything after `</tool_call>` is ignored.
    """
    body = text.split(CALL_OPEN.strip(), 1)[1] if CALL_OPEN.strip() in text else text
    body = body.split(CALL_CLOSE, 1)[0].strip()
    if not body.startswith("{"):
        return None, f"no JSON object where the call should be: {body[:60]!r}"
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except ValueError as e:
        copied = [p for p in _PLACEHOLDERS if p in body]   # a small model copies the format's example
        return None, f"not JSON ({e.msg} at character {e.pos})" + (f": copied the template's {copied[0]}" if copied else "")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "no string 'name' in the call"
    args = obj.get("arguments", {})
    if isinstance(args, str):   # some formats put the arguments in a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None, "'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, "'arguments' is not an object"
    return {"name": obj["name"], "arguments": args}, None


_TYPES = {"object": dict, "string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list}


def _check(value: Any, schema: dict[str, Any], where: str = "arguments") -> str | None:
    """The small checker (module docstring): None when `value` fits `schema`, else why not."""
    t = schema.get("type")
    if t in _TYPES and (not isinstance(value, _TYPES[t]) or (t in ("integer", "number") and isinstance(value, bool))):
        return f"{where} should be {t}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} is not one of {schema['enum']}"
    if isinstance(value, dict):
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{where} lacks required {missing}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return f"{where} has fields the schema does not allow: {sorted(set(value) - set(props))}"
        for k, v in value.items():
            if k in props and (why := _check(v, props[k], f"{where}.{k}")):
                return why
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            if why := _check(v, schema["items"], f"{where}[{i}]"):
                return why
    return None


def check_arguments(args: Any, schema: dict[str, Any]) -> str | None:
    """None when `args` is valid against the JSON `schema`, else why not (`jsonschema` where
    installed, else the small checker of the module docstring)."""
    try:
        import jsonschema
    except ImportError:
        return _check(args, schema)
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(args))
    return None if err is None else f"arguments{''.join(f'.{p}' for p in err.absolute_path)}: {err.message}"


def call_validity(output: str | dict[str, Any] | None, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The three checks of one call, in order; a later check counts only when the earlier
    ones passed: {"parses", "offered", "args_valid", "name", "why"} ("why": the first failure).

    Args:
        output: the model's text (parsed with `parse_call`), or an already parsed call
            {"name", "arguments"} (a server's `tool_calls` entry), or None (no call at all).
        tools: the tools offered, in either shape.
    """
    call, why = (output, None) if isinstance(output, dict) else \
        parse_call(output) if isinstance(output, str) else (None, "no call")
    if call is not None and isinstance(call.get("arguments"), str):
        call, why = parse_call(json.dumps({"name": call["name"], "arguments": call["arguments"]}))
    row = {"parses": call is not None, "offered": False, "args_valid": False,
           "name": call["name"] if call else None, "why": why}
    if call is None:
        return row
    schemas = {tool_name(t): _schema(t) for t in tools}
    if call["name"] not in schemas:
        return {**row, "why": f"{call['name']!r} was not offered"}
    why = check_arguments(call["arguments"], schemas[call["name"]])
    return {**row, "offered": True, "args_valid": why is None, "why": why}

