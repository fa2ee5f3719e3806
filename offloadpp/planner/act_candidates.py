"""The activation choices the planner scores for one model: per-unit policies (activations.py)
made along a ranking of the units, and the smallest that can run. Pure (no torch).

Note: the candidates (`candidates`). When keeping everything does not fit the room a placement
leaves, units are ranked by forward FLOPs per saved byte, lowest first (the paper's rule: the
cheapest to recompute per byte freed, and the hardest to hide a swap behind; among equals the
later unit, which backward needs first). Then: recompute along the ranking until the need fits;
swap everything and keep along the ranking what still fits; recompute the first quarter, half or
three quarters of the ranking, swap the rest and keep what fits; the same with the recomputing
units' checkpoints swapped too (every recomputable unit, or the head of the ranking), keeping
what fits and then pinning on the device the checkpoints that still fit; and partial in place of
recompute in those (where the profile knows the partial bytes): every recomputable unit partial
with its kept outputs swapped, keeping whole units what fits; and a quarter, half or three
quarters of them partial, spread evenly, the rest recomputed with swapped checkpoints (not on
models of many units: each choice costs a replay; the search moves the best one's split a unit
at a time towards the balance of link and compute: act_refine.py). Where even the whole recompute does not fit
(every recomputable unit recomputing, its checkpoint swapped: a block's backward holds all it
saved; issue 36's cliffs), the recomputing choices are made again with the nested recompute in
its place (recompute_nested*: the block's pieces' boundaries and one piece at a time, for a
second forward), before partial, which moves 12x the checkpoint's bytes, is the only way left;
and two more (`_pieces`): every recomputable unit recomputing piece by piece from its pieces' own
checkpoints swapped (recompute_pieces*: the compute of a whole recompute at one piece's peak, two
checkpoints a block moved), and half of them partial instead, spread evenly, or half of them
nested instead, spread evenly. Where the step is nearly all compute they beat nested (the
sweep's cliffs: profiles 1 and 9 at b128 the first, profile 15's the second); where the link or
the SSD is what the step waits on, nested's one checkpoint does; where forward waits on the link
for pieces' two checkpoints a block and nested's second forward would make backward longer, the
mix hides both (profile 1, 13B b128: 38.03 s, pieces alone 39.49 s, nested alone 39.12 s; a
nested block releases its pieces' bytes as their backward ends, so the next block's checkpoint
comes back during it: runtime/activations/recompute.py, Note on release). Three choices, not
nested's family again: each costs a replay (at most 3 per room, twice with the head twin), and
the others (pieces in the family's other choices) never won on those profiles.
Swaps go to host memory on CUDA (to SSD beyond the host memory left for them) and to SSD on the
CPU acting as the device, where host memory is the device's own; SSD is tried on CUDA too.

Note on refetch. At a room where even the least of those does not fit (`least_held`), the
choices are made again by the refetching twin (`_refetching`): the same families with every
swapped piecewise unit under its REFETCH policy (partial_refetch_*, recompute_pieces_refetch_*,
partial_last_refetch_* in place of partial_*, recompute_pieces_*, partial_last_*), whose pieces'
recomputes hold no derived argument's source (planner/activations.py, Note on the derived
argument's source), for one more copy up of each such source. Only there: where the held least
fits, the source held costs nothing and the second copy up does (random profile 31, Llama 7B
b128, 18.7 -> 25.8 s when every swapped piecewise unit sent its sources back). So `least` is the
twin's where that holds less, and the search tries the deeper prefetch depths it fits (random
profile 29, GPT-3 13B bf16 b64, whose MLP recompute held 6.25 GiB beside a 6.03 GiB room at
k = 1, had its weights fetched at each visit), but only for points the held least fits at some
depth (search.least_need: where only the twin fits, it ran 1.15x slower per token than half the
micro-batch).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from .act_policies import REFETCHING
from .activations import (
    CHECKPOINT_SWAPS,
    GRAD_IN_FORWARD,
    LAST_SWAPS,
    NESTED,
    NESTED_SWAPS,
    PIECES_SWAPS,
    SWAPPING,
    TAIL,
    ActUnit,
    held_bytes,
    need_bytes,
    peak_bytes_at,
    recomputes,
)
from .plan import PlanError

MIXES = (0.25, 0.5, 0.75)
# the candidates are made again with a fused head recomputing (see the Note on the head's loss)
# where its logits take at least this share of the room: below it the logits free too little
# to pay for the head's forward again, and each twin costs a replay (paper sweep, 13B fp16: at
# micro-batch 8-64, logits 5-40% of the room, the twin never won; at 128, 80%, it did; twinning
# every batch made planning 1.6x slower). Each twin choice has the head make its gradients in
# forward instead where that fits the room (`_grads_in_forward`): no recompute, so even then the
# twin wins only where the logits are a large share of the room (data-sheet 13B b48, b64: keep)
HEAD_TWIN_SHARE = 0.25


@dataclass(frozen=True)
class Mix:
    """A choice that mixes partial and recompute (`ActPlanner._mix`): `partial` of the `of`
    units that can be partial are, spread evenly, the rest recompute as `again`; `heads` are the
    head twin's (HEAD_TWIN_SHARE), () elsewhere. What act_refine.py moves the split of."""

    again: str
    partial: int
    of: int
    heads: tuple[str, ...] = ()
    refetch: bool = False  # made by the refetching twin (see the Note on refetch)


