"""A step's SSD bytes by kind (planner/traffic.py): one definition, counted by the runtime at its
I/O calls by their kind tag and by the cost model's replay by its keys, and the two agree."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_cost import hw, model, stream

from offloadpp.io import TensorStore
from offloadpp.planner import traffic
from offloadpp.planner.cost import estimate


def test_the_kinds_of_a_units_arrays():
    # fp32: the master is the compute copy, its bytes the weights'; 16-bit: it is optimizer state
    assert traffic.array_kind("master", separate_weights=False) == "weights"
    assert traffic.array_kind("master", separate_weights=True) == "optimizer_state"
    assert traffic.array_kind("weights", True) == "weights"
    assert {traffic.array_kind(a, False) for a in ("exp_avg", "exp_avg_sq")} == {"optimizer_state"}
    assert traffic.array_kind("grads", False) == "gradients"
    assert traffic.key_kind("act.h.3", False) == "activations"
    assert traffic.key_kind("transformer.h.0.exp_avg", False) == "optimizer_state"
    with pytest.raises(ValueError):
        traffic.array_kind("bias", False)
    with pytest.raises(ValueError, match="other"):
        traffic.tally([("other", True, 1)])
    t = traffic.tally([("weights", False, 5), ("weights", True, 2), ("gradients", True, 3)])
    assert t == (("weights", 5, 2), ("gradients", 0, 3), ("optimizer_state", 0, 0), ("activations", 0, 0))
    assert traffic.median([t, t, traffic.tally([])])[0] == ("weights", 5, 2)
    assert "| total | 5 B | 5 B |" in traffic.table(t)


def test_a_table_has_as_many_cells_in_each_row_as_its_header():
    # the plan printout (no cost model's figure beside) printed 5 cells under a 3-cell header
    t = traffic.tally([("weights", False, 5), ("gradients", True, 3)])
    for predicted, cells in (((), 3), (t, 5)):
        rows = traffic.table(t, predicted).splitlines()
        assert {r.count("|") - 1 for r in rows} == {cells}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_estimate_splits_its_bytes_by_kind(dtype):
    m = model()
    plan = stream(m, compute_dtype=dtype, deferred_update=True)  # gradients go to SSD and back
    est = estimate(plan, hw(device_flops_per_s={dtype: 100e9}), m)
    by = {k: (r, w) for k, r, w in est.ssd_by_kind}
    assert sum(r for r, _ in by.values()) == est.ssd_read_bytes
    assert sum(w for _, w in by.values()) == est.ssd_write_bytes
    assert by["gradients"][0] > 0 and by["gradients"][1] > 0 and by["optimizer_state"][1] > 0
    assert by["weights"][1] > 0  # fp32: the master; bf16: the compute copy


def test_a_tagged_store_counts_its_kind(tmp_path):
    with TensorStore(str(tmp_path)) as s:
        t = torch.ones(1000)
        s.tagged("gradients").put("g", t).wait()
        s.tagged("weights").get("g").wait()
        s.get("g").wait()  # untagged: "other"
        assert s.bytes_by_kind() == {
            ("gradients", True): 4000,
            ("weights", False): 4000,
            ("other", False): 4000,
        }


def _steady_steps(eng, model, n: int) -> tuple[list, tuple]:
    """Trains n steps; the reports of the steady ones (from the third: the first reads the
    initial weights, the second applies the first's deferred update with the state still in
    memory) and the cost model's SSD bytes by kind for them."""
    from test_runtime import batches

    from offloadpp.bench.harness import modelled_ssd_by_kind, steps_updates

    reports = []
    for x in batches(n):
        eng.backward(eng(input_ids=x, labels=x).loss)
        reports.append(eng.step())
    modelled, _ = modelled_ssd_by_kind(eng, model.config.to_dict(), steps_updates(reports[2:]))
    return reports[2:], modelled


