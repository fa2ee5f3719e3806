"""What the machine has when a run is planned (offloadpp/assemble.py measures it; the resolve
stage, planner/resolve.py, and its budgets, planner/budgets.py, plan for it). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .plan import PlanError


@dataclass(frozen=True)
class Machine:
    """What the machine has when the run is planned (offloadpp/assemble.py measures it).

    device: "cpu" (the CPU acting as the device) or "cuda".
    host_available_bytes: host memory available now (psutil's `available`).
    device_free_bytes: free device memory (CUDA only).
    ssd_free_bytes: free space on the swap directories' filesystems (None: not known).
    cores: cores this process may run on (the Adam threads' default).
    ranks: data-parallel ranks of the run (each keeps 1/ranks of the optimizer state);
    local_ranks: of them, how many run on this node and share its host memory, SSDs and cores
        (and, on the CPU acting as the device, its compute). Host memory, SSD space and cores
        above are the node's; resolve plans each rank for its share (`rank_share`).
    collective_gbps: the ranks' collectives' bus bandwidth, measured over them all (None: not).
    host_total_bytes / device_total_bytes: the node's RAM and the device's memory in all (None:
        not known); a budget asked above them is refused (check_asked_budgets).
    """

    device: str
    host_available_bytes: int
    device_free_bytes: Optional[int] = None
    ssd_free_bytes: Optional[int] = None
    cores: int = 1
    ranks: int = 1
    local_ranks: int = 1
    collective_gbps: Optional[float] = None  # the ranks' all-gather bus bandwidth, measured at start
    host_total_bytes: Optional[int] = None
    device_total_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise PlanError(f"Machine.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.host_available_bytes <= 0:
            raise PlanError(f"Machine.host_available_bytes must be > 0, got {self.host_available_bytes!r}")
        if self.device == "cuda" and not self.device_free_bytes:
            raise PlanError("Machine.device_free_bytes is needed for device 'cuda'")
        if not 1 <= self.local_ranks <= self.ranks:
            raise PlanError(
                f"Machine: need 1 <= local_ranks <= ranks, got {self.local_ranks} and {self.ranks}"
            )

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.local_ranks)

    def rank_share(self) -> Machine:
        """What one of the node's `local_ranks` ranks may plan with: an equal share of its host
        memory, SSD space and cores (each GPU is a rank's own: its free memory is not shared)."""
        n = self.local_ranks
        if n == 1:
            return self
        return replace(
            self,
            host_available_bytes=self.host_available_bytes // n,
            ssd_free_bytes=self.ssd_free_bytes // n if self.ssd_free_bytes is not None else None,
            cores=max(1, self.cores // n),
        )
