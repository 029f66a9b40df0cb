"""Tests of the virtual cluster (dlion.lab.cluster).

The namespace tests need root and a kernel that allows network namespaces; they
are skipped otherwise. Each test uses its own prefix so that tests (and other
users of the machine) never tear down each other's namespaces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dlion.lab import cluster as vc
from dlion.lab.cluster import (
    ClusterBusyError,
    ClusterRunError,
    RootRequiredError,
    VirtualCluster,
    exit_code,
    parse_rate,
)

NETNS_OK, NETNS_REASON = vc.netns_available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"virtual cluster unavailable: {NETNS_REASON}")

_counter = iter(range(10**6))


def unique_prefix(tag: str) -> str:
    return f"dlt{os.getpid()}{next(_counter)}-{tag}"


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers(prefix: str) -> list[str]:
    """Namespaces of this prefix, and host links whose name mentions it."""
    found = [n for n in namespaces() if n.startswith(prefix + "-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found += [line for line in links.splitlines() if prefix in line]
    return found


def namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def wait_for(condition, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def processes_with(marker: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def ranks_with(marker: str) -> list[int]:
    """The rank processes themselves (``sleep MARKER``), not the launcher whose command line
    also holds the marker."""
    pids = []
    for pid in processes_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if len(argv) == 2 and os.path.basename(argv[0]) == b"sleep" and argv[1] == marker.encode():
            pids.append(pid)
    return pids


# --------------------------------------------------------------------------- no root needed


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("100mbit") == 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("500kbit") == 500_000
    assert parse_rate(12345) == 12345
    for unshaped in (None, "unlimited", "none", 0, "0"):
        assert parse_rate(unshaped) is None
    for bad in ("fast", "10mbps", "-1mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_default_burst():
    assert vc._burst_bytes(None, 10**9) == 250_000  # 2 ms at 1 Gbit/s, ~ the usual 256kb
    assert vc._burst_bytes(None, 50 * 10**6) == 32 * 1024  # floor at low rates
    assert vc._burst_bytes("256kb", 10**9) == 256 * 1024
    assert vc._burst_bytes(None, None) is None


def test_bad_prefix():
    with pytest.raises(ValueError):
        VirtualCluster(2, prefix="../etc")


def test_not_root_error_and_cli_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(RootRequiredError) as info:
        VirtualCluster(2, "100mbit", prefix=unique_prefix("nr")).start()
    assert "root" in str(info.value) and "--standalone" in str(info.value)
    assert vc.main(["--workers", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "root" in err and "loopback" in err
    assert vc.main(["--cleanup"]) == 2


# --------------------------------------------------------------------------- root: namespaces


ALLREDUCE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")  # env:// from the cluster
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.all(t == expected), t[:4]
    print(f"rank {rank} sum {t[0].item():g} ok")
    dist.destroy_process_group()
    """
)


