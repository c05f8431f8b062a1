"""Shape checks of a client's JSON schema before any grammar is built from it.

Two things a valid JSON Schema can still do to a server:

* nest (through containers and local ``$ref`` hops) so deep that the schema
  validator runs out of Python recursion or the grammar compiler out of native
  stack (llguidance overflows its stack on a ~2,500-hop ``$ref`` chain and
  reports "Too many items" on long ones);
* admit no finite value at all: a ``$ref`` cycle with no way out, or a
  required property that recurses forever. llguidance then either allows
  nothing but end-of-sequence (a 200 with empty content) or fails mid-way.

Both are 400s that name the problem. Pure Python, no backend.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

from mlxd.errors import InvalidRequest

MAX_SCHEMA_DEPTH = 128  # nested containers plus $ref hops along any one path
_TYPES_WITH_CHILDREN = ("object", "array")


def _pointer(root: Any, ref: str) -> Any:
    """The target of a local ``$ref`` (``#`` or ``#/a/b``), or None when not local/found."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in [p for p in unquote(ref[1:]).split("/") if p] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(root: Any, node: Any) -> list[Any]:
    """Containers directly inside ``node``, and the target of its local ``$ref``."""
    items = list(node.values()) if isinstance(node, dict) else list(node)
    out = [c for c in items if isinstance(c, dict | list)]
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str):
        target = _pointer(root, ref)
        if isinstance(target, dict | list):
            out.append(target)
    return out


def schema_depth(root: Any) -> int:
    """Longest path of containers and ``$ref`` hops (a cycle is counted once around)."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            on_path.discard(key)
            kids = [depth.get(id(c), 0) for c in _children(root, node) if id(c) not in on_path]
            depth[key] = 1 + max(kids, default=0)
            continue
        if key in depth or key in on_path:
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(root, node)
                     if id(c) not in depth and id(c) not in on_path)
    return depth[id(root)]


def _list(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _object_finite(node: dict[str, Any], ok: Any) -> bool:
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    extra = node.get("additionalProperties", True)
    for name in _list(node, "required"):
        if not isinstance(name, str):
            continue
        sub = props.get(name, extra)
        if not ok(sub):
            return False
    return True


def _array_finite(node: dict[str, Any], ok: Any) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    items = node.get("items", True)
    prefix = _list(node, "prefixItems") or (items if isinstance(items, list) else [])
    rest = node.get("additionalItems", True) if isinstance(items, list) else items
    if not all(ok(s) for s in prefix[:least]):
        return False
    return least <= len(prefix) or ok(rest)


def _finite(root: Any, node: Any, ok: Any) -> bool:
    """Whether ``node`` admits a finite value, given ``ok`` for its subschemas."""
    if not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref)
        if target is not None and not ok(target):
            return False
    if not all(ok(s) for s in _list(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        subs = _list(node, key)
        if subs and not any(ok(s) for s in subs):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if kinds is None or any(k not in _TYPES_WITH_CHILDREN for k in kinds):
        return True
    return any(_object_finite(node, ok) if k == "object" else _array_finite(node, ok)
               for k in kinds)


def _schema_nodes(root: Any) -> list[Any]:
    """Every dict in the document, children before parents (one pass settles most)."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        items = node.values() if isinstance(node, dict) else node
        stack.extend((c, False) for c in items if isinstance(c, dict | list))
    return [n for n in order if isinstance(n, dict)]


def _inputs(root: Any, node: dict[str, Any]) -> list[Any]:
    """The dicts ``_finite`` may read for ``node``: its ``$ref`` target, children, grandchildren."""
    out: list[Any] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        out.append(_pointer(root, ref))
    for child in node.values():
        out.append(child)
        if isinstance(child, dict | list):
            out.extend(child.values() if isinstance(child, dict) else child)
    return [x for x in out if isinstance(x, dict)]


def admits_finite_value(root: Any) -> bool:
    """Least fixpoint: a schema is finite once its own rules hold over finite subschemas.

    A worklist: a node is looked at again only when one of its inputs became finite.
    """
    nodes = _schema_nodes(root)
    readers: dict[int, list[Any]] = {}
    for node in nodes:
        for dep in _inputs(root, node):
            readers.setdefault(id(dep), []).append(node)
    finite: set[int] = set()

    def ok(sub: Any) -> bool:
        return id(sub) in finite if isinstance(sub, dict) else sub is not False

    # FIFO, children first, each node queued at most once at a time: a parent with
    # thousands of required properties is not re-read after each one settles.
    pending = deque(nodes)
    queued = {id(n) for n in nodes}
    while pending:
        node = pending.popleft()
        queued.discard(id(node))
        if id(node) in finite or not _finite(root, node, ok):
            continue
        finite.add(id(node))
        for reader in readers.get(id(node), ()):
            if id(reader) not in finite and id(reader) not in queued:
                queued.add(id(reader))
                pending.append(reader)
    return ok(root)


def check_schema_depth(schema: Any, *, param: str) -> None:
    """400 when ``schema`` nests (containers and ``$ref`` hops) past ``MAX_SCHEMA_DEPTH``."""
    if isinstance(schema, dict | list) and schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(
            f"{param}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (counting "
            "nested objects, arrays and $ref hops); flatten it.", param=param)


def check_schema_satisfiable(schema: Any, *, param: str) -> None:
    """400 when no finite JSON value can satisfy ``schema``."""
    if isinstance(schema, dict) and not admits_finite_value(schema):
        raise InvalidRequest(
            f"{param}: the JSON schema can never be satisfied by a finite value (a $ref "
            "cycle with no way out, or a required property that recurses forever).",
            param=param)
