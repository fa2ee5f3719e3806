"""The FLOP counter of the probe that profiles units for `auto`."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs of the operators torch.utils.flop_counter knows (matmuls, convolutions,
    attention on CUDA); used once, in the forward that profiles units for `auto`."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out
