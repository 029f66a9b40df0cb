"""The ``dlion`` command: each subcommand lives in its own module and takes its own flags."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help)
COMMANDS = {
    "demo": ("dlion.lab.demo", "train a classifier on 4 local workers with G-Lion, D-Lion MaVo and D-Lion Avg"),
    "bench": ("dlion.lab.bench", "benchmarks: codec, comm, overlap, e2e"),
    "cluster": ("dlion.lab.cluster", "run a command on a virtual cluster of network namespaces with shaped links"),
    "experiment": ("dlion.lab.experiments", "convergence sweeps on real data (simulated workers)"),
    "kernels": ("dlion.kernels", "build (or find) the native CPU kernels of fused=True now; print their file"),
}


def usage() -> str:
    lines = ["usage: dlion COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Run 'dlion COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from dlion import __version__

        print(f"dlion {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"dlion: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
