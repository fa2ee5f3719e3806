"""planner/decide.py: each plan-time decision made once, and docs/runtime.md's table of them
("Decided once") naming functions that exist."""

from __future__ import annotations

import importlib
import re
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


def test_defaults_where_the_settings_leave_them():
    assert decide.prefetch_depth(Settings()) == decide.DEFAULT_PREFETCH
    assert decide.prefetch_depth(Settings(prefetch_depth=1)) == 1
    assert decide.optim_prefetch_depth(Settings()) == decide.DEFAULT_OPTIM_PREFETCH
    assert decide.optim_prefetch_depth(Settings(optim_prefetch_depth=0)) == 0
    assert decide.adam_threads(Settings(), cores=7) == 7
    assert decide.adam_threads(Settings(adam_threads=2), cores=7) == 2


def test_pending_updates_at_the_next_visit_one_rank_cpu_deferred():
    s = Settings(gradient_clipping=1.0, speculate="off")
    dev, host = min_budgets(UNITS, device="cpu", **plan_shape(s), prefetch_depth=2)
    cpu = default_plan(UNITS, device="cpu", settings=s, budgets=Budgets(dev, host))
    assert decide.lazy_runtime(cpu) and decide.lazy_applies(cpu)
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
