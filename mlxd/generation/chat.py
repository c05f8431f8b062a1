"""Canonical chat messages for chat templates, whatever API they came from.

Adapters convert their API's messages into this one shape (OpenAI-like: content
a string or a list of parts). The parts reach the engine's input processor
intact; it decides how content becomes template content (a text model keeps
the text parts, a vision model also its image parts) and renders the result
with the model's chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.generation.params import ToolChoice, ToolSpec
from mlxd.generation.tools import ToolCallFormat

# content part type -> (what it holds, what to do instead); the wording names the content,
# not the part type: an Anthropic image block arrives here as an 'image_url' part.
_UNREADABLE = {
    "image_url": ("images", "Use a vision-language model for images."),
    "input_image": ("images", "Use a vision-language model for images."),
    "image": ("images", "Use a vision-language model for images."),
    "video_url": ("video", "Use a vision-language model for video."),
    "input_audio": ("audio", "Transcribe it with POST /v1/audio/transcriptions (a speech-to-"
                             "text model) and send the text."),
    "file": ("files", "Send the file's text as a text part."),
}


def unreadable_part(kind: Any, where: str, reader: str) -> InvalidRequest:
    """The 400 for a content part ``reader`` (e.g. "a text model") cannot read."""
    if kind in _UNREADABLE:
        what, instead = _UNREADABLE[kind]
        return InvalidRequest(f"This model is {reader} and cannot read {what}. {instead}",
                              param=where, code="unsupported_content")
    return InvalidRequest(f"Unsupported content part type: {kind!r}", param=where)


def content_text(content: Any, *, where: str = "messages") -> str:
    """Flatten OpenAI-style content (string or list of parts) into text.

    Image, audio or file parts are refused here: text models cannot read them.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text"):
                texts.append(str(part.get("text", "")))
            else:
                raise unreadable_part(kind, where, "a text model")
        return "".join(texts)
    raise InvalidRequest("Message content must be a string or a list of parts.", param=where)


def _arguments_object(arguments: Any) -> Any:
    """Templates expect arguments as a mapping; OpenAI sends a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def _text_content(content: Any, where: str) -> Any:
    return content_text(content, where=where)


def template_messages(messages: list[dict[str, Any]],
                      content: Callable[[Any, str], Any] = _text_content) -> list[dict[str, Any]]:
    """Messages ready for ``apply_chat_template``.

    ``content(value, where)`` turns one message's content into what the
    template takes; by default the text of its parts (media parts are a 400).
    """
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m["role"],
                               "content": content(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": tc.get("id"), "type": "function",
                 "function": {"name": tc["function"]["name"],
                              "arguments": _arguments_object(tc["function"].get("arguments"))}}
                for tc in m["tool_calls"]]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in (chat_template or "")


def tools_system_prompt(tools: list[ToolSpec], fmt: ToolCallFormat, choice: ToolChoice) -> str:
    """Describe tools for models whose chat template does not render them."""
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    start, end = (fmt.start, fmt.end) if fmt.json_body and fmt.end else ("<tool_call>", "</tool_call>")
    rule = {
        "required": "You must call one of the functions.",
        "function": f"You must call the function '{choice.name}'.",
    }.get(choice.mode, "Call a function only when it helps answer the user.")
    return (
        "You have access to the following functions:\n<tools>\n" + listing + "\n</tools>\n"
        f"{rule} To call a function, reply with a JSON object inside {start}{end} tags:\n"
        f'{start}{{"name": "<function-name>", "arguments": {{...}}}}{end}'
    )


def with_tools_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def late_system_indices(messages: list[dict[str, Any]]) -> list[int]:
    """Positions of system messages that come after the conversation started (after the
    first non-system message): Anthropic's mid-conversation system messages, OpenAI's
    system or developer messages between turns."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    return [i for i in range(first, len(messages)) if messages[i]["role"] == "system"]


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Late system messages appended, in order, to the leading system message (created
    when there is none), for chat templates that cannot render a system turn mid-way."""
    late = late_system_indices(messages)
    if not late:
        return messages
    texts = [content_text(messages[i]["content"]) for i in late]
    rest = [m for i, m in enumerate(messages) if i not in set(late)]
    lead = [m for m in rest if m["role"] == "system"]
    body = [m for m in rest if m["role"] != "system"]
    head = "\n\n".join([*(content_text(m["content"]) for m in lead), *texts])
    return [{"role": "system", "content": head}, *body]
