"""POST/GET/DELETE /v1/responses: the OpenAI Responses API adapter.

A thin adapter like ``routes/chat.py``: the request becomes a
``GenerationRequest`` (``server/responses_input.py``), pipeline events become
output items (``server/responses_output.py``). Completed responses are kept
in the app's bounded ``ResponseStore`` unless ``store`` is false, so
``previous_response_id`` continues a conversation and ``GET`` returns it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.errors import GenerationFailed, InvalidRequest, NotFound
from mlxd.generation.events import Finish
from mlxd.protocol.responses import ResponsesRequest
from mlxd.server.context import ServerContext, get_ctx
from mlxd.server.json_body import StrictJSONRoute
from mlxd.server.leased_stream import StreamError, leased_stream
from mlxd.server.response_store import ResponseStore
from mlxd.server.responses_input import conversation, generation_request, tool_table
from mlxd.server.responses_output import ResponseRun
from mlxd.server.sse import SSE_HEADERS, sse_event
from mlxd.server.text_session import TextSession, finish_of

router = APIRouter(route_class=StrictJSONRoute)
ENDPOINT = "/v1/responses"


def _history(store: ResponseStore, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    stored = store.get(previous_id)
    if stored is None:
        raise InvalidRequest(f"Previous response with id '{previous_id}' not found (it was "
                             "never stored, was deleted, or was evicted from the store).",
                             param="previous_response_id", code="previous_response_not_found")
    return stored.messages


def _keep(store: ResponseStore, run: ResponseRun, response: dict[str, Any],
          messages: list[dict[str, Any]]) -> None:
    if run.req.store:
        store.put(response, [*messages, run.output.assistant_message()])


async def _respond(session: TextSession, request: Request, run: ResponseRun,
                   store: ResponseStore, messages: list[dict[str, Any]]) -> JSONResponse:
    try:
        events = (await session.collect(request))[0]
    finally:
        await session.close()
    finish = finish_of(events)
    if finish.reason == "error":
        raise GenerationFailed(finish.error or "generation failed")
    for event in events:
        run.output.feed(event)
    response, _ = run.finish(finish)
    _keep(store, run, response, messages)
    return JSONResponse(response)


async def _stream(session: TextSession, run: ResponseRun, store: ResponseStore,
                  messages: list[dict[str, Any]]) -> AsyncIterator[str]:
    """created, in_progress, item events..., then completed / incomplete / failed."""

    def send(event: dict[str, Any]) -> str:
        return sse_event(event["type"], run.sequenced(event))

    yield send({"type": "response.created", "response": run.response("in_progress")})
    yield send({"type": "response.in_progress", "response": run.response("in_progress")})
    async for item in session.stream():
        if item is None:  # keep-alive: Codex counts any SSE event as activity
            yield send({"type": "response.in_progress",
                        "response": run.response("in_progress")})
            continue
        event = item[1]
        if not isinstance(event, Finish):
            for item_event in run.output.feed(event):
                yield send(item_event)
            continue
        response, closing = run.finish(event)
        for item_event in closing:
            yield send(item_event)
        if event.reason != "error":
            _keep(store, run, response, messages)


@router.post(ENDPOINT)
async def create_response(req: ResponsesRequest, request: Request,
                          ctx: ServerContext = Depends(get_ctx)) -> Any:
    """Create a model response (streaming with ``stream: true``)."""
    store = ctx.response_store
    tools = tool_table(req)
    messages = conversation(req, _history(store, req.previous_response_id), tools)
    gen = generation_request(req, messages, tools)
    session = await TextSession.open(ctx, req.model, gen, endpoint=ENDPOINT)
    run = ResponseRun(req, gen, tools)
    if req.stream:
        def error_event(error: StreamError) -> str:
            return sse_event("error", run.sequenced({
                "type": "error", "code": error.code or "generation_failed",
                "message": error.message, "param": error.param}))

        return StreamingResponse(leased_stream(_stream(session, run, store, messages),
                                               session.close, error_event),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return await _respond(session, request, run, store, messages)


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id")


@router.get(ENDPOINT + "/{response_id}")
async def get_response(response_id: str, ctx: ServerContext = Depends(get_ctx)) -> Any:
    """A stored response, as it was returned."""
    stored = ctx.response_store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


@router.delete(ENDPOINT + "/{response_id}")
async def delete_response(response_id: str,
                          ctx: ServerContext = Depends(get_ctx)) -> dict[str, Any]:
    """Forget a stored response; it can no longer be a ``previous_response_id``."""
    if not ctx.response_store.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
