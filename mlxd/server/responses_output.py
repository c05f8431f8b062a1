"""Pipeline events -> Responses API output items, response objects and stream events.

``ReasoningDelta`` -> a ``reasoning`` item (``reasoning_text`` content),
``TextDelta`` -> a ``message`` item (``output_text`` content), ``ToolCall`` ->
a ``function_call`` item (with its ``namespace`` when the tool came in one), or
a ``custom_tool_call`` item with the call's text ``input`` for a custom tool.
``OutputItems`` builds the items and the stream
events that describe their growth; the non-streaming response uses the same
builder, so both carry the same output.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from mlxd.generation.events import Event, Finish, ReasoningDelta, TextDelta, ToolCall, Usage
from mlxd.generation.params import GenerationRequest
from mlxd.protocol.responses import ResponsesRequest
from mlxd.server.responses_input import ToolName, ToolTable

StreamEvent = dict[str, Any]  # {"type": "response.…", …}; sequence_number added when sent


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, built from events."""

    def __init__(self, tools: ToolTable | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning" or "message" while text is flowing
        self._tools = tools or ToolTable()

    def feed(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, ReasoningDelta) and event.text:
            return self._text("reasoning", event.text)
        if isinstance(event, TextDelta) and event.text:
            return self._text("message", event.text)
        if isinstance(event, ToolCall):
            return self.close() + self._function_call(event)
        return []

    def close(self, status: str = "completed") -> list[StreamEvent]:
        """Finish the open reasoning or message item."""
        if self._open is None:
            return []
        self._open = None
        item, index = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        item["status"] = status
        ref = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done: StreamEvent = {"type": "response.reasoning_text.done", **ref,
                                 "text": part["text"]}
        else:
            done = {"type": "response.output_text.done", **ref, "text": part["text"],
                    "logprobs": []}
        return [done, {"type": "response.content_part.done", **ref, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index,
                 "item": _copy(item)}]

    def _text(self, kind: str, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._open != kind:
            events += self.close()
            events += self._open_item(kind)
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += text
        ref = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", **ref, "delta": text})
        else:
            events.append({"type": "response.output_text.delta", **ref, "delta": text,
                           "logprobs": []})
        return events

    def _open_item(self, kind: str) -> list[StreamEvent]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                                    "content": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.items)
        added = [{"type": "response.output_item.added", "output_index": index,
                  "item": _copy(item)},
                 {"type": "response.content_part.added", "item_id": item["id"],
                  "output_index": index, "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        self.items.append(item)
        self._open = kind
        return added

    def _function_call(self, call: ToolCall) -> list[StreamEvent]:
        tool = self._tools.client.get(call.name, ToolName(call.name))
        custom = tool.freeform and call.freeform
        field, kind = ("input", "custom_tool_call") if custom else ("arguments", "function_call")
        item: dict[str, Any] = {"id": new_id("ctc" if custom else "fc"), "type": kind,
                                "call_id": call.id, "name": tool.name}
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        item.update({field: "", "status": "in_progress"})
        index = len(self.items)
        events: list[StreamEvent] = [
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        # A call cut off by max_output_tokens keeps its arguments as far as generated.
        item.update({field: call.arguments,
                     "status": "completed" if call.complete else "incomplete"})
        self.items.append(item)
        ref = {"item_id": item["id"], "output_index": index}
        prefix = "response.custom_tool_call_input" if custom \
            else "response.function_call_arguments"
        done: StreamEvent = {"type": f"{prefix}.done", **ref, field: call.arguments}
        if not custom:
            done["name"] = tool.name
        return [
            *events,
            {"type": f"{prefix}.delta", **ref, "delta": call.arguments},
            done,
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]

    def assistant_message(self) -> dict[str, Any]:
        """The output as one canonical assistant message (for ``previous_response_id``)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.items
                            if i["type"] == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": self._tools.model_name(i["name"], i.get("namespace")),
                               "arguments": i["arguments"] if "arguments" in i else
                               json.dumps({"input": i["input"]}, ensure_ascii=False)}}
                 for i in self.items if i["type"] in ("function_call", "custom_tool_call")]
        if calls:
            message["tool_calls"] = calls
        return message


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item.get("content", [])]}


def usage_responses(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.total_tokens}


def _tool_choice_echo(gen: GenerationRequest, tools: ToolTable) -> Any:
    choice = gen.tool_choice
    if choice.mode == "function":
        tool = tools.client.get(choice.name or "", ToolName(choice.name or ""))
        return {"type": "custom" if tool.freeform else "function", "name": tool.name}
    return choice.mode


def _text_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


class ResponseRun:
    """One response being generated: its id, its output and its wire objects."""

    def __init__(self, req: ResponsesRequest, gen: GenerationRequest,
                 tools: ToolTable | None = None) -> None:
        self.req = req
        self.gen = gen
        self.tools = tools or ToolTable()
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.output = OutputItems(self.tools)
        self._sequence = 0

    def response(self, status: str, usage: Usage | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in its current state."""
        req, gen = self.req, self.gen
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model, "output": [_copy(i) for i in self.output.items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": gen.sampling.temperature,
            "text": _text_echo(req), "tool_choice": _tool_choice_echo(gen, self.tools),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "prompt_cache_key": req.prompt_cache_key,
            "top_p": gen.sampling.top_p, "truncation": "disabled",
            "usage": usage_responses(usage) if usage else None,
            "user": req.user, "metadata": req.metadata or {},
        }

    def sequenced(self, event: StreamEvent) -> StreamEvent:
        """Stamp the next ``sequence_number`` on a stream event."""
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return event

    def finish(self, finish: Finish) -> tuple[dict[str, Any], list[StreamEvent]]:
        """The final response object and the stream events that end it."""
        if finish.reason == "error":
            error = {"code": "server_error", "message": finish.error or "generation failed"}
            events = self.output.close("incomplete")
            final = self.response("failed", finish.usage, error)
            return final, [*events, {"type": "response.failed", "response": final}]
        status = "incomplete" if finish.reason == "length" else "completed"
        events = self.output.close(status)
        final = self.response(status, finish.usage)
        return final, [*events, {"type": f"response.{status}", "response": final}]
