"""The buckets of one step in flight, and the order their collectives go out in.

Gloo and NCCL pair the collectives of a process group by the order they are
issued in, so every rank must issue the same collectives in the same order. Each
bucket's algorithm yields a chain of collectives (``1bit``: an ``all_to_all`` of
signs, then an ``all_gather`` of the vote's codes; rarely one more, a re-send in
base 3), each one depending on the result of the one before.

* The **first** collective of every bucket goes on ``first``, in bucket order:
  from backward's gradient hooks with ``overlap=True``, else from ``step()``.
* Every **later** collective goes on ``second`` in *slot order*. The j-th later
  collective of bucket k is slot (j, k); slots are taken row by row, (1, 0),
  (1, 1), …, (1, K−1), (2, 0), …, and a bucket whose chain has ended leaves its
  slot empty. A slot is issued as soon as its bucket's previous collective has
  completed and every slot before it has been issued (not completed): bucket
  k's way back goes on the wire while bucket k−1's is still there, instead of
  after it.

Which slots exist depends only on what the collectives returned, which is the
same on every rank, so the order on ``second`` is the same everywhere. When
``second`` is ``first`` (one process group), no later collective is issued
before the last bucket's first one, so the two kinds never interleave.

With ``threaded=True`` (``overlap=True``), a background thread walks the slots
while backward runs: it blocks on the collective its next slot depends on, hands
the result to the algorithm (the vote of a received chunk, the decoding of the
gathered codes) and issues the next collective the moment it can, not when the
next gradient hook happens to fire. ``finish()`` waits for it.

``finish(progress)`` calls ``progress()`` in the caller's thread each time a
collective's result has been handed on (and once at the end), so that the
caller can use finished buckets (apply them) while later ones are still on the
wire: from the walk itself without the thread, while waiting for it with it.

Off the CPU and without the thread, the headers that the algorithms read on the
host (:attr:`dlion.wire.Request.head`) are read for every bucket whose collective
is in flight at once, when the first of them is needed: one host synchronisation
per round of collectives instead of one per bucket (:func:`dlion.wire.read_heads`).
With the thread, buckets arrive one at a time from backward's hooks and each
bucket's headers are read on the exchange thread as it comes.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from .collectives import GroupTransport
from .wire import read_heads

__all__ = ["Flight", "Pipeline"]


class Flight:
    """One bucket's exchange: drives the algorithm's generator over transports.

    At any time the flight either has a collective in flight (``work``), holds
    the next one the algorithm asked for (``request``, not issued yet) or is done
    (``outcome``).
    """

    def __init__(self, gen, first: GroupTransport):
        self.gen = gen
        self.outcome = None
        self.request: Optional[tuple] = None
        self.waited = 0.0  # seconds blocked in wait()
        #: the collective in flight: its ``Request.head`` (None: no headers for the host), and once
        #: waited for with other flights' (:meth:`Pipeline._fetch_heads`), its result with them read
        self.head: Optional[tuple] = None
        self.fetched = None
        self._start(first, next(gen))

    def _start(self, transport: GroupTransport, request) -> None:
        kind, send, label = request
        self.head = getattr(request, "head", None)
        self.work, self.out = transport.issue(kind, send, label)

    @property
    def running(self) -> bool:
        return self.work is not None

    def wait(self) -> None:
        """Wait for the collective in flight."""
        t = time.perf_counter()
        self.work.wait()
        self.waited += time.perf_counter() - t

    def feed(self) -> None:
        """Wait for the collective in flight and hand its result to the algorithm."""
        if self.fetched is None:
            self.wait()
        out = self.fetched if self.fetched is not None else self.out
        self.work = self.out = self.fetched = self.head = None
        try:
            self.request = self.gen.send(out)
        except StopIteration as stop:
            self.outcome, self.gen = stop.value, None

    def issue(self, transport: GroupTransport) -> None:
        """Issue the collective the algorithm asked for."""
        request, self.request = self.request, None
        self._start(transport, request)

    def advance(self, transport: GroupTransport, block: bool) -> bool:
        """Drive this flight alone (its later collectives on ``transport``); True when done."""
        while self.outcome is None:
            if self.request is None:
                if not block and not self.work.is_completed():
                    return False
                self.feed()
            if self.request is not None:
                self.issue(transport)
        return True


class Pipeline:
    """The ``buckets`` flights of one step; later collectives issued in slot order (module doc)."""

    def __init__(self, buckets: int, first: GroupTransport, second: GroupTransport, threaded: bool = False,
                 device: Optional[torch.device] = None):
        self.buckets = buckets
        self.device = device
        self.first, self.second = first, second
        self.threaded = threaded
        self.flights: list[Flight] = []
        self._col, self._issued_in_row = 0, False  # the next slot's bucket; any slot taken in this row
        self._done = buckets == 0
        self._added = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._progress = threading.Condition()
        self._fed, self._walked = 0, False  # results handed on (by the thread); the thread's walk ended
        #: called after each result is handed on: with the thread, wake finish(); without, its progress
        self._on_feed: Optional[Callable[[], None]] = self._notify if threaded else None
        self.blocked = 0.0  # seconds the caller of finish() was blocked
        #: read the headers of every flight in flight at once (off the CPU, without the thread)
        self._batch_heads = not threaded and device is not None and device.type != "cpu"

    def add(self, flight: Flight) -> None:
        """The next bucket's flight (bucket order), its first collective already issued."""
        if len(self.flights) >= self.buckets:
            raise RuntimeError(f"Pipeline: more than {self.buckets} flights in one step")
        with self._added:
            self.flights.append(flight)
            self._added.notify()
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(target=self._drive_guarded, name="dlion-exchange", daemon=True)
            self._thread.start()

    def finish(self, progress: Optional[Callable[[], None]] = None) -> list:
        """Complete every flight (all ``buckets`` must have been added); their outcomes in bucket
        order. ``progress()``: called in this thread whenever a result has been handed on, and
        once at the end; an exception it raises propagates (after the walk has ended)."""
        if len(self.flights) != self.buckets:
            raise RuntimeError(f"Pipeline.finish: {len(self.flights)} of {self.buckets} flights added")
        if self._thread is not None:
            t, busy, seen = time.perf_counter(), 0.0, -1
            try:
                while True:
                    with self._progress:
                        while self._fed == seen and not self._walked:
                            self._progress.wait()
                        seen, walked = self._fed, self._walked
                    if progress is not None and self._error is None and not walked:
                        u = time.perf_counter()
                        progress()
                        busy += time.perf_counter() - u
                    if walked:
                        break
            finally:
                self._thread.join()
            self.blocked = time.perf_counter() - t - busy
            if self._error is not None:
                raise self._error
        else:
            self._on_feed = progress
            try:
                self._drive()
            finally:  # progress() usually holds the step that holds this pipeline: no cycle for the GC
                self._on_feed = None
            self.blocked = sum(f.waited for f in self.flights)
        if progress is not None:
            progress()
        return [f.outcome for f in self.flights]

    # -- the slot walk ------------------------------------------------------------
    def _drive_guarded(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # a new thread starts on device 0
            self._drive()
        except BaseException as e:  # re-raised by finish() in the caller's thread
            self._error = e
        finally:
            with self._progress:
                self._walked = True
                self._progress.notify()

    def _flight(self, k: int) -> Flight:
        with self._added:
            while len(self.flights) <= k:
                self._added.wait()
            return self.flights[k]

    def _drive(self) -> None:
        while not self._done:
            k = self._col
            f = self._flight(k)
            if f.running:
                self._feed_finished(k)
                self._feed(f)
            if f.request is not None:  # this row's slot of bucket k: its next later collective
                if self.second is self.first:
                    self._flight(self.buckets - 1)  # never between the first collectives
                f.issue(self.second)
                self._issued_in_row = True
            self._col += 1
            if self._col == self.buckets:
                if not self._issued_in_row:  # a row with no slot taken: every chain has ended
                    self._done = True
                self._col, self._issued_in_row = 0, False

    def _feed_finished(self, k: int) -> None:
        """Before blocking on bucket k: hand on the results of earlier buckets that have arrived."""
        for f in self.flights[:k]:
            if f.running and f.work.is_completed():
                self._feed(f)

    def _feed(self, f: Flight) -> None:
        if self._batch_heads and f.head is not None and f.fetched is None:
            self._fetch_heads()
        f.feed()
        if self._on_feed is not None:
            self._on_feed()

    def _fetch_heads(self) -> None:
        """Wait for every flight whose collective in flight returns headers for the host, and read
        all their headers with one copy (:func:`dlion.wire.read_heads`)."""
        group = [f for f in self.flights if f.running and f.head is not None and f.fetched is None]
        for f in group:
            f.wait()
        for f, got in zip(group, read_heads([(f.out, f.head) for f in group])):
            f.fetched = got

    def _notify(self) -> None:
        with self._progress:
            self._fed += 1
            self._progress.notify()
