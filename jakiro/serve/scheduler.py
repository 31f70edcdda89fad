"""Requests through the engine in a worker thread: one at a time, or with ``parallel`` > 1 up to
that many decoded together (continuous batching, ``decoding.batch``: a request joins at the next
step and leaves the step it ends, freeing its slot). Waiting requests sit in a bounded queue.
Results and streamed text go back to the event loop through each job's asyncio queue, and a job
cancelled by its client is dropped before it starts or stopped at its next decode cycle."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from typing import Callable

from ..decoding.sampling import SamplingParams


class QueueFull(Exception):
    pass


class Job:
    def __init__(self, ids: list[int], max_tokens: int, sampling: SamplingParams, stop: list[str],
                 loop: asyncio.AbstractEventLoop, wants_text: bool = True):
        self.ids, self.max_tokens, self.sampling, self.stop = ids, max_tokens, sampling, stop
        self.wants_text = wants_text
        self.loop = loop
        self.created = time.perf_counter()
        self.last_token: float | None = None  # when its last ids were committed
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()


class Scheduler:
    def __init__(self, engine, max_queue: int = 16, on_done: Callable | None = None,
                 on_cancel: Callable | None = None, parallel: int = 1, slot_tokens: int | None = None,
                 observer=None):
        """``parallel``: requests decoded together, each with room for ``slot_tokens`` tokens
        (``BatchDecoder``); ``observer``: told of each batched step's size and each request's
        token times (``ServerMetrics``)."""
        self.engine = engine
        self.max_queue = max_queue
        self.parallel, self.observer = parallel, observer
        self.batch = engine.batch(parallel, slot_tokens) if parallel > 1 else None
        self.running = 0  # requests being decoded
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._on_done, self._on_cancel = on_done, on_cancel
        self._thread = threading.Thread(target=self._run, name="jakiro-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting for the engine whose clients are still there."""
        with self._cond:
            self._drop_cancelled()
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether the engine is decoding a request."""
        return self.running > 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drop_cancelled(self) -> None:
        """Free the slots of waiting jobs whose clients left (call with the lock held)."""
        if any(j.cancelled.is_set() for j in self._waiting):
            kept = [j for j in self._waiting if not j.cancelled.is_set()]
            dropped = len(self._waiting) - len(kept)
            self._waiting = collections.deque(kept)
            if self._on_cancel:
                for _ in range(dropped):
                    self._on_cancel()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._drop_cancelled()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:  # cancel whatever still waits, then stop the worker
            for job in self._waiting:
                job.cancel()
                job.emit("cancelled")
            self._waiting.clear()
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._closed:
                    return None
                if self._waiting:
                    return self._waiting.popleft()
                self._cond.wait()

    def _run(self) -> None:
        if self.batch is not None:
            return self._run_batched()
        while True:
            job = self._next()
            if job is None:
                return
            self.running = 1
            try:
                self._serve(job)
            except BaseException as exc:  # one failing request never takes the worker down
                traceback.print_exc()
                job.emit("error", exc)
            finally:
                self.running = 0

    def _serve(self, job: Job) -> None:
        stream = self.engine.stream(job.ids, job.max_tokens, job.sampling, job.stop)
        while True:
            if job.cancelled.is_set():
                stream.close()
                if self._on_cancel:
                    self._on_cancel()
                return
            try:
                delta = next(stream)
            except StopIteration as done:
                result = done.value
                break
            self._tokens(job)
            if job.wants_text:
                job.emit("text", delta)
        if self._on_done:
            self._on_done(result)
        job.emit("done", result)

    def _tokens(self, job: Job) -> None:
        """A request's answer grew: its time to first token or the time since its last tokens."""
        now = time.perf_counter()
        if self.observer is not None:
            if job.last_token is None:
                self.observer.first_token(now - job.created)
            else:
                self.observer.inter_token(now - job.last_token)
        job.last_token = now

    # ------------------------------------------------------------------ continuous batching
    def _admit(self) -> list[Job] | None:
        """Jobs for the free slots (waiting for one while nothing runs); None once closed."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._closed:
                    return None
                if self._waiting and self.batch.free_slots:
                    n = min(len(self._waiting), self.batch.free_slots)
                    return [self._waiting.popleft() for _ in range(n)]
                if self.running:
                    return []
                self._cond.wait()

    def _run_batched(self) -> None:
        active: dict = {}  # sequence -> (job, its text)
        while True:
            jobs = self._admit()
            if jobs is None:
                for job, _ in active.values():
                    job.cancel()
                    job.emit("cancelled")
                return
            for job in jobs:
                try:
                    text = self.engine.text_of(job.stop)
                    seq = self.batch.add(job.ids, job.max_tokens, job.sampling, text.stop_rule)
                except BaseException as exc:
                    job.emit("error", exc)
                    continue
                active[seq] = (job, text)
            for seq, (job, _) in list(active.items()):
                if job.cancelled.is_set():  # its client left: the slot frees now
                    self.batch.remove(seq)
                    del active[seq]
                    if self._on_cancel:
                        self._on_cancel()
            self.running = len(active)
            if not active:
                continue
            if self.observer is not None:
                self.observer.batch_step(len(active))
            try:
                events = self.batch.step()
            except BaseException as exc:  # a failing step ends the requests in it, not the worker
                traceback.print_exc()
                for seq, (job, _) in active.items():
                    self.batch.remove(seq)
                    job.emit("error", exc)
                active.clear()
                self.running = 0
                continue
            for event in events:
                job, text = active[event.sequence]
                if event.new_ids:
                    self._tokens(job)
                delta = text.take()
                if event.done is not None:
                    last, result = text.finish(event.done)
                    delta += last
                    del active[event.sequence]
                if delta and job.wants_text:
                    job.emit("text", delta)
                if event.done is not None:
                    if self._on_done:
                        self._on_done(result)
                    job.emit("done", result)
            self.running = len(active)
