"""One thread owns the BatchEngine; asyncio handlers talk to it through a queue and per-request handles.

    scheduler = Scheduler(engine, ServerConfig(max_batch=8))
    scheduler.start()
    handle = scheduler.submit(batch_request, loop)   # in a handler; may raise QueueFull / Unavailable
    item = await handle.next(timeout=0.5)             # BatchEvent, EngineFailed, or None on timeout
    scheduler.abort(handle.request_id)               # client gone or deadline passed

    handles = scheduler.submit_all(choice_requests, loop)   # a request's n choices, queued together
    index, item = await next_of(handles, timeout=0.5)       # the next item of any of them (or None)

The engine thread loops: run queued abort commands, admit waiting requests while the batch has room
(``engine.add``: prefill + first token), run one round (``engine.step``), hand each event to its
request's handle with ``loop.call_soon_threadsafe``. It sleeps on a condition while there is nothing
to do. Only this thread touches the engine, so an abort is a command it executes between rounds.

Failure: an exception from the engine (other than a user error from ``add``) marks the scheduler
unhealthy, fails every waiting and running request with :class:`EngineFailed` and ends the thread;
``/health`` then answers 503. Nothing is dropped silently: every submitted request gets exactly one
final item (a finished event or an EngineFailed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from verispec.batch import BatchEngine, BatchEvent, BatchRequest
from verispec.errors import VerispecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Serving limits; the CLI's defaults come from here."""

    max_batch: int = 64  # sequences decoded together in one round
    # Tokens (prompt + output) a request may hold: the KV cache is preallocated for max_batch rows of this
    # many positions (SmolLM2's 8,192 would take ~377 MB per row in fp32, 24 GB for 64 rows).
    max_model_len: int = 2048
    api_key: str | None = None  # requests must send "Authorization: Bearer <key>" (/health always open)
    metrics_public: bool = False  # /metrics without the key
    max_body_bytes: int = 1 << 20  # larger request bodies get HTTP 413 before they are read
    max_queue: int = 256  # requests allowed to wait beyond the free batch rows; more get HTTP 429
    timeout_s: float = 600.0  # per request, from arrival to the last token; then abort + HTTP 504
    shutdown_s: float = 20.0  # on SIGTERM/SIGINT, in-flight requests get this long to finish, then are aborted
    retry_after_s: int = 1  # the Retry-After header of a 429
    logprobs_mode: str = "raw"  # reported logprobs: "raw" log-softmax, or "processed" (what was sampled from)


class QueueFull(Exception):
    """More requests are waiting than ``max_queue`` allows."""


class Unavailable(Exception):
    """The scheduler does not accept requests: shutting down, or the engine failed."""


class EngineFailed(Exception):
    """The engine raised; the request cannot complete."""


