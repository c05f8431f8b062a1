"""POST /v1/audio/speech and GET /v1/audio/voices: the OpenAI speech adapter.

Every refusal that needs no model comes first, in order: the model's kind,
the input's length (``--max-speech-input-chars``), the speed range, and the
voice (read from the model's files when it is not loaded). Then the model is
leased; its first sentence is synthesised before the response starts (so a
failure there is still an error status), and the rest streams as it is made,
encoded on a thread: raw audio chunks, or OpenAI's ``speech.audio.delta`` /
``speech.audio.done`` events.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.engines.base import SPEECH, AudioChunk, SpeechRequest, SpeechSynthesizer
from mlxd.errors import InvalidRequest
from mlxd.media.audio_encode import MEDIA_TYPES, SpeechEncoder, speech_encoder
from mlxd.models.catalog import CatalogError, local_path_of
from mlxd.models.residency import ResidencyManager
from mlxd.models.spec import TTS_KINDS
from mlxd.models.voices import VoiceFile, check_speed, check_voice, resolve_voice, voices_in
from mlxd.protocol.speech import SpeechCreateRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.sse import SSE_HEADERS, sse_data

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/audio/speech"
VOICES = "/v1/audio/voices"


def check_input(text: str, max_chars: int) -> None:
    if not text.strip():
        raise InvalidRequest("input is empty; give the text to speak.", param="input")
    if len(text) > max_chars:
        raise InvalidRequest(f"input has {len(text)} characters; this server speaks at most "
                             f"{max_chars} per request (--max-speech-input-chars).",
                             param="input", code="input_too_long")


async def model_voices(ctx: ServerContext, res: ResidencyManager) -> list[VoiceFile]:
    """The loaded model's voices (read through a lease, so it stays loaded meanwhile), else
    those in its files if they are on disk ([]: unknown until it loads)."""
    async with ctx.manager.lease_if_loaded(res.name, SPEECH) as lease:
        if lease is not None:
            return [VoiceFile(v.id, v.name, v.language) for v in lease.engine.facts().voices]
    try:
        folder = local_path_of(res.entry, ctx.config.home)
        return voices_in(folder) if folder is not None else []
    except (CatalogError, OSError, ValueError):  # bad source or JSON: the load will say why
        return []


async def _encoded(first: AudioChunk | None, rest: AsyncIterator[AudioChunk],
                   encoder: SpeechEncoder) -> AsyncGenerator[bytes, None]:
    """The encoder's output for ``first`` and then every later chunk, and its trailer."""
    try:
        if first is not None:
            yield await asyncio.to_thread(encoder.encode, first.pcm)
            async for chunk in rest:
                data = await asyncio.to_thread(encoder.encode, chunk.pcm)
                if data:
                    yield data
        yield await asyncio.to_thread(encoder.finish)
    finally:
        close = getattr(rest, "aclose", None)
        if close is not None:  # stops synthesis when the client goes away
            await close()


async def _audio_body(stream: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(stream):
        async for data in stream:
            if data:
                yield data


async def _sse_body(stream: AsyncGenerator[bytes, None], characters: int) -> AsyncIterator[str]:
    async with contextlib.aclosing(stream):
        async for data in stream:
            if data:
                yield sse_data({"type": "speech.audio.delta",
                                "audio": base64.b64encode(data).decode("ascii")})
    # These models read characters, not tokens: input_tokens counts characters.
    yield sse_data({"type": "speech.audio.done",
                    "usage": {"input_tokens": characters, "output_tokens": 0,
                              "total_tokens": characters}})


def _sse_error(error: StreamError) -> str:
    return sse_data({"type": "error", "error": {
        "message": error.message, "type": "invalid_request_error" if error.status < 500
        else "server_error", "param": None, "code": "speech_failed"}})


_AUDIO_BODY = {"schema": {"type": "string", "format": "binary"}}


@router.post(ENDPOINT, response_class=StreamingResponse, responses={200: {
    "description": "The speech in ``response_format`` (chunked as it is made), or "
                   "``speech.audio.delta`` / ``speech.audio.done`` events with "
                   "``stream_format: sse``",
    "content": {media: _AUDIO_BODY for media in dict.fromkeys(MEDIA_TYPES.values())}}})
async def create_speech(req: SpeechCreateRequest,
                        ctx: ServerContext = Depends(get_ctx)) -> StreamingResponse:
    """Speak ``input`` with ``voice``; the audio streams back sentence by sentence."""
    ctx.manager.check_kind(req.model, SPEECH, ENDPOINT)
    check_input(req.input, ctx.config.max_speech_input_chars)
    check_speed(req.speed)
    res = ctx.manager.get(req.model)
    own = [v.id for v in await model_voices(ctx, res)]
    aliases = res.entry.voice_aliases
    voice = req.voice if req.voice in own else resolve_voice(req.voice, aliases)
    check_voice(voice, own, res.name, aliases)
    lease = await ctx.manager.acquire(req.model, SPEECH, ENDPOINT)
    try:
        engine: SpeechSynthesizer = lease.engine
        chunks = engine.synthesize(SpeechRequest(text=req.input, voice=voice,
                                                 speed=req.speed, instructions=req.instructions))
        first = await anext(chunks, None)  # errors here are still an HTTP status
        rate = first.sample_rate if first else engine.facts().sample_rate or 24_000
        stream = _encoded(first, chunks, speech_encoder(req.response_format, rate))
    except BaseException:
        await lease.release()
        raise
    if req.stream_format == "sse":
        return StreamingResponse(leased_stream(_sse_body(stream, len(req.input)), lease.release,
                                               _sse_error, "speech synthesis failed"),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return StreamingResponse(leased_stream(_audio_body(stream), lease.release),
                             media_type=MEDIA_TYPES[req.response_format])


@router.get(VOICES)
async def list_voices(model: str | None = Query(None, description="a text-to-speech model"),
                      ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    """The voices of ``model`` (or of every speech model), without loading any."""
    if model is not None:
        ctx.manager.check_kind(model, SPEECH, VOICES)
        residencies = [ctx.manager.get(model)]
    else:
        residencies = [r for r in ctx.manager.residencies() if r.kind in TTS_KINDS]
    data = [{"id": v.id, "name": v.name, "language": v.language, "model": r.name,
             "aliases": [a for a, target in r.entry.voice_aliases.items() if target == v.id]}
            for r in residencies for v in await model_voices(ctx, r)]
    return JSONResponse({"object": "list", "data": data})