@needs_netns
def test_gloo_all_reduce_two_ranks(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    prefix = unique_prefix("ar")
    with VirtualCluster(2, link="1gbit", prefix=prefix) as c:
        assert set(c.namespaces) <= set(namespaces())
        results = c.run([sys.executable, str(script)], timeout=60, check=True)
    for r in results:
        assert r.ok and f"rank {r.rank} sum 3 ok" in r.stdout, r.stderr
    assert leftovers(prefix) == []


@needs_netns
def test_env_isolation_and_failures():
    prefix = unique_prefix("env")
    with VirtualCluster(3, link="100mbit", prefix=prefix) as c:
        lines = []
        res = c.run(lambda rank: ["sh", "-c", 'echo "$RANK $WORLD_SIZE $MASTER_ADDR $GLOO_SOCKET_IFNAME $X"'],
                    env=lambda rank: {"X": f"x{rank}"}, on_line=lambda rank, stream, line: lines.append((rank, line)))
        assert [r.stdout.split() for r in res] == [[str(r), "3", c.master_addr, "eth0", f"x{r}"] for r in range(3)]
        assert sorted(lines) == [(r, res[r].stdout.strip()) for r in range(3)]

        # Traffic cannot leave the namespaces: the only route is the cluster's subnet.
        routes = subprocess.run(c.wrap(1, ["ip", "-4", "route", "show", "table", "main"]),
                                capture_output=True, text=True, check=True).stdout.strip()
        assert routes.splitlines() == [f"127.100.0.0/16 dev eth0 proto kernel scope link src {c.addresses[1]}"]

        # Both ends of every link are shaped.
        for rank, ns in enumerate(c.namespaces):
            for where, dev in ((ns, "eth0"), (c.switch_namespace, f"p{rank}")):
                q = subprocess.run(["tc", "-n", where, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
                assert "tbf" in q and "100Mbit" in q, q

        # Fail fast: rank 1 fails, the sleeping ranks are stopped, its code wins.
        t = time.monotonic()
        res = c.run(lambda rank: ["sh", "-c", "exit 3" if rank == 1 else "sleep 30"], kill_grace=2)
        assert time.monotonic() - t < 10
        assert res[1].returncode == 3 and not res[1].killed
        assert res[0].killed and res[2].killed
        assert exit_code(res) == 3

        res = c.run(["sleep", "30"], timeout=0.5, kill_grace=2)
        assert all(r.timed_out for r in res) and exit_code(res) == 124

        with pytest.raises(ClusterRunError):
            c.run(["false"], check=True)

        # A second live cluster, or a cleanup, must not take the prefix away.
        with pytest.raises(ClusterBusyError):
            VirtualCluster(2, prefix=prefix).start()
        with pytest.raises(ClusterBusyError):
            vc.cleanup(prefix)
        assert set(c.namespaces) <= set(namespaces())
    assert leftovers(prefix) == []


@needs_netns
def test_teardown_after_exception_inside_with():
    prefix = unique_prefix("exc")
    with pytest.raises(ZeroDivisionError):
        with VirtualCluster(2, link="1gbit", prefix=prefix) as c:
            assert set(c.namespaces) <= set(namespaces())
            1 / 0
    assert leftovers(prefix) == []


@needs_netns
def test_teardown_after_sigterm_during_run():
    prefix = unique_prefix("term")
    marker = f"31.{os.getpid()}"
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        with VirtualCluster(2, link="1gbit", prefix=prefix) as c:
            timer.start()
            c.run(["sleep", marker])
    timer.cancel()
    assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    assert leftovers(prefix) == []
    assert processes_with(marker) == []


@needs_netns
def test_teardown_after_sigint_to_cli_process():
    prefix = unique_prefix("int")
    marker = f"32.{os.getpid()}"
    # A non-interactive shell's background job inherits SIGINT ignored; undo
    # that so the test means the same wherever pytest is started from.
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlion", "cluster", "--workers", "2", "--link", "100mbit", "--prefix", prefix,
         "--", "sleep", marker],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(ranks_with(marker)) < 2:  # both ranks are running (the launcher's own command line
            #                                   also holds the marker: counting it raced the set-up)
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "cluster did not start"
            time.sleep(0.05)
        assert len(leftovers(prefix)) == 3
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert leftovers(prefix) == []
    assert processes_with(marker) == []


@needs_netns
def test_leftovers_of_crashed_run_are_removed(capsys):
    prefix = unique_prefix("crash")
    marker = f"33.{os.getpid()}"
    unrelated = f"{prefix}x-r0"  # another prefix's name: must survive
    for ns in (f"{prefix}-sw", f"{prefix}-r0", f"{prefix}-r7", unrelated):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    # A worker the crashed run left behind.
    orphan = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-r7", "sleep", marker])
    try:
        # Wait until it is in the namespace: `ip netns exec` enters it and execs `sleep` a moment
        # after Popen returns (longer on a busy machine). A cluster that starts before then finds
        # no process in the namespace and deletes it; the orphan is never killed.
        in_namespace = lambda: any(p in namespace_pids(f"{prefix}-r7") for p in processes_with(marker))  # noqa: E731
        assert wait_for(in_namespace, timeout_s=60), "the orphan did not enter its namespace within 60 s"
        with VirtualCluster(2, link="1gbit", prefix=prefix) as c:
            assert f"{prefix}-r7" not in namespaces()
            assert sorted(n for n in namespaces() if n.startswith(prefix + "-")) == sorted(
                c.namespaces + [c.switch_namespace])
            assert orphan.wait(timeout=10) == -signal.SIGKILL
            assert all(r.ok for r in c.run(["true"]))
        assert "leftovers" in capsys.readouterr().err
        assert leftovers(prefix) == []
        assert unrelated in namespaces()

        # The same through cleanup() and the CLI.
        subprocess.run(["ip", "netns", "add", f"{prefix}-r0"], check=True)
        assert vc.cleanup(prefix) == [f"{prefix}-r0"]
        subprocess.run(["ip", "netns", "add", f"{prefix}-sw"], check=True)
        assert vc.main(["--cleanup", "--prefix", prefix]) == 0
        assert leftovers(prefix) == [] and unrelated in namespaces()
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run(["ip", "netns", "del", unrelated], capture_output=True)
        vc.cleanup(prefix, force=True)


SENDER_RECEIVER = textwrap.dedent(
    """
    import os, socket, time
    n, sender, rank = int(os.environ["NBYTES"]), int(os.environ.get("SENDER", "1")), int(os.environ["RANK"])
    print("env", os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], os.environ["GROUP_RANK"])
    port = 29600
    if rank == 0:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((os.environ["MASTER_ADDR"], port))
        s.listen(1)
        conn, _ = s.accept()
        got, t0 = 0, None
        while True:
            b = conn.recv(1 << 20)
            if t0 is None:
                t0 = time.perf_counter()
            if not b:
                break
            got += len(b)
        assert got == n, got
        print(f"seconds {time.perf_counter() - t0:.6f}")
    elif rank == sender:
        for _ in range(500):
            try:
                s = socket.create_connection((os.environ["MASTER_ADDR"], port))
                break
            except OSError:
                time.sleep(0.01)
        s.sendall(b"x" * n)
        s.close()
    """
)


@needs_netns
def test_tbf_slows_transfers(tmp_path):
    script = tmp_path / "sendrecv.py"
    script.write_text(SENDER_RECEIVER)
    nbytes, rate = 5_000_000, 50 * 10**6
    expected = nbytes * 8 / rate  # 0.8 s

    def transfer_seconds(c):
        res = c.run([sys.executable, str(script)], env={"NBYTES": str(nbytes)}, timeout=30, check=True)
        return float(res[0].stdout.split()[-1])

    prefix = unique_prefix("tbf")
    with VirtualCluster(2, link=None, prefix=prefix) as c:
        unshaped = transfer_seconds(c)
        c.set_link("50mbit")
        shaped = transfer_seconds(c)
    assert leftovers(prefix) == []
    assert shaped >= 0.5 * expected, (shaped, unshaped)
    assert shaped >= 3 * unshaped, (shaped, unshaped)
    assert shaped <= 8 * expected, (shaped, unshaped)  # shaped, not broken


# --------------------------------------------------------------------------- nodes




def test_nodes_need_a_divisor():
    with pytest.raises(ValueError, match="nodes must be a positive int dividing world_size=4"):
        VirtualCluster(4, nodes=3)


@needs_netns
def test_nodes_fast_inside_a_node_shaped_between_nodes(tmp_path):
    """2 nodes × 2 ranks, uplinks at 50 Mbit/s, unshaped inside a node: 5 MB from rank 1 to
    rank 0 (same node) is fast, from rank 2 (other node) takes ~0.8 s; torchrun's variables."""
    script = tmp_path / "pair.py"
    script.write_text(SENDER_RECEIVER)
    nbytes, rate = 5_000_000, 50 * 10**6
    expected = nbytes * 8 / rate

    def seconds(c, sender):
        res = c.run([sys.executable, str(script)], env={"NBYTES": str(nbytes), "SENDER": str(sender)},
                    timeout=30, check=True)
        envs = [r.stdout.split("\n")[0].split()[1:] for r in res]
        assert envs == [["0", "2", "0"], ["1", "2", "0"], ["0", "2", "1"], ["1", "2", "1"]], envs
        return float(res[0].stdout.split()[-1])

    prefix = unique_prefix("nodes")
    with VirtualCluster(4, link="50mbit", nodes=2, prefix=prefix) as c:
        assert c.per_node == 2 and [c.node_of(r) for r in range(4)] == [0, 0, 1, 1]
        inside, between = seconds(c, 1), seconds(c, 2)
        c.set_link("50mbit", intra_link="50mbit")  # now inside a node is as slow as between
        inside_shaped = seconds(c, 1)
    assert leftovers(prefix) == []
    assert 0.5 * expected <= between <= 8 * expected, (inside, between)
    assert between >= 3 * inside, (inside, between)
    assert inside_shaped >= 0.5 * expected, inside_shaped


@needs_netns
def test_hierarchical_training_on_two_virtual_nodes(tmp_path):
    """examples/train_hierarchical.py on 2 × 2 ranks of the virtual cluster (env:// rendezvous, the
    mesh inferred from LOCAL_WORLD_SIZE): replicas agree, the mesh matches the cluster's nodes."""
    import json
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "train_hierarchical.py"
    prefix = unique_prefix("hier")
    with VirtualCluster(4, link="200mbit", nodes=2, prefix=prefix) as c:
        c.run([sys.executable, str(example), "--steps", "4", "--out", str(tmp_path)],
              env={"OMP_NUM_THREADS": "1"}, timeout=180, check=True)
    assert leftovers(prefix) == []
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(ranks):
        assert (res["node"], res["local_rank"]) == (r // 2, r % 2) and res["steps"] == 4
        assert res["checksum"] == ranks[0]["checksum"]


@needs_netns
def test_two_torchrun_nodes_in_network_namespaces(tmp_path):
    """The multi-node launch of the docs, one torchrun agent per network namespace: two
    "machines" joined by a shaped link, each agent starting 2 ranks of the hierarchical example
    (c10d rendezvous hosted by node 0, each node advertising its own address)."""
    import json
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "train_hierarchical.py"
    prefix = unique_prefix("tr")
    with VirtualCluster(2, link="200mbit", prefix=prefix) as c:
        def agent(node):
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.master_addr}:29533",
                    "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", c.addresses[node],
                    "--node-rank", str(node), str(example), "--steps", "4", "--out", str(tmp_path)]
        results = c.run(agent, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}, timeout=240)
    assert leftovers(prefix) == []
    assert all(r.ok for r in results), "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in results)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(ranks):
        assert res["world"] == 4 and res["steps"] == 4
        assert res["node"] == res["group_rank"] == r // 2 and res["local_rank"] == r % 2
        assert res["checksum"] == ranks[0]["checksum"]
