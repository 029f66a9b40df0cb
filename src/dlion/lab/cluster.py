"""A virtual cluster on one Linux machine: one network namespace per rank,
joined by a switch, every link rate-limited with ``tbf``.

Topology (``world_size`` = N, ``prefix`` = P)::

        netns P-r0           netns P-r1                netns P-r{N-1}
      +------------+       +------------+            +------------+
      | eth0       |       | eth0       |    ...     | eth0       |
      | 127.100.0.1|       | 127.100.0.2|            | 127.100.0.N|
      +-----+------+       +-----+------+            +-----+------+
            | veth               | veth                    | veth
      +-----+--------------------+-------------------------+------+
      |     p0                   p1          ...           p{N-1} |
      |                      br0 (Linux bridge)                   |
      +------------------------- netns P-sw ----------------------+

Each rank's ``eth0`` is one end of a veth pair whose other end (``p<rank>``) is
a port of the bridge ``br0`` in the "switch" namespace ``P-sw``. Both ends are
shaped with ``tbf``: the egress of ``eth0`` limits what the rank sends and the
egress of ``p<rank>`` limits what it receives, so every rank has a full-duplex
port of ``link`` bits/s, as on a switched Ethernet. The kernel here has no
``netem``, so there is no added latency: only rates are emulated.

Nodes (``nodes=n``, ``world_size`` = n·L): the ranks of node a hang on a bridge of
their own, ``bn<a>``, by links shaped to ``intra_link`` (default unshaped: the fast
links inside a machine), and each node bridge reaches the core bridge ``br0`` through
one uplink, the veth pair ``u<a>``–``c<a>``, shaped to ``link`` in both directions: the
node's network port. Every bridge lives in the switch namespace::

        P-r0  P-r1          P-r2  P-r3            (ranks; eth0, intra_link)
          |     |             |     |
      +---p0----p1---+    +---p2----p3---+
      |     bn0      |    |     bn1      |        (node bridges, in P-sw)
      +------u0------+    +------u1------+
             |  link (tbf both ends)|
      +------c0---------------------c1------+
      |               br0 (core)            |
      +-------------------------------------+

Ranks of a node get ``LOCAL_RANK`` = rank mod L, ``LOCAL_WORLD_SIZE`` = L and
``GROUP_RANK`` = ``NODE_RANK`` = rank // L, as torchrun would give them.

Nothing is created in the host's namespace: the veth pairs are created
directly inside the cluster's namespaces, so deleting the namespaces deletes
every link and qdisc with them. The addresses come from 127.100.0.0/16
(``route_localnet`` on, and the ``local 127.0.0.0/8`` route of table ``local``
deleted, inside each rank namespace): loopback-range addresses cannot be
routed anywhere outside the machine, and the namespaces have no other
interface and no default route, so traffic cannot leave them. IPv6 is turned
off inside the namespaces so that Gloo cannot pick an unusable link-local
address and no background IPv6 chatter shares the shaped links.

Burst: ``tbf`` needs a bucket of at least one MTU-sized frame; larger buckets
let short transfers run above the rate. The default is 2 ms worth of line
rate, but at least 32 KiB (1 Gbit/s -> ~244 KiB, close to the usual
``burst 256kb``; 100 Mbit/s and below -> 32 KiB, i.e. a few milliseconds of
slack that is negligible for transfers of megabytes). ``latency 50ms`` sizes
the queue (rate x 50 ms + burst). Both can be overridden.

API::

    VirtualCluster(world_size, link="1gbit", *, prefix="dlion", burst=None,
                   latency="50ms", master_port=29500, nodes=None, intra_link=None)
        # context manager; .start() / .close() for explicit use
        .run(cmd, *, env=None, timeout=None, cwd=None, echo=False,
             on_line=None, fail_fast=True, check=False, kill_grace=5.0)
            -> list[RankResult]
        .set_link(link, burst=None)      # reshape the shaped links in place (the uplinks with nodes)
        .rank_env(rank, env=None) -> dict[str, str]
        .wrap(rank, argv) -> list[str]   # ["ip", "netns", "exec", ns, *argv]
        .namespaces, .switch_namespace, .addresses, .master_addr,
        .master_port, .rate_bps, .burst_bytes, .world_size, .prefix
    RankResult(rank, argv, returncode, stdout, stderr, elapsed, timed_out,
               killed)                   # .ok
    exit_code(results) -> int            # first failure's code, 124 on timeout
    cleanup(prefix="dlion", *, force=False) -> list[str]
    require_root() / netns_available() -> (bool, reason)
    parse_rate(link) -> int | None       # bits/s, None = unshaped
    format_rate(bps) -> str              # 50_000_000 -> "50mbit", None -> "unlimited"
    main(argv) -> int                    # ``dlion cluster ...``

``cmd`` for :meth:`VirtualCluster.run` is one argv for every rank, a list of
one argv per rank, or a callable ``rank -> argv``. Every rank gets the
environment torch.distributed's ``env://`` needs (MASTER_ADDR = rank 0's
address, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) plus
``GLOO_SOCKET_IFNAME=eth0`` — without it Gloo advertises 127.0.0.1 and the
ranks cannot reach each other. A benchmark would do::

    with VirtualCluster(4, link="100mbit") as c:
        results = c.run(lambda rank: [sys.executable, "-m", "some.module"],
                        timeout=600, check=True)
        c.set_link("1gbit")
        results = c.run(...)

Teardown always runs: on normal exit, on an exception, on SIGINT (raised as
KeyboardInterrupt) and on SIGTERM/SIGHUP (raised as ``SystemExit(128+sig)``)
while the cluster is active in the main thread. If the controlling process is
killed outright (SIGKILL), the next cluster with the same prefix removes the
leftovers when it starts, and so does ``dlion cluster --cleanup``. A lock file
per prefix keeps two live clusters from tearing each other down.

Needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``). Without them, run the
workers on 127.0.0.1 without shaping instead (loopback mode), e.g.
``torchrun --standalone --nproc-per-node 4 train.py``.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import errno
import fcntl
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Mapping, Optional, Sequence, Union

__all__ = [
    "VirtualCluster",
    "RankResult",
    "ClusterError",
    "RootRequiredError",
    "ClusterBusyError",
    "ClusterRunError",
    "cleanup",
    "exit_code",
    "netns_available",
    "parse_rate",
    "format_rate",
    "require_root",
    "main",
]

SUBNET = ipaddress.ip_network("127.100.0.0/16")
DEFAULT_PREFIX = "dlion"
DEFAULT_MASTER_PORT = 29500
MIN_BURST_BYTES = 32 * 1024
BURST_SECONDS = 0.002
_IP_TIMEOUT = 20.0  # an `ip`/`tc` call that takes longer than this is stuck

LOOPBACK_HINT = (
    "Without root, use the loopback mode instead: run the workers directly on "
    "127.0.0.1 without link shaping, e.g. `torchrun --standalone --nproc-per-node 4 train.py`."
)

Argv = Sequence[str]
Cmd = Union[str, Argv, Sequence[Argv], Callable[[int], Argv]]


class ClusterError(RuntimeError):
    """Setting up, using or tearing down the virtual cluster failed."""


class RootRequiredError(ClusterError):
    """The virtual cluster needs root and iproute2; the message says what to do instead."""


class ClusterBusyError(ClusterError):
    """Another live cluster holds the same prefix."""


class ClusterRunError(ClusterError):
    """Raised by ``run(..., check=True)`` when a rank failed; carries the results."""

    def __init__(self, message: str, results: list["RankResult"]):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class RankResult:
    """What one rank's process did. ``returncode`` < 0 means killed by that signal;
    ``killed`` means this module stopped it (another rank failed, timeout, interrupt)."""

    rank: int
    argv: list[str]
    returncode: Optional[int]
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool = False
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# --------------------------------------------------------------------------- helpers


def parse_rate(link: Union[str, int, float, None]) -> Optional[int]:
    """Link rate in bits/s, or None for an unshaped link.

    Accepts tc's bit units (``"1gbit"``, ``"100mbit"``, ``"500kbit"``, ``"2.5gbit"``),
    a plain number of bits/s, and ``None``/``"unlimited"``/``"none"``/``0``.
    tc's byte units (``"mbps"`` = megabytes/s) are refused because they are
    easily mistaken for megabits."""
    if link is None:
        return None
    if isinstance(link, (int, float)) and not isinstance(link, bool):
        if link < 0:
            raise ValueError(f"link rate must be >= 0, got {link}")
        return int(link) or None
    text = str(link).strip().lower()
    if text in ("", "unlimited", "none", "inf", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*(bit|kbit|mbit|gbit|tbit)?", text)
    if not m:
        raise ValueError(
            f"bad link rate {link!r}: use e.g. '1gbit', '100mbit', '500kbit', bits/s as a number, "
            "or 'unlimited' (byte units like 'mbps' are not accepted)"
        )
    scale = {None: 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}[m.group(2)]
    bps = int(float(m.group(1)) * scale)
    return bps or None


def rate_key(link: str) -> float:
    """A link label as a sort key: its rate in bit/s (unshaped and unknown labels last)."""
    try:
        rate = parse_rate(link)
    except ValueError:
        return float("inf")
    return float("inf") if rate is None else float(rate)


def format_rate(bps: Optional[int]) -> str:
    """Bits/s as tc writes them, in the largest unit that divides exactly."""
    if bps is None:
        return "unlimited"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"


def _default_burst(bps: int) -> int:
    # 2 ms of line rate keeps tbf's timer from being the bottleneck at high rates;
    # the floor guarantees a few full frames fit at low rates.
    return max(MIN_BURST_BYTES, int(bps / 8 * BURST_SECONDS))


def _burst_bytes(burst: Union[int, str, None], bps: Optional[int]) -> Optional[int]:
    if bps is None:
        return None
    if burst is None:
        return _default_burst(bps)
    if isinstance(burst, int):
        value = burst
    else:
        m = re.fullmatch(r"(\d+)\s*(b|k|kb|m|mb)?", str(burst).strip().lower())
        if not m:
            raise ValueError(f"bad burst {burst!r}: use bytes as an int or e.g. '256kb', '1mb'")
        value = int(m.group(1)) * {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20}[m.group(2)]
    if value < 2048:
        raise ValueError(f"burst {burst!r} is smaller than one frame; use at least a few KiB")
    return value


def _check_prefix(prefix: str) -> str:
    # Names become netns file names and must not be confused with another
    # prefix's names by the cleanup pattern.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}", prefix):
        raise ValueError(f"bad prefix {prefix!r}: letters, digits, '_', '.', '-' (not leading), at most 48 chars")
    return prefix


def _ns_pattern(prefix: str) -> "re.Pattern[str]":
    # Exactly this prefix's names: "dlion" must not match "dlion-x-r0" of prefix "dlion-x".
    return re.compile(rf"^{re.escape(prefix)}-(?:sw|r\d+)$")


def require_root() -> None:
    """Raise :class:`RootRequiredError` unless we are root and iproute2 is installed."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        raise RootRequiredError(
            "the virtual cluster needs root (CAP_NET_ADMIN) to create network namespaces, veth "
            "links and tbf qdiscs. " + LOOPBACK_HINT
        )
    if missing:
        raise RootRequiredError(
            f"the virtual cluster needs iproute2 ({', '.join(missing)} not found on PATH). " + LOOPBACK_HINT
        )


