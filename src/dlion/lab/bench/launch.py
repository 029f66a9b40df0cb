"""Running a benchmark's ranks on loopback or on the virtual cluster (shared by the benchmarks).

A benchmark writes one rank function ``fn(rank, world, *args, emit)``: it runs inside an
initialised Gloo process group and calls ``emit(dict)`` for every result it reports, and
``emit({"tick": 1})`` per step when it wants a progress bar to move. The same function runs

* on loopback: :func:`run_loopback` forks the ranks on this machine (:func:`dlion.lab.spawn.spawn`,
  127.0.0.1, no shaping, no root needed) and returns every rank's results; ticks reach the
  parent as they happen;
* on the virtual cluster: the benchmark's command starts one process per rank, in which
  :func:`env_worker` joins the ``env://`` process group and prints a ``TICK`` line per tick and
  a ``RESULT <json>`` line per result; :func:`run_cluster` runs that command at each link rate
  on one cluster (reshaping the links in between) and parses the lines back (root needed,
  see ``dlion cluster``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Iterator, NoReturn, Optional, Sequence

RESULT = "RESULT "
TICK = "TICK"


def print_emit(d: dict) -> None:
    """``emit`` of a rank inside the virtual cluster: a ``TICK`` or a ``RESULT <json>`` line."""
    print(TICK if "tick" in d else RESULT + json.dumps(d), flush=True)


def env_worker(fn: Callable, *args, timeout_s: Optional[float] = None) -> NoReturn:
    """One rank inside the virtual cluster: join the ``env://`` Gloo group (with the given
    timeout, else torch's default), run ``fn(rank, world, *args, print_emit)``, leave the group.

    On success it does not return: once its results are flushed the process ends with
    ``os._exit(0)``, as multiprocessing's forked workers (the loopback ranks) do. Interpreter
    finalization would tear down what torch's C++ side still holds (process groups kept by
    the benchmark's caches, the profiler's threads), which now and then aborted a rank after
    its last result had been printed (exit 134, "terminate called without an active exception")
    and failed the whole run."""
    import os
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", **kwargs)
    try:
        fn(dist.get_rank(), dist.get_world_size(), *args, print_emit)
        dist.barrier()  # leave together, as dlion.lab.spawn's workers do
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn_entry(rank: int, world: int, fn: Callable, ticks, *args) -> list:
    got: list = []

    def emit(d: dict) -> None:
        if "tick" in d:
            if ticks is not None:
                ticks.put(1)
        else:
            got.append(d)

    fn(rank, world, *args, emit)
    return got


def run_loopback(fn: Callable, world: int, *args, timeout_s: float,
                 on_tick: Optional[Callable[[], None]] = None) -> list[list[dict]]:
    """Run ``fn(rank, world, *args, emit)`` on ``world`` forked local ranks; returns each rank's
    emitted results in rank order. ``on_tick()`` is called in this process for every tick,
    while the ranks run. ``timeout_s``: the process group's timeout."""
    import torch.multiprocessing as mp

    from dlion.lab.spawn import spawn

    if on_tick is None:
        return spawn(_spawn_entry, world, fn, None, *args, timeout_s=timeout_s)
    ticks = mp.get_context("fork").SimpleQueue()
    done = threading.Event()

    def pump() -> None:
        while not done.is_set() or not ticks.empty():
            if ticks.empty():
                time.sleep(0.05)
                continue
            ticks.get()
            on_tick()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        return spawn(_spawn_entry, world, fn, ticks, *args, timeout_s=timeout_s)
    finally:
        done.set()
        reader.join()


def run_cluster(cmd: list[str], world: int, links: Sequence[str], *, prefix: str, timeout: float,
                on_tick: Optional[Callable[[], None]] = None,
                on_link: Optional[Callable[[str], None]] = None,
                nodes: Optional[int] = None, queue: str = "50ms") -> Iterator[tuple[str, list[list[dict]], list]]:
    """Run ``cmd`` (one process per rank, which calls :func:`env_worker`) on a virtual cluster of
    ``world`` ranks once per link rate of ``links``, in order, on one cluster whose links are
    reshaped between runs. ``on_link(link)`` is called before each run and ``on_tick()`` for
    every ``TICK`` line. Yields ``(link, results per rank, RankResults)`` after each run, while
    the cluster is still up; stops after the first run that failed (see
    :func:`dlion.lab.cluster.exit_code`). The cluster is torn down when the generator ends or
    is closed. Raises the cluster's errors (:class:`dlion.lab.cluster.RootRequiredError`
    without root). ``nodes``: group the ranks into that many nodes (the links are then the
    node uplinks; inside a node unshaped, see :class:`dlion.lab.cluster.VirtualCluster`). ``queue``:
    every link's tbf queue bound (tc's ``latency``)."""
    from dlion.lab.cluster import VirtualCluster, exit_code

    with VirtualCluster(world, link=links[0], prefix=prefix, nodes=nodes, latency=queue) as cluster:
        for i, link in enumerate(links):
            if i:
                cluster.set_link(link)
            if on_link is not None:
                on_link(link)
            got: list[list[dict]] = [[] for _ in range(world)]

            def on_line(rank: int, stream: str, line: str, got=got) -> None:
                if stream != "stdout":
                    return
                if line.startswith(RESULT):
                    got[rank].append(json.loads(line[len(RESULT):]))
                elif line == TICK and on_tick is not None:
                    on_tick()

            results = cluster.run(cmd, timeout=timeout, on_line=on_line)
            yield link, got, results
            if exit_code(results):
                return


def report_failure(results: list) -> int:
    """The exit code of a virtual-cluster run (:func:`dlion.lab.cluster.exit_code`); when it is
    not 0, every failed rank's exit status and the tail of its stderr go to our stderr."""
    import sys

    from dlion.lab.cluster import exit_code

    code = exit_code(results)
    if code:
        for r in results:
            if not r.ok:
                sys.stderr.write(f"[rank {r.rank}] exit {r.returncode}"
                                 f"{' (timed out)' if r.timed_out else ''}\n{r.stderr[-3000:]}\n")
    return code
