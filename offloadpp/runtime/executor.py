"""Walking the schedule: module and autograd hooks that fetch, bind and release unit weights.

Note: the hooks. The user's model is not changed. A forward pre-hook on each unit's root modules
enters the unit's forward visit; a forward post-hook registers a grad hook on the unit's outputs
that enters its backward visit when their gradient arrives (before the unit's own backward
runs); a post-accumulate-grad hook on each parameter counts the unit's gradients and hands the
unit to the optimizer when the last one lands. Entering visit i makes the held weights equal to
`alive[i]`: what is no longer needed is released, what is needed next is fetched (k ahead).

Note: saved tensors. Autograd keeps, for backward, tensors that are parameters or views of them
(GPT-2's Conv1D saves its weight; F.linear saves weight.t()). Those would pin the weights in
memory from forward to backward, and would break when a unit's buffer is released and fetched
again into another buffer. A saved-tensor pack hook therefore replaces any tensor that lies in
a bound unit's weights by a ParamRef (unit, offset, size, stride), and the unpack hook rebuilds
the view from whatever buffer holds the unit's weights at that point of backward (fetching them
if the schedule did not: a miss, counted). Activations pass through untouched.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_leaves

from offloadpp.planner import Schedule

from .memory import timed_elsewhere
from .optimizer import OptimizerPipeline
from .slots import Hold
from .unit import Unit, UnitPhase, UnitStateError

log = logging.getLogger("offloadpp.runtime")


class ParamRef:
    """A saved tensor that is a view of a unit's weights, by position rather than by buffer."""

    __slots__ = ("unit", "offset", "size", "stride", "frozen")

    def __init__(self, unit: Unit, offset: int, size, stride, frozen: bool = False):
        self.unit = unit
        self.offset = offset
        self.size = size
        self.stride = stride
        self.frozen = frozen  # a view of the unit's frozen segment (docs/frozen.md)


def _param_hook(executor: Executor, unit: str):
    """A post-accumulate-grad hook that reaches the executor through a weak reference.

    Note: why weak. A parameter's hooks are kept alive from torch's C++ side, where the garbage
    collector cannot see them; a strong reference there keeps the whole engine (its threads,
    files and buffers) alive after the user dropped it without close(). The module hooks are
    ordinary Python references and need no such care."""
    ref = weakref.ref(executor)

    def hook(param) -> None:
        ex = ref()
        if ex is not None and id(param) not in ex.summed:
            ex.param_grad_done(ex._by_name[unit])

    return hook


