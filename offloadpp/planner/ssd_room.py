"""The free SSD space a plan needs: the one rule the search (each candidate against the free
total), the resolve stage (speculation's second generation) and the engine's preflight (each
filesystem its share) check (ssd_need_bytes).

Note: what is counted, and the margin. Everything the run writes to its swap directories that the
plan can name, at its peak, plus one stated margin:
- the state: every array whose home is SSD (Plan.homes), and, where updates run during backward
  (not deferred, or speculative), the second generation of each one a step rewrites (master,
  moments, compute copy: runtime/slots.py) written before the step commits;
- the swap files' own bytes: each file (one per key, one per part of a key striped over several
  directories) begins with a header block and rounds its payload up to the I/O alignment
  (io/format.py, io/buffers.py; the constants below mirror theirs, tests/test_plan.py checks);
- activations the plan swaps to SSD, where the plan knows their sizes (a model profile); without
  one they are measured at the first step and not counted here (SsdNeed.describe says so);
- a margin of MARGIN_FRAC of that, at least MARGIN_MIN_BYTES: filesystem metadata and the I/O
  backend's probe file at start.
Measured (GPT-2 width 128, 4 layers, updates during backward): the swap directory's peak is the
state plus the files' bytes to within a few KiB. The rule used before, 2% plus a fixed 64 MiB
per directory, asked 141 MiB for a 76 MiB peak without saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .activations import SWAPPING, sized_split
from .plan import Plan, Tier, fmt_bytes

SWAP_HEADER_BYTES = 4096  # io/format.py HEADER_BYTES
SWAP_ALIGN_BYTES = 4096  # io/config.py ALIGNMENT
MARGIN_FRAC = 0.01
MARGIN_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class SsdNeed:
    """The free space a plan needs over `paths` swap directories, part by part (bytes)."""

    state_bytes: int  # the SSD arrays, one generation
    second_generation_bytes: int  # what a step writes beside the old state before it commits
    files: int  # swap files, counting each part of a striped key
    file_bytes: int  # their headers and the rounding of their payloads
    activation_bytes: Optional[int]  # swapped to SSD; None: the plan swaps some, sizes unknown yet
    margin_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.state_bytes
            + self.second_generation_bytes
            + self.file_bytes
            + (self.activation_bytes or 0)
            + self.margin_bytes
        )

    def describe(self, share: float = 1.0) -> str:
        """Where the need comes from, each part times `share` (a filesystem's part of it)."""
        s = share
        parts = [f"the training state {fmt_bytes(s * self.state_bytes)}"]
        if self.second_generation_bytes:
            parts.append(
                f"its second generation {fmt_bytes(s * self.second_generation_bytes)} (updates run during backward: "
                "a step writes the new state beside the old before it commits)"
            )
        parts.append(
            f"swap-file headers and {SWAP_ALIGN_BYTES >> 10} KiB rounding {fmt_bytes(s * self.file_bytes)} "
            f"({self.files} files in all)"
        )
        if self.activation_bytes is None:
            parts.append(
                "activations swapped to SSD: not counted (measured at the first step; no model profile)"
            )
        elif self.activation_bytes:
            parts.append(f"activations swapped to SSD {fmt_bytes(s * self.activation_bytes)}")
        parts.append(
            f"a margin of {MARGIN_FRAC:.0%} (at least {fmt_bytes(MARGIN_MIN_BYTES)}) {fmt_bytes(s * self.margin_bytes)} "
            "for filesystem metadata and the I/O backend's probe file"
        )
        return ", ".join(parts)


def ssd_need(plan: Plan, paths: int = 1) -> SsdNeed:
    """The plan's SsdNeed over `paths` directories (module Note); all zero where nothing lives
    on SSD."""
    paths = max(1, paths)
    two = not plan.deferred_update or plan.speculative
    state = second = files = file_bytes = 0
    for u, p in plan:
        for array, tier in plan.homes(u, p).items():
            if tier is not Tier.SSD:
                continue
            n = plan.array_bytes(u, array)
            # (gradients kept across steps and frozen segments are written in place, once a step or once)
            copies = (
                2 if two and array != "frozen" and not (array == "grads" and plan.persistent_grads) else 1
            )
            state += n
            second += n * (copies - 1)
            # a key of `paths` parts at most (the store stripes large ones), each with a header;
            # parts are block-aligned but the last
            per_copy = min(paths, max(1, -(-n // SWAP_ALIGN_BYTES)))
            files += copies * per_copy
            file_bytes += copies * (per_copy * SWAP_HEADER_BYTES + (-n % SWAP_ALIGN_BYTES))
    if state == 0:
        return SsdNeed(0, 0, 0, 0, 0, 0)
    acts = activation_ssd_bytes(plan)
    written = state + second + file_bytes + (acts or 0)
    margin = max(MARGIN_MIN_BYTES, int(written * MARGIN_FRAC))
    return SsdNeed(state, second, files, file_bytes, acts, margin)


def ssd_need_bytes(plan: Plan, paths: int = 1) -> int:
    """The free SSD space the run needs over `paths` swap directories (ssd_need's total); 0
    where nothing lives on SSD."""
    return ssd_need(plan, paths).total_bytes


def activation_ssd_bytes(plan: Plan) -> Optional[int]:
    """The activation bytes the plan swaps to SSD at once (every unit's, from its forward to its
    backward; a vertical window's times its micro-batches), their files' headers and rounding
    included (one file per saved tensor: at least one per unit). 0 where no policy swaps to SSD;
    None where one does and the plan has no sizes (no model profile)."""
    policies = plan.vertical_activations if plan.vertical else plan.activations
    to_ssd = [a for a in policies if a in SWAPPING and a.endswith("ssd")]
    if not to_ssd:
        return 0
    if not plan.activation_sizes:
        return None
    total = 0
    for a, sizes in zip(policies, plan.activation_sizes):
        if a not in SWAPPING or not a.endswith("ssd"):
            continue
        n = sized_split(sizes, a)["ssd"]
        if n:
            total += n + SWAP_HEADER_BYTES + (-n % SWAP_ALIGN_BYTES)
    return total * (plan.micro_batches if plan.vertical else 1)
