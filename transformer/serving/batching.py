"""The server's model worker and its fair batching: one queue per search setting; the queue whose first
request has waited longest goes next, as soon as that request has waited `wait` seconds or the queue
holds a full batch. Requests of a rare setting are batched with each other and never starve; a request
whose client has gone or whose time ran out is dropped before it runs. One thread runs the model."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformer.inference.translation import Guide
from transformer.serving.api import Request

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request in the queue: its lines and search, their source ids, and the asyncio future its
    handler awaits."""

    id: str
    request: Request
    sources: list[list[list[int]]]  # each line's sources (pieces + EOS; parts of a long line), as encoded
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    guides: list[Guide] | None = None  # each line's target prefix and constraints, as pieces
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    dropped: bool = False  # the client left or its time ran out: not run, not answered

    def answer(self, result: Any = None, error: BaseException | None = None) -> None:
        """Settle the future from the worker thread (its loop runs the handler)."""

        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the server's loop has ended: nobody waits for the answer
            pass


class QueueFull(Exception):
    """max_queue requests wait already."""


class Batcher:
    """Queues jobs by search setting and runs their batches in one thread: `work(jobs)` translates the
    jobs together and answers each; it is called with at most `max_lines` lines (one job may be more)."""

    def __init__(
        self, work: Callable[[list[Job]], None], wait: float, max_lines: int, max_queue: int
    ) -> None:
        self.work, self.wait, self.max_lines, self.max_queue = work, wait, max_lines, max_queue
        self.queues: dict[tuple, deque[Job]] = {}
        self.condition = threading.Condition()
        self.stopping = False
        self.batches = self.requests = 0
        self.thread = threading.Thread(target=self._run, name="model-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting, not yet taken into a batch (those no longer waited for aside)."""
        with self.condition:
            return sum(not job.dropped for queue in self.queues.values() for job in queue)

    def submit(self, job: Job) -> None:
        key = dataclasses.astuple(job.request.search)
        if self.depth >= self.max_queue:
            raise QueueFull
        with self.condition:
            self.queues.setdefault(key, deque()).append(job)
            self.condition.notify()

    def stop(self, timeout: float) -> bool:
        """Run what is queued, then end the thread; whether it ended within `timeout` seconds."""
        with self.condition:
            self.stopping = True
            self.condition.notify()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while (batch := self._next()) is not None:
            self.batches += 1
            self.requests += len(batch)
            start = time.monotonic()
            for job in batch:
                job.started = start
            try:
                self.work(batch)
            except Exception as error:  # the worker never stops on one batch
                log.exception("translation failed")
                for job in batch:
                    job.answer(error=error)

    def _next(self) -> list[Job] | None:
        """The next batch: the oldest queue's jobs, once its first has waited `wait` or it is full."""
        with self.condition:
            while True:
                for key in [k for k, q in self.queues.items() if not _prune(q)]:
                    del self.queues[key]
                if not self.queues:
                    if self.stopping:
                        return None
                    self.condition.wait()
                    continue
                key = min(self.queues, key=lambda k: self.queues[k][0].arrived)
                queue = self.queues[key]
                due = queue[0].arrived + self.wait - time.monotonic()
                if (
                    due > 0
                    and not self.stopping
                    and sum(len(j.request.lines) for j in queue) < self.max_lines
                ):
                    self.condition.wait(due)
                    continue
                batch, lines = [], 0
                while queue and (not batch or lines + len(queue[0].request.lines) <= self.max_lines):
                    lines += len(queue[0].request.lines)
                    batch.append(queue.popleft())
                return batch


def _prune(queue: deque[Job]) -> int:
    """Drop the jobs nobody waits for any more; what is left."""
    kept = [job for job in queue if not job.dropped]
    queue.clear()
    queue.extend(kept)
    return len(queue)
