"""The forward of a vertical window: each unit over all G micro-batches while its weights are bound.

Note: coroutines on one thread. Each micro-batch's forward of the model runs as a greenlet (a
coroutine with its own C stack) on the caller's OS thread. The executor's forward pre-hook of a
unit is the switch point (`arrive`): micro-batch m reaching unit j yields to the coordinator,
which resumes m+1, and so on; once all G stand before unit j, the next round resumes them in
turn, 0..G-1, and each runs unit j (the first enters its visit: the weights are fetched once) and
stops before unit j+1. One OS thread matters twice. Autograd numbers the nodes it records per
thread, and its engine runs ready nodes in decreasing number, so one `torch.autograd.backward`
over the G losses runs backward unit by unit across all micro-batches (last micro-batch first
within a unit); and a parameter's gradients from the G graphs meet in its one AccumulateGrad
node, which runs once with their sum: its post-accumulate-grad hook fires once per window, and
the unit goes to the optimizer once (tests/test_window.py checks both). Torch's thread-local
state (grad mode, autocast, the saved-tensor hooks, dispatch modes) is shared by the greenlets,
which is what the window wants: at every switch point it is as the unit hooks left it.

Each micro-batch's RNG stream is its own: its generator state is swapped in before it resumes
and out when it stops (runtime/rng.py for where the start states come from).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import greenlet
import torch

from .rng import RngState


class VerticalForward:
    """Runs `forward(batch)` for each batch, unit by unit across the batches (the Note above).
    starts: each micro-batch's RNG start state. After run(), `ends` holds the state each
    micro-batch's forward left."""

    def __init__(self, device: torch.device, starts: list[RngState]) -> None:
        self.device = device
        self.starts = starts
        self.ends: list[Optional[RngState]] = [None] * len(starts)
        self._main: Optional[greenlet.greenlet] = None
        self._index: dict[greenlet.greenlet, int] = {}
        self._at: list[int] = []  # each micro-batch's last unit reached (its forward index)

    def arrive(self, pos: int) -> None:
        """A unit's forward pre-hook: the current micro-batch stands before forward visit `pos`
        (a switch point the first time it gets there)."""
        m = self._index.get(greenlet.getcurrent())
        if m is None or pos <= self._at[m]:
            return  # not a window's micro-batch, or another root module of the same unit
        self._at[m] = pos
        self._main.switch()

    def run(self, forward: Callable[[Any], Any], batches: list) -> list:
        """The outputs of `forward(batch)` for each batch, in order."""
        g_count = len(batches)
        self._main = greenlet.getcurrent()
        lets = [greenlet.greenlet(forward) for _ in range(g_count)]
        self._index = {g: m for m, g in enumerate(lets)}
        self._at = [-1] * g_count
        states = list(self.starts)
        outs: list = [None] * g_count
        started = [False] * g_count
        try:
            while not all(g.dead for g in lets):
                for m, g in enumerate(lets):
                    if g.dead:
                        continue
                    states[m].restore()
                    r = g.switch() if started[m] else g.switch(batches[m])
                    started[m] = True
                    states[m] = RngState(self.device)
                    if g.dead:
                        outs[m] = r
                        self.ends[m] = states[m]
        except BaseException:
            for m, g in enumerate(lets):  # unwinds the others' stacks (their finally blocks run)
                if started[m] and not g.dead:
                    g.throw(greenlet.GreenletExit)
            raise
        finally:
            self._index = {}
            self._main = None
        return outs
