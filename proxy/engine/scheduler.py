"""The scheduler: one worker thread that owns the engine and runs steps over every admitted
sequence, continuous-batching style.

Between steps it admits waiting requests (first come, first served, as long as the engine can
reserve their KV blocks and fewer than ``max_running`` sequences run), drops cancelled ones (their
blocks are freed before the next step), and hands each step's updates to the requests' event
queues on the event loop. ``n > 1`` choices are sibling sequences: the first one prefills the
prompt, the others are admitted once its prompt blocks are in the prefix cache and reuse them.

Events are typed (``TokensEvent``, ``DoneEvent``, ``ErrorEvent``); a request that fails does not
disturb the others.

Nothing slow runs on the worker thread beside the passes: a finished choice's prediction usage (a
diff of the prediction and the output, a second for a megabyte) is counted by a second thread,
in a child process for a long prediction (``prediction_usage.count_away``), which then calls
``on_result`` and sends the ``DoneEvent``; the prediction is tokenised by the caller
(``GenerationRequest.prediction_encoding``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from foretell.proxy.engine.sequence import GenerationRequest, GenerationResult, Sequence, TokenLogprob
from foretell.proxy.options import MAX_QUEUE, MAX_RUNNING
from foretell.proxy.prediction_usage import count_away

log = logging.getLogger("foretell.engine")


class QueueFullError(Exception):
    """The bounded queue is full: the caller should answer 429."""


@dataclass
class TokensEvent:
    choice: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    origins: list[str | None]  # per token: the draft source it was accepted from, or None


@dataclass
class DoneEvent:
    choice: int
    result: GenerationResult


@dataclass
class ErrorEvent:
    error: Exception


@dataclass
class Job:
    """One submission (a generation with its ``n`` choices): its requests and the events they
    produce, read by whoever submitted it on the event loop."""

    requests: list[GenerationRequest]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Worker-side state.
    sequences: dict[int, Sequence] = field(default_factory=dict)  # running choices
    next_choice: int = 0  # choices not yet admitted start here
    done: int = 0
    failed: bool = False

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """A single thread that owns the engine; ``submit`` is called from the event loop."""

    def __init__(self, engine, max_queue: int = MAX_QUEUE, max_running: int = MAX_RUNNING, on_result=None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_running = max_running
        # Called on the worker thread with every finished result, cancelled ones included
        # (their client is gone, so nobody else sees them).
        self.on_result = on_result
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []  # jobs with a running or not yet admitted choice
        self._wake = threading.Condition()
        self._closed = False
        # Finished choices are completed here, in order, off the worker thread.
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="foretell-finish")
        self._thread = threading.Thread(target=self._run, name="foretell-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine's thread still runs (it ends only when closed, or on a bug)."""
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(len(job.sequences) for job in list(self._active))

    def submit(self, requests: GenerationRequest | list[GenerationRequest]) -> Job:
        requests = [requests] if isinstance(requests, GenerationRequest) else list(requests)
        job = Job(requests=requests, loop=asyncio.get_running_loop())
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError
            self._waiting.append(job)
            self._wake.notify()
        return job

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._finisher.shutdown(wait=False)

    # ---- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active:
                    self._wake.wait()
                if self._closed:
                    return
            self._drop_cancelled()
            self._admit()
            sequences = [seq for job in self._active for seq in job.sequences.values()]
            if not sequences:
                if self._waiting or any(job.next_choice < len(job.requests) for job in self._active):
                    self._wait_for_room()
                continue
            try:
                updates = self.engine.step(sequences)
            except Exception as error:  # the pass itself failed: every request in it fails
                for job in list(self._active):
                    self._fail(job, error)
                continue
            for update in updates:
                self._deliver(update)

    def _wait_for_room(self) -> None:
        """Nothing runs, yet the head of the queue cannot be admitted: only cached prefixes hold
        blocks, and those are evictable, so this happens only while a request never fits."""
        with self._wake:
            self._wake.wait(timeout=0.05)

    def _job_of(self, seq: Sequence) -> tuple[Job, int]:
        for job in self._active:
            for choice, running in job.sequences.items():
                if running is seq:
                    return job, choice
        raise KeyError("sequence without a job")

    def _deliver(self, update) -> None:
        job, choice = self._job_of(update.sequence)
        if update.error is not None:
            self._fail(job, update.error)
            return
        if update.token_ids or update.text:
            job.emit(TokensEvent(choice, update.token_ids, update.text, update.logprobs, update.origins))
        if update.result is not None:
            del job.sequences[choice]
            job.done += 1
            self._finish(update.sequence, update.result, job, choice)
            if job.done == len(job.requests):
                self._active.remove(job)

    def _finish(self, seq: Sequence, result: GenerationResult, job: Job | None = None, choice: int = 0) -> None:
        """Count the prediction's usage, then report the result (to ``on_result``, and as the
        job's DoneEvent unless the job was cancelled): on the finisher thread."""
        def finish() -> None:
            try:
                seq.speculation.count_prediction_usage(count_away)  # writes into result.stats
                if self.on_result is not None:
                    self.on_result(result)
            except Exception:  # a bug: logged, and the request is still answered
                log.exception("finishing a result failed")
            finally:
                if job is not None:
                    job.emit(DoneEvent(choice, result))
        self._finisher.submit(finish)

    def _fail(self, job: Job, error: Exception) -> None:
        for seq in job.sequences.values():
            if not seq.finished:
                self.engine.abort(seq)
            else:
                self.engine.cache.free(seq.blocks)
        job.sequences.clear()
        job.failed = True
        if job in self._active:
            self._active.remove(job)
        job.emit(ErrorEvent(error))

    def _drop_cancelled(self) -> None:
        with self._wake:
            cancelled = [job for job in self._waiting if job.cancelled.is_set()]
            for job in cancelled:
                self._waiting.remove(job)
        for job in [job for job in self._active if job.cancelled.is_set()]:
            for seq in job.sequences.values():
                self._finish(seq, self.engine.abort(seq))  # frees its blocks before the next step
            job.sequences.clear()
            self._active.remove(job)

    def _admit(self) -> None:
        """Admit choices in arrival order while blocks and running slots allow."""
        running = self.running
        for job in list(self._active):  # siblings of admitted choices first
            running = self._admit_choices(job, running)
        while running < self.max_running:
            with self._wake:
                if not self._waiting:
                    return
                job = self._waiting[0]
            running = self._admit_choices(job, running)
            if not job.failed and job.next_choice == 0:
                return  # the head waits for blocks: keep arrival order
            with self._wake:
                self._waiting.popleft()
            if not job.failed:
                self._active.append(job)

    def _admit_choices(self, job: Job, running: int) -> int:
        while job.next_choice < len(job.requests) and running < self.max_running:
            if job.next_choice > 0:
                first = job.sequences.get(0)
                # Siblings wait until the first choice's prompt is cached, then share its blocks.
                if first is not None and first.uncached_prompt > 0:
                    break
            try:
                seq = self.engine.add(job.requests[job.next_choice])
            except ValueError as error:  # invalid, or can never fit in the cache
                self._fail(job, error)
                return running
            if seq is None:
                break
            seq.defer_prediction_usage = True  # counted by _finish, off this thread
            job.sequences[job.next_choice] = seq
            job.next_choice += 1
            running += 1
        return running
