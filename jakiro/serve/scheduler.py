"""One request at a time through the engine, in a worker thread; waiting requests sit in a bounded
queue. Results and streamed text go back to the event loop through each job's asyncio queue, and a
job cancelled by its client is dropped before it starts or stopped at its next decode cycle."""

from __future__ import annotations

import asyncio
import queue
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
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._on_done, self._on_cancel = on_done, on_cancel
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="jakiro-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None

    def close(self, timeout: float = 5.0) -> None:
        while True:  # cancel whatever still waits, then stop the worker
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit("cancelled")
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                if self._on_cancel:
                    self._on_cancel()
                continue
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
