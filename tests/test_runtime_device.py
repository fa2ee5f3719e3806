"""The runtime on each device it runs on (the CPU acting as the device, and CUDA where present),
against torch in memory on the same device, batches moved to the engine's device:

- fp32: the same weights as torch.optim.AdamW within 1e-5;
- bf16 compute with fp32 master weights: the same weights as torch's mixed-precision recipe
  (a bf16 copy of fp32 masters computes forward and backward; AdamW updates the masters from the
  bf16 gradients). Both compute with the same kernels on the same device, so the two agree as
  closely as two fp32 Adam kernels do.

scripts/gpu_check.sh runs the CUDA cases on a GPU machine; here they skip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from numerics import compare_weights
from test_runtime import batches, global_rel_diff, tiny_gpt2, tiny_llama

from offloadpp.assemble import assemble_engine
from offloadpp.optim import AdamHyper
from offloadpp.planner import Settings, Tier
from offloadpp.runtime import RuntimeConfig

LR, WD = 1e-3, 0.01
DEVICES = [
    "cpu",
    "standin",  # the CPU with a GPU's asynchrony (runtime/accel/standin.py): the copy path
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def torch_device(device: str) -> str:
    """Where torch's reference computes: the stand-in's device memory is the CPU's."""
    return "cpu" if device == "standin" else device


def config(path, device: str, **settings) -> RuntimeConfig:
    return RuntimeConfig(nvme_paths=[str(path)], settings=Settings(**settings), device=device,
                         ssd_read_gbps=2.0, ssd_write_gbps=2.0)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_fp32_trains_like_adamw(tmp_path, device, make):
    ref = make().to(torch_device(device))
    eng = assemble_engine(copy.deepcopy(ref), config(tmp_path, device, gradient_clipping=1.0),
                          hyper=AdamHyper(lr=LR, weight_decay=WD))  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    with eng:
        assert eng.device.torch_device.type == torch_device(device) and eng.device.accel.kind == device
        for x in batches(4):
            x = x.to(eng.device.torch_device)
            ref(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
        want = {k: v.cpu() for k, v in ref.state_dict().items()}
        assert compare_weights(eng.module.state_dict(), want, lr=LR, steps=4) < 1e-5


def mixed_precision_reference(model, data, device: str):
    """torch's bf16 recipe: fp32 masters (AdamW's) on the host, a bf16 copy computing on the device."""
    master = copy.deepcopy(model)
    device = torch_device(device)
    low = copy.deepcopy(model).to(device)
    for (
        p
    ) in low.parameters():  # parameters in bf16; buffers (rotary tables) as created, as offloadpp keeps them
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)
    for x in data:
        with torch.no_grad():
            for lo, hi in zip(low.parameters(), master.parameters()):
                lo.copy_(hi)
        x = x.to(device)
        low(input_ids=x, labels=x).loss.backward()
        for lo, hi in zip(low.parameters(), master.parameters()):
            hi.grad = lo.grad.float().cpu()
            lo.grad = None
        opt.step()
        opt.zero_grad()
    return master


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama])
def test_bf16_compute_with_fp32_masters_matches_mixed_precision_adamw(tmp_path, device, make):
    """One step: the same weights (both convert the same masters to bf16 and compute the same
    gradients). Four steps: within 2% of the distance travelled. Exact agreement ends after the
    first steps: where the two Adam kernels' fp32 results differ by an ulp, the bf16 copies can
    round apart, and Adam normalises the resulting gradient noise (tests/numerics.py) into
    updates of order lr; bf16 makes far more elements noise-dominated than fp32 does."""
    model = make()
    init = copy.deepcopy(model.state_dict())
    data = batches(4)
    first = mixed_precision_reference(model, data[:1], device).state_dict()
    want = mixed_precision_reference(model, data, device).state_dict()
    eng = assemble_engine(copy.deepcopy(model), config(tmp_path, device, compute_dtype="bf16"),
                          hyper=AdamHyper(lr=LR, weight_decay=WD))  # fmt: skip
    with eng:
        assert eng.plan.separate_weights
        for i, x in enumerate(data):
            x = x.to(eng.device.torch_device)
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
            if i == 0:
                assert compare_weights(eng.module.state_dict(), first, lr=LR, steps=1) < 1e-5
        got = eng.module.state_dict()
    assert got["lm_head.weight"].dtype == torch.float32  # the master, as the model created it
    assert global_rel_diff(got, want) < 0.02 * global_rel_diff(want, init)


def test_every_kind_of_device_weights_is_a_weights():
    """runtime/device.py's Weights: what the executor and the optimizer use of a unit's device
    weights, which all three kinds provide (`state` a property, or set in the constructor)."""
    import inspect

    from offloadpp.runtime.device import CopyWeights, CpuWeights, Weights
    from offloadpp.runtime.dp.sharded import GatheredWeights

    members = {n for n in dir(Weights) if not n.startswith("_")}
    assert members == {"state", "acquire", "pump", "wait", "release", "refresh"}
    for kind in (CpuWeights, CopyWeights, GatheredWeights):
        for name in members - {"state"}:
            assert callable(getattr(kind, name, None)), f"{kind.__name__}.{name}"
        assert isinstance(getattr(kind, "state", None), property) or "self.state =" in inspect.getsource(
            kind.__init__
        ), f"{kind.__name__}.state"


