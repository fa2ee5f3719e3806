"""Data parallel over torch.distributed: starting the ranks from a launcher's environment, and
the process groups and threads the runtime's collectives go through.

    env = launch_env()                      # torchrun / the deepspeed launcher set RANK, WORLD_SIZE, ...
    init_from_env("cpu")                    # gloo on the CPU, NCCL on CUDA (device cuda:LOCAL_RANK)
    dp = DataParallel()                     # over the default group; None-like when alone

Note: channels. Collectives of one process group must be issued in the same order on every rank,
and the runtime issues them from two threads whose own orders are deterministic but whose
interleaving is not: the main thread (weights gathered as the schedule fetches them, the global
norm, exports, checkpoints) and the optimizer's worker (gradients reduce-scattered and updated
resident weights gathered, in job order). Each therefore has a process group of its own:
`fetch` is a channel (a group and the one thread that issues its collectives, in the order the
main thread submitted them, so a gather can wait for its shard's read off the main thread), and
`grads` is used by the worker directly. Every wait is on a collective the ranks submitted
earlier in one common order, so no rank can wait on one another has not reached.

Note: host and device tensors. NCCL moves device tensors only, so on CUDA each issuer has a
second group, gloo, for what lives in host memory: the gradients (accumulated there, and reduced
there: reducing them on the GPUs before the copy down would move less over PCIe, and is not
done), the norm, the first weights' broadcast, the exports' gathers of fp32 masters, the small
objects the ranks compare. On the CPU every group is gloo.

Note: averages. Each rank back-propagates the mean loss of its own micro-batch; the gradients
are summed over the ranks and divided by their number, which is the gradient of the mean over
the global batch (equal micro-batches), as DeepSpeed and torch DDP average.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("offloadpp.runtime")

# The one-tensor collectives (torch 2.13 names them *_single; older versions *_tensor).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# What torchrun and the deepspeed launcher set for every rank (DeepSpeed's init_distributed
# requires the same five before it starts a process group from the environment).
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """The ranks cannot train together as configured; the message names what differs."""


@dataclass(frozen=True)
class LaunchEnv:
    """A rank's place as the launcher describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.local_world_size)


def launch_env(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchEnv]:
    """The launcher's description of this rank, or None when it was not started by one (or
    alone). The ranks on this node: LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (the deepspeed
    launcher), else the world size (one node)."""
    env = os.environ if environ is None else environ
    if not all(k in env for k in ENV_KEYS):
        return None
    try:
        world = int(env["WORLD_SIZE"])
        out = LaunchEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", world))),
        )
    except ValueError as e:
        raise DistributedError(f"the launcher's environment is not numeric: {e}") from None
    return out if out.world_size > 1 else None


def backend_for(device_kind: str) -> str:
    """NCCL on CUDA, gloo on the CPU (DeepSpeed's choice for each accelerator)."""
    return "nccl" if device_kind == "cuda" else "gloo"


def device_for(device_kind: str, env: Optional[LaunchEnv]) -> str:
    """The device a rank computes on: cuda:LOCAL_RANK on CUDA, else the CPU."""
    if device_kind == "cuda":
        return f"cuda:{env.local_rank}" if env is not None else "cuda"
    return "cpu"


def init_from_env(device_kind: str, timeout: Optional[timedelta] = None) -> Optional[LaunchEnv]:
    """Starts torch.distributed when the launcher's environment says so and it is not started
    yet (as DeepSpeed's init_distributed does from the same variables); on CUDA the rank's
    device becomes cuda:LOCAL_RANK. Returns the rank's LaunchEnv (None: a single process)."""
    env = launch_env()
    if env is None:
        return None
    if device_kind == "cuda":
        torch.accelerator.set_device_index(env.local_rank)
    if not dist.is_initialized():
        start_process_group(backend_for(device_kind), env, timeout)
        log.info("offloadpp: rank %d of %d started (%s)", env.rank, env.world_size, backend_for(device_kind))
    return env


def start_process_group(backend: str, env: LaunchEnv, timeout: Optional[timedelta] = None) -> None:
    """dist.init_process_group from the launcher's environment, on a store of this attempt's
    own when torchrun's agent has restarted the group (the Note in elastic_store)."""
    kw = {"timeout": timeout} if timeout is not None else {}
    store = elastic_store(env, timeout)
    if store is not None:
        kw["store"] = store
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kw)


