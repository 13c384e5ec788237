"""verispec.server.scheduler: the engine thread and the hand-off to asyncio handlers, driven with a fake
engine (the real engine behind a live server is tested in test_server.py)."""

from __future__ import annotations

import asyncio

import pytest

from verispec.batch import BatchEvent, BatchRequest
from verispec.server.scheduler import EngineFailed, QueueFull, Scheduler, ServerConfig, Unavailable, next_of


class FakeEngine:
    """Emits token 1 on add and token 2 on each step; a request ends with "length" after ``steps``."""

    def __init__(self, steps: int = 2, capacity: int = 8, fail: bool = False):
        self.steps, self.capacity, self.fail = steps, capacity, fail
        self.rows: dict[str, int] = {}

    def check(self, request):
        pass

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def has_capacity(self) -> bool:
        return len(self.rows) < self.capacity

    def add(self, request):
        self.rows[request.request_id] = 0
        return [BatchEvent(request.request_id, [1])]

    def step(self):
        if self.fail:
            raise RuntimeError("boom")
        events = []
        for request_id in list(self.rows):
            self.rows[request_id] += 1
            done = self.rows[request_id] == self.steps
            events.append(BatchEvent(request_id, [2], "length" if done else None))
            if done:
                del self.rows[request_id]
        return events

    def abort(self, request_id):
        return BatchEvent(request_id, [], "abort") if self.rows.pop(request_id, None) is not None else None


async def drain(handles) -> dict[int, list]:
    """Every item of ``handles`` until each has its final one."""
    items: dict[int, list] = {i: [] for i in range(len(handles))}
    left = len(handles)
    while left:
        found = await next_of(handles, timeout=10)
        assert found is not None, "no item within 10 s"
        index, item = found
        items[index].append(item)
        left -= isinstance(item, EngineFailed) or item.finished
    return items


def test_submitted_choices_stream_their_events_to_their_handles():
    async def main():
        scheduler = Scheduler(FakeEngine(steps=2))
        scheduler.start()
        try:
            handles = scheduler.submit_all([BatchRequest("a", [5]), BatchRequest("b", [6])],
                                           asyncio.get_running_loop())
            return await drain(handles)
        finally:
            await asyncio.to_thread(scheduler.shutdown, 1.0)

    items = asyncio.run(main())
    for index in (0, 1):
        assert [event.tokens for event in items[index]] == [[1], [2], [2]]
        assert [event.finish_reason for event in items[index]] == [None, None, "length"]


def test_a_full_queue_refuses_and_shutdown_aborts_what_waits():
    async def main():
        scheduler = Scheduler(FakeEngine(capacity=0), ServerConfig(max_batch=1, max_queue=1))
        loop = asyncio.get_running_loop()
        with pytest.raises(Unavailable, match="engine thread is not running"):
            scheduler.submit(BatchRequest("early", [1]), loop)
        scheduler.start()
        first, second = scheduler.submit_all([BatchRequest("a", [1]), BatchRequest("b", [1])], loop)
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            scheduler.submit(BatchRequest("c", [1]), loop)
        scheduler.abort("a")
        aborted = await first.next(timeout=5)
        await asyncio.to_thread(scheduler.shutdown, 0.0)
        shut = await second.next(timeout=5)
        with pytest.raises(Unavailable):
            scheduler.submit(BatchRequest("d", [1]), loop)
        return aborted, first.abort_reason, shut, second.abort_reason, scheduler.healthy

    aborted, first_reason, shut, second_reason, healthy = asyncio.run(main())
    assert aborted.finish_reason == "abort" and first_reason == "abort"
    assert shut.finish_reason == "abort" and second_reason == "shutdown"
    assert not healthy  # the engine thread has ended


def test_an_engine_failure_fails_every_request_and_the_scheduler():
    async def main():
        scheduler = Scheduler(FakeEngine(fail=True))
        scheduler.start()
        handles = scheduler.submit_all([BatchRequest("a", [1])], asyncio.get_running_loop())
        items = await drain(handles)
        with pytest.raises(Unavailable, match="the engine has failed"):
            scheduler.submit(BatchRequest("b", [1]), asyncio.get_running_loop())
        return items[0], scheduler

    items, scheduler = asyncio.run(main())
    assert items[0].tokens == [1]  # the first token came from add, before the failing step
    assert isinstance(items[-1], EngineFailed) and "RuntimeError: boom" in str(items[-1])
    assert not scheduler.healthy and not scheduler.accepting and isinstance(scheduler.error, RuntimeError)