@pytest.mark.parametrize("clip", [1.0, 1000.0])  # every step clips (deferred) / speculates from the third
def test_bf16_gradients_are_kept_bf16_and_update_as_their_fp32_upcast(tmp_path, monkeypatch, clip):
    """bf16 compute keeps autograd's bf16 gradients (their home on SSD, the optimizer's buffer)
    and the update upcasts them: bit for bit the weights of the same run whose gradients are
    upcast to fp32 when they leave autograd (Plan.grad_dtype patched to fp32, the way before),
    with half the gradient bytes through the SSD."""
    from offloadpp.planner.plan import Plan

    model = tiny_gpt2()
    data = batches(5)
    out = {}
    for way in ("bf16", "fp32"):
        if way == "fp32":
            monkeypatch.setattr(Plan, "grad_dtype", property(lambda self: "fp32"))
        (tmp_path / way).mkdir()
        cfg = config(
            tmp_path / way, "cpu", compute_dtype="bf16", gradient_clipping=clip, optim_prefetch_depth=0
        )
        with assemble_engine(copy.deepcopy(model), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD)) as eng:
            assert {u.grads.dtype for u in eng.units} == {torch.bfloat16 if way == "bf16" else torch.float32}
            reports = []
            for x in data:
                eng.backward(eng(input_ids=x, labels=x).loss)
                reports.append(eng.step())
            grads = [dict((k, (r, w)) for k, r, w in rep.ssd_by_kind)["gradients"] for rep in reports]
            out[way] = (eng.module.state_dict(), grads, [rep.updates for rep in reports])
    (got, grads16, ways16), (want, grads32, ways32) = out["bf16"], out["fp32"]
    assert ways16 == ways32 and ("speculative" in ways16) == (clip > 1)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert grads32[-1][1] > 0 and grads16[-1] == (grads32[-1][0] // 2, grads32[-1][1] // 2)


@pytest.mark.parametrize(
    "homes",
    [
        # (weights, master) per unit: resident weights refreshed from a master on SSD or in host
        # memory, beside a streamed unit (whose copies tell the host that the stream moved on)
        ((Tier.DEVICE, Tier.SSD), (Tier.DEVICE, Tier.HOST), (Tier.SSD, Tier.SSD), (Tier.DEVICE, Tier.SSD)),
        # all resident, masters in host memory: nothing but the update waits for a refresh's copy
        ((Tier.DEVICE, Tier.HOST),) * 4,
        # all resident, masters on SSD: the refresh reads the master (fp32: the compute copy),
        # whose buffer goes back to its pool after that copy, not as the update lets it go
        ((Tier.DEVICE, Tier.SSD),) * 4,
    ],
    ids=["mixed", "resident", "resident_ssd"],
)
@pytest.mark.parametrize("clip", [0.0, 1.0])  # updates in backward / deferred to the step's end
def test_on_the_standin_weights_resident_on_the_device_train_like_adamw(tmp_path, monkeypatch, clip, homes):
    """Units whose weights live on the device for the whole run (refreshed after each update,
    from a master on SSD or in host memory) beside a streamed one train like torch AdamW. On the
    stand-in only: this is the copy path's (on the CPU device resident fp32 weights are the
    master itself, nothing is refreshed). It runs the resident refresh's lines: its copy waits
    for compute to be done with the old weights, the host buffer it reads goes back only after
    it, and the next update writes that buffer only once the copy has read it."""
    from dataclasses import replace

    from conftest import set_device
    from test_runtime import train_pair

    from offloadpp.assemble import unit_specs
    from offloadpp.planner import Placement, streaming_plan, with_peak_budgets
    from offloadpp.runtime import OffloadEngine

    set_device(monkeypatch, "standin")
    ref = tiny_gpt2()
    specs = unit_specs(ref, None)
    placements = tuple(Placement(u.name, w, m, Tier.SSD) for u, (w, m) in zip(specs, homes))
    base = streaming_plan(specs, device="cuda", compute_dtype="fp32", prefetch_depth=1,
                          deferred_update=clip > 0, clipping=clip > 0)  # fmt: skip
    plan = with_peak_budgets(replace(base, placements=placements))
    cfg = config(tmp_path, "cpu", gradient_clipping=clip)
    with OffloadEngine(copy.deepcopy(ref), cfg, plan, hyper=AdamHyper(lr=LR, weight_decay=WD)) as eng:
        train_pair(ref, eng, batches(4), clip=clip)
        assert compare_weights(eng.module.state_dict(), ref.state_dict(), lr=LR, steps=4) < 1e-5
