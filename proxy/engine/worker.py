"""Runs the engine off the event loop: one generation at a time on a worker thread, a bounded
queue in front of it, and cancellation when the client goes away.

The event loop never blocks on the model. A request is a ``Job``; its rounds reach the loop as
events on an ``asyncio.Queue`` (``("tokens", ids, text, logprobs)``, then ``("done", result)`` or
``("error", exception)``). Cancelling a job (client disconnected) makes the engine stop after
the round in progress, or skips it if it has not started.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from foretell.proxy.engine.engine import GenerationRequest


class QueueFullError(Exception):
    """The bounded queue is full: the caller should answer 429."""


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    checked_at: float = 0.0  # when the server last asked whether the client is still there

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    """A single thread that owns the engine; ``submit`` is called from the event loop."""

    def __init__(self, engine, max_queue: int = 16, on_result=None):
        self.engine = engine
        # Called on the worker thread with every finished result, cancelled ones included
        # (their client is gone, so nobody else sees them).
        self.on_result = on_result
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="foretell-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request=request, loop=asyncio.get_running_loop())
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None
        return job

    def close(self) -> None:
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            try:
                result = self.engine.generate(
                    job.request,
                    on_tokens=lambda ids, text, logprobs, job=job: job._emit("tokens", ids, text, logprobs),
                    should_stop=job.cancelled.is_set,
                )
                if self.on_result is not None:
                    self.on_result(result)
                job._emit("done", result)
            except Exception as error:  # reported to the client, the worker lives on
                job._emit("error", error)