@dataclass(frozen=True)
class ActChoice:
    label: str
    policies: tuple[tuple[str, str], ...]  # (unit, policy) for every unit, forward order
    need_bytes: int
    mix: Optional[Mix] = None  # where the choice is a mix of partial and recompute

    def as_dict(self) -> dict[str, str]:
        return dict(self.policies)


class ActPlanner:
    """The activation choices for one model and settings.

    fixed: policies the settings fix (per-unit overrides; every unit when the settings' policy is
    not "auto"); the others are the planner's to choose. host_bytes: host memory swapped
    activations may take (None: no limit); beyond it they go to SSD. device: "cuda" or "cpu".
    mixes: offer partial and recompute mixed (search.py: not on models of many units).
    stage_units: the settings' activations.prefetch_units (what backward stages ahead).
    refetch: its swapped piecewise units send their derived arguments' sources back (the
    refetching twin: see the Note on refetch)."""

    def __init__(self, units: Sequence[ActUnit], fixed: Mapping[str, str], *, device: str,
                 host_bytes: Optional[int] = None, mixes: bool = True, stage_units: int = 2,
                 refetch: bool = False):  # fmt: skip
        self.units = tuple(units)
        self.refetch = refetch
        self._swapped_partial = self._swapped("partial_ssd")
        self.stage_units = stage_units  # the units backward reads from SSD ahead (_staging_peak)
        self.mixes = mixes  # partial and recompute mixed (each costs a replay: off on 175B)
        self.fixed = {n: ("keep" if recomputes(p) and not self._unit(n).can_recompute else p)
                      for n, p in fixed.items() if p != "auto"}  # fmt: skip
        bad = [n for n, p in self.fixed.items() if p == GRAD_IN_FORWARD and not self._unit(n).logits]
        if bad:
            raise PlanError(
                f"activations.overrides gives {bad} the policy 'grad_in_forward', which only a fused causal-LM "
                "head can take (activations.fused_loss, the unit owning the output embedding)"
            )
        self.free = [u for u in self.units if u.name not in self.fixed]
        self.device = device
        self.host_bytes = host_bytes
        self._cache: dict[int, tuple[ActChoice, ...]] = {}

    def _swapped(self, policy: str) -> str:
        """A swapped piecewise policy as this planner offers it: its REFETCH twin's in the
        refetching twin (see the Note on refetch). (To SSD here: _swap_to sends it to host.)"""
        return REFETCHING[policy] if self.refetch else policy

    def _unit(self, name: str) -> ActUnit:
        return next(u for u in self.units if u.name == name)

    def _choice(self, label: str, chosen: Mapping[str, str]) -> ActChoice:
        pol = {**{u.name: "keep" for u in self.units}, **chosen, **self.fixed}
        return ActChoice(label, tuple((u.name, pol[u.name]) for u in self.units), need_bytes(self.units, pol))

    @property
    def keep_all(self) -> ActChoice:
        return self._choice("keep", {})

    @property
    def swap_all(self) -> ActChoice:
        """Every free unit swapped whole."""
        return self._choice("swap all", {u.name: "ssd" for u in self.free})

    @property
    def least(self) -> ActChoice:
        """The choice with the least need: every free unit swapped (what must stay stays), or
        partial with its kept outputs swapped, or recomputing piece by piece from its pieces'
        checkpoints swapped, where that holds less (both hold one piece's at a time in backward;
        pieces hold no kept output, so less than partial where a piece keeps outputs autograd does
        not save: a Llama attention's q and k before the rotation). The search tries no prefetch
        depth whose room the least does not fit: random profile 0, Llama 7B b128, whose least
        was partial's (8.02 GiB against pieces' 7.38), was planned at k = 0 only, its weights
        fetched at each visit (77.54 s); pieces fit k = 1 and 2 too. The refetching twin's
        where it holds less (see the Note on refetch)."""
        own = self.least_held
        if self.refetch:
            return own
        lean = self._refetching.least_held
        return lean if lean.need_bytes < own.need_bytes else own

    @property
    def least_held(self) -> ActChoice:
        """The least need with each derived argument's source held beside its piece (no
        partial_refetch_*, but in the refetching twin itself: see the Note on refetch)."""
        return self._least(pieces=True)

    @functools.cached_property
    def _refetching(self) -> ActPlanner:
        """This planner with its swapped piecewise units sending their derived arguments' sources
        back (REFETCH's policies: see the Note on refetch)."""
        return ActPlanner(self.units, self.fixed, device=self.device, host_bytes=self.host_bytes,
                          mixes=self.mixes, stage_units=self.stage_units, refetch=True)  # fmt: skip

    @property
    def least_partial(self) -> ActChoice:
        """The least need without recomputing piece by piece: the room the search sets aside for
        the activations (search.py; pieces' only at the depths where this one does not fit).
        Setting aside pieces' smaller room where partial's fits changed the fills replayed and
        the pick: random profile 29, Llama 7B b32, 18.146 -> 18.240 s; profile 0 b64, 33.989 ->
        34.466 s."""
        return self._least(pieces=False)

    def _least(self, pieces: bool) -> ActChoice:
        def least_of(u: ActUnit) -> str:
            if u.can_recompute and 0 < u.partial < u.saved:
                # (in this order: the first of equals, as before pieces were counted here)
                tried = ("ssd", self._swapped_partial) + (
                    (self._swapped("recompute_pieces_ssd"),) if pieces and u.pieces else ()
                )
                return min(tried, key=lambda p: peak_bytes_at(u, p))
            if u.can_recompute and u.logits:
                return min(("ssd", "recompute_ssd"), key=lambda p: peak_bytes_at(u, p))
            return "ssd"

        return self._choice("swap all", {u.name: least_of(u) for u in self.free})

    def _ranked(self) -> list[ActUnit]:
        idx = {u.name: i for i, u in enumerate(self.units)}
        return sorted(
            (u for u in self.free if u.saved > 0),
            key=lambda u: (u.flops / u.saved, -idx[u.name]),
        )

    def _swap_to(self, chosen: dict[str, str], to: str) -> dict[str, str]:
        """`chosen` with its swaps (and swapped checkpoints) sent to `to`; to host only within the
        host memory left for them (the units with the fewest FLOPs per byte first: they hide an
        SSD read worst)."""

        def sent(p: str, where: str) -> str:
            return where if p in ("host", "ssd") else f"{p.rsplit('_', 1)[0]}_{where}"

        if to != "host":
            return {n: (sent(p, to) if p in SWAPPING else p) for n, p in chosen.items()}
        room = self.host_bytes
        for _ in range(4):  # (each pass leaves the staging's overshoot to SSD: rarely a second)
            left, spilled = room, False
            out = dict(chosen)
            for u in self._ranked():
                p = out.get(u.name)
                if p in SWAPPING:
                    n = u.moved(p)
                    if left is None or n <= left:
                        out[u.name] = sent(p, "host")
                        left = None if left is None else left - n
                    else:
                        out[u.name] = sent(p, "ssd")
                        spilled = True
            over = self._staging_peak(out) - self.host_bytes if spilled and room is not None else 0
            if over <= 0:
                break
            room -= over
        return out

    def _staging_peak(self, pol: Mapping[str, str]) -> int:
        """The most host memory the swapped activations take in backward: as backward reaches a
        unit, the units after it in forward order have released theirs, and the next units' SSD
        bytes are read into host memory ahead (runtime/activations/swap.py, Note on staging:
        up to `stage_units`, to the first that recomputes) beside the host bytes of the units
        before it and its own."""
        units = self.units
        tier = [CHECKPOINT_SWAPS.get(pol.get(u.name, "keep"), pol.get(u.name, "keep")) for u in units]
        moved = [u.moved(pol[u.name]) if t in ("host", "ssd") else 0 for u, t in zip(units, tier)]
        host = [m if t == "host" else 0 for m, t in zip(moved, tier)]
        peak, held = 0, sum(host)
        for i in range(len(units) - 1, -1, -1):
            staged = 0
            for j in range(i - 1, max(-1, i - 1 - self.stage_units), -1):
                staged += moved[j] if tier[j] == "ssd" else 0
                if recomputes(pol.get(units[j].name, "keep")):
                    break
            peak = max(peak, held + staged)
            held -= host[i]
        return peak

    def _upgrade_what_fits(
        self, chosen: dict[str, str], room: int, frm: frozenset, to: str
    ) -> dict[str, str]:
        """`chosen` with its units whose policy is in `frm` set to `to` along the ranking while the
        need fits `room` (keep: no swap nor recompute; recompute: the checkpoint pinned).

        Changing unit p's policy changes what unit p holds during its backward and what every
        later unit's backward starts with by the same amount for all of them, so the need becomes
        max(the peak before p, p's own, the peak after p + the change): running maxima, rebuilt
        only when a unit changes."""
        out = {**dict(chosen), **self.fixed}
        units = self.units
        pos = {u.name: i for i, u in enumerate(units)}

        def maxima() -> tuple[list[int], list[int], list[int]]:
            held, at, before = 0, [], []
            for u in units:
                p = out.get(u.name, "keep")
                before.append(held)
                at.append(held + peak_bytes_at(u, p))
                held += held_bytes(u, p)
            upto, after = [0] * (len(at) + 1), [0] * (len(at) + 1)
            for i, x in enumerate(at):
                upto[i + 1] = max(upto[i], x)
            for i in range(len(at) - 1, -1, -1):
                after[i] = max(after[i + 1], at[i])
            return upto, after, before

        upto, after, before = maxima()
        for u in self._ranked():
            p = out.get(u.name)
            if p in frm and (not recomputes(to) or u.can_recompute):
                i = pos[u.name]
                grow = held_bytes(u, to) - held_bytes(u, p)
                own = before[i] + peak_bytes_at(u, to)
                if max(upto[i], own, after[i + 1] + grow) <= room:
                    out[u.name] = to
                    upto, after, before = maxima()
        return out

    def _keep_what_fits(self, chosen: dict[str, str], room: int) -> dict[str, str]:
        """`chosen` with its swapped units (swapped checkpoints too) kept along the ranking while
        the need fits `room`."""
        return self._upgrade_what_fits(chosen, room, SWAPPING, "keep")

    def _pin_what_fits(self, chosen: dict[str, str], room: int, to: str = "recompute") -> dict[str, str]:
        """`chosen` with its swapped checkpoints kept on the device (as `to`: recompute, or
        recompute_nested / recompute_pieces for theirs) while the need fits `room`."""
        frm = _SWAPS_OF.get(to, frozenset(CHECKPOINT_SWAPS) - NESTED_SWAPS - PIECES_SWAPS - LAST_SWAPS)
        return self._upgrade_what_fits(chosen, room, frm, to)

    def candidates(self, room: int) -> tuple[ActChoice, ...]:
        """The choices whose need fits `room` device bytes (the first is keeping all, alone,
        when it fits); () when even the least does not."""
        if room in self._cache:
            return self._cache[room]
        keep = self.keep_all
        if keep.need_bytes <= room:
            out: tuple[ActChoice, ...] = (keep,)
        elif self.least_held.need_bytes <= room:
            out = self._candidates(room)
        elif not self.refetch and self._refetching.least_held.need_bytes <= room:
            out = self._refetching._candidates(room)  # (see the Note on refetch)
        else:
            out = ()
        self._cache[room] = out
        return out

    def _offers_nested(self, room: int) -> bool:
        """Nested recompute is offered where the whole recompute does not fit (every recomputable
        unit recomputing with its checkpoint swapped, the rest swapped, needs more than `room`)
        and some unit's nested recompute holds less (see the Note on the candidates)."""
        rec = [u for u in self.free if u.can_recompute]
        if not any(u.pieces and u.nested() < u.recomputed() for u in rec):
            return False
        base = {**{u.name: "ssd" for u in self.free}, **{u.name: "recompute_ssd" for u in rec}, **self.fixed}
        return need_bytes(self.units, base) > room

    def _families(self, room: int) -> list[ActChoice]:
        found = self._family(room)
        if self._offers_nested(room):  # (the family again, nested in place of recompute; pieces)
            found += [
                c for c in self._family(room, "recompute_nested") if any(p in NESTED for _, p in c.policies)
            ]
            found += self._pieces(room)
        return found

    def _pieces(self, room: int) -> list[ActChoice]:
        """Every recomputable unit recomputing piece by piece from its pieces' own checkpoints
        (recompute_pieces*), the checkpoints to the first tier (host on CUDA, beyond the host
        memory left to SSD), whole units kept and then checkpoints pinned along the ranking while
        they fit; and (not on models of many units) half of them partial instead (where the
        profile knows partial's bytes), or nested instead (where that holds less than the whole
        recompute), spread evenly, moved the same way. The choices of nested's family that pieces
        made faster than nested on the sweep's cliffs (profile 9, 13B and Llama b128: the first;
        profile 15, Llama b128, host memory too small for every block's partial outputs: the
        second; profile 1, 13B b128, forward waiting on the link for pieces' checkpoints: the
        third); the others with pieces in place of nested never won there, and each costs a
        replay (see the Note on the candidates)."""
        to = "host" if self.device == "cuda" else "ssd"
        rec = [u for u in self._ranked() if u.can_recompute]
        # (a unit without pieces, the head, recomputes whole: what pieces would count it as)
        base = {**{u.name: "ssd" for u in self.free},
                **{u.name: self._swapped("recompute_pieces_ssd") if u.pieces else "recompute_ssd" for u in rec}}  # fmt: skip
        out = [(f"pieces recompute 100% with checkpoints to {to}, swap to {to}", base)]
        partial = [u for u in rec if 0 < u.partial < u.saved]
        if partial and self.mixes:
            half = {u.name: self._swapped_partial for u in _spread(partial, 0.5)}
            out.append((f"partial 50%, pieces recompute the rest with checkpoints to {to}", {**base, **half}))
            # (the same with partial_last where a unit's partial piece holds more than its last
            # piece does partial: a Llama block's attention, see activations.py Note on the last piece)
            last = self._swapped("partial_last_ssd")
            if any(peak_bytes_at(u, last) < peak_bytes_at(u, self._swapped_partial) for u in partial):
                half = {u.name: last for u in _spread(partial, 0.5)}
                out.append((f"partial last piece 50%, pieces recompute the rest with checkpoints to {to}",
                            {**base, **half}))  # fmt: skip
        nested = [u for u in rec if u.pieces and u.nested() < u.recomputed()]
        if nested and self.mixes:
            half = {u.name: "recompute_nested_ssd" for u in _spread(nested, 0.5)}
            out.append(
                (
                    f"nested recompute 50%, pieces recompute the rest with checkpoints to {to}",
                    {**base, **half},
                )
            )
        found = []
        for label, chosen in out:
            kept = self._upgrade_what_fits(self._keep_what_fits(chosen, room), room,
                                           frozenset((self._swapped_partial,)), "partial")  # fmt: skip
            kept = self._upgrade_what_fits(
                kept, room, frozenset((self._swapped("partial_last_ssd"),)), "partial_last"
            )
            kept = self._pin_what_fits(kept, room, "recompute_pieces")
            kept = self._pin_what_fits(kept, room, "recompute_nested")
            kept = self._upgrade_what_fits(
                kept, room, frozenset(("recompute_ssd",)), "recompute"
            )  # (the head)
            found.append(self._choice(label, self._swap_to(kept, to)))
        return found

    def _candidates(self, room: int) -> tuple[ActChoice, ...]:
        found = self._families(room)
        heads = [u.name for u in self.free if u.can_recompute and u.logits >= HEAD_TWIN_SHARE * room]
        if heads:  # (see the Note on the head's loss)
            for c in self._twin(heads)._families(room):
                c = self._grads_in_forward(c, heads, room)
                found += [c] + self._tails(c, heads, room)
        seen, out = set(), []
        for c in found:
            if c.need_bytes <= room and c.policies not in seen:
                seen.add(c.policies)
                out.append(c)
        return tuple(out)

    def _twin(self, heads: Sequence[str]) -> ActPlanner:
        """This planner with `heads` recomputing (the head twin: see the Note on the head's loss)."""
        return ActPlanner(self.units, {**self.fixed, **{n: "recompute" for n in heads}}, device=self.device,
                          host_bytes=self.host_bytes, mixes=self.mixes, stage_units=self.stage_units,
                          refetch=self.refetch)  # fmt: skip

    def remix(self, c: ActChoice, partial: int, room: int) -> Optional[ActChoice]:
        """The mix `c` with `partial` of its units partial (spread evenly), made as `c` was (the
        head twin's too); None where `c` is no mix, or the new one does not fit `room`."""
        m = c.mix
        if m is None or not 0 <= partial <= m.of:
            return None
        planner = self._refetching if m.refetch and not self.refetch else self
        planner = planner._twin(m.heads) if m.heads else planner
        units = planner._partial_units()
        if len(units) != m.of:
            return None
        head = [u for i, u in enumerate(units) if (i + 1) * partial // m.of > i * partial // m.of]
        got = planner._mix(room, m.again, head, f"{partial} of {m.of}")
        if m.heads:
            got = self._grads_in_forward(got, list(m.heads), room)
        return got if got.need_bytes <= room else None

    def _grads_in_forward(self, c: ActChoice, heads: list[str], room: int) -> ActChoice:
        """A choice of the head twin with its heads making their gradients in forward in place of
        recomputing their logits, where that fits `room`: it runs nothing again, holds t x width
        more at its peak (h beside grad_h), and nothing else changes (see the Note on the head's
        loss); else the choice as it is. (One choice, not two: each costs a replay, and where it
        fits the recompute was never the faster on the paper's and the data-sheet profiles.)"""
        grads = self._choice(
            f"{c.label}, head gradients in forward", {**c.as_dict(), **{n: GRAD_IN_FORWARD for n in heads}}
        )
        mix = replace(c.mix, heads=tuple(heads)) if c.mix is not None else None
        got = grads if grads.need_bytes <= room else replace(c, label=f"{c.label}, head recomputed")
        return replace(got, mix=mix)

    def _tails(self, c: ActChoice, heads: list[str], room: int) -> list[ActChoice]:
        """The choice with the unit just before the head keeping its last pieces on the device
        (partial_host_tail, see the Note on the tail) where it is partial_host and the room cannot
        keep it whole (partial): the head's forward follows it at once, and its backward comes
        first, so what it keeps is neither copied out nor fetched back; [] elsewhere. (Only on
        the head twin: each choice costs a replay.)"""
        pol = c.as_dict()
        names = [u.name for u in self.units]
        before = {names[names.index(h) - 1] for h in heads if names.index(h) > 0}
        out = []
        for n in sorted(before):
            if pol.get(n) != "partial_host" or n in self.fixed:
                continue
            if self._choice(c.label, {**pol, n: "partial"}).need_bytes <= room:
                continue  # (it fits whole: the families keep it partial where that pays)
            tail = self._choice(f"{c.label}, {n} keeps its last pieces", {**pol, n: TAIL})
            if tail.need_bytes <= room:
                out.append(tail)
        return out

    def _family(self, room: int, again: str = "recompute") -> list[ActChoice]:
        """again: the recompute policy of the family (recompute, or recompute_nested: its label
        says "nested recompute")."""
        ranked = self._ranked()
        found: list[ActChoice] = []
        rec: dict[str, str] = {}
        name = "recompute" if again == "recompute" else "nested recompute"
        for u in ranked:
            if need_bytes(self.units, {**rec, **self.fixed}) <= room:
                break
            if u.can_recompute:
                rec[u.name] = again
        found.append(self._choice(f"{name} lowest FLOPs/byte", rec))
        recomputable = [u for u in ranked if u.can_recompute]
        swaps = ("host", "ssd") if self.device == "cuda" else ("ssd",)
        for to in swaps:
            base = {u.name: "ssd" for u in self.free}
            found.append(self._choice(f"swap to {to}, keep what fits",
                                      self._swap_to(self._keep_what_fits(base, room), to)))  # fmt: skip
            for frac in MIXES + (1.0,):
                head = recomputable[: round(frac * len(recomputable))]
                if not head:
                    continue
                mixed = {**{u.name: "ssd" for u in self.free}, **{u.name: again for u in head}}
                if frac < 1.0:
                    found.append(self._choice(f"{name} {frac:.0%}, swap to {to}",
                                              self._swap_to(self._keep_what_fits(mixed, room), to)))  # fmt: skip
                # the paper's scheme: the recomputing units' checkpoints leave the device too
                # (tried with the first tier only: to host on CUDA, which sends to SSD what host
                # memory cannot take, and so is never slower than all to SSD; each candidate
                # costs a replay, and 175B must plan within 2 s)
                if to != swaps[0]:
                    continue
                ckpt = {**mixed, **{u.name: f"{again}_ssd" for u in head}}
                kept = self._keep_what_fits(ckpt, room)
                found.append(self._choice(f"{name} {frac:.0%} with checkpoints to {to}, swap to {to}",
                                          self._swap_to(self._pin_what_fits(kept, room, again), to)))  # fmt: skip
        # selective recomputation: the recomputable units partial (the profile knows their kept
        # bytes, and keeping them is less than all they save), their kept outputs swapped with the
        # checkpoint; whole units kept, then partial units pinned, along the ranking while they fit
        partial = [u for u in recomputable if 0 < u.partial < u.saved]
        if partial:
            for frac in (1.0,):  # (a half was never the fastest on the paper's sweep; each costs a replay)
                head = partial[: round(frac * len(partial))]
                base = {**{u.name: "ssd" for u in self.free}, **{u.name: self._swapped_partial for u in head}}
                kept = self._upgrade_what_fits(self._keep_what_fits(base, room), room,
                                               frozenset((self._swapped_partial,)), "partial")  # fmt: skip
                found.append(self._choice(f"partial {frac:.0%}, swap to {swaps[0]}",
                                          self._swap_to(kept, swaps[0])))  # fmt: skip
            # a mix: partial moves its kept outputs (14 x width a token for a GPT-2 block) over
            # the link, recompute only its checkpoint but runs its forward again; spread evenly
            # (every other unit at a half) so that neither the link nor the compute queues up
            # (the quarter steps only: act_refine.py moves the best's split a unit at a time)
            for frac in MIXES if self.mixes else ():
                found.append(self._mix(room, again, _spread(partial, frac), f"{frac:.0%}"))
        return found

    def _partial_units(self) -> list[ActUnit]:
        """The units that can be partial (the profile knows their kept bytes, and keeping them is
        less than all they save), along the ranking."""
        return [u for u in self._ranked() if u.can_recompute and 0 < u.partial < u.saved]

    def _mix(self, room: int, again: str, head: Sequence[ActUnit], share: str) -> ActChoice:
        """Every recomputable unit recomputing as `again` with its checkpoint swapped, those of
        `head` partial instead with their kept outputs swapped (`share`: how many, for the label);
        whole units kept, then partial units and checkpoints pinned, along the ranking while they
        fit; swaps to the first tier (host on CUDA, beyond the host memory left to SSD)."""
        to = "host" if self.device == "cuda" else "ssd"
        name = "recompute" if again == "recompute" else "nested recompute"
        rec = [u for u in self._ranked() if u.can_recompute]
        base = {**{u.name: "ssd" for u in self.free}, **{u.name: f"{again}_ssd" for u in rec},
                **{u.name: self._swapped_partial for u in head}}  # fmt: skip
        kept = self._upgrade_what_fits(self._keep_what_fits(base, room), room,
                                       frozenset((self._swapped_partial,)), "partial")  # fmt: skip
        got = self._choice(f"partial {share}, {name} the rest with checkpoints to {to}",
                           self._swap_to(self._pin_what_fits(kept, room, again), to))  # fmt: skip
        return replace(got, mix=Mix(again, len(head), len(self._partial_units()), refetch=self.refetch))


_SWAPS_OF = {"recompute_nested": NESTED_SWAPS, "recompute_pieces": PIECES_SWAPS}


def _spread(units: list, frac: float) -> list:
    """`frac` of `units`, spread evenly over them (every other one at a half)."""
    return [u for i, u in enumerate(units) if int((i + 1) * frac) > int(i * frac)]


def fixed_policies(settings_activations, names: Sequence[str]) -> dict[str, str]:
    """The policies the settings fix: the per-unit overrides, and every unit's when the policy
    is not "auto"."""
    act = settings_activations
    out = {n: act.policy for n in names} if act.policy != "auto" else {}
    out.update({n: p for n, p in act.overrides.items() if p != "auto"})
    return out


def untwinned(label: str) -> str:
    """A choice's label without its head twin's suffix (HEAD_TWIN_SHARE; `_grads_in_forward`)."""
    return re.sub(r", head (gradients in forward|recomputed)$", "", label)


__all__ = ["HEAD_TWIN_SHARE", "MIXES", "ActChoice", "Mix", "ActPlanner", "fixed_policies", "untwinned"]
