"""Tool calls cut off by ``max_tokens``: keep what the model generated.

A call whose markup ends mid-JSON is still a tool call (OpenAI returns it with
``finish_reason: length`` and the arguments as far as they were generated),
never markup in the content. ``salvage_calls`` splits a truncated JSON tool-call
body into the calls it completed and the one it was writing;
``parse_partial_json`` gives the best-effort value of a JSON prefix for APIs
that need an object (Anthropic's ``tool_use.input``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxd.generation.params import ToolSpec
from mlxd.generation.tools import (
    JSON_SEPARATORS,
    ParsedCall,
    ToolParseError,
    calls_from_json_value,
    json_values,
)

# Each retry drops one trailing member; a prefix needing more is given up on.
_MAX_CUTS = 64
_CLOSERS = {"{": "}", "[": "]"}
# The order the forced-call grammar and every JSON tool format write: name first.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?', re.S)
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)


def _scan(text: str) -> tuple[str, int | None, bool]:
    """``(closing, cut, dangling_escape)`` for a JSON prefix.

    ``closing`` closes the open string and containers; ``cut`` is where to cut
    to drop the last (possibly incomplete) member: before the last ``,`` or
    just after the last ``{``/``[`` outside strings.
    """
    stack: list[str] = []
    in_string = escape = False
    cut: int | None = None
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
            cut = i + 1
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == ",":
            cut = i
    closing = ('"' if in_string else "") + "".join(reversed(stack))
    return closing, cut, escape


def parse_partial_json(text: str) -> Any | None:
    """The value of a JSON prefix with open strings and containers closed and an
    incomplete trailing member dropped; None when nothing usable is left."""
    text = text.strip()
    for _ in range(_MAX_CUTS):
        if not text:
            return None
        closing, cut, escape = _scan(text)
        candidate = text[:-1] if escape else text
        try:
            return json.loads(candidate + closing)
        except json.JSONDecodeError:
            pass
        if cut is None or cut >= len(text):
            return None
        text = text[:cut].rstrip()
    return None


def _tool_name(name: str | None, partial: str | None, tools: list[ToolSpec]) -> str | None:
    """The call's name: as written when complete, else the one tool it can only be."""
    if name:
        return name
    names = [t.name for t in tools]
    if partial:
        names = [n for n in names if n.startswith(partial)]
    return names[0] if len(names) == 1 else None


def _decode_string(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def partial_call(text: str, tools: list[ToolSpec]) -> ParsedCall | None:
    """The call a truncated JSON body was writing: ``{"name", "arguments": <raw
    prefix>, "complete"}``; None when not even its name can be told."""
    m = _NAME.match(text)
    if m:
        raw_name = _decode_string(m["name"]) if m["closed"] else None
        partial = None if m["closed"] else _decode_string(m["name"].rstrip("\\"))
        rest = text[m.end():]
        found = _ARGS.match(rest) if m["closed"] else None
        arguments = rest[found.end():].rstrip() if found else ""
    else:
        value = parse_partial_json(text)
        value = value if isinstance(value, dict) else {}
        raw_name = value.get("name") if isinstance(value.get("name"), str) else None
        partial = None
        args = value.get("arguments", value.get("parameters"))
        arguments = json.dumps(args, ensure_ascii=False) if args is not None else ""
    name = _tool_name(raw_name, partial, tools)
    if name is None:
        return None
    return {"name": name, "arguments": arguments, "complete": _is_object(arguments)}


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def salvage_calls(body: str, tools: list[ToolSpec]) -> list[ParsedCall]:
    """The calls in a JSON tool-call body cut off mid-way: every complete one
    (``arguments`` a mapping), then the truncated one, if it can be named."""
    calls: list[ParsedCall] = []
    pos = 0  # where the values read so far end
    try:
        for value, end in json_values(body):
            calls.extend(calls_from_json_value(value))
            pos = end
    except (json.JSONDecodeError, ToolParseError):
        pass
    tail = body[pos:].lstrip(JSON_SEPARATORS)
    if tail.strip():
        if tail.lstrip().startswith("["):  # a list of calls: salvage its last element
            tail = tail.lstrip()[1:]
            calls.extend(salvage_calls(tail, tools))
        else:
            call = partial_call(tail, tools)
            if call is not None:
                calls.append(call)
    return calls
