"""Clipping and fp16 with speculative updates (runtime/speculation.py): the updates run during
backward with the raw gradients and are validated at its end. Whether the step commits, is
redone with clipped gradients or is skipped, the training state is bit for bit what deferred
updates give (compared through checkpoints: the CRC-32C of every master and moment, and every
step count), and the weights are torch AdamW's with clip_grad_norm_ within 1e-5."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_runtime import LR, WD, batches, compare, streaming_config, tiny_gpt2, train_pair

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.runtime.checkpoint import MANIFEST
from offloadpp.runtime.speculation import SPECULATE_AFTER

pytest.importorskip("transformers")


def engine(path, model, **settings):
    path.mkdir()
    return assemble_engine(
        copy.deepcopy(model), streaming_config(path, **settings), hyper=AdamHyper(lr=LR, weight_decay=WD)
    )


def fingerprint(eng, path) -> dict:
    """Every master and moment's CRC-32C and every step count, through a checkpoint."""
    eng.save_state(str(path))
    m = json.loads((path / MANIFEST).read_text())
    return {"arrays": {k: v["crc32c"] for k, v in m["arrays"].items()}, "steps": m["param_steps"],
            "global": m["runtime"]["global_step"]}  # fmt: skip


def run(eng, data, accum: int = 1) -> list:
    reports = []
    for i, x in enumerate(data):
        eng.backward(eng(input_ids=x, labels=x).loss)
        r = eng.step()
        assert (r is None) == ((i + 1) % accum != 0)
        if r is not None:
            reports.append(r)
    return reports


# q: the optimizer's read-ahead. None: "auto", over every unit here (the state of all is read as
# backward starts and every gradient stays in memory); 1: the window slides, the gradients of
# the units past the deferred window go to SSD and a redo reads them back.
@pytest.mark.parametrize("q", [None, 1], ids=["window-all", "window-1"])
@pytest.mark.parametrize("accum", [1, 2], ids=["one-micro-batch", "accumulation"])
@pytest.mark.parametrize("max_norm", [1e3, 0.05], ids=["within-the-norm", "clipping"])
def test_speculative_updates_equal_deferred_ones_bit_for_bit_and_torch(tmp_path, max_norm, accum, q):
    _speculative_equal_deferred(tmp_path, max_norm, accum, q)


@pytest.mark.parametrize("max_norm", [1e3, 0.05], ids=["within-the-norm", "clipping"])
def test_on_the_standin_speculative_updates_equal_deferred_ones_and_torch(tmp_path, monkeypatch, max_norm):
    """The same on the stand-in accelerator (the copy path: runtime/accel/standin.py), with
    accumulation and a sliding window."""
    from conftest import set_device

    set_device(monkeypatch, "standin")
    _speculative_equal_deferred(tmp_path, max_norm, 2, 1)


def _speculative_equal_deferred(tmp_path, max_norm, accum, q):
    ref = tiny_gpt2()
    data = batches(6 * accum)
    kw = dict(gradient_clipping=max_norm, gradient_accumulation_steps=accum, optim_prefetch_depth=q)
    spec = engine(tmp_path / "spec", ref, speculate="on", **kw)
    defer = engine(tmp_path / "defer", ref, speculate="off", **kw)
    try:
        assert spec.plan.speculative and not defer.plan.speculative
        assert spec.plan.optim_prefetch_depth == (q if q is not None else len(spec.units) - 1)
        n = len(spec.units)
        reports = train_pair(ref, spec, data, accum=accum, clip=max_norm)
        assert compare(spec.module.state_dict(), ref.state_dict(), len(reports)) < 1e-5
        deferred = run(defer, data, accum)
        assert fingerprint(spec, tmp_path / "a") == fingerprint(defer, tmp_path / "b")
        for r, d in zip(reports, deferred):
            assert r.grad_norm == d.grad_norm  # the norm is taken the same way either way
            assert r.updates == "speculative" and d.updates == "deferred" and d.speculated_units == 0
            assert r.speculated_units == n and r.mode_switches == 0
            if max_norm > 1:
                assert r.grad_norm < max_norm and (r.committed_units, r.redone_units) == (n, 0)
            else:
                assert r.grad_norm > max_norm and (r.committed_units, r.redone_units) == (0, n)
    finally:
        spec.close()
        defer.close()


def test_auto_speculates_while_steps_validate_and_defers_after_one_clips(tmp_path):
    """With clipping, "auto" begins deferred, speculates once SPECULATE_AFTER steps in a row
    stayed within the limit, and defers again after a step that clips (here one whose loss is
    scaled up: its gradients too), which it redoes exactly."""
    ref = tiny_gpt2()
    data = batches(9)
    spike = {SPECULATE_AFTER + 2: 50.0}  # step -> loss multiplier: the third speculative step
    probe = engine(tmp_path / "probe", ref, gradient_clipping=1e3, speculate="off")
    try:
        norms = [r.grad_norm for r in run(probe, data)]
    finally:
        probe.close()
    limit = 2 * max(norms)  # the plain steps stay within it; the scaled one does not
    engines = {k: engine(tmp_path / k, ref, gradient_clipping=limit, speculate=k) for k in ("auto", "off")}
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    reports = {k: [] for k in engines}
    try:
        for i, x in enumerate(data):
            m = spike.get(i, 1.0)
            (ref(input_ids=x, labels=x).loss * m).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), limit)
            opt.step()
            opt.zero_grad()
            for k, eng in engines.items():
                eng.backward(eng(input_ids=x, labels=x).loss * m)
                reports[k].append(eng.step())
        auto = engines["auto"]
        assert compare(auto.module.state_dict(), ref.state_dict(), len(data)) < 1e-5
        assert fingerprint(auto, tmp_path / "a") == fingerprint(engines["off"], tmp_path / "b")
        rs = reports["auto"]
        modes = [r.updates for r in rs]
        want = ["deferred"] * SPECULATE_AFTER + ["speculative"] * 3  # the third speculative one clips
        want += ["deferred"] * SPECULATE_AFTER + ["speculative"] * (len(data) - len(want) - SPECULATE_AFTER)
        assert modes == want
        assert [r.grad_norm > limit for r in rs] == [i in spike for i in range(len(data))]
        assert (rs[4].speculated_units, rs[4].redone_units, rs[4].committed_units) == (
            len(auto.units),
        ) * 2 + (0,)
        assert all(
            r.committed_units == len(auto.units) for r in rs if r.updates == "speculative" and r.step != 5
        )
        assert [r.mode_switches for r in rs] == [0, 1, 1, 1, 2, 2, 3, 3, 3]
        assert "updates speculative (speculated" in rs[-1].summary()
    finally:
        for eng in engines.values():
            eng.close()


