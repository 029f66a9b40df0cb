"""Two torchrun "nodes" on loopback: the multi-node launch of the docs, rehearsed.

Two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1) each
start two ranks of ``examples/train_hierarchical.py``; the hierarchical optimizer infers the
(node, local) mesh from torchrun's LOCAL_WORLD_SIZE, trains a few steps and checks the
replicas. Every rank's JSON says where it ran and what it holds.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_train_with_the_hierarchical_optimizer_and_agree(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    agents = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", str(node_rank),
               str(ROOT / "examples" / "train_hierarchical.py"), "--steps", "6", "--out", str(tmp_path)]
        agents.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for a in agents:
            logs.append(a.communicate(timeout=240)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    for a, log in zip(agents, logs):
        assert a.returncode == 0, log[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(ranks):
        assert res["world"] == 4 and res["steps"] == 6
        # the mesh inferred from LOCAL_WORLD_SIZE matches torchrun's placement: one agent = one node
        assert res["node"] == res["group_rank"] == r // 2 and res["local_rank"] == res["env_local_rank"] == r % 2
        assert res["checksum"] == ranks[0]["checksum"]  # (check_replicas also passed: bitwise equal)
        assert 0 < res["inter_bits_per_param_step"] < 1.5
    assert ranks[0]["checksum"] != [0.0] * len(ranks[0]["checksum"])
    for node in (0, 1):  # the node's momentum is split between its two ranks
        assert ranks[2 * node]["momentum_numel"] + ranks[2 * node + 1]["momentum_numel"] == ranks[0]["num_params"]
