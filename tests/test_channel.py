"""The worker-to-event-loop channel (``runtime/channel.py``): streams and single results
(``Reply``) reach the loop through one path, with one thread hop per loop per batch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import pytest

from mlxd.engines.encoders.token_batcher import Encoded, TokenBatcher
from mlxd.runtime.channel import Failure, LoopChannel, Reply, send_all
from mlxd.runtime.worker import CancelToken, ModelWorker

WAIT_S = 30.0


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the thread hops made into it."""

    def __init__(self) -> None:
        super().__init__()
        self.hops = 0
        self.errors: list[dict[str, Any]] = []
        self.set_exception_handler(lambda _loop, context: self.errors.append(context))

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: Any = None) -> asyncio.Handle:
        self.hops += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def run_on(loop: CountingLoop, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def on_a_thread(fn: Callable[[], object]) -> None:
    """Run ``fn`` on another thread and wait for it (the loop does not run meanwhile)."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()


async def thread_event(event: threading.Event) -> None:
    """Wait for a worker-side event without blocking the loop."""
    for _ in range(int(WAIT_S / 0.01)):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the worker never got there")


@pytest.fixture
def worker() -> Any:
    w = ModelWorker("channel-test")
    w.start()
    yield w
    w.stop()


def test_a_reply_hands_the_workers_value_to_its_awaiter(worker: ModelWorker) -> None:
    async def main() -> Any:
        return await worker.run(lambda a, b: (threading.current_thread().name, a + b), 2, 3)

    name, total = run_on(CountingLoop(), main)
    assert name == "mlxd-model-channel-test" and total == 5


def test_a_reply_raises_the_workers_exception_with_its_type(worker: ModelWorker) -> None:
    class ModelFault(Exception):
        pass

    fault = ModelFault("bad weights")

    def job() -> None:
        raise fault

    async def main() -> None:
        with pytest.raises(ModelFault) as raised:
            await worker.run(job)
        assert raised.value is fault

    run_on(CountingLoop(), main)


def test_cancelling_the_awaiter_before_the_job_starts_skips_the_job(
        worker: ModelWorker) -> None:
    ran: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(WAIT_S)

    async def main() -> None:
        worker.submit(hold)
        await thread_event(holding)  # the worker is busy: the next job waits its turn
        waiting = asyncio.ensure_future(worker.run(ran.append, "ran"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await worker.run(lambda: None)  # everything queued before it has been handled

    run_on(CountingLoop(), main)
    assert ran == []


def test_cancelling_the_awaiter_of_a_running_job_sets_its_cancel_token(
        worker: ModelWorker) -> None:
    seen: list[CancelToken] = []
    running = threading.Event()

    def job(token: CancelToken) -> str:
        seen.append(token)
        running.set()
        for _ in range(int(WAIT_S / 0.01)):
            token.check()  # raises JobCancelled once the caller left
            threading.Event().wait(0.01)
        return "finished"

    async def main() -> None:
        waiting = asyncio.ensure_future(worker.run_cancellable(job))
        await thread_event(running)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await worker.run(lambda: None)  # the job stopped: the worker is free again

    loop = CountingLoop()
    run_on(loop, main)
    assert seen and seen[0].cancelled
    assert loop.errors == []  # the job's JobCancelled went to nobody, quietly


def test_a_result_for_an_awaiter_that_left_is_dropped_quietly() -> None:
    loop = CountingLoop()

    async def main() -> Reply[int]:
        reply: Reply[int] = Reply()
        assert reply.start()  # running: cancelling the awaiter cannot stop it
        waiting = asyncio.ensure_future(_await(reply))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        on_a_thread(lambda: reply.set_result(7))
        await asyncio.sleep(0.05)  # the hop has run
        return reply

    reply = run_on(loop, main)
    assert loop.errors == [] and reply.result(0) == 7


def test_a_closed_loop_is_ignored() -> None:
    loop = CountingLoop()

    async def main() -> tuple[Reply[int], LoopChannel[int]]:
        return Reply(), LoopChannel()

    reply, channel = run_on(loop, main)
    assert loop.is_closed()
    on_a_thread(lambda: send_all([(reply, 1), (channel, 2)]))
    assert reply.result(0) == 1


def test_a_reply_made_off_any_loop_is_waited_for_with_result() -> None:
    reply: Reply[str] = Reply()
    with pytest.raises(TimeoutError):
        reply.result(0.01)
    on_a_thread(lambda: reply.set_exception(KeyError("k")))
    with pytest.raises(KeyError):
        reply.result(0)
    assert not reply.cancel() and reply.done  # settled: too late to cancel
    skipped: Reply[str] = Reply()
    assert skipped.cancel() and not skipped.start()


def test_a_batch_of_replies_and_stream_items_is_one_hop_per_loop() -> None:
    loop = CountingLoop()
    other = CountingLoop()

    async def on_other() -> Reply[str]:
        return Reply()

    elsewhere = other.run_until_complete(on_other())

    async def main() -> list[Any]:
        replies: list[Reply[int]] = [Reply() for _ in range(16)]
        channel: LoopChannel[str] = LoopChannel()
        batch: list[tuple[Any, Any]] = [(r, i) for i, r in enumerate(replies)]
        batch += [(replies[3], 99), (channel, "piece"), (elsewhere, "there")]
        batch[5] = (replies[5], Failure(ValueError("row 5")))
        before = loop.hops
        on_a_thread(lambda: send_all(batch))
        assert loop.hops - before == 1
        values = await asyncio.gather(*(_await(r) for r in replies), return_exceptions=True)
        return [*values, await channel.receive()]

    out = run_on(loop, main)
    assert out[:5] == [0, 1, 2, 3, 4] and isinstance(out[5], ValueError)
    assert out[6:] == [*range(6, 16), "piece"]  # the second value for reply 3 was dropped
    assert other.hops == 1 and elsewhere.result(0) == "there"
    other.close()


def test_an_encoder_batch_answers_all_its_requests_with_one_hop() -> None:
    """Embedding and rerank requests share batches; the requests one batch completes
    are answered together, not one thread hop each."""
    def forward(rows: Sequence[Encoded]) -> np.ndarray:
        return np.array([[float(len(r))] for r in rows], dtype=np.float32)

    loop = CountingLoop()

    async def main() -> list[list[float]]:
        batcher = TokenBatcher(forward, token_budget=4096)
        jobs = [batcher.submit([Encoded(list(range(n)))]) for n in range(5, 13)]
        before = loop.hops
        on_a_thread(batcher.step)  # the worker's step: one batch of eight requests
        assert loop.hops - before == 1
        out = await asyncio.gather(*(_await(j.reply) for j in jobs))
        return [o[:, 0].tolist() for o in out]

    assert run_on(loop, main) == [[float(n)] for n in range(5, 13)]


async def _await(reply: Reply[Any]) -> Any:
    return await reply
