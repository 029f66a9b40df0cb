"""dlion.pipeline: the order collectives go out in, with fake collectives that complete on demand."""

import threading
import time

import pytest
import torch

from dlion.pipeline import Flight, Pipeline


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name
        self.done = threading.Event()

    def is_completed(self):
        return self.done.is_set()

    def wait(self):
        assert self.done.wait(10), f"{self.name} never completed"
        self.log.append(("waited", self.name))


class FakeTransport:
    """Records every issue as (group, label); completes collectives when told to (or at once)."""

    def __init__(self, name, log, works, auto=False):
        self.name, self.log, self.works, self.auto = name, log, works, auto
        self.lock = threading.Lock()

    def issue(self, kind, send, label=None):
        with self.lock:
            work = FakeWork(self.log, label)
            self.log.append((self.name, label))
            self.works[label] = work
            if self.auto:
                work.done.set()
            return work, send


def chain(bucket, length):
    """An algorithm whose collectives are c0 … c{length-1}; returns the bucket and the chain length."""
    x = torch.zeros(1)
    for j in range(length):
        x = yield ("all_gather", x, f"b{bucket}c{j}")
    return (bucket, length)


def issued(log, group):
    return [label for g, label in log if g == group]


def test_later_collectives_go_out_in_slot_order_before_earlier_ones_complete():
    log, works = [], {}
    first, second = FakeTransport("first", log, works), FakeTransport("second", log, works)
    lengths = [2, 1, 3, 2]
    pipe = Pipeline(len(lengths), first, second)
    for k, n in enumerate(lengths):
        pipe.add(Flight(chain(k, n), first))
    done = threading.Event()
    outcomes = []
    t = threading.Thread(target=lambda: (outcomes.extend(pipe.finish()), done.set()))
    t.start()
    # complete the first collectives in order: each bucket's second goes out as soon as its first is back
    for k in range(4):
        works[f"b{k}c0"].done.set()
        if lengths[k] > 1:
            deadline = time.time() + 5
            while f"b{k}c1" not in works and time.time() < deadline:
                time.sleep(0.001)
            assert f"b{k}c1" in works, log
    # bucket 3's way back went out while bucket 0's was still in flight
    assert not works["b0c1"].is_completed()
    for label in ["b0c1", "b2c1", "b3c1"]:
        works[label].done.set()
    deadline = time.time() + 5
    while "b2c2" not in works and time.time() < deadline:
        time.sleep(0.001)
    works["b2c2"].done.set()
    assert done.wait(5)
    t.join()
    assert issued(log, "first") == ["b0c0", "b1c0", "b2c0", "b3c0"]
    assert issued(log, "second") == ["b0c1", "b2c1", "b3c1", "b2c2"]  # row 1, then row 2
    assert outcomes == [(k, n) for k, n in enumerate(lengths)]


@pytest.mark.parametrize("threaded", [False, True])
def test_same_group_never_interleaves_later_collectives_with_first_ones(threaded):
    """One process group: no later collective before the last bucket's first one, even when
    the first buckets are back long before the last is issued."""
    log, works = [], {}
    group = FakeTransport("g", log, works, auto=True)
    pipe = Pipeline(3, group, group, threaded=threaded)
    for k in range(3):
        pipe.add(Flight(chain(k, 2), group))
        time.sleep(0.02)  # a thread, if any, has time to try issuing bucket 0's second collective
    assert pipe.finish() == [(0, 2), (1, 2), (2, 2)]
    assert issued(log, "g") == ["b0c0", "b1c0", "b2c0", "b0c1", "b1c1", "b2c1"]


def test_the_thread_issues_while_buckets_are_still_being_added():
    """threaded=True (overlap): bucket 0's second collective goes out before bucket 2 exists."""
    log, works = [], {}
    first, second = FakeTransport("first", log, works, auto=True), FakeTransport("second", log, works, auto=True)
    pipe = Pipeline(3, first, second, threaded=True)
    pipe.add(Flight(chain(0, 2), first))
    deadline = time.time() + 5
    while "b0c1" not in works and time.time() < deadline:
        time.sleep(0.001)
    assert "b0c1" in works, log
    for k in (1, 2):
        pipe.add(Flight(chain(k, 2), first))
    assert pipe.finish() == [(0, 2), (1, 2), (2, 2)]
    assert issued(log, "second") == ["b0c1", "b1c1", "b2c1"]


def test_an_error_in_the_thread_is_raised_by_finish():
    log, works = [], {}
    first = FakeTransport("first", log, works, auto=True)

    def broken():
        yield ("all_gather", torch.zeros(1), "x")
        raise ValueError("the algorithm failed")

    pipe = Pipeline(1, first, first, threaded=True)
    pipe.add(Flight(broken(), first))
    with pytest.raises(ValueError, match="the algorithm failed"):
        pipe.finish()


def test_finish_refuses_missing_flights():
    log, works = [], {}
    first = FakeTransport("first", log, works, auto=True)
    pipe = Pipeline(2, first, first)
    pipe.add(Flight(chain(0, 1), first))
    with pytest.raises(RuntimeError, match="1 of 2 flights"):
        pipe.finish()


@pytest.mark.parametrize("threaded", [False, True])
def test_a_step_without_buckets_finishes_at_once(threaded):
    """Every parameter frozen: no bucket, nothing to wait for (it must not hang)."""
    log, works = [], {}
    first = FakeTransport("first", log, works, auto=True)
    assert Pipeline(0, first, first, threaded=threaded).finish() == []


@pytest.mark.parametrize("threaded", [False, True])
def test_progress_sees_bucket_0_finished_while_bucket_1_is_still_on_the_wire(threaded):
    """finish(progress): progress() runs in the caller's thread after results arrive, so the
    caller can use bucket 0's outcome before bucket 1's last collective has completed."""
    log, works = [], {}
    first = FakeTransport("first", log, works, auto=True)
    second = FakeTransport("second", log, works)
    pipe = Pipeline(2, first, second, threaded=threaded)
    for k in range(2):
        pipe.add(Flight(chain(k, 2), first))
    caller = threading.get_ident()
    seen = []

    def progress():
        assert threading.get_ident() == caller
        done = [f.outcome is not None for f in pipe.flights]
        seen.append(done)
        if done == [True, False]:
            works["b1c1"].done.set()  # bucket 1's way back completes only once bucket 0 was seen done

    def complete_b0():
        deadline = time.time() + 5
        while not {"b0c1", "b1c1"} <= set(works) and time.time() < deadline:
            time.sleep(0.001)
        works["b0c1"].done.set()

    helper = threading.Thread(target=complete_b0)
    helper.start()
    assert pipe.finish(progress) == [(0, 2), (1, 2)]
    helper.join()
    assert [True, False] in seen
    assert seen[-1] == [True, True]