@pytest.mark.parametrize(
    "clip, q, dtype",
    [
        (0.0, None, "fp32"),
        (1.0, None, "fp32"),
        # a speculative plan whose steps all clip (so defer), with a read-ahead short of the model:
        # the gradients go to their home on SSD and back, which the plan's own replay (of a step
        # that validates) does not move; the figure beside them must be the deferred step's
        (1.0, 0, "fp32"),
        (1.0, 0, "bf16"),  # 16-bit gradients (Plan.grad_dtype): half the bytes, on both sides
    ],
)
def test_the_runtimes_bytes_by_kind_are_the_cost_models(tmp_path, clip, q, dtype):
    transformers = pytest.importorskip("transformers")
    from test_runtime import streaming_config, tiny_gpt2

    from offloadpp.assemble import assemble_engine

    transformers.logging.set_verbosity_error()
    m = tiny_gpt2()
    cfg = streaming_config(tmp_path, gradient_clipping=clip, optim_prefetch_depth=q, compute_dtype=dtype)
    eng = assemble_engine(m, cfg)
    try:
        steady, modelled = _steady_steps(eng, m, 4)
        assert eng.plan.speculative == (clip > 0)  # speculate "auto"
        for r in steady:
            assert r.updates == ("deferred" if clip else "in-backward")  # (tiny models' norms clip)
            assert r.ssd_by_kind == modelled
            assert sum(x for _, x, _ in r.ssd_by_kind) == r.ssd_read_bytes  # reads finish within their step
        assert dict((k, w) for k, _, w in modelled)["weights"] > 0  # the master (bf16: the compute copy)
        if q == 0:
            # every unit's but the first's (the update window, q+1 units in forward order, keeps them)
            grads = sum(u.padded_numel for u in eng.units[1:]) * (2 if dtype == "bf16" else 4)
            assert dict((k, (r, w)) for k, r, w in modelled)["gradients"] == (grads, grads)
    finally:
        eng.close()


def test_a_quick_pending_update_of_a_compute_copy_leaves_it_to_the_fetch(tmp_path, monkeypatch):
    """bf16 compute on the CPU: a unit's compute copy is its pending update's product. An update
    that finishes (and is reaped) before the fetch holds the copy must not give it back: the
    fetch would read it again, a read the cost model does not make. Forced here: every pending
    update is done and reaped as soon as it is handed over (under load this happened by itself,
    to the embeddings' copy, in about one run in three)."""
    transformers = pytest.importorskip("transformers")
    from test_runtime import streaming_config, tiny_gpt2

    from offloadpp.assemble import assemble_engine

    transformers.logging.set_verbosity_error()
    m = tiny_gpt2()
    cfg = streaming_config(tmp_path, gradient_clipping=1.0, optim_prefetch_depth=0, compute_dtype="bf16")
    eng = assemble_engine(m, cfg)
    opt = eng.executor.optimizer
    apply = opt.apply_pending

    def apply_and_finish(names):
        apply(names)
        while opt._lazy_inflight:
            opt._reap_pending()

    monkeypatch.setattr(opt, "apply_pending", apply_and_finish)
    try:
        steady, modelled = _steady_steps(eng, m, 4)
        for r in steady:
            assert r.updates == "deferred" and r.ssd_by_kind == modelled
    finally:
        eng.close()


def test_a_pending_update_and_the_fetch_of_the_same_master_read_it_once(tmp_path):
    """With updates applied at the next visit, a unit whose master is its weights (fp32 on the CPU)
    and lives on SSD is read once a step at its forward fetch, its pending update sharing the read,
    also where other units keep theirs in memory: the runtime's bytes are the cost model's. (The
    executor submitted the update before the fetch held the slot; a quick update wrote it back
    and gave it up, and the fetch read it again: one unit's master more than the model.)"""
    transformers = pytest.importorskip("transformers")

    from offloadpp.assemble import assemble_engine
    from offloadpp.planner import Budgets, Placement, Settings, Tier
    from offloadpp.planner.planfile import save_plan
    from offloadpp.runtime.config import RuntimeConfig

    transformers.logging.set_verbosity_error()

    def model():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=8, n_embd=128, n_head=4, vocab_size=4096, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)

    def config(**kw):
        settings = Settings(gradient_clipping=1.0, optim_prefetch_depth=1, **kw)
        return RuntimeConfig(nvme_paths=[str(tmp_path)], settings=settings, device="cpu", ssd_read_gbps=2.0,
                             ssd_write_gbps=2.0)  # fmt: skip

    eng = assemble_engine(model(), config())
    plan = eng.plan
    eng.close()
    kept = {"embed", "transformer.h.0", "transformer.h.1", "head"}  # masters (and embed's moments) in memory
    placements = tuple(
        Placement(p.unit, Tier.HOST, Tier.HOST, Tier.HOST if p.unit == "embed" else Tier.SSD,
                  Tier.HOST if p.unit == "head" else Tier.SSD)
        if p.unit in kept
        else p
        for p in plan.placements
    )  # fmt: skip
    path = str(tmp_path / "plan.json")
    save_plan(path, replace(plan, placements=placements, budgets=Budgets(1 << 30, 1 << 30)))
    m = model()
    eng = assemble_engine(m, config(plan=path))
    try:
        steady, modelled = _steady_steps(eng, m, 5)
        assert dict((k, r) for k, r, _ in modelled)["weights"] > 0
        for r in steady:
            assert r.updates == "deferred" and r.ssd_by_kind == modelled
    finally:
        eng.close()