def netns_available() -> tuple[bool, str]:
    """Whether namespaces can really be created here (root alone is not enough in
    some containers). Returns (usable, reason-if-not)."""
    try:
        require_root()
    except RootRequiredError as exc:
        return False, str(exc)
    probe = f"dlionprobe{os.getpid()}"
    try:
        res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_IP_TIMEOUT)
        if res.returncode != 0:
            return False, f"`ip netns add` failed: {res.stderr.strip()}"
        res = subprocess.run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                             capture_output=True, text=True, timeout=_IP_TIMEOUT)
        if res.returncode != 0:
            return False, f"cannot create veth links in a namespace: {res.stderr.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot run ip: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_IP_TIMEOUT)


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=_IP_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"`{shlex.join(argv)}` hung for {_IP_TIMEOUT:.0f} s") from exc
    if check and res.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    # Everything still running inside one of our namespaces was started by a
    # cluster with this prefix (a worker or a worker's child): kill it by pid so
    # the namespace really goes away.
    res = _sh(["ip", "netns", "pids", ns], check=False)
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _remove_namespaces(prefix: str) -> list[str]:
    pattern = _ns_pattern(prefix)
    names = [n for n in _list_namespaces() if pattern.match(n)]
    # Rank namespaces first: a veth pair dies with whichever end's namespace goes first.
    names.sort(key=lambda n: n.endswith("-sw"))
    errors = []
    for ns in names:
        _kill_namespace_pids(ns)
        res = _sh(["ip", "netns", "del", ns], check=False)
        if res.returncode != 0 and ns in _list_namespaces():
            errors.append(f"{ns}: {res.stderr.strip()}")
    if errors:
        raise ClusterError("could not delete namespaces: " + "; ".join(errors))
    return names


