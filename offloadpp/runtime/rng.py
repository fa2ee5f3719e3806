"""Each micro-batch's RNG stream in a vertical window, as if it ran alone (runtime/window.py).

Note: why a tape. Run horizontally, micro-batch m's forward starts from the RNG state m-1's
forward left. A vertical window runs m's first unit before m-1's later ones, so m's start state
is not known when m starts. What a forward draws from the RNG depends on the shapes of its random
operators (dropout's masks), not on the values they are applied to. The first window of an input
shape runs horizontally (exact by definition) under a `TapeRecorder`, which logs each random
operator the forward runs (operator, argument shapes, dtypes, devices); in later windows of that
shape each micro-batch's start state is the previous one's with its tape replayed on scratch
tensors: the same operators on the same shapes make the same draws. The window checks at the end
of each micro-batch's forward that the state it reached is the next one's predicted start
(`window.py`), and reruns horizontally if not, so a tape that does not hold (an operator whose
draws depend on values) costs time, never exactness.

Only the default generators are followed (the CPU's and the device's): an operator given its own
`generator=` draws from that one, in the same order vertically as horizontally only if nothing
else shares it, and is not on the tape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class RngState:
    """The default generators' states: the CPU's and, where the device is not the CPU, the
    device's (through torch's device-generic module: torch.get_device_module)."""

    __slots__ = ("cpu", "dev", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type != "cpu" else None
        self.cpu = torch.get_rng_state()
        self.dev = torch.get_device_module(device).get_rng_state(device) if self.device is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device).set_rng_state(self.dev, self.device)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RngState):
            return NotImplemented
        same_dev = (self.dev is None and other.dev is None) or (
            self.dev is not None and other.dev is not None and torch.equal(self.dev, other.dev)
        )
        return torch.equal(self.cpu, other.cpu) and same_dev

    __hash__ = None  # (mutable tensors inside)


class _Spec:
    """A tensor argument of a random operator, by what its draws depend on."""

    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride = tuple(t.shape), tuple(t.stride())
        self.dtype, self.device = t.dtype, t.device

    def scratch(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        # (a probability argument, e.g. bernoulli(p): in range; the count of draws is the same)
        return t.fill_(0.5) if self.dtype.is_floating_point else t.zero_()


def _random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class Tape:
    """The random operators of one forward, in order, as (operator, args, kwargs) with each
    tensor replaced by its _Spec."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def replay(self) -> None:
        """Makes the same draws from the default generators the recorded forward made."""
        with torch.no_grad():
            for func, args, kwargs in self.ops:
                a, k = tree_map(lambda x: x.scratch() if type(x) is _Spec else x, (args, kwargs))
                func(*a, **k)


class TapeRecorder(TorchDispatchMode):
    """Logs the random operators that draw from a default generator into `tape`."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _random(func) and kwargs.get("generator") is None:
            spec = tree_map(lambda x: _Spec(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            self.tape.ops.append((func, spec[0], spec[1]))
        return func(*args, **kwargs)


def shape_key(training: bool, batch: Any) -> tuple:
    """What a forward's RNG draws depend on: the module's mode and the batch's structure, tensor
    shapes, dtypes and devices (other values as they are, where hashable)."""
    leaves, spec = tree_flatten(batch)
    out: list = [training, str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, x.device.type))
        else:
            try:
                hash(x)
                out.append(x)
            except TypeError:
                out.append(repr(x))
    return tuple(out)


def predicted_starts(first: RngState, tapes: list[Tape], device: torch.device) -> list[RngState]:
    """Each micro-batch's start state: the first's as given, each next one's the previous one's
    with its tape replayed (the Note on why a tape). The generators end as `first` left them."""
    starts = [first]
    try:
        for tape in tapes[:-1]:
            starts[-1].restore()
            tape.replay()
            starts.append(RngState(device))
    finally:
        first.restore()
    return starts
