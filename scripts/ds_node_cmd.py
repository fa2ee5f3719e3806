"""The shell command DeepSpeed's multi-node launcher runs on node NODE_RANK, without ssh.

    python scripts/ds_node_cmd.py --nodes 2 --nproc-per-node 2 --node-rank 1 --master-port 29500 \
        -- train.py ARGS...

`deepspeed --hostfile H train.py` (launcher/runner.py) encodes the hostfile's slots as
--world_info, collects the variables it exports to every node (PYTHON*, the accelerator's,
and the lines of .deepspeed_env) and hands pdsh one command for all nodes, in which pdsh
replaces %n by each node's rank and runs it there over ssh: `export ...; cd DIR; python -u -m
deepspeed.launcher.launch --world_info=... --node_rank=%n --master_addr=... --master_port=...
train.py ARGS`. This prints that command for one node, built by DeepSpeed's own PDSHRunner with
pdsh's part left off and %n replaced, so scripts/multinode.sh (--launcher deepspeed) runs on
each simulated node what pdsh would run on a real one; launch.py then builds each rank's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_*) as on a
cluster. The hosts are named node0, node1, ... (the world_info's keys; launch.py uses their
order only).
"""

from __future__ import annotations

import argparse
import os
import sys


def node_command(nodes: int, nproc: int, node_rank: int, master_port: int, script: list[str],
                 environ: dict) -> str:  # fmt: skip
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner as ds_runner
    from deepspeed.launcher.multinode_runner import PDSHRunner

    hosts = {f"node{i}": list(range(nproc)) for i in range(nodes)}
    args = ds_runner.parse_args(["--master_addr", "127.0.0.1", "--master_port", str(master_port), *script])
    runner = PDSHRunner(args, ds_runner.encode_world_info(hosts))
    # what runner.main exports to every node (its own loop, repeated: it is inline there)
    exports = ds_runner.EXPORT_ENVS + get_accelerator().export_envs()
    for var, val in environ.items():
        if any(var.startswith(name) for name in exports):
            runner.add_export(var, val)
    env_file = os.path.join(os.path.abspath("."), ds_runner.DEEPSPEED_ENVIRONMENT_NAME)
    if os.path.isfile(env_file):
        with open(env_file) as f:
            for line in f:
                if line.strip() and "=" in line:
                    key, val = line.strip().split("=", 1)
                    runner.add_export(key, val)
    cmd, _kill, _env = runner.get_cmd(dict(environ), hosts)
    launch = cmd[cmd.index("-w") + 2 :]  # pdsh -S -f N -w HOSTS [launcher args] | the node's command
    while launch and not launch[0].startswith("export ") and not launch[0].startswith("cd "):
        launch = launch[1:]  # (pdsh's own launcher_args, none here)
    # pdsh hands the remote shell the words joined by spaces (PDSHRunner quotes the user's
    # arguments that contain spaces for that shell)
    return " ".join(launch).replace("--node_rank=%n", f"--node_rank={node_rank}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("script", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    # (the last line: DeepSpeed may log to stdout first)
    print(node_command(a.nodes, a.nproc_per_node, a.node_rank, a.master_port, script, dict(os.environ)))


if __name__ == "__main__":
    sys.exit(main())