def elastic_store(env: LaunchEnv, timeout: Optional[timedelta] = None, environ=None):
    """The store a rank restarted by torchrun's agent starts its process group on, or None to
    let torch make it (not under an agent, or no agent store).

    Note: restarts and the agent's store. Under torchrun the ranks' process groups meet in the
    agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE), which outlives a restart of the group, and
    torch reuses it with no prefix per attempt: each rank of the new group finds the dead
    group's gloo addresses still under the keys it reads, and a rank that reads them before its
    peer has overwritten them connects to a closed port until the timeout ("Gloo connectFullMesh
    failed ... Connection refused"; torch 2.13, reproduced with plain torch). A prefix naming
    the attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt keys of its own."""
    e = os.environ if environ is None else environ
    attempt = agent_attempt(e)
    if attempt is None:
        return None
    kw = {"timeout": timeout} if timeout is not None else {}
    base = dist.TCPStore(e["MASTER_ADDR"], int(e["MASTER_PORT"]), env.world_size, is_master=False, **kw)
    return dist.PrefixStore(f"offloadpp/attempt_{attempt}", base)


def agent_attempt(environ=None) -> Optional[int]:
    """Which attempt of the group this rank is in, when torchrun's agent started it and its
    ranks meet in the agent's store; else None."""
    e = os.environ if environ is None else environ
    if "TORCHELASTIC_RESTART_COUNT" not in e or e.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return int(e["TORCHELASTIC_RESTART_COUNT"])


def _bind_device(index: Optional[int]) -> None:
    if index is not None:
        torch.accelerator.set_device_index(index)  # (a new thread's current device is 0)


