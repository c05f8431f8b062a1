"""Every JSON request model is strictly typed (issue 31 item 10).

A number field takes a JSON number, never a string (``"2.5"``) or a boolean
(``true``); an integer field takes no fractional number either; a boolean field
takes only ``true`` / ``false``. This walks every pydantic model in
``mlxd/protocol`` that a JSON body is read into (responses going out and the
multipart transcription form, whose fields arrive as strings, are not), and one
route per API shows the refusal on the wire.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from typing import Annotated, Any

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

import mlxd.protocol
from tests.helpers.server import RunningServer

NOT_JSON_BODIES = {"TranscriptionForm"}  # multipart text fields: strings by nature


def _models_in(annotation: Any) -> set[type[BaseModel]]:
    """The pydantic models an annotation names, through unions and containers."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return {annotation}
    return {m for arg in typing.get_args(annotation) for m in _models_in(arg)}


def _response_side(models: list[type[BaseModel]]) -> set[type[BaseModel]]:
    """Models that only describe what the server sends: ``*Response`` models, their
    bases and the models their fields hold, unless a request model holds them too."""
    def closure(roots: set[type[BaseModel]]) -> set[type[BaseModel]]:
        seen: set[type[BaseModel]] = set()
        todo = list(roots)
        while todo:
            model = todo.pop()
            if model in seen:
                continue
            seen.add(model)
            todo += [b for b in model.__mro__[1:] if issubclass(b, BaseModel) and b is not BaseModel]
            for field in model.model_fields.values():
                todo += _models_in(field.annotation)
        return seen

    responses = {m for m in models if m.__name__.endswith("Response")}
    requests = {m for m in models if m not in closure(responses)}
    return closure(responses) - closure(requests)


def request_models() -> list[type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}
    for info in pkgutil.iter_modules(mlxd.protocol.__path__):
        module = importlib.import_module(f"mlxd.protocol.{info.name}")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseModel)
                    and obj.__module__ == module.__name__ and name not in NOT_JSON_BODIES):
                found[f"{info.name}.{name}"] = obj
    outgoing = _response_side(list(found.values()))
    return [found[k] for k in sorted(found) if found[k] not in outgoing]


def scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types (bool, int, float, str) an annotation admits, through unions,
    Optional, Annotated and containers."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return scalar_kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict, tuple):
        return set().union(*(scalar_kinds(a) for a in typing.get_args(annotation)))
    return {annotation} & {bool, int, float, str}


def wrong_values(kinds: set[type]) -> list[Any]:
    """JSON values of the wrong type for a field admitting ``kinds``."""
    if float in kinds:
        values: list[Any] = ["2.5", True]
    elif int in kinds:
        values = ["2", True, 2.5]
    elif bool in kinds:
        values = ["true", 1]
    else:
        return []
    values = [v for v in values if type(v) not in kinds]
    return values + [[v] for v in values]  # inside a list, for list fields


FIELDS = [(model, name) for model in request_models() for name, field in
          model.model_fields.items() if wrong_values(scalar_kinds(field.annotation))]


def test_the_walk_finds_the_request_models() -> None:
    names = {m.__name__ for m in request_models()}
    assert {"ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "ResponsesRequest",
            "EmbeddingRequest", "RerankRequest", "SpeechCreateRequest",
            "TokenizeRequest"} <= names
    assert len(FIELDS) > 30


@pytest.mark.parametrize("model,name", FIELDS, ids=[f"{m.__name__}.{n}" for m, n in FIELDS])
def test_every_number_and_boolean_field_is_strict(model: type[BaseModel], name: str) -> None:
    field = model.model_fields[name]
    annotation: Any = (Annotated.__class_getitem__((field.annotation, *field.metadata))
                       if field.metadata else field.annotation)
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)
    strict = bool(model.model_config.get("strict"))
    accepted = []
    for value in wrong_values(scalar_kinds(field.annotation)):
        try:
            adapter.validate_python(value, strict=strict or None)
        except ValidationError:
            continue
        accepted.append(value)
    assert not accepted, f"{model.__name__}.{name} accepts {accepted}"


@pytest.mark.parametrize("speed", [True, "2.5", "1"])
def test_speech_speed_must_be_a_number(tiny_server: RunningServer, speed: Any) -> None:
    r = httpx.post(tiny_server.url + "/v1/audio/speech", timeout=30, json={
        "model": "tiny", "input": "hello", "voice": "alloy", "speed": speed})
    assert r.status_code in (400, 422), r.text
    err = r.json()["error"]
    assert "speed" in str(err.get("param")) + err["message"], err
