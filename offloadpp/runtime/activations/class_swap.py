"""Module classes swapped for a subclass of the runtime's, held by count (gelu.py, swiglu.py).

A module under the units the runtime manages gets a subclass of its own class (still an
instance of the original) whose forward is made from the original's; the subclass is made once
per class, named as the original and published in its home module's namespace, so that a model
holding one still pickles. Two managers over one model each hold the modules they swapped: the
first removed must not restore what the second still runs, so the last holder restores the
original class."""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

from torch import nn


class ClassSwaps:
    """One kind of swap: `make_forward(original_forward)` is the subclass's forward; the
    subclasses live in `home` (the defining module's globals()) under `home["__name__"]`."""

    def __init__(self, home: dict, make_forward: Callable[[Callable], Callable]):
        self._home = home
        self._make_forward = make_forward
        self._subclasses: dict[type, type] = {}
        # module -> how many hold() calls hold it
        self._users: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def subclass(self, cls: type) -> type:
        sub = self._subclasses.get(cls)
        if sub is None:
            sub = type(cls.__name__, (cls,), {"forward": self._make_forward(cls.forward), "_offloadpp_original": cls,
                                              "__module__": self._home["__name__"], "__doc__": cls.__doc__})  # fmt: skip
            self._subclasses[cls] = sub
            self._home[cls.__name__] = sub  # found by name: a model holding one still pickles
        return sub

    def hold(self, roots: Iterable[nn.Module], applies: Callable[[nn.Module], bool]) -> list[nn.Module]:
        """Swaps the class of every module under `roots` that `applies` to (or holds it again,
        already swapped); returns the modules held (for restore)."""
        held = []
        for root in roots:
            for m in root.modules():
                if m in self._users:
                    self._users[m] += 1
                    held.append(m)
                elif applies(m):
                    m.__class__ = self.subclass(type(m))
                    self._users[m] = 1
                    held.append(m)
        return held

    def restore(self, modules: Iterable[nn.Module]) -> None:
        """Gives back what hold returned; the last holder restores the original class."""
        for m in modules:
            n = self._users.get(m, 0) - 1
            if n > 0:
                self._users[m] = n
                continue
            self._users.pop(m, None)
            orig = getattr(type(m), "_offloadpp_original", None)
            if orig is not None:
                m.__class__ = orig