class Channel:
    """A process group (and its gloo twin for host tensors) and the one thread that issues
    their collectives, in submission order."""

    def __init__(self, name: str, group, host_group, cuda_index: Optional[int] = None):
        self.group = group
        self.host_group = host_group
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix=f"offloadpp-{name}", initializer=_bind_device, initargs=(cuda_index,)
        )

    def submit(self, fn: Callable, *args) -> Future:
        return self._thread.submit(fn, *args)

    def run(self, fn: Callable, *args):
        """Submits and waits (a collective the main thread needs now, in its place in the order)."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class DataParallel:
    """The ranks of a data-parallel run (the default process group), and the channels the
    runtime's collectives use (the module Note). Every rank must create it at the same point."""

    def __init__(self, local_world_size: Optional[int] = None):
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized (init_from_env, or the launcher)")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        env = launch_env()
        self.local_world = local_world_size or (env.local_world_size if env is not None else self.world)
        # torchrun and the deepspeed launcher give each node a contiguous block of global ranks,
        # so a rank's node is its block (node-local checkpoints are written by each node's first)
        self.node, self.local_rank = divmod(self.rank, self.local_world)
        self.backend = dist.get_backend()
        nccl = self.backend == "nccl"
        self.cuda_index = torch.accelerator.current_device_index() if nccl else None
        # (every rank creates the groups in this order: new_group is itself a collective)
        fetch = dist.new_group(backend=self.backend)
        fetch_host = dist.new_group(backend="gloo")
        self.fetch = Channel("gather", fetch, fetch_host, self.cuda_index)
        self.grads_group = dist.new_group(backend="gloo")  # the worker's host tensors
        self.worker_device_group = dist.new_group(backend=self.backend) if nccl else self.grads_group
        try:
            locals_ = self.all_gather_object(self.local_world)
            if len(set(locals_)) > 1:
                raise DistributedError(
                    f"the nodes run different numbers of ranks ({sorted(set(locals_))} per node): offloadpp plans "
                    "each rank for an equal share of its node's memory, SSDs and cores; start the same number on each"
                )
        except BaseException:
            self.close()
            raise
        # Bytes through this rank's link ((N-1)/N of each collective's buffer: a ring's) and the
        # seconds the collectives took, by who issued them (read between steps for the reports).
        self.gather_bytes = 0
        self.gather_s = 0.0
        self.reduce_bytes = 0
        self.reduce_s = 0.0

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world={self.world}, backend={self.backend!r})"

    # ---- on the fetch channel's thread --------------------------------------------------
    def _gather(self, full: torch.Tensor, lo: int, hi: int, group) -> None:
        t0 = time.perf_counter()
        _all_gather(full, full[lo:hi], group=group)
        n = self.ring_bytes(full.numel() * full.element_size())
        if group is self.grads_group or group is self.worker_device_group:
            self.reduce_bytes += n
            self.reduce_s += time.perf_counter() - t0
        else:
            self.gather_bytes += n
            self.gather_s += time.perf_counter() - t0

    def gather_in_place(self, full: torch.Tensor, lo: int, hi: int, *, worker: bool = False) -> None:
        """Every rank's part [r*S, (r+1)*S) of `full` from its owner (the caller's own part,
        [lo, hi), already in place). On the calling thread: the fetch channel's, or with
        worker=True the optimizer's (on a stream: the caller's Accelerator.run_on)."""
        host = full.device.type == "cpu"  # (the stand-in's device memory too: gloo's)
        if worker:
            group = self.grads_group if host else self.worker_device_group
        else:
            group = self.fetch.host_group if host else self.fetch.group
        self._gather(full, lo, hi, group)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """On the optimizer's worker: this rank's shard of the mean of `full` over the ranks."""
        t0 = time.perf_counter()
        _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=self.grads_group)
        shard.mul_(1.0 / self.world)
        self.reduce_bytes += self.ring_bytes(full.numel() * full.element_size())
        self.reduce_s += time.perf_counter() - t0

    def ring_bytes(self, nbytes: int) -> int:
        return nbytes * (self.world - 1) // self.world

    @property
    def comm(self) -> tuple[int, float]:
        """(bytes, seconds) of every collective so far (ring bytes through this rank's link)."""
        return self.gather_bytes + self.reduce_bytes, self.gather_s + self.reduce_s

    def agree_flags(self, index: int, flags: list[bool]) -> list[bool]:
        """On the optimizer's worker, before unit `index`'s gradients are reduced: each flag
        OR-ed over the ranks, and a check that every rank is at the same unit (a reduction
        that paired two equal-sized units would otherwise sum the wrong gradients silently)."""
        t = torch.tensor([index, -index] + [int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.grads_group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != index or lo != index:
            raise DistributedError(
                f"the ranks reduce different units' gradients (this rank unit {index}, others up to {lo}..{hi}): "
                "their backward passes differ"
            )
        return [bool(x) for x in t[2:].tolist()]

    # ---- from the main thread, in its place in the fetch channel's order ------------------
    def sum(self, x: float) -> float:
        """x summed over the ranks (fp64: partial squared norms; inf and nan carry through)."""

        def run() -> float:
            t = torch.tensor([x], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.fetch.host_group)
            return float(t.item())

        return self.fetch.run(run)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        group = self.fetch.host_group if tensor.device.type == "cpu" else self.fetch.group
        self.fetch.run(lambda: dist.broadcast(tensor, src=src, group=group))

    def all_gather_object(self, obj) -> list:
        def run() -> list:
            out: list = [None] * self.world
            dist.all_gather_object(out, obj, group=self.fetch.host_group)
            return out

        return self.fetch.run(run)

    def barrier(self) -> None:
        self.fetch.run(lambda: dist.barrier(group=self.fetch.host_group))

    def check_same(self, what: str, value) -> None:
        """Refuses to go on unless every rank has the same `value` (a rank that differs would
        issue other collectives, or other sizes, and hang or corrupt the others)."""
        values = self.all_gather_object(value)
        if any(v != values[0] for v in values):
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise DistributedError(
                f"the ranks disagree on {what}: rank 0 has {values[0]!r}, rank {differ[0]} has {values[differ[0]]!r}; "
                "every rank must run the same model with the same settings"
            )

    def measure_gbps(self, nbytes: int = 16 << 20, repeat: int = 3) -> float:
        """The bus bandwidth of an all-gather of `nbytes` over the ranks, GB/s: bytes each rank
        receives, (N-1)/N of the total, over the time (the best of `repeat`)."""
        n = max(self.world, nbytes // 4 // self.world * self.world)
        full = torch.zeros(n, dtype=torch.float32, device=self._device())
        part = n // self.world
        best = float("inf")
        for _ in range(repeat):
            self.barrier()
            t0 = time.perf_counter()
            self.fetch.run(
                lambda: _all_gather(
                    full, full[self.rank * part : (self.rank + 1) * part], group=self.fetch.group
                )
            )
            if full.device.type != "cpu":
                torch.accelerator.synchronize()
            best = min(best, time.perf_counter() - t0)
        return n * 4 * (self.world - 1) / self.world / best / 1e9

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.accelerator.current_device_index())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def close(self) -> None:
        """Stops the fetch channel's thread and lets the groups go (the default one stays: it is
        the launcher's)."""
        self.fetch.close()
        groups = {id(g): g for g in (self.fetch.group, self.fetch.host_group, self.grads_group,
                                     self.worker_device_group)}  # fmt: skip
        for g in groups.values():
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError):  # already gone with the default group
                pass


def rank_dirs(paths, rank: int) -> tuple[str, ...]:
    """A rank's own swap directories: a folder per rank under each nvme path (created), so the
    ranks of one node never share a swap file or a lock (io/lock.py)."""
    out = []
    for p in paths:
        d = os.path.join(p, f"rank{rank}")
        os.makedirs(d, exist_ok=True)
        out.append(d)
    return tuple(out)


__all__ = [
    "DataParallel",
    "DistributedError",
    "agent_attempt",
    "ENV_KEYS",
    "LaunchEnv",
    "backend_for",
    "device_for",
    "elastic_store",
    "init_from_env",
    "launch_env",
    "rank_dirs",
    "start_process_group",
]
