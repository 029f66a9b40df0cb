"""``dlion bench NAME``: benchmarks that print figures (never timed unit tests).

* ``codec``   ns/parameter of pack, vote and unpack vs the local Lion step
* ``comm``    time and bytes per step of each collective algorithm vs an fp32 all-reduce
* ``overlap`` step time with communication overlapped with backward, on vs off
* ``e2e``     end-to-end step time on an emulated slow network (virtual cluster)
* ``ttq``     time to a target validation loss per link rate (curves from real ranks × e2e step times)
* ``timeline`` per step: phases, each collective's issue and completion, CPU time against the CPU floor
* ``wire``    D-Lion's exchange alone on a shaped link, CPU idle and busy: how much of the link it uses
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("codec", "comm", "overlap", "e2e", "ttq", "timeline", "wire")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(importlib.import_module(f"dlion.lab.bench.{argv[0]}").main(argv[1:]) or 0)
