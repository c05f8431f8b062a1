"""Ollama requests -> the API-neutral ``GenerationRequest``; names and ``keep_alive``.

* ``options`` map onto sampling: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``seed`` (negative: random), ``repeat_penalty``, ``presence_penalty``,
  ``frequency_penalty``, ``stop``, ``num_predict`` (-1, -2 or absent: up to the end of
  the context, or the registry entry's ``max_tokens``). Other options are ignored;
  one left out takes the registry entry's default (``server/request_policy.py``).
* ``format``: ``"json"`` or a JSON schema, through constrained decoding.
* ``think``: the chat template's ``enable_thinking``; the reasoning split is the
  pipeline's, as for every API.
* Messages: ``images`` (base64) become image parts (a vision model reads them, a text
  model refuses them); assistant ``tool_calls`` get ids when they have none, and a
  ``tool`` message answers the earliest unanswered call of its ``tool_name``.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from mlxd.errors import InvalidRequest, ModelNotFound
from mlxd.generation.params import Constraint, GenerationRequest, SamplingChoices, ToolChoice
from mlxd.protocol.ollama import ChatRequest, GenerateRequest, Message, Options
from mlxd.server.context import ServerContext
from mlxd.server.request_policy import sampling_choices
from mlxd.server.tool_checks import check_json_schema, resolve_tool_choice, tool_spec_list

_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0}
_IMAGE_MAGIC = {"/9j/": "image/jpeg", "iVBOR": "image/png", "R0lGOD": "image/gif",
                "UklGR": "image/webp", "Qk": "image/bmp"}


def ndjson(payload: dict[str, Any]) -> str:
    """One line of an NDJSON stream (Ollama's streaming format)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


def resolve_name(ctx: ServerContext, name: str) -> str:
    """The registered name for ``name`` (a LoRA adapter's own name: it runs with the
    adapter); Ollama's default tag ``:latest`` may be left on."""
    for candidate in (name, name.removesuffix(":latest")):
        try:
            model = ctx.manager.resolve_name(candidate)
        except ModelNotFound:
            continue
        return candidate if candidate in ctx.manager.get(model).entry.adapters else model
    raise ModelNotFound(name, ctx.manager.names)


def keep_alive_seconds(value: float | int | str | None) -> float | None:
    """Ollama's ``keep_alive``: seconds, or a Go duration (``"5m"``, ``"1h30m"``); negative
    means forever (``inf``). None: not given."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise InvalidRequest("keep_alive must be a number of seconds or a duration "
                                 "such as '5m'.", param="keep_alive")
        return math.inf if value < 0 else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    parts = _GO_DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidRequest(f"keep_alive {value!r} is not a duration: use seconds (a number) "
                             "or a value such as '30s', '5m', '1h30m' (negative: keep loaded).",
                             param="keep_alive")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    return math.inf if sign < 0 else seconds


def _options(options: Options | None) -> tuple[SamplingChoices, int | None, list[str]]:
    """(sampling, num_predict, stop) from Ollama's ``options``: the client's values only
    (``TextSession.open`` fills in the model's defaults)."""
    o = options or Options()
    sampling = sampling_choices(
        temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
        seed=o.seed if o.seed is not None and o.seed >= 0 else None,
        repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty)
    num_predict = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    return sampling, num_predict, [s for s in o.stop or [] if s]


def constraint_of(fmt: str | dict[str, Any] | None) -> Constraint | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return Constraint("json_object")
    return Constraint("json_schema", check_json_schema(fmt, param="format"))


def _data_url(image: str, where: str) -> str:
    data = image.strip()
    if not data:
        raise InvalidRequest(f"{where} is empty; images are base64-encoded files.", param=where)
    if data.startswith("data:"):
        return data
    mime = next((m for magic, m in _IMAGE_MAGIC.items() if data.startswith(magic)), "image/png")
    return f"data:{mime};base64,{data}"


def _with_images(text: str, images: list[str] | None, where: str) -> str | list[dict[str, Any]]:
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts += [{"type": "image_url", "image_url": {"url": _data_url(img, f"{where}[{i}]")}}
              for i, img in enumerate(images)]
    return parts


def _assistant(message: Message, pending: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.thinking:
        out["reasoning_content"] = message.thinking
    calls = []
    for call in message.tool_calls or []:
        call_id = call.id or f"call_{uuid.uuid4().hex[:24]}"
        pending.append((call_id, call.function.name))
        arguments = call.function.arguments
        calls.append({"id": call_id, "type": "function", "function": {
            "name": call.function.name,
            "arguments": arguments if isinstance(arguments, str) else
            json.dumps(arguments, ensure_ascii=False)}})
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_result(message: Message, pending: list[tuple[str, str]]) -> dict[str, Any]:
    call_id = message.tool_call_id
    if call_id is None:
        match = next((i for i, (_, name) in enumerate(pending)
                      if message.tool_name in (None, name)), None)
        call_id = pending.pop(match)[0] if match is not None else f"call_{uuid.uuid4().hex[:24]}"
    else:
        pending[:] = [p for p in pending if p[0] != call_id]
    out: dict[str, Any] = {"role": "tool", "content": message.content or "",
                           "tool_call_id": call_id}
    if message.tool_name:
        out["name"] = message.tool_name
    return out


def canonical_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # tool calls not answered yet: (id, name)
    for i, message in enumerate(messages):
        if message.role == "assistant":
            out.append(_assistant(message, pending))
        elif message.role == "tool":
            out.append(_tool_result(message, pending))
        else:
            out.append({"role": message.role, "content": _with_images(
                message.content or "", message.images, f"messages[{i}].images")})
    return out


def _template_kwargs(req: ChatRequest | GenerateRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if req.think is not None:
        kwargs["enable_thinking"] = req.think is not False
        if isinstance(req.think, str):
            kwargs["reasoning_effort"] = req.think
    return kwargs


def _request(req: ChatRequest | GenerateRequest, **fields: Any) -> GenerationRequest:
    sampling, num_predict, stop = _options(req.options)
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
    # num_predict absent (or -1/-2): the engine's default (the registry's or --max-tokens),
    # else the rest of the context; a larger one is capped (generation/output_length.py)
    return GenerationRequest(sampling_choices=sampling, stop=stop, logprobs=req.logprobs,
                             max_tokens=num_predict,
                             top_logprobs=req.top_logprobs, constraint=constraint_of(req.format),
                             chat_template_kwargs=_template_kwargs(req), **fields)


def chat_request(req: ChatRequest) -> GenerationRequest:
    tools = tool_spec_list(((t.function.name, t.function.description, t.function.parameters)
                            for t in req.tools or []), param="tools", schema_field="parameters")
    choice: ToolChoice = resolve_tool_choice(None, None, tools)
    return _request(req, messages=canonical_messages(req.messages), tools=tools,
                    tool_choice=choice)


def generate_request(req: GenerateRequest) -> GenerationRequest:
    """A templated prompt (``system`` + ``prompt`` + ``images``), or with ``raw`` the prompt as is."""
    for field in ("suffix", "template"):
        if getattr(req, field):
            raise InvalidRequest(f"{field} is not supported by this server; leave it out "
                                 "(the model's own chat template is used).", param=field)
    if req.context:
        raise InvalidRequest("context (the deprecated conversation memory) is not supported; "
                             "send the conversation to /api/chat.", param="context")
    if req.raw:
        if req.images:
            raise InvalidRequest("images need the chat template; leave out raw.", param="images")
        return _request(req, prompt=req.prompt)
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    messages.append({"role": "user", "content": _with_images(req.prompt, req.images, "images")})
    return _request(req, messages=messages)