class Executor:
    handle = ParamRef  # what pack returns for a saved weight (the activation manager's `params`)

    def __init__(self, schedule: Schedule, units: list[Unit], optimizer: OptimizerPipeline):
        """optimizer: what the hooks hand each unit's complete gradients to (on_grads), and ask
        at each visit: reap finished jobs, start the pending updates of units about to be fetched
        and finish a unit's before its weights are bound (runtime/pending.py), start the queued
        writes once the first fetches are issued, whether this backward ends in an update."""
        self.schedule = schedule
        self.units = units
        self._by_name = {u.name: u for u in units}
        self.optimizer = optimizer
        self.cursor = -1
        self.in_backward = False
        self.held: list[Unit] = []  # units with a COMPUTE hold on their weights
        self.bound: list[tuple[int, int, Unit, bool]] = []  # (start, end) addresses of bound weights, frozen?
        self.wait_s = 0.0
        self.misses = 0
        self._warned_order = False
        self._in_root_forward = False  # inside a forward of the whole model (root module hooks)
        self.window = None  # a vertical window's forward (runtime/window.py), while it runs
        # ids of the parameters whose gradients a vertical window's backward sums in fp32 and
        # counts itself (runtime/window_grads.py): their AccumulateGrad hooks are not theirs
        self.summed: frozenset = frozenset()
        # units whose weights (== master) backward leaves held for the next forward, where that
        # forward applies their pending update (runtime/pending.py's Note on memory)
        self.keep_across: frozenset = (
            schedule.next_keep if optimizer.lazy and not optimizer.separate else frozenset()
        )
        # Per visit, the units `alive` holds, in the order they are needed (units the schedule
        # keeps between two uses last: they are held already).
        self._fetch_order = []
        for i in range(len(schedule.visits)):
            names: list[str] = []
            for v in schedule.visits[i:]:
                names.extend(n for n in v.needs if n not in names and n in schedule.alive[i])
            names.extend(sorted(schedule.alive[i] - set(names)))
            self._fetch_order.append(tuple(names))
        self._handles = []

    # ---- installing the hooks -----------------------------------------------------------------
    def install(self, modules: dict) -> None:
        root = modules[""]
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(root.register_forward_hook(self._root_post_forward))
        for u in self.units:
            for q in u.layout.unit.modules:
                m = modules[q]
                self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
                self._handles.append(m.register_forward_hook(functools.partial(self._post_forward, u)))
            for p, _ in u.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(_param_hook(self, u.name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- the walk ------------------------------------------------------------------------
    def start_forward(self) -> None:
        self.cursor = -1
        self.in_backward = False

    def start_backward(self) -> None:
        self.in_backward = True

    def end_backward(self) -> None:
        self.in_backward = False
        for u in list(self.held):
            self._drop(u)

    def release_all(self) -> None:
        for u in list(self.held):
            self._drop(u)
        self.cursor = -1

    def enter(self, i: int) -> None:
        """Visit i starts: hold alive[i] (fetching what is new), bind what visit i needs."""
        t_enter = time.perf_counter()
        with timed_elsewhere():  # (the pools' waits in here are this hook's)
            self._enter(i)
        self.wait_s += time.perf_counter() - t_enter  # all of it is time the device did not compute
        self.cursor = i

    def _enter(self, i: int) -> None:
        self.optimizer.reap()
        v = self.schedule.visits[i]
        want = self.schedule.alive[i]
        with record_function("offloadpp::fetch"):
            for u in list(self.held):
                if u.name not in want:
                    self._drop(u)
            # The pending updates go after the drops (their buffers are the fetch's). A master
            # that is the weights is one slot: the fetch holds it first, else an update holding
            # it alone could finish, write it and give it back before the fetch held it, and the
            # fetch would read it again (a read the schedule and the cost model do not make). A
            # separate compute copy is the update's product: fetched after it. Where the update
            # is still to be submitted here (u.pending), the copy's buffer is taken first and
            # marked as one the update overwrites whole (no read; the update fills it and the
            # bind waits for it), for the same reason: a quick update could otherwise write it
            # back and give it up before the fetch held it.
            fetch = [self._by_name[n] for n in self._fetch_order[i]]
            made = [u for u in fetch if u.master is not u.compute and u.pending is not None]
            for u in made:
                u.compute.acquire(Hold.NEXT, overwrite=True)
            for aliased in (True, False):
                for u in fetch:
                    if (u.master is u.compute) == aliased and all(u is not h for h in self.held):
                        u.weights.acquire()
                        self.held.append(u)
                if aliased:
                    self.optimizer.apply_pending(self._fetch_order[i])
            for u in made:
                u.compute.release(Hold.NEXT)  # (held now by the fetch and the update)
            for u in self.held:
                u.weights.pump()
        if self.in_backward or i >= min(self.schedule.prefetch_depth, self.schedule.num_forward - 1):
            self.optimizer.flush_writes()
        # The updated weights kept for this forward (schedule.next_keep): held now by the
        # schedule, or from their first holding visit on (not needed before).
        for name, t in self.schedule.next_keep_until.items() if not self.in_backward else ():
            u = self._by_name[name]
            if i >= t or any(u is h for h in self.held):
                u.compute.release(Hold.NEXT)
        with record_function("offloadpp::wait_weights"):
            for name in v.needs:
                self._bind(self._by_name[name])

    def _bind(self, u: Unit) -> None:
        if not u.bound:
            self.optimizer.wait_pending(u)
            u.bind()
            self.bound.extend((start, end, u, frozen) for start, end, frozen in u.flat_ranges())

    def _drop(self, u: Unit) -> None:
        if (
            self.in_backward
            and u.name in self.schedule.keep_until_update
            and u.phase not in (UnitPhase.UPDATING, UnitPhase.UPDATED)
            and self.optimizer.boundary  # (this backward ends in an update)
        ):
            u.master.acquire(Hold.OPTIM)  # == its weights: its update needs them (schedule.py)
        # (a speculating step keeps spec_next_keep after its updates, as before)
        opt = self.optimizer
        if self.in_backward and u.name in self.keep_across and opt.boundary and not opt.speculating:
            u.compute.acquire(Hold.NEXT)  # (released as the next forward first holds it)
        if u.bound:
            u.unbind()
            self.bound = [b for b in self.bound if b[2] is not u]
        u.weights.release()
        self.held = [h for h in self.held if h is not u]

    def ensure(self, u: Unit, frozen: bool = False) -> torch.Tensor:
        """The unit's weights for backward (its frozen segment's, if `frozen`), fetched now if
        the schedule has not (a miss). The frozen segment may be read after the unit's update
        started (a frozen weight's input gradient after the adapter's gradients): no update
        writes it."""
        if not frozen:
            u.check_usable_in_backward()
        if not u.bound:
            self.misses += 1
            if not self._warned_order:
                log.warning(
                    "unit %r was needed in backward but not prefetched (visit order differs "
                    "from the plan's); fetching it now",
                    u.name,
                )
                self._warned_order = True
            t0 = time.perf_counter()
            with timed_elsewhere():
                if all(u is not h for h in self.held):
                    u.weights.acquire()
                    self.held.append(u)
                self._bind(u)
            self.wait_s += time.perf_counter() - t0
        return u.flat_of(frozen)

    # ---- hooks ---------------------------------------------------------------------------
    def _root_pre_forward(self, module, args):
        self.start_forward()
        self._in_root_forward = True
        return None

    def _root_post_forward(self, module, args, output):
        self._in_root_forward = False
        return None

    def _pre_forward(self, u: Unit, module, args):
        if self.in_backward:
            self._recompute(u)
            return None
        pos = self.schedule.forward_index[u.name]
        if self.window is not None:
            self.window.arrive(pos)  # the switch point: every micro-batch before unit u first
        if pos < self.cursor and self._in_root_forward:
            self._in_root_forward = False
            raise UnitStateError(
                f"unit {u.name!r} (module {type(module).__name__}) ran a second time in one forward pass, after "
                f"{self.schedule.visits[self.cursor].needs[0]!r}; offloadpp's schedule visits each unit once per "
                "forward. A module called from two places (e.g. an encoder-decoder's shared embedding) must be "
                "inside one unit with everything between its calls (Settings.units)"
            )
        if pos < self.cursor:  # a forward of part of the model, called directly: a new walk
            self.start_forward()
        if pos > self.cursor:
            if pos != self.cursor + 1 and self.cursor >= 0 and not self._warned_order:
                log.warning("forward ran unit %r out of the planned order", u.name)
                self._warned_order = True
            self.enter(pos)
            u.phase = UnitPhase.FORWARD
            if torch.is_grad_enabled():
                u.start_backward()  # its parameters' gradients are expected in this backward
        else:  # a second root module of the same unit, a re-run, or a window's next micro-batch
            self._pump_held()
            for name in self.schedule.visits[pos].needs:
                self.ensure_forward(self._by_name[name])
        return None

    def _pump_held(self) -> None:
        """Starts the device copies of the held units whose reads are in. Entering a visit pumps
        them; a vertical window's visit runs G micro-batches, so each one reaching the unit pumps
        too, and a unit fetched ahead is copied up within the visit its read ends in, not at its
        own (planner/simulate.py Sim.compute replays it so)."""
        for u in self.held:
            u.weights.pump()

    def _recompute(self, u: Unit) -> None:
        """The model runs unit u's forward again during backward (its own activation
        checkpointing, e.g. Hugging Face gradient checkpointing): u's backward starts now, so
        its backward visit is entered (fetching ahead as the schedule says) if it was not yet.
        With reentrant checkpointing the first forward ran without autograd, so the unit expects
        its gradients only from here."""
        pos = self.schedule.backward_index[u.name]
        if pos > self.cursor:
            self.enter(pos)
        else:
            for name in self.schedule.visits[pos].needs:
                self.ensure_forward(self._by_name[name])
        if torch.is_grad_enabled() and u.grads_pending == 0 and u.phase is UnitPhase.FORWARD:
            u.start_backward()
        u.phase = UnitPhase.BACKWARD

    def ensure_forward(self, u: Unit) -> None:
        if not u.bound:
            self.misses += 1
            if all(u is not h for h in self.held):
                u.weights.acquire()
                self.held.append(u)
            self._bind(u)

    def _post_forward(self, u: Unit, module, args, output):
        if torch.is_grad_enabled():
            # The first gradient to reach any output enters the backward visit (entering is
            # idempotent, so a plain hook per output does what a multi-grad "any" hook would).
            hook = functools.partial(self._pre_backward, u)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        return None

    def _pre_backward(self, u: Unit, grad) -> None:
        pos = self.schedule.backward_index[u.name]
        if pos > self.cursor:
            self.enter(pos)
            u.phase = UnitPhase.BACKWARD
        else:  # another output's gradient: a window's next micro-batch reaching the unit
            self._pump_held()

    def backward_reaches(self, name: str) -> None:
        """Backward reached unit `name` other than through its outputs' gradient (the fused
        head: runtime/activations/head.py): its backward visit is entered now."""
        self._pre_backward(self._by_name[name], None)

    def param_grad_done(self, u: Unit) -> None:
        """One of u's parameters has its gradient for this backward."""
        u.grads_pending -= 1
        if u.grads_pending == 0:
            self.optimizer.on_grads(u)

    # ---- saved tensors -------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if self.bound and t.dtype.is_floating_point:
            ptr = t.data_ptr()
            for start, end, u, frozen in self.bound:
                if start <= ptr < end:
                    if t.dtype != u.flat_of(frozen).dtype:
                        return t
                    return ParamRef(u, (ptr - start) // t.element_size(), t.size(), t.stride(), frozen)
        return t

    def unpack(self, x):
        if type(x) is ParamRef:
            flat = self.ensure(x.unit, x.frozen)
            return torch.as_strided(flat, x.size, x.stride, flat.storage_offset() + x.offset)
        return x
