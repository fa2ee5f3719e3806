"""The budgets of a run (the resolve stage's first step, planner/resolve.py): the settings'
requests ("auto" = None) turned into byte budgets for the machine; resolve.py's module Note says
how "auto" budgets are sized. Pure.
"""

from __future__ import annotations

from typing import Optional

from .decide import DEFAULT_OPTIM_PREFETCH, prefetch_depth
from .default import plan_shape, streaming_plan
from .machine import Machine
from .model_profile import ModelProfile
from .peaks import peak_bytes
from .plan import PlanError, UnitSpec, fmt_bytes
from .request import Request
from .search import act_planner
from .spec import PLAN_AUTO, Budgets, Settings

DEVICE_SHARE_CUDA = 0.8
DEVICE_SHARE_CPU = 0.25
HOST_SHARE = 0.5
READ_AHEAD_HOST_SHARE = 0.25
DEFERRED_PARTIAL_PREFETCH = 0


def check_asked_budgets(settings: Settings, m: Machine) -> None:
    """A budget is a promise the engine keeps by waiting or raising rather than allocating past
    it, so one above what the machine has in all (1e30, "999TiB") is no limit at all: the run
    would page or be killed instead. Refused, naming the field, the value and the machine's
    memory; a budget above what is free now but within the total is the user's call."""
    host_total = m.host_total_bytes
    dev_total = m.device_total_bytes if m.device == "cuda" else host_total
    dev_what = "device memory" if m.device == "cuda" else "RAM (the CPU is the device)"
    dev_free = m.device_free_bytes if m.device == "cuda" else m.host_available_bytes
    asked = (
        ("device_budget_bytes", settings.device_budget_bytes, dev_total, dev_what, dev_free),
        ("host_budget_bytes", settings.host_budget_bytes, host_total, "RAM", m.host_available_bytes),
        ("activations.budget_bytes", settings.activations.budget_bytes, dev_total, dev_what, dev_free),
        ("activations.host_budget_bytes", settings.activations.host_budget_bytes, host_total, "RAM",
         m.host_available_bytes),
    )  # fmt: skip
    for name, value, total, what, free in asked:
        if value is not None and total is not None and value > total:
            free_s = f", {fmt_bytes(free)} free now" if free is not None else ""
            raise PlanError(
                f"{name}: {value} bytes ({fmt_bytes(value)}) is more than this machine has: {fmt_bytes(total)} of "
                f'{what}{free_s}; set it at most that, or "auto"'
            )


def budgets_for(settings: Settings, units: tuple[UnitSpec, ...], m: Machine,
             model: Optional[ModelProfile], window: int = 1) -> tuple[Budgets, Settings]:  # fmt: skip
    """The budgets for the settings' requests (the module Note), and the settings with the
    optimizer read-ahead they were sized for. With a model profile the device budget counts the
    activations; activation_bytes is then left for the planner to split (None here) unless the
    settings cap it."""
    dev, host = settings.device_budget_bytes, settings.host_budget_bytes
    cap = settings.activations.budget_bytes
    machine_dev = (
        int(m.device_free_bytes * DEVICE_SHARE_CUDA)
        if m.device == "cuda"
        else int(m.host_available_bytes * DEVICE_SHARE_CPU)
    )
    stream_dev = dev is None and settings.offload_params
    stream_host = host is None and settings.offload_optimizer
    if stream_dev or stream_host:
        k = prefetch_depth(settings)
        need_dev, need_host, q = _streaming_need(settings, units, m, k, window)
        if settings.optim_prefetch_depth is None and stream_host and settings.plan != PLAN_AUTO:
            # (plan "auto" leaves the read-ahead to the search, which also tries the one the
            # host budget was sized for: search._depths; fixed here, it hid shallower ones that
            # fit the same budget and ran faster: tests/test_planner_properties.py)
            settings = settings.model_copy(update={"optim_prefetch_depth": q})
        if stream_dev:
            if model is None:
                dev = need_dev + (cap or 0)
            else:
                # the buffers streaming needs, and room for keeping every activation (within
                # the activation budget), as far as the device has it
                acts = act_planner(model, Request(Budgets(1, 1), settings), m.device)
                want = min(cap if cap is not None else acts.keep_all.need_bytes, acts.keep_all.need_bytes)
                dev = min(need_dev + want, max(machine_dev, need_dev + 1))
        if stream_host:
            host = need_host
    if dev is None:
        dev = machine_dev
    if host is None:
        host = int(m.host_available_bytes * HOST_SHARE)
    if cap is not None and cap >= dev:
        raise PlanError(
            f"activations.budget_bytes ({cap}) must be less than the device budget ({dev} bytes): the saved "
            "activations are a part of the device budget, the runtime's buffers need the rest"
        )
    budgets = Budgets(device_bytes=dev, host_bytes=host, activation_bytes=cap)
    return budgets, settings


def _streaming_need(settings: Settings, units, m: Machine, k: int, window: int = 1) -> tuple[int, int, int]:
    """(device, host, q): the streaming plan's peaks at the read-ahead q resolve picks (the
    module Note: every unit when that fits READ_AHEAD_HOST_SHARE of host memory, else
    DEFERRED_PARTIAL_PREFETCH, for deferred updates; DEFAULT_OPTIM_PREFETCH otherwise)."""
    top = max(0, len(units) - 1)
    shape = dict(plan_shape(settings), micro_batches=window)  # (a vertical window's: Request.window)

    def needs(q: int) -> tuple[int, int]:
        return peak_bytes(
            streaming_plan(units, device=m.device, prefetch_depth=k, optim_prefetch_depth=q, **shape)
        )

    if settings.optim_prefetch_depth is not None:
        q = settings.optim_prefetch_depth
    elif settings.deferred_update:
        q = (
            top
            if needs(top)[1] <= m.host_available_bytes * READ_AHEAD_HOST_SHARE
            else min(DEFERRED_PARTIAL_PREFETCH, top)
        )
    else:
        q = min(DEFAULT_OPTIM_PREFETCH, top)
    dev, host = needs(q)
    return dev, host, q
