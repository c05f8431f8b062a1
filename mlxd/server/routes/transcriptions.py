"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text.

Everything that can refuse a request runs before the model is leased (so a
refused upload never loads a model): the multipart body is read as it streams
in with the upload limit enforced live (``server/multipart.py``), the fields
are validated, the model's kind is checked, and the file is decoded with its
limits checked (``media/audio_decode.py``, on a thread: decoding is CPU work
but not model code), its samples' bytes held in the memory budget from before
decoding until the response ends (``models/transient.py``). Only then is the model leased and the samples handed to
its engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from mlxd.engines.base import TRANSCRIPTION, Chunking, TranscriptionRequest
from mlxd.errors import InvalidRequest, validation_text
from mlxd.media.audio_decode import WHISPER_RATE, decode_audio, decoded_bytes, header_seconds
from mlxd.media.audio_limits import AudioLimits
from mlxd.models.transient import TransientHold
from mlxd.protocol.transcription import TranscriptionForm, form_schema
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.disconnect import unless_disconnected
from mlxd.server.multipart import MultipartForm, read_multipart
from mlxd.server.transcript_formats import render
from mlxd.server.transcript_stream import stream_transcription

router = APIRouter()
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
Task = Literal["transcribe", "translate"]
_LIST_FIELDS = {"timestamp_granularities[]": "timestamp_granularities",
                "timestamp_granularities": "timestamp_granularities"}
_CHUNKING = "chunking_strategy"
_TRANSCRIBE_ONLY = ("language", "timestamp_granularities", "stream", _CHUNKING)
# json / verbose_json are JSON objects; text, srt and vtt are plain text.
RESPONSES: dict[str, Any] = {
    "description": "The transcript in ``response_format``",
    "content": {"application/json": {"schema": {"type": "object", "required": ["text"],
                                                "properties": {"text": {"type": "string"}}}},
                "text/plain": {"schema": {"type": "string"}},
                "application/x-subrip": {"schema": {"type": "string"}},
                "text/vtt": {"schema": {"type": "string"}}}}


def _form_value(text: str) -> object:
    """A ``chunking_strategy[...]`` form field as the JSON value it spells (``0.5`` a
    number, ``true`` a boolean, which the strict model then refuses), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_form(form: MultipartForm, task: Task) -> TranscriptionForm:
    """The text fields as a validated ``TranscriptionForm`` (a 400 naming the bad field)."""
    data: dict[str, object] = {}
    for name, values in form.fields.items():
        if name.startswith(f"{_CHUNKING}[") and name.endswith("]") and len(values) == 1:
            # The openai SDK sends an object field as chunking_strategy[type]=server_vad...
            if not isinstance(data.setdefault(_CHUNKING, {}), dict):
                raise InvalidRequest("Form field 'chunking_strategy' is given twice.",
                                     param=_CHUNKING)
            key = name[len(_CHUNKING) + 1:-1]
            data[_CHUNKING][key] = _form_value(values[0]) if key != "type" else values[0]  # type: ignore[index]
        elif name in _LIST_FIELDS:
            data.setdefault(_LIST_FIELDS[name], [])
            data[_LIST_FIELDS[name]] += values  # type: ignore[operator]
        elif len(values) > 1:
            raise InvalidRequest(f"Form field '{name}' is given {len(values)} times.",
                                 param=name)
        elif name == _CHUNKING and _CHUNKING in data:
            raise InvalidRequest("Form field 'chunking_strategy' is given twice.",
                                 param=_CHUNKING)
        else:
            data[name] = values[0]
    if task == "translate":
        for name in _TRANSCRIBE_ONLY:  # OpenAI's translations take none of these
            data.pop(name, None)
    try:
        return TranscriptionForm.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        where = f"'{param}': " if param else ""
        raise InvalidRequest(f"Invalid form field {where}{validation_text(err)}.",
                             param=param) from None


async def _transcription_request(
        request: Request, ctx: ServerContext, task: Task, endpoint: str,
        holds: list[TransientHold]) -> tuple[TranscriptionForm, TranscriptionRequest]:
    """The form and the decoded job; the samples' bytes are held in the memory budget
    (``holds``, released by the caller) from before decoding on."""
    limits = AudioLimits.from_config(ctx.config)
    body = await read_multipart(request.headers.get("content-type"),
                                request.headers.get("content-length"), request.stream(),
                                file_field="file", max_file_bytes=limits.upload_bytes)
    form = parse_form(body, task)
    if body.file is None:
        raise InvalidRequest("The form has no 'file' part (the recording to transcribe).",
                             param="file")
    ctx.manager.check_kind(form.model, TRANSCRIPTION, endpoint)
    what = "this request's decoded audio"
    seconds = await asyncio.to_thread(header_seconds, body.file.data)
    holds.append(await ctx.manager.transient.hold(decoded_bytes(seconds, limits), what))
    audio = await asyncio.to_thread(decode_audio, body.file.data, limits, WHISPER_RATE)
    if audio.samples.nbytes > holds[0].nbytes:  # the header was short of the truth
        holds.append(await ctx.manager.transient.hold(
            audio.samples.nbytes - holds[0].nbytes, what))
    return form, TranscriptionRequest(
        audio=audio.samples, sample_rate=audio.sample_rate, task=task,
        language=form.language, prompt=form.prompt, temperature=form.temperature,
        word_timestamps=form.word_timestamps, chunking=chunking(form))


def chunking(form: TranscriptionForm) -> Chunking:
    """``chunking_strategy`` as the engine reads it."""
    strategy = form.chunking_strategy
    if strategy is None:
        return Chunking()
    if strategy == "sequential":
        return Chunking(mode="sequential")
    if strategy == "auto":
        return Chunking(mode="batched")
    return Chunking(mode="batched", threshold=strategy.threshold,
                    silence_duration_ms=strategy.silence_duration_ms,
                    prefix_padding_ms=strategy.prefix_padding_ms)


async def _serve(request: Request, ctx: ServerContext, task: Task, endpoint: str) -> Response:
    holds: list[TransientHold] = []

    async def release_holds() -> None:
        for hold in holds:
            await hold.release()

    streaming = False
    try:
        form, job = await _transcription_request(request, ctx, task, endpoint, holds)
        if form.stream:
            lease = await ctx.manager.acquire(form.model, TRANSCRIPTION, endpoint)
            streaming = True  # the stream releases the holds when it ends
            return await stream_transcription(request, lease, job, on_close=release_holds)
        async with ctx.manager.lease(form.model, TRANSCRIPTION, endpoint) as held:
            # a client that leaves first stops the job before its next 30 s window
            transcript = await unless_disconnected(request, held.engine.transcribe(job))
        return render(transcript, form.response_format, task, form.timestamp_granularities)
    finally:
        if not streaming:
            await release_holds()


@router.post(TRANSCRIPTIONS, openapi_extra={"requestBody": form_schema(translation=False)},
             responses={200: RESPONSES})
async def create_transcription(request: Request,
                               ctx: ServerContext = Depends(get_ctx)) -> Response:
    """Transcribe an uploaded recording (multipart ``file``) in its own language."""
    return await _serve(request, ctx, "transcribe", TRANSCRIPTIONS)


@router.post(TRANSLATIONS, openapi_extra={"requestBody": form_schema(translation=True)},
             responses={200: RESPONSES})
async def create_translation(request: Request,
                             ctx: ServerContext = Depends(get_ctx)) -> Response:
    """Translate an uploaded recording into English text."""
    return await _serve(request, ctx, "translate", TRANSLATIONS)
