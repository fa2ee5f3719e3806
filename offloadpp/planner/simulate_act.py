"""The replay of activation swapping and recomputation (runtime/activations/: manager.py, swap.py).

Pure (no torch). Per unit, the policy says what happens to what its forward saves for backward:
  keep       nothing moves.
  host       forward: a swap-out job copies the bytes to host memory (on the CPU device a memmove
             on the activation worker's thread; on CUDA a device->host copy); backward: they are
             handed back (CPU: no copy; CUDA: a host->device copy).
  ssd        as host, then the worker writes them to SSD; backward reads them back ahead of use.
  recompute  nothing is saved: backward runs the unit's forward again first; its inputs (the
             activation checkpoint) stay on the device.
  recompute_host, recompute_ssd
             as recompute, with the checkpoint moved as host/ssd move saved bytes (copied out in
             forward, fetched back ahead of the recompute).
  recompute_nested, recompute_nested_host, recompute_nested_ssd
             as recompute and its swapped-checkpoint forms, holding in backward the unit's pieces'
             boundaries and one piece's saved bytes (ActUnit.nested); the recompute runs the
             unit's forward twice (recompute_fraction).
  recompute_pieces, recompute_pieces_host, recompute_pieces_ssd
             replayed as partial with no kept outputs (planner/activations.py, Note on pieces: its
             pieces' checkpoints moved piece by piece), its recompute the unit's whole forward
             once; its pieces' shares of the compute by what each saves, the last's its known
             share (ActUnit.last_piece_share); a fetch waits for the last piece and the pieces its
             arguments are made again from (a block's MLP: the second norm's checkpoint).
  partial, partial_host, partial_ssd
             as recompute, the outputs of the matmuls and attention held (or moved) with the
             checkpoint; the recompute runs no matmul (only the per-visit time is added).
  partial_host_tail
             partial_host but its last TAIL_PIECES pieces, kept (planner/activations.py, Note on
             the tail): a piece is copied out once the TAIL_PIECES-th after it was saved.
  grad_in_forward
             a fused head's: nothing moves nor runs again; it holds its gradients from its
             forward to its backward (ActUnit.grads_held), and its backward's time is in its
             forward's (cost.py replay, activations.forward_moved).
Backward fetches the activations of the unit it reaches and of the next `prefetch_units` units
(in backward order) as far as the budget allows. A fetch finds a swap-out job still queued: it is
cancelled (the bytes never left). Still copying: ready when the copy ends. Still in host memory
(host policy, or an SSD write not yet finished): ready at once. On SSD: a read, queued behind
whatever the SSD is doing. On CUDA the next units' SSD bytes are read into host memory as backward
reaches a unit, whatever the device room (runtime/activations/swap.py, Note on staging).

Device bytes are counted as the runtime counts them (planner/activations.py): a kept unit's from
its forward to the end of its backward, a recomputing unit's inputs from its forward and what it
recomputes during its backward (a whole or nested recompute less each piece's bytes as that
piece's backward ends: simulate_release.py), a swapped unit's until its copy out is done and
again from its fetch. With a budget (the plan's Budgets.activation_bytes), a unit's forward waits for the
oldest copies out until its bytes fit, as the runtime's pack hook waits (per unit here, per
saved tensor there).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Optional

from .activations import (
    AS_RUN,
    CHECKPOINT_SWAPS,
    GRAD_IN_FORWARD,
    NESTED,
    PARTIAL,
    POLICIES,
    SWAPPING,
    TAIL,
    TAIL_PIECES,
    ActUnit,
    as_run,
    as_whole,
    backward_bytes,
    evicted,
    recompute_fraction,
    recomputes,
)
from .desim import NOTHING, Replay, When, done_by, when
from .simulate_fetch import Fetching, last_first
from .simulate_memo import per_unit, shared_sizes
from .simulate_pieces import PieceByPiece
from .simulate_release import Releasing


@dataclass(eq=False)
class _Out:
    unit: str
    nbytes: int
    to_ssd: bool
    started: bool = False
    cancelled: bool = False
    copy_done: Optional[float] = None
    write_done: When = None
    back: bool = False  # fetched back: its bytes are on the device again
    pieces: tuple[int, ...] = ()  # a partial unit's pieces: copied out one by one, each freed when done
    produced: int = 1  # of those, how many its forward has saved so far
    copied: int = 0  # and how many are copied out
    lag: int = 0  # a piece is copied once this many more pieces were saved (partial_host_tail's)
    parts: tuple[tuple[int, ...], ...] = ()  # per piece, its records' bytes (_swapped_parts)


@dataclass(frozen=True)
class ActWork:
    """What the activation replay is given (Sim passes it on): each unit's policy, the bytes its
    forward saves, its checkpoint's and partial bytes (ActUnit), and how many units ahead swapped activations
    are fetched back."""

    policies: Mapping[str, str] = field(default_factory=dict)
    saved_bytes: Mapping[str, int] = field(default_factory=dict)
    units: Mapping[str, ActUnit] = field(default_factory=dict)  # its checkpoint and partial bytes
    prefetch_units: int = 2


class ActReplay(PieceByPiece, Fetching, Releasing):
    def __init__(self, sim: Replay, policies: Mapping[str, str], act_bytes: Mapping[str, int], prefetch_units: int,
                 budget: Optional[int] = None, units: Optional[Mapping[str, ActUnit]] = None):  # fmt: skip
        bad = {u: p for u, p in policies.items() if p not in POLICIES}
        if bad:
            raise ValueError(f"activation policies must be one of {POLICIES}, got {bad}")
        self.sim = sim
        self._memos: dict[str, dict] = {}  # per_unit's: method -> unit -> its value
        self._given = policies  # (as given: the shared sizes' key, simulate_memo.per_unit)
        self._shared, self._src_bytes = shared_sizes(units), act_bytes
        self.policies = dict(policies)
        self.act_bytes = dict(act_bytes)
        # per unit: its checkpoint (inputs) and partial bytes (planner/activations.py ActUnit)
        self.units = dict(units or {})
        # recompute_pieces units replayed as they are counted (activations.as_run), their
        # recompute's share of the forward kept (see the module docstring)
        self.pieces: dict[str, float] = {}
        for n, p in policies.items():
            if p in AS_RUN:  # (partial_last's too: see planner/activations.py, Note on the last piece)
                u = self.units.get(n)
                self.pieces[n] = recompute_fraction(p, u)
                if u is not None:
                    self.units[n], self.policies[n] = as_run(u, p)
                else:
                    self.policies[n] = as_whole(p)
        self.inputs = {n: u.inputs for n, u in self.units.items()}
        self.prefetch = prefetch_units
        self.budget = budget
        self.backward_order = [v.unit for v in sim.sched.visits if v.backward]
        self.backward_index = {u: i for i, u in enumerate(self.backward_order)}
        self._after: dict[str, list] = {}  # unit -> the units whose activations it prefetches
        self.queue: deque[_Out] = deque()
        self.inflight: deque[_Out] = deque()  # swap-outs whose copy is not done, oldest first
        self.out: dict[str, _Out] = {}
        self.ready: dict[
            str, tuple[When, bool, int]
        ] = {}  # unit -> (its read or time, a h2d copy to follow, bytes)
        self.swapped_bytes = 0
        self.device_bytes = 0  # accounted on the device now (see the module docstring)
        self.peak_bytes = 0
        self.wait_s = 0.0  # forward waiting for copies out
        self.rest: dict[str, int] = {}  # a partial unit's bytes fetched with its backward, not before
        self.rest_up: dict[str, int] = {}  # of those, in host memory: copied up from its backward on
        self.counted: dict[str, int] = {}  # a unit in its backward: the device bytes it holds now
        self.held_back = False  # the last prefetch stopped for the budget (backward_parts)
        self.staged: dict[str, When] = {}  # unit -> its staged SSD read (into host memory)
        self.first_left: dict[str, int] = {}  # a partial unit's first fetch, the part not yet room for
        # units fetched whose SSD read is not copied up yet, in the order their reads were issued
        # (a dict as an ordered set: a set's order follows the interpreter's hash seed, and so did
        # the order their copies took the link in, and the replay's estimate by up to 4%)
        self.reading: dict[str, None] = {}
        self.to_ssd = any(CHECKPOINT_SWAPS.get(p, p) == "ssd" for p in self.policies.values())

    def policy(self, unit: str) -> str:
        return self.policies.get(unit, "keep")

    @property
    def active(self) -> bool:
        return any(p != "keep" for p in self.policies.values())

    @functools.partial(per_unit, shared=False)
    def recompute_s(self, unit: str) -> float:
        if not recomputes(self.policy(unit)):
            return 0.0
        frac = self.pieces.get(unit)
        if frac is None:
            frac = recompute_fraction(self.policy(unit), self.units.get(unit))
        return self.sim.costs.forward_s[unit] * frac + self.sim.costs.forward_visit_s

    def _add(self, n: int) -> None:
        self.device_bytes += n
        if self.device_bytes > self.peak_bytes:
            self.peak_bytes = self.device_bytes

    # ---- forward -------------------------------------------------------------------------
    @per_unit
    def forward_parts(self, unit: str) -> tuple[tuple[float, int], ...]:
        """The unit's forward as (share of its compute, bytes it saves) parts: one, or a swapped
        partial unit's pieces, each entering the budget as it runs (the runtime's pack hook waits
        per saved tensor: the previous unit's pieces leave while this one's first pieces run).
        The pieces' FLOPs are not in the profile: a piece's share of the compute is its share of
        the bytes it moves (its input and its matmuls' outputs, which grow with its FLOPs)."""
        pol = self.policy(unit)
        sub = self._sub_parts(unit)
        if sub:
            return tuple((share, sum(recs)) for share, recs in sub)
        pieces = self._window_chunks(unit) or self._piece_bytes(unit)
        if (pol in CHECKPOINT_SWAPS and pol in PARTIAL or self._window_chunks(unit)) and sum(pieces) > 0:
            if unit in self.pieces and not self._window_chunks(unit):
                return tuple(zip(self._piece_shares(unit), pieces))
            return tuple((p / sum(pieces), p) for p in pieces)
        if pol == GRAD_IN_FORWARD and unit in self.units:  # (h beside its gradients until its forward ends)
            return ((1.0, self._kept(unit) + self.units[unit].loss_input),)
        return ((1.0, self._held_in(unit) if recomputes(pol) else self._kept(unit)),)

    @per_unit
    def _sub_parts(self, unit: str) -> tuple[tuple[float, tuple[int, ...]], ...]:
        """A swapped partial unit's forward split where its records are saved (ActUnit.piece_kept
        and piece_kept_at), as (share of its compute, the records saved at its end): each part's
        records enter the budget at its start (the runtime's pack hook waits at the save, later)
        and are copied out from its end (when saved, as the runtime's are), a piece's checkpoint
        with its first part's (the runtime saves it as the piece starts, earlier). () where the
        profile does not say when they are saved, for a tail unit (forward_parts' pieces) and a
        vertical window's unit."""
        return self._split(unit)

    def _split(self, unit: str) -> tuple[tuple[float, tuple[int, ...]], ...]:
        u = self.units.get(unit)
        pol = self.policy(unit)
        if (
            u is None or pol == TAIL or pol not in CHECKPOINT_SWAPS or pol not in PARTIAL or u.micro_batches != 1
            or not u.pieces or len(u.piece_kept_at) != len(u.pieces) or len(u.piece_kept) != len(u.pieces)
        ):  # fmt: skip
            return ()
        pieces = self._piece_bytes(unit)
        total = sum(pieces)
        if total <= 0:
            return ()
        out: list[tuple[float, tuple[int, ...]]] = []
        shares = self._piece_shares(unit)
        for p, kept, at, share in zip(u.pieces, u.piece_kept, u.piece_kept_at, shares):
            recs, prev = [p[1]] if p[1] else [], 0.0
            for r, a in zip(kept, at):
                recs.append(r)
                out.append((share * (a - prev), tuple(recs)))
                recs, prev = [], a
            if recs or prev < 1.0:
                out.append((share * (1.0 - prev), tuple(recs)))
        return tuple(out)

    @per_unit
    def _piece_shares(self, unit: str) -> tuple[float, ...]:
        """A piecewise unit's pieces' shares of its compute, forward order: a partial unit's by the
        bytes each moves (its input and its matmuls' outputs, which grow with its FLOPs); a
        recompute_pieces unit's, which moves its checkpoints only, by the bytes each saves, its
        last piece's its known share (ActUnit.last_piece_share) where the profile says."""
        u = self.units[unit]
        if unit not in self.pieces:
            pieces = self._piece_bytes(unit)
            return tuple(p / sum(pieces) for p in pieces)
        saved = [p[0] for p in u.pieces]
        last = u.last_piece_share
        if not 0 < last < 1 or sum(saved[:-1]) <= 0:
            return tuple(x / sum(saved) for x in saved)
        return tuple((1 - last) * x / sum(saved[:-1]) for x in saved[:-1]) + (last,)

    def _kept(self, unit: str) -> int:
        """What a unit that neither recomputes nor swaps holds from its forward to its backward:
        all it saved, or a grad_in_forward head's gradients (ActUnit.grads_held)."""
        u = self.units.get(unit)
        if u is not None and self.policy(unit) == GRAD_IN_FORWARD:
            return u.grads_held
        return self.act_bytes.get(unit, 0)

    @per_unit
    def _window_chunks(self, unit: str) -> tuple[int, ...]:
        """A vertical window's swapped unit (planner/vertical.py): its forward runs the window's
        micro-batches one at a time, each saving and copying out its share (its pieces' shares,
        partial) as the runtime's pack hook does; () for any other unit."""
        u = self.units.get(unit)
        pol = self.policy(unit)
        if u is None or u.micro_batches == 1 or pol not in SWAPPING:
            return ()
        g = u.micro_batches
        base = self._piece_bytes(unit) or (
            self._held_in(unit) if pol in CHECKPOINT_SWAPS else self.act_bytes.get(unit, 0),
        )
        return tuple(b // g for _ in range(g) for b in base)

    def before_forward(self, unit: str, own: int) -> Iterable:
        """A part of the unit's forward saves `own` bytes (a recomputing one keeps its inputs):
        within the budget, waiting for the oldest copies out (what `yield from` runs: nothing
        where it fits at once)."""
        if self.budget is None or self.device_bytes + own <= self.budget or not self.inflight:
            self._add(own)
            return NOTHING
        return self._before_forward(unit, own)

    def _before_forward(self, unit: str, own: int) -> Iterator:
        if self.budget is not None:
            t0 = self.sim.t
            while self.device_bytes + own > self.budget and self.inflight:
                job = self.inflight[0]
                if self._stalled(job):  # this unit's own: its earlier pieces are out as far as they go
                    break
                # (a partial unit's pieces free their bytes one by one: room may come before the end)
                yield ("cond", lambda job=job: job.copy_done is not None or job.cancelled
                       or self.device_bytes + own <= self.budget
                       or self._stalled(job))  # fmt: skip
                if self.inflight and self.inflight[0] is job and (job.copy_done is not None or job.cancelled):
                    self.inflight.popleft()
            self.wait_s += self.sim.t - t0
        self._add(own)

    def _stalled(self, job: _Out) -> bool:
        """The worker cannot copy more of `job` until the forward saves its next piece (on CUDA
        pieces are copied as they come, on the CPU the unit's bytes in one memmove)."""
        return job.produced < len(job.pieces) + job.lag and (
            not self.sim.cuda or job.copied + job.lag >= job.produced
        )

    def after_forward(self, unit: str, part: int = 0) -> None:
        """Part `part` of the unit's forward (forward_parts) is done: at the first, its copy out
        is queued; a later part's bytes join it (the worker copies each once it exists)."""
        if part:
            job = self.out.get(unit)
            if job is not None:
                job.produced += 1
            return
        pol = self.policy(unit)
        if pol == GRAD_IN_FORWARD and unit in self.units:  # (h is freed: its gradients stay)
            self.device_bytes -= self.units[unit].loss_input
        while self.inflight and (self.inflight[0].copy_done is not None or self.inflight[0].cancelled):
            self.inflight.popleft()
        out = self._out_shape(unit)
        if out is not None:
            n, to_ssd, pieces, lag, parts = out
            job = _Out(unit, n, to_ssd, pieces=pieces, lag=lag, parts=parts)
            self.out[unit] = job
            self.queue.append(job)
            self.inflight.append(job)
            self.ready.pop(unit, None)
            self.reading.pop(unit, None)
            self.first_left.pop(unit, None)

    @per_unit
    def _out_shape(self, unit: str) -> Optional[tuple]:
        """What a unit's copy out moves (after_forward's job): (bytes, to SSD?, its pieces, the
        lag, its pieces' records); None where nothing leaves the device."""
        pol = self.policy(unit)
        to = CHECKPOINT_SWAPS.get(pol, pol)  # a swapped checkpoint moves as swapped bytes do
        n = self._held_in(unit) if pol in CHECKPOINT_SWAPS else self.act_bytes.get(unit, 0)
        if to not in ("host", "ssd") or n <= 0:
            return None
        window, sub = self._window_chunks(unit), self._sub_parts(unit)
        return (n, to == "ssd", window or tuple(sum(r) for _, r in sub) or self._swapped_pieces(unit),
                TAIL_PIECES - 1 if pol == TAIL else 0,
                () if window else tuple(r for _, r in sub) or self._swapped_parts(unit))  # fmt: skip

    # ---- backward ------------------------------------------------------------------------
    def before_backward(self, unit: str) -> Iterator:
        """At the unit's backward visit: fetch it and the next units' (within the budget), then
        wait for its own."""
        self._stage_after(unit)
        if self.reading:
            self._copy_up_read()
        self._fetch(unit, force=True)
        rest = self.rest.pop(unit, 0)  # (its other pieces' bytes come back during its backward)
        self._rest_up(unit, after_read=False)
        if not recomputes(self.policy(unit)):
            self._add(rest)
        else:  # what it recomputes is counted before any prefetch
            # (its inputs among them; a partial unit's pieces, fetched and recomputed one by one,
            # can hold less than all they moved: counted as one change, no passing peak)
            # (a partial_host_tail unit's last piece, kept since its forward, is among them)
            grow = rest + self._recomputed(unit) - self._held_in(unit) - self._tail(unit)
            # copies out still running (the replay starts a unit's copies at its forward's end, the
            # runtime as each tensor is saved): wait for them as the runtime's would have ended
            while self.budget is not None and self.device_bytes + grow > self.budget and self.inflight:
                job = self.inflight[0]
                yield ("cond", lambda job=job: job.copy_done is not None or job.cancelled
                       or self.device_bytes + grow <= self.budget)  # fmt: skip
                if self.inflight and self.inflight[0] is job and (job.copy_done is not None or job.cancelled):
                    self.inflight.popleft()
            self._add(grow)
        self.counted[unit] = self._recomputed(unit) if recomputes(self.policy(unit)) else self._kept(unit)
        if unit in self.units and self.units[unit].pieces and self.policy(unit) in PARTIAL:
            self._hold(unit, 0)  # (its first piece recomputed: see next_piece)
        self._prefetch_after(unit)
        r = self.ready.get(unit)
        if r is None and unit in self.out:  # fetched while its copy was running: ready when it ends
            yield ("cond", lambda: self.out[unit].copy_done is not None)
            self._fetch(unit, force=True)
            # (the pieces it sets to come back during its backward were not among what was
            # counted above: the fetch had not started then; counted now, or their release at
            # after_backward takes them from bytes never added)
            self._add(self.rest.pop(unit, 0))
            self._rest_up(unit, after_read=False)
            r = self.ready.get(unit)
        if r is not None:
            got, h2d, nbytes = r
            if not done_by((got,), self.sim.t):
                yield ("wait", (got,))
            if h2d:  # CUDA: copied up once the bytes are in host memory (the read's end)
                t = self.sim.h2d.submit(when(got), nbytes, write=False)
                self._rest_up(unit, after_read=True)  # (a partial unit's other pieces: not waited for)
                if t > self.sim.t:
                    yield ("until", t)
        self.out.pop(unit, None)
        self.ready.pop(unit, None)
        self.reading.pop(unit, None)

    def _rest_up(self, unit: str, after_read: bool) -> None:
        """A partial unit's pieces but the one its backward starts with are copied up from its
        backward on, behind that one, as the runtime fetches them one piece ahead of their
        recompute (runtime/activations/backward.py); queued at its prefetch they would hold the
        link ahead of the weights the units before it need first. Read from SSD (after_read),
        once its read is done; in host memory, now."""
        r = self.ready.get(unit)
        if unit in self.rest_up and r is not None and r[1] == after_read:
            self.sim.h2d.submit(self.sim.t, self.rest_up.pop(unit), write=False)

    def _stage_after(self, unit: str) -> None:
        """CUDA: the SSD units a prefetch tries next are read into host memory now (Swapper.stage;
        not a vertical window's, as ActivationManager.start_backward)."""
        sim, at = self.sim, self.backward_index[unit]
        for name in self.backward_order[at + 1 : at + self.prefetch + 1] if sim.cuda and self.to_ssd else ():
            job = self.out.get(name)
            if (job is not None and job.to_ssd and not job.back and name not in self.staged
                    and not self._window_chunks(name) and job.write_done is not None
                    and done_by((job.write_done,), sim.t)):  # fmt: skip
                self.staged[name] = sim.ssd.submit(sim.t, job.nbytes, write=False, key=f"act.{name}")
            if recomputes(self.policy(name)):
                break

    def _prefetch_after(self, unit: str) -> None:
        self.held_back = False
        after = self._after.get(unit)
        if after is None:
            i = self.backward_index[unit]
            after = self._after[unit] = self.backward_order[i + 1 : i + self.prefetch + 1]
        for name in after:
            # a unit still to recompute will hold all it saved at its backward, counted only
            # then: nothing beyond it is fetched now (its checkpoint is), as the runtime does
            if not self._fetch(name, force=False):
                self.held_back = True  # (the budget stopped it: see backward_parts)
                break
            if recomputes(self.policy(name)):
                break

    def after_backward(self, unit: str) -> None:
        """The unit's backward is done: its activations (and a recompute's inputs) are released."""
        self.device_bytes -= self.counted.pop(unit)

    @per_unit
    def _recomputed(self, unit: str) -> int:
        """What a recompute holds once it ran: all the unit saved, its inputs included (as the
        runtime counts it: planner/activations.py backward_bytes)."""
        u = self.units.get(unit)
        if u is not None and self.policy(unit) in PARTIAL:  # (piece by piece: backward_bytes)
            return backward_bytes(u, self.policy(unit))
        if u is not None and self.policy(unit) in NESTED:  # (its boundaries and one piece's)
            return u.nested()
        if u is not None:  # (a fused head's logits come one chunk at a time: ActUnit.recomputed)
            return u.recomputed()
        return max(self.act_bytes.get(unit, 0), self.inputs.get(unit, 0))

    @per_unit
    def _piece_bytes(self, unit: str) -> tuple[int, ...]:
        """What each piece of a partial unit moves (its inputs and kept outputs), forward order;
        () for any other unit."""
        u = self.units.get(unit)
        if u is None or not u.pieces or self.policy(unit) not in PARTIAL:
            return ()
        return tuple(p[1] + p[2] for p in u.pieces)

    def _swapped_pieces(self, unit: str) -> tuple[int, ...]:
        """The pieces whose bytes leave the device: a partial_host_tail unit's but its last
        TAIL_PIECES (kept on the device, see planner/activations.py's Note on the tail);
        _piece_bytes otherwise."""
        pieces = self._piece_bytes(unit)
        return pieces[:-TAIL_PIECES] if self.policy(unit) == TAIL else pieces

    def _swapped_parts(self, unit: str) -> tuple[tuple[int, ...], ...]:
        """Per swapped piece, its records' bytes in save order (its checkpoint, then the storages
        of its kept outputs: ActUnit.piece_kept): the worker copies them one by one, each freeing
        its device bytes when its copy ends, as the runtime's copies out do; () where the profile
        does not know them (a piece then leaves as one)."""
        u = self.units.get(unit)
        pieces = self._swapped_pieces(unit)
        if u is None or not pieces or len(u.piece_kept) != len(u.pieces):
            return ()
        return tuple(((p[1],) if p[1] else ()) + k for p, k in zip(u.pieces[: len(pieces)], u.piece_kept))

    def _tail(self, unit: str) -> int:
        """What a partial_host_tail unit keeps on the device from its forward to its backward."""
        u = self.units.get(unit)
        return u.tail if u is not None and self.policy(unit) == TAIL else 0

    @per_unit
    def _held_in(self, unit: str) -> int:
        """What a recomputing unit holds (or moves) between its forward and its backward: its
        inputs, and a partial unit's kept outputs (its pieces' inputs)."""
        u = self.units.get(unit)
        if u is not None:  # (a fused head's: its inputs and the loss's input, ActUnit.checkpoint)
            return u.moved(self.policy(unit))
        return self.inputs.get(unit, 0)

    def _fetch(self, unit: str, force: bool) -> bool:
        """Starts bringing `unit`'s activations back; False when the budget has no room for
        them (a prefetch waits for a later visit)."""
        job = self.out.get(unit)
        if unit in self.first_left:
            return self._fetch_left(unit, force)
        if job is None or unit in self.ready or job.back:
            return True
        sim = self.sim
        if not job.started:  # never left: the bytes are still on the device
            job.cancelled = True
            job.back = True
            self.queue = deque(j for j in self.queue if j is not job)
            self.inflight = deque(j for j in self.inflight if j is not job)
            self.ready[unit] = (sim.t, False, job.nbytes)
            return True
        if job.copy_done is None:  # copying now: continued when the copy ends (before_backward)
            return True
        recs = self._first_records(unit)
        first = sum(recs) if recs else job.nbytes
        now = first
        if not force and self.budget is not None and self.device_bytes + first > self.budget:
            # the runtime fetches record by record, last first, while they fit the budget
            # (backward.py `_fetch_unit`): its last records that fit now come back now, the rest
            # (the MLP's other records, the second norm's checkpoint) as room comes (_fetch_left);
            # stopped by the budget all the same, nothing after it is fetched (and a releasing
            # unit's backward runs in parts: backward_parts)
            now = last_first(recs, 0, self.budget - self.device_bytes)
            if now <= 0:
                return False
            self.first_left[unit] = first - now
        on_ssd = job.to_ssd and job.write_done is not None and done_by((job.write_done,), sim.t)
        h2d, done = sim.cuda, sim.t
        staged = self.staged.pop(unit, None)  # (read into host memory: copied up now, as from host)
        if staged is not None:
            read = done_by((staged,), sim.t)
            done, h2d = (sim.h2d.submit(sim.t, now, False), False) if read else (staged, True)
        elif on_ssd:
            done = sim.ssd.submit(sim.t, job.nbytes, False, f"act.{unit}")
        elif sim.cuda:  # in host memory: the copy up starts now, as the runtime's fetch starts it
            done, h2d = sim.h2d.submit(sim.t, now, False), False
        else:
            done = sim.t
        # (the other pieces, and the checkpoints fetched again after their next piece's argument
        # was derived from them: _rest_up; planner/activations.py, Note on the derived argument's source)
        again = sum(evicted(self.units[unit], self.policy(unit))) if unit in self.units else 0
        if sim.cuda and job.nbytes - first + again > 0:
            self.rest_up[unit] = job.nbytes - first + again
        job.back = True
        self._add(now)
        self.rest[unit] = job.nbytes - first
        if self._tail(unit) and isinstance(done, float):  # (see _tail_credit)
            done = max(sim.t, done - self._tail_credit(unit))
        self.ready[unit] = (done, h2d, now)
        if h2d:
            self.reading[unit] = None
        return unit not in self.first_left

    def _tail_credit(self, unit: str) -> float:
        """A partial_host_tail unit's backward starts with its kept pieces, and needs its swapped
        ones only once those are done: its backward time in the kept pieces that run before it
        reads a swapped byte (a piece whose input is derived from the previous piece's output
        recomputes that piece's checkpoint first: planner/activations.py, Note on the tail)."""
        u = self.units[unit]
        shares = self.backward_parts(unit)  # (last to first)
        kept, credit = len(u.pieces) - len(self._swapped_pieces(unit)), 0.0
        for k in range(kept):
            piece = u.pieces[len(u.pieces) - 1 - k]
            if piece[1] == 0 and k == kept - 1:  # (its input is made again from a swapped piece's)
                break
            credit += shares[k]
        work = self.sim.costs.backward_s[unit] + self.sim.costs.backward_visit_s + self.recompute_s(unit)
        return credit * work

    # ---- the activation worker -------------------------------------------------------------
    def worker(self) -> Iterator:
        sim = self.sim
        while True:
            if not self.queue:
                yield ("idle", self, sim)
                if not self.queue:
                    return
            job = self.queue.popleft()
            job.started = True
            if sim.cuda:
                for k, part in enumerate(job.pieces or (job.nbytes,)):
                    if k + job.lag >= job.produced:  # this piece's forward (or the lag's) has not run yet
                        yield ("cond", lambda job=job, k=k: job.produced > k + job.lag)
                    for rec in job.parts[k] if job.parts else (part,):  # (its records one by one)
                        done = sim.d2h.submit(sim.t, rec, False)
                        if done > sim.t:
                            yield ("until", done)
                        self.device_bytes -= rec  # this record's copy is out: its device bytes are free
                    job.copied += 1
            else:
                if job.produced < len(job.pieces) + job.lag:
                    yield ("cond", lambda job=job: job.produced >= len(job.pieces) + job.lag)
                yield ("cpu", job.nbytes / sim.costs.memcpy_bps)
                self.device_bytes -= job.nbytes  # the copy is out: the device bytes are free
            self.swapped_bytes += job.nbytes
            if job.to_ssd:
                job.write_done = sim.ssd.submit(sim.t, job.nbytes, True, f"act.{job.unit}")
            job.copy_done = sim.t


__all__ = ["ActReplay", "POLICIES"]
