"""JSON request bodies parsed once, strictly, before any route sees them.

Python's ``json`` accepts a lone UTF-16 surrogate (``"\\ud800"``) and gives a
``str`` that no tokenizer can encode and no response can echo, and it raises
``RecursionError`` on very deep nesting. Both become 400s here that name the
problem (and where it is), in the API's own error shape, instead of 500s deep
inside a tokenizer or the "error parsing the body" FastAPI would say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from mlxd.errors import InvalidRequest

# The parsed body is walked (deep nesting costs nothing to refuse) only when
# its bytes could hold a surrogate: an escape \uD800-\uDFFF, or raw ED A0-BF.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_JSON_DEPTH = 128


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _where(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "body"


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """400 naming the first lone surrogate (in a string or a key) or over-deep nesting."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if len(path) > max_depth:
            raise InvalidRequest(f"The request body nests deeper than {max_depth} levels "
                                 f"(under {_where(path[:6])}).", param=_where(path[:6]))
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InvalidRequest(
                    f"{_where(path)} contains a lone UTF-16 surrogate (such as \"\\ud800\"); "
                    "strings must be valid Unicode.", param=_where(path))
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    raise InvalidRequest(
                        f"A key in {_where(path)} contains a lone UTF-16 surrogate; strings "
                        "must be valid Unicode.", param=_where(path))
                stack.append((child, [*path, key]))
        elif isinstance(item, list):
            stack.extend((child, [*path, i]) for i, child in enumerate(item))


def parse_json_body(body: bytes) -> Any:
    """The parsed body; ``json.JSONDecodeError`` for syntax errors, 400 for the rest."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.",
                             param=None) from None
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"The request body is not valid UTF-8: {e.reason} at byte "
                             f"{e.start}.") from None
    if _MAYBE_SURROGATE.search(body) or _deeper_than(body, MAX_JSON_DEPTH):
        check_json_value(value)
    return value


def _deeper_than(body: bytes, limit: int) -> bool:
    """Cheap upper bound: fewer opening brackets than the limit cannot nest past it."""
    return body.count(b"[") + body.count(b"{") > limit


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is parsed by :func:`parse_json_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH") and _is_json(request):
                body = await request.body()
                if body:
                    # Starlette's Request.json() returns this cached value.
                    request._json = parse_json_body(body)
            return await handler(request)

        return strict_handler
