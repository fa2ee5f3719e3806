"""Data-parallel ranks in the cost model: one rank's share of its node, and its collectives.

Pure (no torch). A plan over several ranks (UnitSpec.shards) is one rank's plan; every rank runs
the same one at the same time, so the estimate replays one rank on what it gets of the node.

Note: what the ranks of a node share. `local` ranks run on each node and share its SSDs (every
rank streams its own shards through the same drives: each gets 1/local of their rates), its
memory bandwidth (memcpy, the CPU Adam, which is bound by it: the node's Adam rate at all the
ranks' threads, divided among them) and its cores; on the CPU acting as the device, its compute
too. Each GPU is a rank's own, and so is its host link.

Note: the collectives. Each rank gathers every unit's weights before each visit that fetches
them and reduce-scatters every unit's gradients once per step; ring algorithms move (N-1)/N of
the whole buffer through each rank's link, at the bus bandwidth: `collective_gbps` within a
node (NVLink, PCIe, or shared memory: measured by `offloadpp bench dp`, or configured), and,
across nodes, at most each node's `network_gbps` (a ring crosses the network between nodes, and
every hop carries the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import HardwareProfile, IOPoint, SsdProfile
from .plan import PlanError


@dataclass(frozen=True)
class RankLink:
    """The ranks of a run as the estimate sees them: `local` per node, `nodes` nodes, and the
    collectives' bus bandwidth (GB/s) within a node and between nodes (0: one node)."""

    local: int = 1
    nodes: int = 1
    collective_gbps: float = 0.0
    network_gbps: float = 0.0

    def __post_init__(self) -> None:
        if self.local < 1 or self.nodes < 1:
            raise PlanError(f"RankLink: local and nodes must be >= 1, got {self.local} and {self.nodes}")
        if self.collective_gbps < 0 or self.network_gbps < 0:
            raise PlanError("RankLink: bandwidths must be >= 0")

    @property
    def ranks(self) -> int:
        return self.local * self.nodes

    def bus_gbps(self) -> float:
        """The ring's bandwidth: within the node, and at most the network's across nodes."""
        if self.nodes > 1:
            if not self.network_gbps:
                raise PlanError(
                    f"{self.nodes} nodes: the estimate needs the network's bandwidth between them (network_gbps)"
                )
            return min(self.collective_gbps, self.network_gbps) if self.collective_gbps else self.network_gbps
        if not self.collective_gbps:
            raise PlanError(
                f"{self.ranks} ranks: the estimate needs the collectives' bandwidth (collective_gbps in the "
                "offloadpp block or the hardware profile; `offloadpp bench dp` measures it)"
            )
        return self.collective_gbps

    def ring_bytes(self, total_bytes: float) -> float:
        """Bytes through each rank's link for an all-gather or reduce-scatter of `total_bytes`."""
        n = self.ranks
        return total_bytes * (n - 1) / n


def rank_share(hw: HardwareProfile, local: int) -> HardwareProfile:
    """What one of `local` ranks running together on the node `hw` describes gets of it (the
    module Note)."""
    if local <= 1:
        return hw
    adam = {t: hw.adam_rate(t * local) / local for t in hw.adam_params_per_s}
    cpu = hw.device == "cpu"
    return replace(
        hw,
        cpu_cores=max(1, hw.cpu_cores // local),
        ssd_read_gbps=hw.ssd_read_gbps / local,
        ssd_write_gbps=hw.ssd_write_gbps / local,
        ssd_mixed_gbps=hw.ssd_mixed_gbps / local,
        ssd_mixed_busy_gbps=hw.ssd_mixed_busy_gbps / local,
        ssds=tuple(
            SsdProfile(s.path, s.read_gbps / local, s.write_gbps / local, s.free_bytes // local)
            for s in hw.ssds
        ),
        io_grid=tuple(
            IOPoint(p.block_size_bytes, p.queue_depth, p.read_gbps / local, p.write_gbps / local)
            for p in hw.io_grid
        ),
        memcpy_gbps=hw.memcpy_gbps / local,
        h2d_gbps=hw.h2d_gbps / local if cpu else hw.h2d_gbps,
        d2h_gbps=hw.d2h_gbps / local if cpu else hw.d2h_gbps,
        adam_params_per_s=adam,
        device_flops_per_s={k: v / local for k, v in hw.device_flops_per_s.items()}
        if cpu
        else hw.device_flops_per_s,
        host_memory_bytes=hw.host_memory_bytes // local,
        device_memory_bytes=hw.device_memory_bytes // local if cpu else hw.device_memory_bytes,
    )


__all__ = ["RankLink", "rank_share"]
