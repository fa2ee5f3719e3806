"""A Plan as text for humans (Plan.describe): the settings line, the budgets, one line per unit,
the frozen segment, the activation policies and where each unit's saved bytes go, the notes.

Pure (no torch).
"""

from __future__ import annotations

from .activations import sized_split
from .spec import fmt_bytes


def describe_budgets(plan) -> str:
    b = plan.budgets
    if b is None:
        return "none"
    if b.activation_bytes is None:
        return f"device {fmt_bytes(b.device_bytes)} (activations not counted), host {fmt_bytes(b.host_bytes)}"
    return (f"device {fmt_bytes(b.device_bytes)} (buffers {fmt_bytes(b.buffer_bytes)}, activations "
            f"{fmt_bytes(b.activation_bytes)}), host {fmt_bytes(b.host_bytes)}")  # fmt: skip


def describe(plan) -> str:
    """A table for humans: one line per unit."""
    w = max([28] + [len(u.name) for u in plan.units])
    lines = [
        f"plan: device={plan.device} compute={plan.compute_dtype} prefetch_depth={plan.prefetch_depth} "
        f"optim_prefetch_depth={plan.optim_prefetch_depth} accumulate={plan.accumulate_grads} "
        f"deferred_update={plan.deferred_update}{' (speculative)' if plan.speculative else ''} "
        f"fill_gaps={plan.fill_gaps}"
        + (f" grads={plan.grad_dtype}" if plan.persistent_grads or plan.compute_dtype != "fp32" else "")
        + (
            f" (a window's: {plan.window_grad_dtype})"
            if plan.vertical and plan.window_grad_dtype != plan.grad_dtype
            else ""
        )
        + (f" ranks={plan.ranks} (each keeps 1/{plan.ranks} of the state)" if plan.ranks > 1 else ""),
        f"  budgets: {describe_budgets(plan)}; resident: device {fmt_bytes(plan.resident_device_bytes())}, "
        f"host {fmt_bytes(plan.resident_host_bytes())}; ssd {fmt_bytes(plan.ssd_bytes())}",
        f"  {'unit':<{w}} {'trainable':>12} {'frozen':>12} {'weights':>8} {'master':>8} {'moments':>8} "
        f"{'grads':>8} {'frozen at':>9}",
    ]
    for u, p in plan:
        grads = p.grads.value if plan.persistent_grads else "-"
        frozen_at = plan.frozen_home(p).value if u.frozen_numel else "-"
        lines.append(
            f"  {u.name:<{w}} {u.numel:>12,} {u.frozen_numel:>12,} {p.weights.value:>8} {p.master.value:>8} "
            f"{p.moments.value:>8} {grads:>8} {frozen_at:>9}"
        )
    frozen = sum(u.frozen_numel for u in plan.units)
    if frozen:
        trainable = sum(u.numel for u in plan.units)
        rest = plan.ssd_footprint_bytes() - plan.frozen_ssd_bytes()
        lines.append(
            f"  frozen: {frozen:,} parameters, {fmt_bytes(sum(u.frozen_bytes(plan.compute_dtype) for u in plan.units))} "
            f"read-only ({fmt_bytes(plan.frozen_ssd_bytes())} on SSD); trainable: {trainable:,} parameters with "
            f"master, moments and gradients; on SSD in all {fmt_bytes(plan.ssd_footprint_bytes())}: the frozen "
            f"base and {rest / max(1, trainable):.1f} B per trainable parameter"
        )
    if plan.activations and set(plan.activations) != {"keep"}:
        act = plan.budgets.activation_bytes if plan.budgets is not None else None
        budget = fmt_bytes(act) if act else "none"
        lines.append(
            f"  activations (budget {budget}): "
            + ", ".join(f"{u.name}={a}" for u, a in zip(plan.units, plan.activations))
        )
        lines.extend(_activation_split(plan))
    lines.extend(f"  note: {n}" for n in plan.notes)
    return "\n".join(lines)


def _activation_split(plan) -> list[str]:
    """Per unit (runs of alike units on one line), where its saved bytes are between its
    forward and its backward (planner/activations.py split_bytes)."""
    if not plan.activation_sizes or not plan.activations:
        return []
    rows: list[list] = []  # [first, last, count, policy, sizes]
    for u, a, sz in zip(plan.units, plan.activations, plan.activation_sizes):
        if rows and rows[-1][3] == a and rows[-1][4] == sz:
            rows[-1][1] = u.name
            rows[-1][2] += 1
        else:
            rows.append([u.name, u.name, 1, a, sz])
    w = max(14, *(len(r[3]) for r in rows))  # (partial_last_refetch_host: 25 characters)
    out = [f"  {'activations per unit':<40} {'policy':>{w}} {'saved':>10} {'kept':>10} {'host':>10} "
           f"{'ssd':>10} {'recomputed':>10}"]  # fmt: skip
    totals = {"kept": 0, "host": 0, "ssd": 0, "recomputed": 0}
    for first, last, n, a, sizes in rows:
        name = first if n == 1 else f"{first} .. {last} ({n})"
        saved = sizes[0]
        sp = sized_split(sizes, a if a != "auto" else "keep")
        for k in totals:
            totals[k] += n * sp[k]
        out.append(f"  {name:<40} {a:>{w}} {fmt_bytes(saved):>10} {fmt_bytes(sp['kept']):>10} "
                   f"{fmt_bytes(sp['host']):>10} {fmt_bytes(sp['ssd']):>10} {fmt_bytes(sp['recomputed']):>10}")  # fmt: skip
    out.append(f"  {'total':<40} {'':>{w}} {'':>10} {fmt_bytes(totals['kept']):>10} "
               f"{fmt_bytes(totals['host']):>10} {fmt_bytes(totals['ssd']):>10} {fmt_bytes(totals['recomputed']):>10}")  # fmt: skip
    return out
