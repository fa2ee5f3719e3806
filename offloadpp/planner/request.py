"""What the search is asked (`Request`): its own module, since the search (search.py) and the
fills of what is left after the streaming minimum (fills.py) both read it and fills.py is a part
of the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .ranks import RankLink
from .spec import Budgets, Settings


@dataclass(frozen=True)
class Request:
    """What the search is asked: budgets, and the settings that change the schedule and the
    estimate (compute dtype, accumulation, deferral, Adam threads, fixed depths).

    count_activations: the saved activations count in the device budget (the resolve stage sets
    it: the model profile says how large they are); so does an activation budget in `budgets`,
    which then caps them. act_host_bytes: host memory swapped activations may take (None: no
    limit); beyond it they go to SSD."""

    budgets: Budgets
    settings: Settings
    adam_threads: int = 1  # resolved (Settings.adam_threads may say "every core")
    ssd_free_bytes: Optional[int] = None  # plans keeping more on SSD are not candidates (None: not checked)
    count_activations: bool = False
    act_host_bytes: Optional[int] = None
    ranks: int = 1  # data-parallel ranks the optimizer state is partitioned over (UnitSpec.shards)
    link: Optional[RankLink] = None  # with several ranks: per node, and the collectives' bandwidth
    # A vertical window of this many micro-batches planned as one step (planner/vertical.py): the
    # plans carry it (Plan.micro_batches).
    window: int = 1
    # Another schedule's estimate of the same window (the vertical one's, resolve._with_window):
    # a plan slower than it loses to it, so once the best replayed is, candidates whose lower
    # bound is above it are not replayed, nor scored again on a slow SSD (search.py).
    beat_s: Optional[float] = None
    # The candidate to take instead of the robust pick's, by its (label, activations) (a vertical
    # window whose pick would slow a per-micro-batch loop: resolve._with_window, decide.py's Note
    # on the loop); it must be one the search replays.
    prefer: Optional[tuple] = None

    @property
    def micro_batches(self) -> int:
        return self.settings.gradient_accumulation_steps

    @property
    def act_prefetch_units(self) -> int:
        return self.settings.activations.prefetch_units

    @property
    def counted(self) -> bool:
        return self.count_activations or self.budgets.activation_bytes is not None

    @property
    def act_cap(self) -> int:
        """The most the activations may take of the device budget."""
        b = self.budgets
        return b.activation_bytes if b.activation_bytes is not None else b.device_bytes - 1
