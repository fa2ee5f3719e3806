"""What the ActivationManager reports (`ActivationStats`, `ManagerReports`: a mixin of
manager.py's class), and the policies it resolves for `auto` units from what its first forward
measured.

Note: auto. A plan made without a model profile leaves `auto` under a budget: the first forward
measures the auto units (bytes saved, FLOPs through a dispatch-mode counter) while sending them to
host memory, which is within any budget, and the planner decides from that (planner/decide.py
measured_activations); from the next forward on, its choice applies. The runtime has no rule.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from offloadpp.planner import decide, fmt_bytes

from .policy import ActPolicy, UnitActProfile

log = logging.getLogger("offloadpp.runtime")


@dataclass(frozen=True)
class ActivationStats:
    """Cumulative since the last reset_stats(); bytes, seconds."""

    saved_bytes: int  # distinct storages saved (dedup), all policies but recompute
    d2h_bytes: int  # device -> host (swap-out copies)
    h2d_bytes: int  # host -> device (swap-in copies; on the CPU device, handed over without a copy)
    ssd_write_bytes: int
    ssd_read_bytes: int
    swap_out_wait_s: float  # forward waiting for swap-outs (budget), or release waiting for them
    swap_in_wait_s: float  # backward waiting for activations to arrive
    recompute_s: float  # backward re-running forwards of recompute units
    peak_device_bytes: int  # accounted activation bytes on the device
    peak_host_bytes: int
    budget_bytes: Optional[int]
    fetch_misses: int  # records backward needed before any prefetch asked for them
    dedup_hits: int  # saved tensors that were views of an already saved storage
    param_refs: int  # saved tensors that were parameters (never swapped)
    cache_hits: int  # storages whose unchanged SSD copy from an earlier step was reused

    @property
    def within_budget(self) -> bool:
        return self.budget_bytes is None or self.peak_device_bytes <= self.budget_bytes

    def as_dict(self) -> dict:
        return asdict(self)


class ManagerReports:
    """The manager's stats and auto policies (manager.py's ActivationManager sets what it reads:
    `units`, `outside`, `swapper`, `config`, `budget`, `accel`, `profiles`, `_probing` and the
    counters reset_stats() zeroes)."""

    def _resolve_from_probe(self) -> None:
        self.resolve(
            [UnitActProfile(u.name, u.saved_bytes, float(u.flops)) for u in self.units],
            self.outside.saved_bytes,
        )

    def resolve(self, profiles: Sequence[UnitActProfile], outside_bytes: int = 0) -> None:
        """Fixes the policy of every `auto` unit from per-unit profiles (forward order), as the
        planner decides it (the Note on auto)."""
        room = None if self.budget is None else self.budget - outside_bytes  # (outside: always kept)
        chosen = decide.measured_activations(profiles, [u.requested.value for u in self.units], room,
                                             device=self.accel.plan_device, host_bytes=self.config.host_budget_bytes)  # fmt: skip
        for u, p in zip(self.units, chosen):
            u.policy = ActPolicy(p)
        self.profiles = tuple(profiles)
        self._probing = False
        log.info("activation policies (auto resolved):\n%s", self.describe(profiles))

    def policies(self) -> dict[str, str]:
        return {u.name: u.policy.value for u in self.units}

    def describe(self, profiles: Optional[Sequence[UnitActProfile]] = None) -> str:
        profiles = profiles if profiles is not None else self.profiles
        lines = [f"  {'unit':<28} {'policy':>9} {'requested':>9} {'saved':>11} {'GFLOP':>8}"]
        for i, u in enumerate(self.units):
            b = profiles[i].bytes if profiles else u.saved_bytes
            f = profiles[i].flops if profiles else u.flops
            lines.append(
                f"  {u.name:<28} {u.policy.value:>9} {u.requested.value:>9} {fmt_bytes(b):>11} {f / 1e9:>8.3f}"
            )
        lines.append(f"  budget: {fmt_bytes(self.budget) if self.budget else 'none'}")
        return "\n".join(lines)

    def reset_stats(self) -> None:
        sw = self.swapper
        sw.d2h_bytes = sw.h2d_bytes = sw.ssd_write_bytes = sw.ssd_read_bytes = 0
        sw.swap_out_wait_s = sw.swap_in_wait_s = 0.0
        sw.cache_hits = 0
        sw.peak_device_bytes = sw.device_bytes
        sw.peak_host_bytes = sw.host_bytes
        self.saved_bytes = 0
        self.recompute_s = 0.0
        self.fetch_misses = self.dedup_hits = self.param_refs = 0

    def stats(self) -> ActivationStats:
        sw = self.swapper
        return ActivationStats(
            saved_bytes=self.saved_bytes,
            d2h_bytes=sw.d2h_bytes,
            h2d_bytes=sw.h2d_bytes,
            ssd_write_bytes=sw.ssd_write_bytes,
            ssd_read_bytes=sw.ssd_read_bytes,
            swap_out_wait_s=sw.swap_out_wait_s,
            swap_in_wait_s=sw.swap_in_wait_s,
            recompute_s=self.recompute_s,
            peak_device_bytes=sw.peak_device_bytes,
            peak_host_bytes=sw.peak_host_bytes,
            budget_bytes=self.budget,
            fetch_misses=self.fetch_misses,
            dedup_hits=self.dedup_hits,
            param_refs=self.param_refs,
            cache_hits=sw.cache_hits,
        )
