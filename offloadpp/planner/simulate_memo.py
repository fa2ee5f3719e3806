"""The replay's per-unit memos (simulate_act.py's ActReplay and its bases): a unit's sizes and
shares, found once per replay and, across the replays of a search, once per (unit, policy) of a
model (the Note on shared sizes). Pure."""

from __future__ import annotations

import functools
from typing import Mapping, Optional

from .activations import ActUnit

_MISSING = object()


def per_unit(f, shared: bool = True):
    """A method of one unit's sizes or shares, remembered for the replay: they read only the
    replay's policies and profiles, which do not change while it runs, and a replay asks for
    them at every visit of every step. `shared`: remembered across replays too (the Note on
    shared sizes); recompute_s reads the replay's costs and is not."""
    name = f.__name__

    def remembered(self, unit: str):
        memo = self._memos.get(name)  # (a dict of the replay's: no __dict__ lookup per call)
        if memo is None:
            memo = self._memos[name] = {}
        got = memo.get(unit, _MISSING)
        if got is _MISSING:
            if shared and self._shared is not None:
                key = (name, unit, self._given.get(unit, "keep"), self._src_bytes.get(unit))
                got = self._shared.get(key, _MISSING)
                if got is _MISSING:
                    got = self._shared[key] = f(self, unit)
                memo[unit] = got
            else:
                got = memo[unit] = f(self, unit)
        return got

    return functools.wraps(f)(remembered)


# Note: shared sizes. The replays of a search (dozens a point) share the model's activation units
# (cost._model_acts: one mapping per model profile) and differ in their policies, so a unit's
# sizes and shares (forward_parts, _recomputed, ...: functions of the unit's profile, its saved
# bytes and its policy as given) are found once per (unit, policy) and kept with that mapping:
# per mapping of units (held in the entry, so its id is not reused), the last _SHARED_MAX
# mappings'. Kept per model, not in one store emptied when full, a point's cost does not depend
# on what was planned before it (the store once filled up every ~25 points of a sweep and was
# emptied in the middle of one); values are tuples and ints.
_SHARED: dict[int, tuple] = {}
_SHARED_MAX = 4


def shared_sizes(units: Optional[Mapping[str, ActUnit]]) -> Optional[dict]:
    """The shared sizes of the replays given `units` (the Note above; a mapping not changed while
    replays use it, as cost._model_acts'); None: none shared (no units)."""
    if not units:
        return None
    e = _SHARED.get(id(units))
    if e is not None and e[0] is units:
        return e[1]
    if len(_SHARED) >= _SHARED_MAX:
        _SHARED.pop(next(iter(_SHARED)))
    memo: dict = {}
    _SHARED[id(units)] = (units, memo)
    return memo


def clear_shared() -> None:
    """Forgets every model's shared sizes (benchmarks time planning from nothing)."""
    _SHARED.clear()
