#!/usr/bin/env bash
# Several "nodes" on one host, as faithfully as one host allows: each node is a torchrun agent
# (--nnodes N --node_rank i, c10d rendezvous on the loopback, gloo on the CPU) in a mount
# namespace of its own, where every --bind PATH is that node's own folder ROOT/nodeI/K mounted
# at PATH. So every node sees the same nvme path, as on a cluster, and none sees another's
# files; anything not bound (a shared checkpoint folder, the output folder) is shared, as an NFS
# mount would be. Needs root (unshare, mount --bind). The ranks get OFFLOADPP_SIM_NODE=i.
#
#   scripts/multinode.sh --nodes 2 --nproc-per-node 2 --root /tmp/nodes --bind /tmp/nvme \
#       [--bind /tmp/local_ckpt] [--port 29600] [--max-restarts K] [--launcher torchrun|deepspeed] \
#       -- train.py ARGS...
#
# --launcher deepspeed runs on each node what `deepspeed --hostfile` has pdsh run there over ssh
# (python -m deepspeed.launcher.launch --world_info=... --node_rank=i ..., with the launcher's
# exports; scripts/ds_node_cmd.py builds it with DeepSpeed's own PDSHRunner): the multi-node
# environment each rank receives, without ssh. (No restarts there: DeepSpeed's launcher has none.)
#
# Exits with the first failing node's status (and stops the other nodes' agents then: a real
# cluster's scheduler does the same); 0 when every node's agent succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=2
NPROC=1
ROOT=""
PORT=""
RESTARTS=0
LAUNCHER=torchrun
BINDS=()
# The repo's venv, else the python on PATH (a worktree sharing another checkout's venv)
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3 || command -v python)
TORCHRUN=${TORCHRUN:-$(dirname "$(readlink -f "$PY")")/torchrun}
[ -x "$TORCHRUN" ] || TORCHRUN=$(dirname "$PY")/torchrun
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --nproc-per-node|--nproc_per_node) NPROC=$2; shift 2 ;;
    --root) ROOT=$2; shift 2 ;;
    --bind) BINDS+=("$2"); shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --max-restarts|--max_restarts) RESTARTS=$2; shift 2 ;;
    --launcher) LAUNCHER=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "multinode.sh: unknown option $1 (the script and its arguments go after --)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "multinode.sh: no training script (give it after --)" >&2; exit 2; }
[ -n "$ROOT" ] || { echo "multinode.sh: --root DIR is required (the nodes' own folders go there)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "multinode.sh: needs root (unshare --mount, mount --bind)" >&2; exit 2; }
if [ -z "$PORT" ]; then
  PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

pids=()
stop_all() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
}
trap stop_all INT TERM

for ((i = 0; i < NODES; i++)); do
  mounts=""
  for k in "${!BINDS[@]}"; do
    src="$ROOT/node$i/$k"
    mkdir -p "$src" "${BINDS[$k]}"
    mounts+="mount --bind $(printf %q "$(readlink -f "$src")") $(printf %q "$(readlink -f "${BINDS[$k]}")") && "
  done
  # node 0's agent hosts the rendezvous store (is_host), the others join it; the store lives as
  # long as node 0's agent, across the group's restarts.
  host=$([ "$i" = 0 ] && echo 1 || echo 0)
  cmd=("$TORCHRUN" --nnodes "$NODES" --node_rank "$i" --nproc_per_node "$NPROC" --rdzv_backend c10d
       --rdzv_endpoint "127.0.0.1:$PORT" --rdzv_id offloadpp-multinode --rdzv_conf "is_host=$host"
       --max_restarts "$RESTARTS" "$@")
  if [ "$LAUNCHER" = deepspeed ]; then
    line=$("$PY" scripts/ds_node_cmd.py --nodes "$NODES" --nproc-per-node "$NPROC" --node-rank "$i" \
           --master-port "$PORT" -- "$@" | tail -n 1)
  elif [ "$LAUNCHER" = torchrun ]; then
    line="exec $(printf '%q ' "${cmd[@]}")"
  else
    echo "multinode.sh: --launcher is torchrun or deepspeed, not $LAUNCHER" >&2; exit 2
  fi
  OFFLOADPP_SIM_NODE=$i unshare --mount --propagation private -- bash -c "${mounts}${line}" &
  pids+=($!)
done

rc=0
for ((n = 0; n < NODES; n++)); do
  set +e
  wait -n  # (the next node to end: only the nodes run in the background)
  r=$?
  set -e
  if [ "$r" != 0 ] && [ "$rc" = 0 ]; then
    rc=$r
    echo "multinode.sh: a node exited with status $r; stopping the others" >&2
    stop_all
  fi
done
exit "$rc"
