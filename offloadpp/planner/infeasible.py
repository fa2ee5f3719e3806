"""Why nothing fits: the search's error when no plan fits the budgets (search.py). Pure."""

from __future__ import annotations

from typing import Optional

from .act_candidates import ActPlanner
from .activations import peak_bytes_at
from .keep import keep
from .model_profile import ModelProfile
from .peaks import peak_bytes
from .plan import InfeasibleError, Plan, PlanError, fmt_bytes
from .request import Request
from .ssd_room import ssd_need_bytes


def raise_infeasible(smallest: Optional[Plan], req: Request, acts: ActPlanner, model: ModelProfile) -> None:
    """Raise the InfeasibleError that says how many bytes each budget lacks for the smallest
    working set `smallest` (k = 0, q = 0), which unit makes it that large, and where the
    activations are what does not fit, the largest micro-batch whose activations would."""
    if smallest is None:
        raise PlanError("no prefetch depths to try")
    dev0, host0 = peak_bytes(smallest)
    cdt = smallest.compute_dtype
    biggest = max(smallest.units, key=lambda u: u.master_bytes)
    b = req.budgets
    parts = []
    # (with each derived argument's source held: the refetching twin's choices make no point run
    # that does not without them, search.least_need)
    least = acts.least_held if req.counted else None
    act_need = least.need_bytes if least is not None else 0
    largest_batch = None
    if dev0 + act_need > b.device_bytes or act_need > req.act_cap:
        miss = max(dev0 + act_need - b.device_bytes, act_need - req.act_cap)
        msg = (f"the device budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(b.device_bytes)}, "
               f"streaming with prefetch depth {smallest.prefetch_depth} needs {fmt_bytes(dev0)} of buffers")  # fmt: skip
        if least is not None:
            # the unit that holds the most at once under that choice (a head's logits and their
            # gradient can pass a block's saved bytes: planner/activations.py, Note on the head's loss)
            pol = least.as_dict()
            top = max(acts.units, key=lambda u: peak_bytes_at(u, pol[u.name]))
            msg += (f" and the saved activations at least {fmt_bytes(act_need)} at micro-batch {model.micro_batch} "
                    f"(every unit swapped that can be, partial or recomputed piece by piece where a piece at a time holds less; the largest, "
                    f"{top.name!r}, holds {fmt_bytes(peak_bytes_at(top, pol[top.name]))} at once)")  # fmt: skip
            if req.budgets.activation_bytes is not None and act_need > req.act_cap:
                msg += f", above the activation budget of {fmt_bytes(req.act_cap)}"
            # activations grow with the micro-batch (tokens), the buffers do not
            room = min(req.act_cap, b.device_bytes - dev0)
            if dev0 < b.device_bytes and act_need > 0:
                largest_batch = int(room * model.micro_batch // act_need)
                msg += (f". The largest micro-batch that fits is {largest_batch}" if largest_batch >= 1 else
                        ". No micro-batch fits")  # fmt: skip
            per_sample = -(-act_need // model.micro_batch)
            msg += (f"; at micro-batch {model.micro_batch} the device budget must be at least "
                    f"{fmt_bytes(dev0 + act_need)} ({dev0 + act_need} bytes), at micro-batch 1 "
                    f"{fmt_bytes(dev0 + per_sample)}")  # fmt: skip
        parts.append(msg)
    if host0 > b.host_bytes:
        miss = host0 - b.host_bytes
        parts.append(
            f"the host budget is short by {fmt_bytes(miss)} ({miss} bytes): it is {fmt_bytes(b.host_bytes)}, "
            f"the optimizer's working set with read-ahead {smallest.optim_prefetch_depth} needs "
            f"{fmt_bytes(host0)}"
        )
    if not parts and req.ssd_free_bytes is not None:
        need = all_kept_ssd_bytes(smallest, req)
        miss = need - req.ssd_free_bytes
        parts.append(
            f"the SSD space is short by {fmt_bytes(miss)} ({miss} bytes): {fmt_bytes(req.ssd_free_bytes)} free, "
            f"the state that does not fit in memory needs {fmt_bytes(need)} (with its margin, and a second "
            "generation where updates run during backward)"
        )
    raise InfeasibleError(
        "no plan fits the budgets: " + "; ".join(parts) + f". The largest unit is {biggest.name!r} "
        f"({biggest.numel:,} parameters: {fmt_bytes(biggest.weights_bytes(cdt))} of {cdt} weights, "
        f"{fmt_bytes(biggest.master_bytes + biggest.moments_bytes)} of master weights and moments).",
        largest_micro_batch=largest_batch if largest_batch is not None and parts[1:] == [] else None,
        device_bytes_needed=dev0 + act_need,
    )


def all_kept_ssd_bytes(plan: Plan, req: Request) -> int:
    """The free SSD space (ssd_room.ssd_need_bytes) the plan that keeps the most in memory (keep.py's
    rule) at these depths needs."""
    return ssd_need_bytes(keep(plan, req.budgets.device_bytes, req.budgets.host_bytes))
