"""The placements the planner tries at one pair of prefetch depths: planner/keep.py's rule (by the
SSD bytes each kept array saves per byte it takes; the default policy's too) and the fills a
person would try by hand (search.py's Note has the list). Pure (no torch).

Every candidate is checked against the budgets with planner.peaks (the schedule's peaks without
building the schedule); fills take the longest prefix that fits by bisection, then go on one by
one until keep.MAX_MISSES misses in a row, and persistent gradients then take what is left by
keep.py's rule.
"""

from __future__ import annotations

from dataclasses import replace

from .keep import fits, keep, take
from .peaks import peak_bytes
from .plan import Plan, fmt_bytes
from .request import Request
from .spec import Budgets


def _fill(base: Plan, steps: list[tuple[tuple[str, str], ...]], req: Request) -> Plan:
    b = req.budgets
    filled = take(base, steps, lambda p: fits(p, b.device_bytes, b.host_bytes))
    return keep(filled, b.device_bytes, b.host_bytes, ("grads@host",))


def _ordered_fill(base: Plan, order: list[str], arrays: tuple[str, ...], req: Request) -> Plan:
    """Keeps `arrays` of the units in `order` (all of the first array's units, then the next
    array's) while the budgets allow: the fills a person tuning by hand would try."""
    masters = ("master@device", "master@host") if base.device == "cpu" else ("master@host",)
    steps = []
    for what in arrays:
        for u in order:
            if what == "master+weights":  # a unit's master, then its 16-bit copy, in host memory
                steps += [((u, "master@host"),), ((u, "weights@host"),)]
            else:
                steps.append(tuple((u, w) for w in (masters if what == "master" else (what,))))
    return _fill(base, steps, req)


FILLS = (
    ("forward, master first", False, ("master", "moments@host")),
    ("forward, moments first", False, ("moments@host", "master")),
    ("backward, master first", True, ("master", "moments@host")),
)


# With 16-bit compute on CUDA, also the fill a person keeping a unit's weights in host memory makes
# by hand (planner_grid's): its master and its 16-bit copy (read at every fetch, written by the
# update). The fills above leave every copy on SSD, and keep.py's rule ranks the copies first but
# then, ties going to gradients, leaves moments on SSD: issue 36's property sweep, profile 6 (666
# GiB host, SSD write 2.9 GB/s), Llama 7B b16 / b32: 8.99 / 13.49 s against the hand-written
# 8.54 / 11.96 s (now 6.17 / 11.96 s).
WEIGHTS_FILL = ("forward, master with its 16-bit copy first", False, ("master+weights", "moments@host"))


def _placements(base: Plan, req: Request, reserve: int) -> dict:
    """The placements to try at the depths of `base`: keep.py's rule and FILLS, with `reserve`
    device bytes set aside for the activations (placements -> how)."""
    rq = replace(req, budgets=Budgets(req.budgets.device_bytes - reserve, req.budgets.host_bytes),
                 count_activations=False)  # fmt: skip
    dev0, host0 = peak_bytes(base)
    if dev0 > rq.budgets.device_bytes:
        return {}
    tag = f" (activations {fmt_bytes(reserve)})" if reserve else ""
    tried = {base.placements: "stream"}
    tried.setdefault(
        keep(base, rq.budgets.device_bytes, rq.budgets.host_bytes).placements, "by bytes saved" + tag
    )
    names = [u.name for u in base.units]
    fills = FILLS + ((WEIGHTS_FILL,) if base.separate_weights and base.device != "cpu" else ())
    for label, backward, arrays in fills:
        filled = _ordered_fill(base, names[::-1] if backward else names, arrays, rq)
        tried.setdefault(filled.placements, label + tag)
    return tried
