"""A local generation seen from the event loop: the job submitted to the scheduler, its engine
events waited for without blocking, the job cancelled when the client goes away, each finished
choice recorded (latency metrics, the access line), and the answer a body or a stream."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from foretell.proxy.engine.scheduler import DoneEvent, ErrorEvent, TokensEvent
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.logs import note_result
from foretell.proxy.server.responses import ClientGone, ClientWatch, client_gone, stream_response


async def answer(request: Request, server, local, choices: list, stream: bool, chunks, body):
    """Submit ``choices`` (one engine request per choice) and answer with the stream of
    ``chunks(job)`` or the body ``body(results)``; QueueFullError when the queue is full."""
    job = LocalJob(request, local, local.scheduler.submit(choices), server.metrics)
    if stream:
        return stream_response(chunks(job))
    try:
        results = await job.results()
    except ClientGone:
        return client_gone()
    return body(results)


def generation_error(error: Exception) -> APIError:
    """A failed generation in the envelope: a request the engine refused is the caller's fault."""
    if isinstance(error, ValueError):
        return APIError(400, str(error), code="invalid_request")
    return APIError(500, f"generation failed: {error}", type="server_error")


class LocalJob:
    """A job submitted to the local model's scheduler, for the request that submitted it."""

    def __init__(self, request: Request, local, job, metrics):
        self.request, self.local, self.job, self.metrics = request, local, job, metrics
        self.started = time.perf_counter()
        self.first: float | None = None  # when the first tokens came
        self.client = ClientWatch(request)

    def cancel(self) -> None:
        """Stop the engine's work on the job (a no-op once it has finished)."""
        self.job.cancel()

    async def next_event(self) -> TokensEvent | DoneEvent:
        """The next engine event. A failed generation raises its APIError; a client that has gone
        away (``ClientWatch``: asked also while events keep coming) cancels the job and raises
        ClientGone."""
        job = self.job
        while True:
            try:
                await self.client.check()
            except ClientGone:
                job.cancel()
                raise
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=ClientWatch.CLIENT_CHECK_SECONDS)
            except asyncio.TimeoutError:
                continue
            if isinstance(event, ErrorEvent):
                raise generation_error(event.error)
            if isinstance(event, TokensEvent):
                self.first = self.first or time.perf_counter()
            else:
                self._finished(event.result)
            return event

    async def results(self) -> list:
        """Every choice's result, in choice order (raises as ``next_event``)."""
        results = [None] * len(self.job.requests)
        while any(result is None for result in results):
            event = await self.next_event()
            if isinstance(event, DoneEvent):
                results[event.choice] = event.result
        return results

    def _finished(self, result) -> None:
        now, name = time.perf_counter(), self.local.name
        if self.first is not None:
            self.metrics.time_to_first_token.labels(name).observe(self.first - self.started)
            if result.stats.completion_tokens > 1:
                self.metrics.inter_token_latency.labels(name).observe(
                    (now - self.first) / (result.stats.completion_tokens - 1))
        self.metrics.e2e_latency.labels(name).observe(now - self.started)
        note_result(self.request.scope, result.stats)