class _PrefixLock:
    """An flock on a per-prefix file: held while a cluster is alive, free after
    its process dies (even by SIGKILL), so leftovers of a dead run can be
    removed while a live cluster's namespaces are never touched."""

    def __init__(self, prefix: str):
        self.path = os.path.join(tempfile.gettempdir(), f"dlion-cluster-{prefix}.lock")
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ClusterBusyError(
                        f"another virtual cluster with this prefix is running (lock {self.path}); "
                        "choose another --prefix"
                    ) from None
                raise
            # The previous holder unlinks the file before releasing; if we locked
            # a file that is no longer at the path, retry on the new one.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    self.fd = fd
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                    return
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def cleanup(prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[str]:
    """Remove every namespace of ``prefix`` (with their veths, bridge and qdiscs,
    and any process still inside them); returns the names removed.

    Refuses (:class:`ClusterBusyError`) while a live cluster holds the prefix,
    unless ``force``."""
    _check_prefix(prefix)
    require_root()
    lock = _PrefixLock(prefix)
    try:
        lock.acquire()
    except ClusterBusyError:
        if not force:
            raise
        return _remove_namespaces(prefix)
    try:
        return _remove_namespaces(prefix)
    finally:
        lock.release()


def exit_code(results: Sequence[RankResult]) -> int:
    """One exit status for a run: 0 if every rank succeeded, 124 on timeout,
    else the code of the rank that failed first (a rank this module killed only
    counts if none failed on its own); death by signal N gives 128+N."""
    if all(r.ok for r in results):
        return 0
    if any(r.timed_out for r in results):
        return 124
    failed = [r for r in results if not r.ok and not r.killed] or [r for r in results if not r.ok]
    first = min(failed, key=lambda r: (r.elapsed, r.rank))
    code = first.returncode
    if code is None:
        return 1
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- cluster


class VirtualCluster:
    """``world_size`` ranks, each in its own network namespace with an ``eth0``
    on a bridge in a switch namespace, every link shaped to ``link`` in both
    directions (see the module docstring for the topology and the API).

    ``link``: ``"1gbit"``, ``"100mbit"``, bits/s, or ``None``/``"unlimited"`` for
    no shaping. ``burst``: tbf bucket (bytes or e.g. ``"256kb"``; default 2 ms
    of line rate, at least 32 KiB). ``latency``: tbf queue bound. ``prefix``
    names the namespaces (``<prefix>-r<rank>``, ``<prefix>-sw``); leftovers of
    an earlier run with the same prefix are removed on start."""

    def __init__(
        self,
        world_size: int,
        link: Union[str, int, None] = "1gbit",
        *,
        prefix: str = DEFAULT_PREFIX,
        burst: Union[int, str, None] = None,
        latency: str = "50ms",
        master_port: int = DEFAULT_MASTER_PORT,
        nodes: Optional[int] = None,
        intra_link: Union[str, int, None] = None,
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if nodes is not None and (not isinstance(nodes, int) or nodes < 1 or world_size % nodes):
            raise ValueError(f"nodes must be a positive int dividing world_size={world_size}, got {nodes!r}")
        if world_size > SUBNET.num_addresses - 2:
            raise ValueError(f"world_size {world_size} does not fit in {SUBNET}")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"bad master_port {master_port}")
        self.world_size = world_size
        self.prefix = _check_prefix(prefix)
        self.nodes = nodes
        self.per_node = world_size // nodes if nodes else None
        self.rate_bps = parse_rate(link)
        self.burst_bytes = _burst_bytes(burst, self.rate_bps)
        self.intra_bps = parse_rate(intra_link) if nodes else None
        self.latency = latency
        self.master_port = master_port
        self.switch_namespace = f"{prefix}-sw"
        self.namespaces = [f"{prefix}-r{r}" for r in range(world_size)]
        self.addresses = [str(SUBNET.network_address + r + 1) for r in range(world_size)]
        self.master_addr = self.addresses[0]
        self._lock = _PrefixLock(prefix)
        self._active = False
        self._old_handlers: dict[int, object] = {}

    @property
    def link(self) -> str:
        return format_rate(self.rate_bps)

    @property
    def intra_link(self) -> str:
        return format_rate(self.intra_bps)

    def node_of(self, rank: int) -> int:
        """The node of ``rank`` (0 without nodes)."""
        return rank // self.per_node if self.nodes else 0

    def __repr__(self) -> str:
        nodes = f", nodes={self.nodes}, intra_link={self.intra_link!r}" if self.nodes else ""
        return f"VirtualCluster({self.world_size}, link={self.link!r}{nodes}, prefix={self.prefix!r})"

    # ---- lifecycle

    def __enter__(self) -> "VirtualCluster":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def start(self) -> "VirtualCluster":
        """Create the namespaces and links (after removing leftovers of this prefix)."""
        if self._active:
            return self
        require_root()
        self._lock.acquire()
        try:
            self._active = True
            atexit.register(self.close)  # last resort if the process exits without close()
            self._install_signal_handlers()
            stale = _remove_namespaces(self.prefix)
            if stale:
                print(f"dlion cluster: removed leftovers of an earlier run: {' '.join(stale)}", file=sys.stderr)
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill whatever runs in the namespaces and delete them. Idempotent."""
        if not self._active:
            return
        global _defer_depth
        # A second Ctrl-C must not leave the teardown half done: our handler only
        # records signals that arrive now, and they are re-raised once it is done.
        # (Should one land before this line, the atexit hook still tears down.)
        _defer_depth += 1
        try:
            try:
                _remove_namespaces(self.prefix)
            except ClusterError as exc:
                print(f"dlion cluster: teardown incomplete ({exc}); run `dlion cluster --cleanup "
                      f"--prefix {self.prefix}`", file=sys.stderr)
            self._active = False
            self._lock.release()
            atexit.unregister(self.close)
            self._restore_signal_handlers()
        finally:
            _defer_depth -= 1
        if _defer_depth == 0 and _pending_signals:
            signum = _pending_signals[0]
            _pending_signals.clear()
            _raise_for(signum)

    def _install_signal_handlers(self) -> None:
        # Python only turns SIGINT into an exception; SIGTERM/SIGHUP would kill
        # the process without running __exit__. Only default handlers are
        # replaced: a caller's own handler or an inherited SIG_IGN is respected.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, signal.default_int_handler):
                self._old_handlers[sig] = old
                signal.signal(sig, _raise_on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _build(self) -> None:
        sw = self.switch_namespace
        _sh(["ip", "netns", "add", sw])
        _disable_ipv6(sw)
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for a in range(self.nodes or 0):  # node bridges, each with its uplink to the core bridge
            _sh(["ip", "-n", sw, "link", "add", f"bn{a}", "type", "bridge"])
            _sh(["ip", "-n", sw, "link", "add", f"u{a}", "type", "veth", "peer", "name", f"c{a}"])
            _sh(["ip", "-n", sw, "link", "set", f"u{a}", "master", f"bn{a}"])
            _sh(["ip", "-n", sw, "link", "set", f"c{a}", "master", "br0"])
            for dev in (f"bn{a}", f"u{a}", f"c{a}"):
                _sh(["ip", "-n", sw, "link", "set", dev, "up"])
        for rank, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            port = f"p{rank}"
            _sh(["ip", "netns", "add", ns])
            # Created inside the namespaces directly: no link ever exists in the
            # host namespace, so a crash cannot leave one there.
            _sh(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "netns", "exec", ns, "sh", "-c",
                 "for f in all default lo eth0; do"
                 " echo 1 > /proc/sys/net/ipv4/conf/$f/route_localnet || exit 1;"
                 " p=/proc/sys/net/ipv6/conf/$f/disable_ipv6; [ ! -e $p ] || echo 1 > $p; done"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Without this, every 127/8 address is local to the namespace and
            # packets for other ranks would never reach eth0.
            _sh(["ip", "-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local"])
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/{SUBNET.prefixlen}", "dev", "eth0"])
            bridge = f"bn{self.node_of(rank)}" if self.nodes else "br0"
            _sh(["ip", "-n", sw, "link", "set", port, "master", bridge])
            _sh(["ip", "-n", sw, "link", "set", port, "up"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
        self._apply_shaping()
        self._wait_links_up()

    def _apply_shaping(self) -> None:
        # Without nodes every rank's link is shaped to `link`; with nodes, the ranks' links
        # to `intra_link` and the node uplinks to `link`.
        rank_rate = self.intra_bps if self.nodes else self.rate_bps
        rank_burst = _burst_bytes(None, rank_rate) if self.nodes else self.burst_bytes
        links = [(where, dev, rank_rate, rank_burst) for rank, ns in enumerate(self.namespaces)
                 for where, dev in ((ns, "eth0"), (self.switch_namespace, f"p{rank}"))]
        links += [(self.switch_namespace, dev, self.rate_bps, self.burst_bytes)
                  for a in range(self.nodes or 0) for dev in (f"u{a}", f"c{a}")]
        for where, dev, rate, burst in links:
            if rate is None:
                # No qdisc to delete is fine: the link is already unshaped.
                _sh(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _sh(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf",
                     "rate", f"{rate}bit", "burst", str(burst), "latency", self.latency])

    def _wait_links_up(self, timeout: float = 5.0) -> None:
        # veth carrier comes up asynchronously; Gloo would retry, but a plain
        # socket connect() by a worker should not race the link.
        deadline = time.monotonic() + timeout
        for ns in self.namespaces:
            while "LOWER_UP" not in _sh(["ip", "-n", ns, "-o", "link", "show", "eth0"]).stdout:
                if time.monotonic() > deadline:
                    raise ClusterError(f"eth0 in {ns} did not come up within {timeout} s")
                time.sleep(0.02)

    def set_link(self, link: Union[str, int, None], burst: Union[int, str, None] = None, *,
                 intra_link: Union[str, int, None, bool] = False) -> None:
        """Reshape the links (both directions) of the running cluster, e.g. to sweep
        rates without rebuilding it: every rank's link, or with nodes the node uplinks
        (and, if ``intra_link`` is given, the links inside the nodes)."""
        self._require_active()
        rate = parse_rate(link)
        self.burst_bytes = _burst_bytes(burst, rate)
        self.rate_bps = rate
        if self.nodes and intra_link is not False:
            self.intra_bps = parse_rate(intra_link)
        self._apply_shaping()

    def _require_active(self) -> None:
        if not self._active:
            raise ClusterError("the cluster is not running; use `with VirtualCluster(...) as c:` or c.start()")

    # ---- running workers

    def rank_env(self, rank: int, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment of ``rank``'s process: ours, then the torch.distributed
        variables, then ``env`` (the caller's word wins)."""
        out = dict(os.environ)
        out.setdefault("PYTHONUNBUFFERED", "1")  # lines arrive as they are printed
        out.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            # Without nodes all ranks share this machine's devices, so LOCAL_RANK = RANK lets
            # workers that pick cuda:LOCAL_RANK spread over the GPUs; with nodes, torchrun's numbering.
            LOCAL_RANK=str(rank % self.per_node if self.nodes else rank),
            LOCAL_WORLD_SIZE=str(self.per_node if self.nodes else self.world_size),
            GROUP_RANK=str(self.node_of(rank)),
            NODE_RANK=str(self.node_of(rank)),
            # Mandatory: otherwise Gloo resolves the hostname / advertises 127.0.0.1.
            GLOO_SOCKET_IFNAME="eth0",
            TP_SOCKET_IFNAME="eth0",
            NCCL_SOCKET_IFNAME="eth0",
            DLION_CLUSTER_LINK=self.link,
            DLION_CLUSTER_NODES=str(self.nodes or self.world_size),
            DLION_CLUSTER_PREFIX=self.prefix,
        )
        if env:
            out.update({str(k): str(v) for k, v in env.items()})
        return out

    def wrap(self, rank: int, argv: Argv) -> list[str]:
        """``argv`` as a command that runs inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def _argvs(self, cmd: Cmd) -> list[list[str]]:
        if callable(cmd):
            argvs = [list(map(str, cmd(r))) for r in range(self.world_size)]
        elif isinstance(cmd, str):
            argvs = [shlex.split(cmd)] * self.world_size
        elif cmd and all(isinstance(a, str) for a in cmd):
            argvs = [list(cmd)] * self.world_size
        else:
            argvs = [list(map(str, a)) for a in cmd]
            if len(argvs) != self.world_size:
                raise ValueError(f"got {len(argvs)} commands for {self.world_size} ranks")
        if any(not a for a in argvs):
            raise ValueError("empty command")
        return argvs

    def run(
        self,
        cmd: Cmd,
        *,
        env: Union[Mapping[str, str], Callable[[int], Mapping[str, str]], None] = None,
        timeout: Optional[float] = None,
        cwd: Optional[str] = None,
        echo: bool = False,
        on_line: Optional[Callable[[int, str, str], None]] = None,
        fail_fast: bool = True,
        check: bool = False,
        kill_grace: float = 5.0,
    ) -> list[RankResult]:
        """Run one process per rank inside its namespace and wait for all of them.

        ``cmd``: one argv (or shell-like string) for every rank, a list of one
        argv per rank, or ``rank -> argv``. ``env``: extra variables, or
        ``rank -> dict``. ``echo``: print each line as it arrives as
        ``[rank N] line`` (stdout to stdout, stderr to stderr). ``on_line(rank,
        "stdout"|"stderr", line)`` is called for every line. With ``fail_fast``,
        the first rank to exit non-zero gets the others terminated (SIGTERM,
        SIGKILL after ``kill_grace`` s) — a collective would otherwise hang.
        After ``timeout`` s every rank is stopped and marked ``timed_out``.
        ``check``: raise :class:`ClusterRunError` if any rank failed. Returns
        the results in rank order; output is always captured in them."""
        self._require_active()
        argvs = self._argvs(cmd)
        envs = [self.rank_env(r, env(r) if callable(env) else env) for r in range(self.world_size)]
        print_lock = threading.Lock()
        n = self.world_size
        out_lines: list[list[str]] = [[] for _ in range(n)]
        err_lines: list[list[str]] = [[] for _ in range(n)]
        ended: list[Optional[float]] = [None] * n
        killed = [False] * n
        timed_out = [False] * n
        procs: list[subprocess.Popen] = []
        threads: list[threading.Thread] = []

        def pump(rank: int, stream, name: str, sink: list[str]) -> None:
            for line in iter(stream.readline, ""):
                sink.append(line)
                text = line.rstrip("\n")
                if on_line is not None:
                    on_line(rank, name, text)
                if echo:
                    with print_lock:
                        print(f"[rank {rank}] {text}", file=sys.stdout if name == "stdout" else sys.stderr,
                              flush=True)
            stream.close()

        def stop(ranks: Sequence[int], grace: float) -> None:
            live = [r for r in ranks if procs[r].poll() is None]
            for r in live:
                killed[r] = True
                _signal_group(procs[r], signal.SIGTERM)
            deadline = time.monotonic() + grace
            for r in live:
                try:
                    procs[r].wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(procs[r], signal.SIGKILL)
            for r in live:
                procs[r].wait()
                if ended[r] is None:
                    ended[r] = time.monotonic()

        start = time.monotonic()
        try:
            for r in range(n):
                # Own session: a terminal's Ctrl-C reaches only us, and we stop
                # the ranks in order; killpg then reaches the rank's children too.
                p = subprocess.Popen(self.wrap(r, argvs[r]), env=envs[r], cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     encoding="utf-8", errors="replace", start_new_session=True)
                procs.append(p)
                for stream, name, sink in ((p.stdout, "stdout", out_lines[r]), (p.stderr, "stderr", err_lines[r])):
                    t = threading.Thread(target=pump, args=(r, stream, name, sink), daemon=True)
                    t.start()
                    threads.append(t)
            deadline = None if timeout is None else start + timeout
            while True:
                now = time.monotonic()
                running = []
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        running.append(r)
                    elif ended[r] is None:
                        ended[r] = now
                        if p.returncode != 0 and fail_fast:
                            stop([q for q in range(n) if q != r], kill_grace)
                if not running:
                    break
                if deadline is not None and now > deadline:
                    for r in running:
                        timed_out[r] = True
                    stop(running, kill_grace)
                    break
                time.sleep(0.02)
        finally:
            # Reached with an exception too (KeyboardInterrupt, SystemExit from
            # SIGTERM): no rank may outlive the run.
            if len(procs) < n or any(p.poll() is None for p in procs):
                stop(range(len(procs)), min(kill_grace, 2.0))
            for t in threads:
                t.join(timeout=5.0)
            # Children a rank left behind (daemonised, or in another process group).
            for ns in self.namespaces:
                _kill_namespace_pids(ns)

        results = [
            RankResult(rank=r, argv=argvs[r], returncode=procs[r].returncode, stdout="".join(out_lines[r]),
                       stderr="".join(err_lines[r]), elapsed=(ended[r] or time.monotonic()) - start,
                       timed_out=timed_out[r], killed=killed[r])
            for r in range(n)
        ]
        if check and not all(r.ok for r in results):
            raise ClusterRunError(_describe_failure(results), results)
        return results


# Signals that arrive while a cluster is being torn down are held here and
# re-raised afterwards (see VirtualCluster.close).
_defer_depth = 0
_pending_signals: list[int] = []


def _raise_for(signum: int):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _raise_on_signal(signum, frame):
    if _defer_depth:
        _pending_signals.append(signum)
        return
    _raise_for(signum)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # proc has not been reaped (poll() returned None just before), so its pid,
    # which is also its process-group id, still belongs to it.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _disable_ipv6(ns: str) -> None:
    _sh(["ip", "netns", "exec", ns, "sh", "-c",
         "for f in all default; do p=/proc/sys/net/ipv6/conf/$f/disable_ipv6; [ ! -e $p ] || echo 1 > $p; done"])


def _describe_failure(results: Sequence[RankResult]) -> str:
    parts = []
    for r in results:
        if r.ok:
            continue
        why = "timed out" if r.timed_out else "killed after another rank failed" if r.killed else \
            f"exit code {r.returncode}"
        parts.append(f"rank {r.rank}: {why}")
    failed = [r for r in results if not r.ok and not r.killed] or [r for r in results if not r.ok]
    first = min(failed, key=lambda r: (r.elapsed, r.rank))
    tail = "\n".join(first.stderr.splitlines()[-20:])
    msg = "; ".join(parts)
    return f"{msg}\n--- rank {first.rank} stderr (tail) ---\n{tail}" if tail else msg


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlion cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run COMMAND once per rank, each rank in its own network namespace with an eth0 on a\n"
            "virtual switch; every link is rate-limited with tbf in both directions. Each process\n"
            "gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and GLOO_SOCKET_IFNAME=eth0,\n"
            "so torch.distributed.init_process_group('gloo') with env:// works unchanged.\n"
            "Output lines are prefixed with [rank N]; the exit code is that of the first rank to\n"
            "fail (the others are then stopped), 124 on --timeout, 2 if not root.\n"
            "Needs root and iproute2. Without root, run the workers directly on 127.0.0.1\n"
            "without shaping (loopback mode), e.g. torchrun --standalone --nproc-per-node 4 train.py."
        ),
        epilog=(
            "examples:\n"
            "  dlion cluster --workers 4 --link 1gbit -- python train.py\n"
            "  dlion cluster --workers 2 --link 100mbit --timeout 600 -- python -m mybench --steps 10\n"
            "  dlion cluster --nodes 2 --per-node 2 --link 50mbit -- python train.py   # 2 nodes of 2 ranks\n"
            "  dlion cluster --cleanup            # remove leftovers of a killed run\n"
        ),
    )
    p.add_argument("--workers", "-n", type=int, default=None, metavar="N",
                   help="number of ranks (default 2, or --nodes × --per-node)")
    p.add_argument("--nodes", type=int, default=None, metavar="K",
                   help="group the ranks into K nodes of --per-node ranks: ranks of a node share a bridge "
                        "(links shaped to --intra-link), each node reaches the others through one uplink "
                        "shaped to --link")
    p.add_argument("--per-node", type=int, default=None, metavar="L", help="ranks per node (with --nodes)")
    p.add_argument("--intra-link", default="unlimited", metavar="RATE",
                   help="with --nodes: rate of the links inside a node (default unlimited)")
    p.add_argument("--link", default="1gbit", metavar="RATE",
                   help="per-link rate in each direction (with --nodes: of each node's uplink): 1gbit, "
                        "100mbit, 500kbit, ... or 'unlimited' (default 1gbit)")
    p.add_argument("--burst", default=None, metavar="SIZE",
                   help="tbf bucket, e.g. 256kb (default: 2 ms of line rate, at least 32 KiB)")
    p.add_argument("--latency", default="50ms", metavar="TIME", help="tbf queue bound (default 50ms)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help=f"name prefix of the namespaces; leftovers with it are removed first (default {DEFAULT_PREFIX})")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                   help=f"MASTER_PORT (default {DEFAULT_MASTER_PORT}); ports are per namespace, so no host clash")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop every rank after this long and exit 124")
    p.add_argument("--keep-going", action="store_true",
                   help="do not stop the other ranks when one fails")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the namespaces, links and qdiscs of --prefix and exit")
    p.add_argument("--force", action="store_true", help="with --cleanup: even if a live cluster holds the prefix")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]",
                   help="what every rank runs")
    return p


def resolve_workers(parser, args, *, default: int, minimum: int) -> int:
    """The number of ranks from ``--workers`` and/or ``--nodes``/``--per-node`` (which must agree),
    or ``default``; a usage error through ``parser`` otherwise."""
    if (args.nodes is None) != (args.per_node is None):
        parser.error("--nodes and --per-node go together")
    workers = args.workers
    if args.nodes is not None:
        if args.nodes < 1 or args.per_node < 1:
            parser.error("--nodes and --per-node must be >= 1")
        if workers is not None and workers != args.nodes * args.per_node:
            parser.error(f"--workers {workers} != --nodes {args.nodes} × --per-node {args.per_node}")
        workers = args.nodes * args.per_node
    elif workers is None:
        workers = default
    if workers < minimum:
        parser.error(f"--workers must be >= {minimum}")
    return workers


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to COMMAND, even things that look like options.
    if "--" in argv:
        i = argv.index("--")
        opts, command = argv[:i], argv[i + 1:]
    else:
        opts, command = argv, None
    parser = _parser()
    args = parser.parse_args(opts)
    if command is None:
        command = args.command
    try:
        if args.cleanup:
            removed = cleanup(args.prefix, force=args.force)
            print(f"dlion cluster: removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        if not command:
            parser.error("no COMMAND given (put it after --)")
        args.workers = resolve_workers(parser, args, default=2, minimum=1)
        cluster = VirtualCluster(args.workers, args.link, prefix=args.prefix, burst=args.burst,
                                 latency=args.latency, master_port=args.master_port, nodes=args.nodes,
                                 intra_link=args.intra_link)
        with cluster:
            shaping = (f"tbf {cluster.link} each way, burst {cluster.burst_bytes} B"
                       if cluster.rate_bps else "unshaped")
            if cluster.nodes:
                shaping = (f"{cluster.nodes} nodes × {cluster.per_node}; uplinks {shaping}; inside a node "
                           f"{cluster.intra_link}")
            print(f"dlion cluster: {args.workers} ranks ({shaping}), master {cluster.master_addr}:"
                  f"{cluster.master_port}, namespaces {cluster.prefix}-r*", file=sys.stderr, flush=True)
            results = cluster.run(command, timeout=args.timeout, echo=True, fail_fast=not args.keep_going)
    except RootRequiredError as exc:
        print(f"dlion cluster: {exc}", file=sys.stderr)
        return 2
    except (ClusterError, ValueError) as exc:
        print(f"dlion cluster: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:  # e.g. `ip` vanished between the check and the call
        print(f"dlion cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dlion cluster: interrupted; the cluster was torn down", file=sys.stderr)
        return 130
    code = exit_code(results)
    if code:
        print(f"dlion cluster: {_describe_failure(results).splitlines()[0]}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
