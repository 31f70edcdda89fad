"""One request at a time through the engine, in a worker thread; waiting requests sit in a bounded
queue. Results and streamed text go back to the event loop through each job's asyncio queue, and a
job cancelled by its client is dropped before it starts or stopped at its next decode cycle."""

from __future__ import annotations

import asyncio
import collections
import threading
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
                 on_cancel: Callable | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._on_done, self._on_cancel = on_done, on_cancel
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="jakiro-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests waiting for the engine whose clients are still there."""
        with self._cond:
            self._drop_cancelled()
            return len(self._waiting)

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
        while True:
            job = self._next()
            if job is None:
                return
            self.busy = True
            try:
                self._serve(job)
            except BaseException as exc:  # one failing request never takes the worker down
                traceback.print_exc()
                job.emit("error", exc)
            finally:
                self.busy = False

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
            if job.wants_text:
                job.emit("text", delta)
        if self._on_done:
            self._on_done(result)
        job.emit("done", result)