def test_an_overflow_in_a_speculative_fp16_step_skips_it_exactly(tmp_path):
    """fp16 (on the CPU: slow, so few steps): an injected overflow (the loss scale made huge
    for one step) forgets the speculative updates; the state is then bit for bit the deferred
    run's, and the same as before the step."""
    ref = tiny_gpt2()
    data = batches(4)
    engines = {
        k: engine(tmp_path / k, ref, compute_dtype="fp16", hysteresis=1, speculate=k) for k in ("on", "off")
    }
    try:
        for name, eng in engines.items():
            eng.loss_scaler.scale = 1024.0
            run(eng, data[:2])
            before = fingerprint(eng, tmp_path / f"{name}-fp")
            eng.loss_scaler.scale = 2.0**40  # the fp16 gradients overflow
            (r,) = run(eng, data[2:3])
            assert r.skipped and r.step == 2 and r.loss_scale == 2.0**40 and eng.loss_scaler.scale < 2.0**40
            assert r.speculated_units == (len(eng.units) if name == "on" else 0) and r.committed_units == 0
            assert fingerprint(eng, tmp_path / f"{name}-after") == before  # nothing was updated
            eng.loss_scaler.scale = 1024.0
            (r,) = run(eng, data[3:])
            assert not r.skipped and r.step == 3
        assert fingerprint(engines["on"], tmp_path / "a") == fingerprint(engines["off"], tmp_path / "b")
    finally:
        for eng in engines.values():
            eng.close()


class Boom(Exception):
    pass


def test_a_redo_interrupted_leaves_the_last_completed_step(tmp_path, monkeypatch):
    """A speculating step is a transaction to its end: an error during the redo (after the
    speculative updates were forgotten, with some units updated again) leaves the last completed
    step's state, and training goes on as if nothing had happened."""
    ref = tiny_gpt2()
    data = batches(4)
    eng = engine(tmp_path / "eng", ref, gradient_clipping=0.05, speculate="on")
    other = engine(tmp_path / "other", ref, gradient_clipping=0.05, speculate="off")
    try:
        run(eng, data[:2])
        run(other, data[:2])
        orig = eng.optimizer._submit
        redo = []

        def fail_midway(job):  # the third update submitted after backward: the redo is under way
            if job.update and not eng.executor.in_backward:
                redo.append(job)
                if len(redo) == 3:
                    raise Boom("interrupted")
            orig(job)

        monkeypatch.setattr(eng.optimizer, "_submit", fail_midway)
        with pytest.raises(Boom):
            run(eng, data[2:3])
        monkeypatch.undo()
        assert len(redo) == 3 < len(eng.units)
        assert fingerprint(eng, tmp_path / "a") == fingerprint(other, tmp_path / "b")
        run(eng, data[2:])
        run(other, data[2:])
        assert fingerprint(eng, tmp_path / "c") == fingerprint(other, tmp_path / "d")
    finally:
        eng.close()
        other.close()


def test_units_whose_state_lives_in_memory_are_not_speculated(tmp_path):
    """State resident in host memory is updated in place: no previous generation to redo from.
    Those units are updated after validation, and the step is exact."""
    ref = tiny_gpt2()
    eng = engine(tmp_path / "eng", ref, gradient_clipping=1e3, speculate="on", offload_params=False,
                 offload_optimizer=False)  # fmt: skip
    try:
        assert not any(u.can_speculate for u in eng.units)
        reports = train_pair(ref, eng, batches(3), clip=1e3)
        assert compare(eng.module.state_dict(), ref.state_dict(), 3) < 1e-5
        assert all(r.updates == "speculative" and r.speculated_units == 0 for r in reports)
    finally:
        eng.close()


@pytest.mark.parametrize("max_norm", [1e3, 0.05], ids=["within-the-norm", "clipping"])
def test_param_groups_with_their_own_hyper_parameters(tmp_path, max_norm):
    """Biases in a group of their own (no weight decay, another lr): a unit's parameters then take
    two groups, so its speculative update is not one fused call; still bit for bit deferred's."""
    ref = tiny_gpt2()
    data = batches(4)
    hypers = (AdamHyper(lr=LR, weight_decay=WD), AdamHyper(lr=2 * LR, weight_decay=0.0))
    groups = {n: int(n.endswith("bias")) for n, _ in ref.named_parameters()}
    out = []
    for mode in ("on", "off"):
        eng = engine(tmp_path / mode, ref, gradient_clipping=max_norm, speculate=mode)
        try:
            eng.set_hypers(hypers, groups)
            reports = run(eng, data)
            assert all(r.updates == ("speculative" if mode == "on" else "deferred") for r in reports)
            out.append(fingerprint(eng, tmp_path / f"{mode}-fp"))
        finally:
            eng.close()
    assert out[0] == out[1]
