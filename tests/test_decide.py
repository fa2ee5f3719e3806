"""planner/decide.py: each plan-time decision made once, and docs/runtime.md's table of them
("Decided once") naming functions that exist."""

from __future__ import annotations

import importlib
import re
from dataclasses import replace
from pathlib import Path

from offloadpp.planner import Settings, decide
from offloadpp.planner.default import default_plan, min_budgets, plan_shape
from offloadpp.planner.plan import UnitSpec
from offloadpp.planner.spec import Budgets

DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
UNITS = (UnitSpec("embed", 1000), UnitSpec("h.0", 3000), UnitSpec("h.1", 3000), UnitSpec("head", 500))


def test_clipping_and_speculation():
    assert not decide.clipping(Settings())
    assert decide.clipping(Settings(gradient_clipping=1.0))
    assert not decide.speculates(Settings())  # nothing deferred: nothing to speculate
    assert decide.speculates(Settings(gradient_clipping=1.0))
    assert decide.speculates(Settings(compute_dtype="fp16"))
    assert not decide.speculates(Settings(gradient_clipping=1.0, speculate="off"))
    shape = plan_shape(Settings(gradient_clipping=1.0))
    assert shape["clipping"] and shape["speculative"] and shape["deferred_update"]


def test_updates_overlap_backward_only_where_that_can_pay():
    """overlap_share bounds what running updates during backward can save by the optimizer's
    share of a step's bytes; overlap_pays holds it to the cost model's prediction error (the
    accuracy bench's bar), for speculate "auto" only."""
    assert decide.overlap_share(UNITS, "fp32") == 28 / 36  # no frozen parameters: 28 B against 2 x 4
    assert decide.overlap_share(UNITS, "bf16") == 30 / 34  # (its 16-bit copy written; weights 2 x 2)
    lora = tuple(UnitSpec(u.name, u.numel // 100, frozen_numel=u.numel) for u in UNITS)
    assert decide.overlap_share(lora, "fp32") < 0.04 < decide.PREDICTION_ERROR
    for s in (Settings(), Settings(gradient_clipping=1.0), Settings(compute_dtype="fp16")):
        assert decide.overlap_pays(s, UNITS)
        assert not decide.overlap_pays(s, lora)
    assert decide.overlap_pays(Settings(gradient_clipping=1.0, speculate="on"), lora)
    assert decide.overlap_pays(Settings(speculate="off"), lora)  # (the settings decide, not the planner)
    # where the share crosses the error: trainable state about 5% of the base's parameters in fp32
    edge = tuple(UnitSpec(u.name, u.numel // 20, frozen_numel=u.numel) for u in UNITS)
    assert decide.overlap_pays(Settings(), edge) == (decide.overlap_share(edge, "fp32") >= 0.15)
    from offloadpp.bench.planner_accuracy import BAR

    assert decide.PREDICTION_ERROR == BAR
    # updates deferred on purpose never speculate
    assert not decide.speculates(Settings(gradient_clipping=1.0, defer_updates=True))
    assert Settings(defer_updates=True).deferred_update and not Settings().deferred_update


def test_defaults_where_the_settings_leave_them():
    assert decide.prefetch_depth(Settings()) == decide.DEFAULT_PREFETCH
    assert decide.prefetch_depth(Settings(prefetch_depth=1)) == 1
    assert decide.optim_prefetch_depth(Settings()) == decide.DEFAULT_OPTIM_PREFETCH
    assert decide.optim_prefetch_depth(Settings(optim_prefetch_depth=0)) == 0
    assert decide.adam_threads(Settings(), cores=7) == 7
    assert decide.adam_threads(Settings(adam_threads=2), cores=7) == 2


def test_pending_updates_at_the_next_visit_one_rank_deferred():
    s = Settings(gradient_clipping=1.0, speculate="off")
    dev, host = min_budgets(UNITS, device="cpu", **plan_shape(s), prefetch_depth=2)
    cpu = default_plan(UNITS, device="cpu", settings=s, budgets=Budgets(dev, host))
    assert decide.lazy_runtime(cpu) and decide.lazy_applies(cpu)
    # on CUDA too: the device copy is made once the update made the weights (Slot.updating)
    cuda = replace(cpu, device="cuda")
    assert decide.lazy_runtime(cuda) and "next visit" in decide.deferred_where(cuda)
    assert not decide.lazy_runtime(
        default_plan(UNITS, device="cpu", settings=Settings(), budgets=Budgets(dev, host))
    )


def test_the_docs_table_names_functions_that_exist():
    text = DOC.read_text()
    table = text[text.index("## Decided once") :].split("\n## ")[0]
    named = re.findall(r"`(planner/[\w/]+)\.py` `(\w+)`", table)
    assert len(named) >= 6, named
    for path, fn in named:
        mod = importlib.import_module("offloadpp." + path.replace("/", "."))
        assert callable(getattr(mod, fn, None)), f"{path}.py has no {fn}"
        for more in re.findall(rf"`{path}\.py` `{fn}`, `(\w+)`", table):
            assert callable(getattr(mod, more, None)), f"{path}.py has no {more}"


def _measured(n_blocks: int = 4):
    from offloadpp.runtime.activations.policy import UnitActProfile

    mb = 1 << 20
    return [UnitActProfile("embed", 1 * mb, 0.0)] + [
        UnitActProfile(f"b{i}", 10 * mb, 1e9) for i in range(n_blocks)
    ]


def test_auto_from_what_the_first_step_measured():
    """A plan without a model profile leaves "auto" to the first step's measured sizes:
    decided here by the default plan's rule (activation_choice): keep what fits along the
    FLOPs-per-byte ranking (embed first: no FLOPs), swap the rest, to SSD on the CPU device and
    to host memory on CUDA while the host budget lasts; explicit policies stay."""
    mb, prof = 1 << 20, _measured()
    auto = ["auto"] * 5
    assert decide.measured_activations(prof, auto, 100 * mb, device="cpu", host_bytes=None) == ("keep",) * 5
    assert decide.measured_activations(prof, auto, None, device="cpu", host_bytes=None) == ("keep",) * 5
    # b0's backward would start with embed, b1..b3 kept and its own 10 MiB: 41 MiB; 31 MiB keeps three
    got = decide.measured_activations(prof, auto, 31 * mb, device="cpu", host_bytes=None)
    assert got == ("keep", "ssd", "keep", "keep", "keep")
    got = decide.measured_activations(prof, auto, 31 * mb, device="cuda", host_bytes=None)
    assert got == ("keep", "host", "keep", "keep", "keep")
    # host memory holds both swapped blocks; the fixed recompute stays
    got = decide.measured_activations(
        prof, ["recompute"] + auto[1:], 21 * mb, device="cuda", host_bytes=20 * mb
    )
    assert got == ("recompute", "host", "host", "keep", "keep")
    # it holds one block but not one more read ahead beside it (backward stages the next SSD
    # block into host memory as it reaches a block: runtime/activations/swap.py, Note on staging;
    # act_candidates._staging_peak), so both go to SSD
    got = decide.measured_activations(
        prof, ["recompute"] + auto[1:], 21 * mb, device="cuda", host_bytes=15 * mb
    )
    assert got == ("recompute", "ssd", "ssd", "keep", "keep")
    # not even a swapped unit fits: all swapped but the last (backward starts with it: keeping it
    # adds nothing to the least need); the runtime's accounting then waits or raises
    got = decide.measured_activations(prof, auto, 1 * mb, device="cpu", host_bytes=None)
    assert got == ("ssd",) * 4 + ("keep",)


def test_plans_with_a_model_profile_carry_concrete_activation_policies():
    """With a model profile the planner decides "auto" at plan time (the Plan carries it, `offloadpp
    plan` prints it); without one the plan keeps "auto" under a budget and its note names the
    function that decides it from the first step."""
    from test_planner import GPT2

    from offloadpp.planner.model_profile import analytic_profile
    from offloadpp.planner.resolve import Machine, resolve

    m = analytic_profile(GPT2, micro_batch=4, seq_len=64)
    machine = Machine("cpu", host_available_bytes=8 << 30, cores=2)
    budget = {"activations": {"budget_bytes": 12 << 20}}
    r = resolve(Settings(**budget), m.unit_specs(), machine, model=m)
    assert r.plan.activations and "auto" not in r.plan.activations and "ssd" in r.plan.activations
    assert "activations (budget 12.00 MiB)" in r.plan.describe()
    bare = resolve(Settings(**budget), m.unit_specs(), machine)
    assert set(bare.plan.activations) == {"auto"}
    assert any("measured_activations" in n for n in bare.plan.notes)


def test_auto_accumulation_never_takes_a_plan_that_slows_a_per_micro_batch_loop():
    """decide.accumulation's Note: "auto" runs windows vertically only where the vertical plan,
    run by a per-micro-batch loop, is estimated no slower than the horizontal plan (within
    LOOP_SLOWDOWN_TOLERANCE); "vertical" regardless."""
    auto, forced = (Settings(gradient_accumulation_steps=4, accumulation=a) for a in ("auto", "vertical"))
    tol = decide.LOOP_SLOWDOWN_TOLERANCE
    assert decide.accumulation(auto, 2.0, 1.0, loop_s=2.0 * (1 + tol / 2)) is True
    assert decide.accumulation(auto, 2.0, 1.0, loop_s=2.0 * (1 + 2 * tol)) is False
    assert decide.accumulation(forced, 2.0, 1.0, loop_s=20.0) is True
    assert decide.accumulation(auto, 2.0, 1.0) is True  # (no loop estimate: the windows decide)


def test_the_windows_other_candidates_asked_about_the_loop():
    """decide.loop_candidates' Note: where the window search's pick would slow a loop, its other
    candidates faster than the horizontal plan are asked in turn, least estimate first, the
    best of each pair of prefetch depths (the pick's pair is its own), as Request.prefer keys."""
    from types import SimpleNamespace as NS

    def cand(label, s, k, q=0):
        plan = NS(prefetch_depth=k, optim_prefetch_depth=q)
        return NS(label=label, activations=(("h.0", "keep"),), plan=plan, estimate=NS(step_s=s))

    cands = [cand("a", 1.0, 1), cand("b", 1.01, 1), cand("c", 1.02, 2), cand("d", 1.03, 2), cand("e", 1.04, 0),
             cand("f", 1.05, 1, 1), cand("g", 3.0, 3)]  # fmt: skip
    got = decide.loop_candidates(cands, cands[0].estimate, 2.0)
    assert [label for label, _ in got] == ["c", "e", "f"]
    assert got[0] == ("c", (("h.0", "keep"),))
    assert [label for label, _ in decide.loop_candidates(cands, cands[2].estimate, 1.045)] == ["a", "e"]
    assert decide.loop_candidates(cands, cands[0].estimate, None) == []
