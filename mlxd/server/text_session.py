"""What every text API adapter shares: lease a model, prepare, run n choices.

The adapters (OpenAI chat/completions, Responses, Anthropic) only translate
requests into a ``GenerationRequest`` and events into their wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import Request

from mlxd.engines.base import CHAT, TextGenerator
from mlxd.errors import InvalidRequest
from mlxd.generation.events import Event, Finish, Usage
from mlxd.generation.params import GenerationRequest
from mlxd.media.limits import MediaLimits, prepared_media_bytes
from mlxd.media.resolve import has_media, resolve_media
from mlxd.media.types import resolved_media
from mlxd.models.manager import ModelLease
from mlxd.models.spec import Family, ModelKind
from mlxd.models.transient import TransientHold
from mlxd.server.context import ServerContext
from mlxd.server.disconnect import unless_disconnected
from mlxd.server.observe import current_record
from mlxd.server.request_policy import apply_serving_defaults
from mlxd.server.sse import with_keepalive

if TYPE_CHECKING:
    from mlxd.engines.base import PreparedPrompt

def merge_usage(usages: Iterable[Usage]) -> Usage:
    items = list(usages)
    if not items:
        return Usage(0, 0)
    return Usage(prompt_tokens=items[0].prompt_tokens,
                 completion_tokens=sum(u.completion_tokens for u in items),
                 cached_tokens=items[0].cached_tokens,
                 reasoning_tokens=sum(u.reasoning_tokens for u in items),
                 accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in items),
                 rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in items))


def usage_openai(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {
                "reasoning_tokens": usage.reasoning_tokens,
                "accepted_prediction_tokens": usage.accepted_prediction_tokens,
                "rejected_prediction_tokens": usage.rejected_prediction_tokens}}


async def resolve_request_media(ctx: ServerContext, model: str, request: GenerationRequest,
                         family: Family[TextGenerator], endpoint: str) -> None:
    """A vision model's images and videos, fetched, checked and probed before it is leased
    (the limits refuse before any load). A text model's media parts are left for its
    input processor to refuse, unread."""
    if not request.messages or not has_media(request.messages):
        return
    ctx.manager.check_kind(model, family, endpoint)  # a wrong kind is refused before fetching
    if ctx.manager.get(model).kind is ModelKind.VISION:
        request.messages = await resolve_media(request.messages,
                                               MediaLimits.from_config(ctx.config))


async def hold_media_memory(ctx: ServerContext,
                            request: GenerationRequest) -> TransientHold | None:
    """Count what preparing the request's resolved images and videos holds in the memory
    budget (waiting while other requests' media fill it); None without media."""
    nbytes = prepared_media_bytes(resolved_media(request.messages or []))
    if not nbytes:
        return None
    return await ctx.manager.transient.hold(nbytes, "this request's decoded images and videos")


class TextSession:
    """A leased text model with one prepared request; close it when done.

    The prepared prompt is the engine's: adapters ask the engine about it
    (``prompt_tokens``, ``engine.prompt_text``), never read it.
    """

    def __init__(self, lease: ModelLease[TextGenerator], prepared: PreparedPrompt,
                 n: int, media: TransientHold | None = None,
                 keepalive_interval: float = 5.0) -> None:
        self.lease = lease
        self.prepared = prepared
        self.n = n
        self.media = media  # the decoded media's bytes in the budget, until close
        self.keepalive_interval = keepalive_interval
        self.adapter = prepared.request.adapter  # the LoRA adapter held in use until close

    @property
    def model_name(self) -> str:
        return self.lease.name

    @property
    def engine(self) -> TextGenerator:
        return self.lease.engine

    @property
    def context_limited(self) -> bool:
        """The context, not the request's limit, bounds the output (the limit was capped
        to the room the prompt leaves, ``generation/output_length.py``)."""
        return self.prepared.context_limited

    @property
    def cache_pins(self) -> tuple[tuple[int, float], ...]:
        """The prompt prefixes the request marked for caching, (tokens, seconds)."""
        return self.prepared.cache_pins

    @property
    def prompt_tokens(self) -> int:
        """Tokens the prompt takes in the context (what usage reports)."""
        return self.engine.count_tokens(self.prepared)

    @classmethod
    async def open(cls, ctx: ServerContext, model: str, request: GenerationRequest, *, n: int = 1,
                   endpoint: str, family: Family[TextGenerator] = CHAT) -> TextSession:
        if n > ctx.config.max_n:
            raise InvalidRequest(f"n must be at most {ctx.config.max_n}", param="n")
        await resolve_request_media(ctx, model, request, family, endpoint)
        media = await hold_media_memory(ctx, request)
        try:
            lease = await ctx.manager.acquire(model, family, endpoint)
        except BaseException:
            if media is not None:
                await media.release()
            raise
        try:
            # an adapter's name leases its base model and runs the request with the adapter,
            # held in use (an unload waits for it) until the session closes
            request.adapter = ctx.manager.hold_adapter(model, lease.residency)
        except BaseException:
            await lease.release()
            if media is not None:
                await media.release()
            raise
        apply_serving_defaults(request, lease.entry.defaults, ctx.config)
        try:
            prepared = await lease.engine.prepare(request)
        except BaseException:
            lease.residency.release_adapter(request.adapter)
            await lease.release()
            if media is not None:
                await media.release()
            raise
        return cls(lease, prepared, n, media, ctx.config.keepalive_interval)

    async def close(self) -> None:
        adapter, self.adapter = self.adapter, None  # released once, however often closed
        self.lease.residency.release_adapter(adapter)
        await self.lease.release()
        if self.media is not None:
            await self.media.release()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """Events of all choices, interleaved, tagged with the choice index.

        Every text API streams through here, so this is where the request's record
        (``server/observe.py``) learns its tokens, time to first output and timings.
        """
        record = current_record()
        started = time.monotonic()
        first: dict[int, float] = {}
        # closed here, not left to the garbage collector: closing cancels the generation
        async with contextlib.aclosing(self._events()) as events:
            async for index, ev in events:
                if record is not None:
                    now = time.monotonic()
                    if isinstance(ev, Finish):
                        record.finished(index, ev, started, first.get(index), now)
                    elif index not in first:
                        first[index] = now
                        record.first_output(now)
                yield index, ev

    def stream(self) -> AsyncIterator[tuple[int, Event] | None]:
        """``events()`` for a streaming response: ``None`` marks each keep-alive interval
        that passed without an event (see ``sse.with_keepalive``); every streaming route
        renders it as its API's keep-alive."""
        return with_keepalive(self.events(), self.keepalive_interval)

    async def _events(self) -> AsyncGenerator[tuple[int, Event], None]:
        if self.n == 1:
            async for ev in self.engine.generate(self.prepared):
                yield 0, ev
            return
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def run(index: int) -> None:
            try:
                async for ev in self.engine.generate(self.prepared, seed_offset=index):
                    await queue.put((index, ev))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.create_task(run(i)) for i in range(self.n)]
        try:
            done = 0
            while done < self.n:
                index, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                yield index, item
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, request: Request | None = None) -> dict[int, list[Event]]:
        """All events per choice; stops generating if the client disconnects."""
        out: dict[int, list[Event]] = {i: [] for i in range(self.n)}

        async def gather() -> None:
            async for index, ev in self.events():
                out[index].append(ev)

        if request is None:
            await gather()
        else:
            await unless_disconnected(request, gather())
        return out


def finish_of(events: list[Event]) -> Finish:
    for ev in reversed(events):
        if isinstance(ev, Finish):
            return ev
    return Finish("cancelled", Usage(0, 0))