@dataclass
class Handle:
    """One request's side of the hand-off: the engine thread pushes, the event loop awaits ``next``."""

    request: BatchRequest
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    last_emit: float | None = None  # when the last tokens were handed over (engine thread)
    abort_reason: str | None = None
    _items: collections.deque = field(default_factory=collections.deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)  # shared by handles submitted together

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def push(self, item: BatchEvent | EngineFailed) -> None:
        """Thread-safe: deliver ``item`` on the handle's event loop."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _deliver(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    async def next(self, timeout: float) -> BatchEvent | EngineFailed | None:
        """The next item, or None if none came within ``timeout`` seconds."""
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self._items.popleft()


async def next_of(handles: list[Handle], timeout: float) -> tuple[int, BatchEvent | EngineFailed] | None:
    """The next item of any of ``handles`` (from one ``submit_all``: they share one ready event) and the
    index of its handle, or None if none came within ``timeout`` seconds."""
    for waited in (False, True):
        for index, handle in enumerate(handles):
            if handle._items:
                return index, handle._items.popleft()
        if waited:
            return None
        ready = handles[0]._ready
        ready.clear()
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except asyncio.TimeoutError:
            return None
    return None


class Scheduler:
    def __init__(self, engine: BatchEngine, config: ServerConfig = ServerConfig(), metrics=None):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._running: dict[str, Handle] = {}  # admitted (or being admitted) and not yet finished
        self._aborts: list[tuple[str, str]] = []  # (request_id, reason) for the engine thread
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    # ---- called from the event loop --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.healthy

    def check(self, request: BatchRequest) -> None:
        """Raise a VerispecError if the request can never run (read-only, safe from any thread)."""
        self.engine.check(request)

    def submit(self, request: BatchRequest, loop: asyncio.AbstractEventLoop) -> Handle:
        return self.submit_all([request], loop)[0]

    def submit_all(self, requests: list[BatchRequest], loop: asyncio.AbstractEventLoop) -> list[Handle]:
        """Queue requests together (a request's choices): all of them, or none (QueueFull / Unavailable).
        Their handles share one ready event, for ``next_of``."""
        ready = asyncio.Event()
        handles = [Handle(request, loop, _ready=ready) for request in requests]
        with self._cond:
            if self.error is not None:
                raise Unavailable("the engine has failed; the server cannot take requests (see /health)")
            if not self._thread.is_alive():
                raise Unavailable("the engine thread is not running (was the app started with its lifespan?)")
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            free_rows = self.config.max_batch - len(self._running)
            if len(self._waiting) + len(handles) > self.config.max_queue + max(0, free_rows):
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-queue "
                                f"{self.config.max_queue}); retry later")
            self._waiting.extend(handles)
            self._gauges()
            self._cond.notify()
        return handles

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request wherever it is; its slot is freed before the next round."""
        with self._cond:
            for handle in self._waiting:
                if handle.request_id == request_id:
                    self._waiting.remove(handle)
                    self._gauges()
                    self._finish(handle, BatchEvent(request_id, [], "abort"), reason)
                    return
            if request_id in self._running:
                self._aborts.append((request_id, reason))
                self._cond.notify()

    def shutdown(self, drain_s: float | None = None) -> None:
        """Stop accepting; let in-flight requests finish for ``drain_s`` seconds, abort the rest, join.

        Blocking: call it from a worker thread (``asyncio.to_thread``) so handlers can still run."""
        drain_s = self.config.shutdown_s if drain_s is None else drain_s
        deadline = time.monotonic() + drain_s
        with self._cond:
            self._accepting = False
            while (self._waiting or self._running) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            for handle in list(self._waiting):
                self._finish(handle, BatchEvent(handle.request_id, [], "abort"), "shutdown")
            self._waiting.clear()
            self._aborts.extend((request_id, "shutdown") for request_id in self._running)
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, drain_s))

    # ---- the engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._has_work():
                        if self._stopping:
                            return
                        self._cond.wait()
                    aborts, self._aborts = self._aborts, []
                for request_id, reason in aborts:
                    event = self.engine.abort(request_id)
                    if event is not None:
                        self._dispatch([event], reason)
                self._admit()
                self._dispatch(self.engine.step())
        except BaseException as err:  # noqa: BLE001 - any engine failure must reach every request
            self._fail(err)

    def _has_work(self) -> bool:
        return bool(self._aborts or self.engine.active or (self._waiting and self.engine.has_capacity))

    def _admit(self) -> None:
        while self.engine.has_capacity:
            with self._cond:
                if not self._waiting:
                    return
                handle = self._waiting.popleft()
                self._running[handle.request_id] = handle
                self._gauges()
            handle.admitted = time.perf_counter()
            if self.metrics is not None:
                self.metrics.on_admit(handle)
            try:
                events = self.engine.add(handle.request)
            except VerispecError as err:  # the request's own fault (checked before queueing; a safety net)
                with self._cond:
                    self._running.pop(handle.request_id, None)
                    self._gauges()
                handle.push(EngineFailed(str(err)))
                continue
            self._dispatch(events)

    def _dispatch(self, events: list[BatchEvent], reason: str | None = None) -> None:
        now = time.perf_counter()
        for event in events:
            handle = self._running.get(event.request_id)
            if handle is None:
                log.warning("event for unknown request %s dropped", event.request_id)
                continue
            if event.tokens and self.metrics is not None:
                self.metrics.on_tokens(handle, len(event.tokens), now)
            if event.tokens:
                handle.last_emit = now
            if event.finished:
                with self._cond:
                    self._running.pop(event.request_id, None)
                    self._gauges()
                    self._finish(handle, event, reason or event.finish_reason)
            else:
                handle.push(event)

    def _finish(self, handle: Handle, event: BatchEvent, reason: str) -> None:
        """Deliver a final event (caller holds the lock); ``reason`` labels the metrics."""
        handle.abort_reason = reason if event.finish_reason == "abort" else None
        if self.metrics is not None:
            self.metrics.on_finish(handle, event, reason)
        handle.push(event)
        self._cond.notify_all()

    def _fail(self, err: BaseException) -> None:
        log.exception("the engine failed; failing every in-flight request", exc_info=err)
        with self._cond:
            self.error = err
            self._accepting = False
            handles = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
            self._gauges()
            for handle in handles:
                if self.metrics is not None:
                    self.metrics.on_failure(handle, "engine_error")
                handle.push(EngineFailed(f"the engine failed: {type(err).__name__}: {err}"))
            self._cond.notify_all()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(running=len(self._running), waiting=len(self._waiting))
