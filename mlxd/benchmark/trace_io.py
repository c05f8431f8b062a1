"""Trace requests as data: Anthropic <-> OpenAI chat shapes and the JSONL trace file.

A trace file has one request per line, in the order a client sent them:
``{"session": "s0", "api": "messages", "body": {...}}`` where ``body`` is the
JSON of a ``/v1/messages`` (``api: messages``) or ``/v1/chat/completions``
(``api: chat``) request. A bare request body per line also works (a proxy log
of Claude Code traffic, say): ``api`` is then ``messages`` when the body has a
top-level ``system`` or Anthropic content blocks, else ``chat``, and lines
without ``session`` form one session. Requests of one session are replayed in
order, one after the other; sessions run side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mlxd.benchmark.agent_trace import AgentTrace, anthropic_body

TraceApi = Literal["messages", "chat"]
MAX_TRACE_LINES = 100_000
_ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "image"}


class TraceFileError(ValueError):
    """A trace file line that is not a request (the message names the line)."""


@dataclass(frozen=True)
class TraceRequest:
    """One recorded request: its session, API and body (the model name is replaced)."""

    session: str
    api: TraceApi
    body: dict[str, Any]


def agent_requests(trace: AgentTrace, model: str = "model") -> list[list[TraceRequest]]:
    """The generated trace as sessions of ``/v1/messages`` requests."""
    return [[TraceRequest(f"s{s.index}", "messages", anthropic_body(trace, s.index, k, model))
             for k in range(len(s.turns))] for s in trace.sessions]


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t["name"],
                                              "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}}
            for t in tools]


def text_of(blocks: Any) -> str:
    """The text of a string or of a list of content blocks (text blocks only)."""
    if isinstance(blocks, str):
        return blocks
    return "\n".join(b.get("text", "") for b in blocks or [] if b.get("type") == "text")


def _assistant(content: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text_of(content)}
    calls = [{"id": b["id"], "type": "function",
              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
             for b in (content if isinstance(content, list) else []) if b["type"] == "tool_use"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text_of(b.get("content"))}
        for b in content if b["type"] == "tool_result"]
    text = text_of(content)
    if text:
        out.append({"role": "user", "content": text})
    return out


def tools_text(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as plain text, for servers whose chat template drops ``tools``."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in openai_tools(tools))
    return ("You have access to the following functions:\n<tools>\n" + listing +
            "\n</tools>\nTo call a function, reply with a JSON object inside "
            '<tool_call></tool_call> tags: <tool_call>{"name": "<function-name>", '
            '"arguments": {...}}</tool_call>')


def chat_messages(body: dict[str, Any], tools_in_system: bool = False) -> list[dict[str, Any]]:
    """An Anthropic request's ``system`` + ``messages`` as OpenAI chat messages."""
    system = text_of(body.get("system") or "")
    if tools_in_system and body.get("tools"):
        system = f"{system}\n\n{tools_text(body['tools'])}" if system else \
            tools_text(body["tools"])
    out = [{"role": "system", "content": system}] if system else []
    for m in body["messages"]:
        out += _user(m["content"]) if m["role"] == "user" else [_assistant(m["content"])]
    return out


def to_chat(body: dict[str, Any], tools_in_system: bool = False) -> dict[str, Any]:
    """An Anthropic ``/v1/messages`` body as a ``/v1/chat/completions`` body.

    ``tools_in_system``: describe the tools in the system message instead of ``tools``.
    """
    out: dict[str, Any] = {k: body[k] for k in ("model", "max_tokens", "temperature", "stream")
                           if k in body}
    out["messages"] = chat_messages(body, tools_in_system)
    if body.get("tools") and not tools_in_system:
        out["tools"] = openai_tools(body["tools"])
    return out


def guess_api(body: dict[str, Any]) -> TraceApi:
    if "system" in body:
        return "messages"
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS for b in content):
            return "messages"
    return "chat"


def _line_request(obj: Any, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFileError(f"{where}: expected a JSON object")
    body = obj.get("body", obj)
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise TraceFileError(f"{where}: a request needs a 'messages' list")
    api = obj.get("api") or guess_api(body)
    if api not in ("messages", "chat"):
        raise TraceFileError(f"{where}: api must be 'messages' or 'chat', got {api!r}")
    if api == "messages" and not isinstance(body.get("max_tokens"), int):
        raise TraceFileError(f"{where}: a /v1/messages request needs an integer max_tokens")
    return TraceRequest(str(obj.get("session", "s0")), api, body)


def read_trace_file(path: Path) -> list[list[TraceRequest]]:
    """The sessions of a JSONL trace file, in order of their first request."""
    sessions: dict[str, list[TraceRequest]] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if n > MAX_TRACE_LINES:
                raise TraceFileError(f"{path}: more than {MAX_TRACE_LINES} requests")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFileError(f"{path}:{n}: not JSON ({e.msg})") from None
            req = _line_request(obj, f"{path}:{n}")
            sessions.setdefault(req.session, []).append(req)
    if not sessions:
        raise TraceFileError(f"{path}: no requests")
    return list(sessions.values())


def write_trace_file(path: Path, sessions: list[list[TraceRequest]]) -> None:
    """Write ``sessions`` as JSONL (all of session 0, then session 1, ...)."""
    with path.open("w", encoding="utf-8") as f:
        for session in sessions:
            for r in session:
                f.write(json.dumps({"session": r.session, "api": r.api, "body": r.body},
                                   ensure_ascii=False) + "\n")
