"""Copies between host and device, in order, beside the computation.

One `Copies` is a queue of copy work run by its own thread, in submission order. On CUDA the
device copies that work issues go on the queue's own CUDA stream, after an event of the compute
stream where one is given, and the `Ticket` carries an event the compute stream then waits on;
host work that must follow a device copy (accumulating a gradient that came back) runs once the
copy has finished. On CPU processes the thread is the whole copy engine, so the overlap and every
wait of the CUDA path run, and are tested, on a CPU.

`debug.stream_copy_delay_s` sleeps before each copy: a wait that is missing then shows as wrong
numbers, not as a race that rarely loses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Ticket:
    """A copy submitted: `wait()` makes the computation that follows see its result."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> None:
        event = self.future.result()
        if event is not None:
            torch.cuda.current_stream(event.device).wait_event(event)

    def done(self) -> None:
        """Block the host until the copy and the host work after it are finished."""
        event = self.future.result()
        if event is not None:
            event.synchronize()


class Copies:
    """One ordered queue of copies: a thread, and on CUDA a stream of its own."""

    def __init__(self, device: torch.device, name: str, delay_s: float = 0.0):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"oomless-{name}")

    def compute_mark(self) -> torch.cuda.Event | None:
        """An event after the computation issued so far (None on CPU, where it has run)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def submit(
        self,
        copy: Callable[[], None],
        after: torch.cuda.Event | None = None,
        then: Callable[[], None] | None = None,
    ) -> Ticket:
        """Queue `copy` (after the compute event `after`); `then` runs on the host once the
        copy has finished."""
        return Ticket(self._pool.submit(self._run, copy, after, then))

    def _run(self, copy, after, then) -> torch.cuda.Event | None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if not self.cuda:
            copy()
            if then is not None:
                then()
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            copy()
            event = torch.cuda.Event()
            event.record(self.stream)
        if then is not None:
            event.synchronize()
            then()
        return event

    def drain(self) -> None:
        """Every copy queued so far has finished (a no-op copy queued last, waited for)."""
        self.submit(lambda: None).done()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
