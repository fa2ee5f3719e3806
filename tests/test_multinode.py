"""Several nodes simulated on one host (scripts/multinode.sh): each node a torchrun agent in a
mount namespace of its own, its own folder bind-mounted at the config's nvme path, a c10d
rendezvous on the loopback, gloo. The ranks train the tiny GPT-2 of tests/dp_common.py to the
weights of one process on the global batch, each node's disk holding only its own ranks' shards;
a run resumed from 2 ranks (2 nodes x 1, torchrun) to 1 process to 4 ranks (2 nodes x 2, started
as the deepspeed launcher starts several nodes) through shared checkpoints ends where one
process ends; node-local checkpoints resume on their own nodes and name a missing node's shards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from dp_common import LR, reference
from numerics import compare_weights
from test_distributed import REPO, WORKER, _env, _single_engine, _train_single, ranks, weights

from offloadpp.runtime.checkpoint import CheckpointError

pytest.importorskip("transformers")

SCRIPT = os.path.join(REPO, "scripts", "multinode.sh")


def _can_simulate() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return r.returncode == 0


needs_namespaces = pytest.mark.skipif(not _can_simulate(), reason="needs root and unshare --mount")


def multinode(root, binds, args: list[str], *, nodes: int = 2, nproc: int = 1, timeout: float = 400,
              extra: tuple[str, ...] = (), fails: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    """scripts/multinode.sh over `nodes` nodes of `nproc` ranks running tests/dp_worker.py. The
    rendezvous port is picked free and released before node 0's agent binds it: a clash (only
    that) is retried on a new one. fails: the run must fail (its result returned)."""
    cmd = [SCRIPT, "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--root", str(root)]
    for b in binds:
        cmd += ["--bind", str(b)]
    cmd += [*extra, "--", WORKER, *args]
    for attempt in range(3):
        r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if (r.returncode != 0) == fails and "address already in use" not in (r.stdout + r.stderr).lower():
            return r
        if attempt == 2 or "address already in use" not in (r.stdout + r.stderr).lower():
            raise AssertionError(
                f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
            )
    raise AssertionError("unreachable")


def check_node_disks(root, out, nvme, world: int, nodes: int, sub: str = "") -> None:
    """Each node's own folder holds the swap folders of the ranks that ran on it and no other
    (under `sub`: offloadpp/ on the DeepSpeed path); the nvme path seen from outside the nodes'
    namespaces holds nothing."""
    info = ranks(out, world)
    per = world // nodes
    for i in range(nodes):
        mine = sorted(f"rank{d['rank']}" for d in info if d["node"] == str(i))
        # torchrun gives each agent a contiguous block of global ranks (LOCAL_RANK within it)
        assert mine == [f"rank{r}" for r in range(i * per, (i + 1) * per)], (i, mine)
        assert sorted(d["local_rank"] for d in info if d["node"] == str(i)) == list(range(per))
        folder = os.path.join(root, f"node{i}", "0", sub)
        assert sorted(os.listdir(folder)) == mine
        for name in mine:
            assert sum(len(fs) for _, _, fs in os.walk(os.path.join(folder, name))) > 0
    assert os.listdir(nvme) == []
    assert len({d["disk_bytes"] for d in info}) == 1  # equal shares


@needs_namespaces
def test_two_nodes_train_like_one_process_and_resume_across_world_sizes(tmp_path):
    """2 nodes x 1 rank train 2 steps (equal to one process within 1e-5) and save to a shared
    folder; one process resumes it for a step and saves; 2 nodes x 2 ranks resume that and end
    within 1e-5 of one process that ran every step (each step's batch split as the ranks of its
    leg split it)."""
    nvme = tmp_path / "nvme"
    ck2 = tmp_path / "ck2"
    a = tmp_path / "a"
    multinode(tmp_path / "nodes_a", [nvme], [str(a), "--nvme", str(nvme), "--steps", "2", "--save", str(ck2)])
    assert compare_weights(weights(a), reference(2, clip=1.0, parts=2), lr=LR, steps=2) < 1e-5
    check_node_disks(tmp_path / "nodes_a", a, nvme, world=2, nodes=2)
    assert json.load(open(ck2 / "manifest.json"))["world_size"] == 2

    (tmp_path / "nv1").mkdir()
    eng = _single_engine(tmp_path / "nv1")
    ck1 = tmp_path / "ck1"
    try:
        eng.load_state(str(ck2))  # resharded: 2 ranks' shards into one process
        _train_single(eng, 2, 1)
        ck1.mkdir()
        eng.save_state(str(ck1))
    finally:
        eng.close()

    # 2 nodes x 2 ranks, started as `deepspeed --hostfile` starts them: each node runs the command
    # DeepSpeed's PDSHRunner has pdsh run there (scripts/ds_node_cmd.py), without ssh, and
    # launcher/launch.py gives each rank its environment
    b = tmp_path / "b"
    multinode(tmp_path / "nodes_b", [nvme], [str(b), "--nvme", str(nvme), "--steps", "1", "--from-step", "3",
                                              "--load", str(ck1)], nproc=2, extra=("--launcher", "deepspeed"))  # fmt: skip
    want = reference(4, clip=1.0, parts=(2, 2, 2, 4))
    assert compare_weights(weights(b), want, lr=LR, steps=4) < 1e-5
    info = ranks(b, 4)
    assert all(d["global_step"] == 4 for d in info)
    for d in info:  # RANK by node order, LOCAL_RANK within it, CROSS_RANK the node, LOCAL_SIZE its ranks
        assert d["cross_rank"] == d["node"] == str(d["rank"] // 2) and d["local_size"] == "2", d
        assert d["local_rank"] == d["rank"] % 2 and d["group_rank"] is None  # (not torchrun's)
    check_node_disks(tmp_path / "nodes_b", b, nvme, world=4, nodes=2)


@needs_namespaces
def test_node_local_checkpoints_resume_on_their_nodes_and_name_a_missing_node(tmp_path):
    """`"checkpoint": {"use_node_local_storage": true}` over 2 nodes x 1 rank, the checkpoint
    folder bound to each node's own disk: each node's folder holds its rank's shards, its node's
    manifest (naming both nodes' ranks, one save id) and `latest`, nothing of the other node's;
    resumed on the same nodes the run ends within 1e-5 of one process that ran every step;
    with node 1's disk emptied, the resume fails naming node 1's shard folder, and so does
    loading node 0's folder alone into one process."""
    nvme, ck = tmp_path / "nvme", tmp_path / "ck"
    nodes = tmp_path / "nodes"
    a, b = tmp_path / "a", tmp_path / "b"
    ds = ["--api", "deepspeed", "--node-local", "--nvme", str(nvme)]
    multinode(nodes, [nvme, ck], [str(a), *ds, "--steps", "2", "--save", str(ck)])
    ids = set()
    for i in range(2):
        own = nodes / f"node{i}" / "1"  # (the second --bind: this node's checkpoint disk)
        assert sorted(os.listdir(own)) == ["latest", "t"]
        assert sorted(os.listdir(own / "t")) == [
            "client_state.pt",
            "config.json",
            "engine.pt",
            "manifest.json",
            f"rank{i:05d}",
        ]
        m = json.load(open(own / "t" / "manifest.json"))
        assert (
            m["world_size"] == 2 and m["node_local"]["node"] == i and m["node_local"]["nodes"] == [[0], [1]]
        )
        ids.add(m["node_local"]["save_id"])
    assert len(ids) == 1 and os.listdir(ck) == []  # one save; nothing on the shared path itself

    multinode(nodes, [nvme, ck], [str(b), *ds, "--steps", "1", "--from-step", "2", "--load", str(ck)])
    assert compare_weights(weights(b), reference(3, clip=1.0, parts=2), lr=LR, steps=3) < 1e-5
    assert all(d["global_step"] == 3 for d in ranks(b, 2))

    shutil.rmtree(nodes / "node1" / "1")  # node 1 replaced: an empty disk
    r = multinode(
        nodes, [nvme, ck], [str(tmp_path / "c"), *ds, "--steps", "1", "--load", str(ck)], fails=True
    )
    out = r.stdout + r.stderr
    assert "rank(s) [1] on node(s) [1] lack it" in out and "t/rank00001" in out and "node-local" in out, out[
        -3000:
    ]

    (tmp_path / "nv1").mkdir()
    eng = _single_engine(tmp_path / "nv1")
    try:  # one process, node 0's disk alone: node 1's shard is named
        with pytest.raises(
            CheckpointError, match=r"node-local: .*rank00001 \(node 1's\) is on another node's disk"
        ):
            eng.load_state(str(nodes / "node0" / "1" / "t"))
    finally:
        eng.close()
