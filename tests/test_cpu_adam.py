"""CPUAdam: DeepSpeedCPUAdam's interface, torch Adam/AdamW's results and checkpoint layout.

The bf16/fp16 comparisons port DeepSpeed's tests/unit/ops/adam/test_cpu_adam.py
(test_torch_adamw_equal: 10 steps on random grads, param norms within 1%).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from offloadpp import _C
from offloadpp.optim import AMSGradNotSupportedError, CPUAdam

LEVELS = ["scalar", "avx2", "avx512"]
ORDER = {name: i for i, name in enumerate(LEVELS)}


@pytest.fixture(params=LEVELS)
def simd(request, monkeypatch):
    if ORDER[request.param] > ORDER[_C.detected_simd_level()]:
        pytest.skip(f"CPU lacks {request.param}")
    monkeypatch.setenv("OFFLOADPP_SIMD", request.param)
    return request.param


def rel_max_diff(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_pair(opt_a, pa, opt_b, pb, steps=10, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for x, y in zip(pa, pb):
            g = torch.randn(x.shape, generator=gen).to(dtype)
            x.grad = g.clone()
            y.grad = g.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("n", [1, 22, 1000, 1 << 20])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_matches_torch_fp32(simd, n, adamw):
    torch.manual_seed(0)
    data = torch.randn(n)
    a, b = torch.nn.Parameter(data.clone()), torch.nn.Parameter(data.clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)([b], lr=1e-2, weight_decay=0.1)
    run_pair(ours, [a], ref, [b])
    assert rel_max_diff(a, b) <= 1e-6
    assert rel_max_diff(ours.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"]) <= 1e-6
    assert ours.state[a]["step"] == 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [64, 22, 128, 1024, 1048576])
def test_torch_adamw_equal_half(simd, dtype, n):
    """DeepSpeed's test_torch_adamw_equal. torch's CPU AdamW keeps fp16 moments, which overflow
    (DeepSpeed skips fp16 on CPU); for fp16 the reference is AdamW on an fp32 copy."""
    torch.manual_seed(0)
    data = torch.randn(n).to(dtype)
    ours_p = torch.nn.Parameter(data.clone())
    ref_p = torch.nn.Parameter(data.clone() if dtype == torch.bfloat16 else data.float())
    ours = CPUAdam([ours_p])
    ref = torch.optim.AdamW([ref_p])
    for _ in range(10):
        ours_p.grad = torch.randn(n).to(dtype)
        ref_p.grad = ours_p.grad.clone().to(ref_p.dtype)
        ours.step()
        ref.step()
    tolerance = ours_p.float().norm().item() * 1e-2
    assert abs(ours_p.float().norm().item() - ref_p.float().norm().item()) <= tolerance
    assert ours.state[ours_p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_optimizer_states_false(dtype):
    torch.manual_seed(0)
    base = torch.randn(1024).to(dtype)
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt_a = CPUAdam([a], fp32_optimizer_states=True)
    opt_b = CPUAdam([b], fp32_optimizer_states=False, eps=1e-4 if dtype == torch.float16 else 1e-8)
    run_pair(opt_a, [a], opt_b, [b], dtype=dtype)
    assert opt_b.state[b]["exp_avg"].dtype == dtype and opt_b.state[b]["exp_avg_sq"].dtype == dtype
    assert opt_a.state[a]["exp_avg"].dtype == torch.float32
    assert abs(a.float().norm() - b.float().norm()) <= a.float().norm() * 5e-2


def test_groups_mixed_dtypes_and_missing_grads():
    torch.manual_seed(0)
    shapes = [(3, 5), (1000,), (7,), (4, 4, 4)]
    ours_ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref_ps = [torch.nn.Parameter(p.detach().clone()) for p in ours_ps]
    ours = CPUAdam(
        [{"params": ours_ps[:2], "lr": 1e-2, "weight_decay": 0.1}, {"params": ours_ps[2:]}], lr=3e-3
    )
    ref = torch.optim.AdamW(
        [{"params": ref_ps[:2], "lr": 1e-2, "weight_decay": 0.1}, {"params": ref_ps[2:]}],
        lr=3e-3,
        weight_decay=0.0,
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for i, (x, y) in enumerate(zip(ours_ps, ref_ps)):
            if i == 3 and step < 2:  # starts later: its step count differs from the others
                x.grad = y.grad = None
                continue
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for x, y in zip(ours_ps, ref_ps):
        assert rel_max_diff(x, y) <= 1e-6
    assert ours.state[ours_ps[3]]["step"] == 4 and ours.state[ours_ps[0]]["step"] == 6


def test_mixed_grad_dtype_and_closure():
    p = torch.nn.Parameter(torch.randn(100))
    opt = CPUAdam([p])
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None  # torch >= 2.10 guards grad dtypes
    p.grad = torch.randn(100).to(torch.bfloat16)  # bf16 grads on fp32 master params
    calls = []
    loss = opt.step(lambda: calls.append(1) or 3.5)
    assert loss == 3.5 and calls == [1]


def test_state_dict_roundtrip_with_torch():
    torch.manual_seed(0)
    data = [torch.randn(10, 3), torch.randn(7)]
    ours_ps = [torch.nn.Parameter(d.clone()) for d in data]
    ref_ps = [torch.nn.Parameter(d.clone()) for d in data]
    ours = CPUAdam(ours_ps, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1)
    run_pair(ours, ours_ps, ref, ref_ps, steps=3)

    # ours -> torch AdamW and torch Adam (decoupled_weight_decay travels with the groups)
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert isinstance(sd["state"][0]["step"], torch.Tensor) and sd["state"][0]["step"].item() == 3
    assert isinstance(ours.state[ours_ps[0]]["step"], int)
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in ours_ps]
        other = cls(ps, lr=1.0)
        other.load_state_dict(sd)
        assert other.param_groups[0]["decoupled_weight_decay"] is True
        cont_ours = [torch.nn.Parameter(p.detach().clone()) for p in ours_ps]
        again = CPUAdam(cont_ours, lr=1.0)
        again.load_state_dict(sd)
        run_pair(again, cont_ours, other, ps, steps=3, seed=5)
        for x, y in zip(cont_ours, ps):
            assert rel_max_diff(x, y) <= 1e-6

    # torch -> ours
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ref_ps]
    mine = CPUAdam(fresh, lr=5.0)
    mine.load_state_dict(ref.state_dict())
    assert mine.param_groups[0]["lr"] == 1e-2
    assert mine.state[fresh[0]]["step"] == 3
    run_pair(mine, fresh, ref, ref_ps, steps=3, seed=6)
    for x, y in zip(fresh, ref_ps):
        assert rel_max_diff(x, y) <= 1e-6


def test_load_keeps_fp32_moments_for_bf16_params():
    p = torch.nn.Parameter(torch.randn(33).to(torch.bfloat16))
    opt = CPUAdam([p])
    p.grad = torch.randn(33).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    other = CPUAdam([q])
    other.load_state_dict(sd)
    assert other.state[q]["exp_avg"].dtype == torch.float32
    assert torch.equal(other.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert other.state[q]["exp_avg"].data_ptr() != opt.state[p]["exp_avg"].data_ptr()


def test_load_rejects_adam_checkpoint_into_adamw_with_decay():
    p = torch.nn.Parameter(torch.randn(4))
    ref = torch.optim.Adam([p], weight_decay=0.1)
    p.grad = torch.randn(4)
    ref.step()
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        CPUAdam([torch.nn.Parameter(torch.randn(4))], weight_decay=0.1).load_state_dict(ref.state_dict())
    CPUAdam([torch.nn.Parameter(torch.randn(4))], weight_decay=0.1, adamw_mode=False).load_state_dict(
        ref.state_dict()
    )


def test_amsgrad_rejected():
    with pytest.raises(ValueError, match="AMSGrad"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    with pytest.raises(RuntimeError):  # DeepSpeedCPUAdam raises RuntimeError: both match
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(AMSGradNotSupportedError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.999)), "beta1"),
        (dict(betas=(0.9, 1.5)), "beta2"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(num_threads=0), "num_threads"),
    ],
)
def test_bad_hyper_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_hyper_parameter_set_later_is_caught_at_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = CPUAdam([p])
    opt.param_groups[0]["lr"] = float("nan")
    p.grad = torch.zeros(2)
    with pytest.raises(ValueError, match=r"param_groups\[0\].*lr"):
        opt.step()


def test_bad_tensors_name_the_param():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(2)), p])
    p.grad = torch.zeros(4, 4)
    opt.step()
    opt.state[p]["exp_avg"] = torch.zeros(3, 4)  # torch refuses a grad of the wrong shape; a state can be
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*shape"):
        opt.step()
    opt.state[p]["exp_avg"] = torch.zeros(4, 4)
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
    p.grad = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\[1\]: grad has dtype float64"):
        opt.step()
    p.grad = torch.zeros(4, 8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    q = torch.nn.Parameter(torch.zeros(8, 8)[:, ::2])
    q.grad = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([q]).step()
    named = CPUAdam([("encoder.weight", p)])
    p.grad = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="encoder.weight"):
        named.step()
    if torch.cuda.is_available():
        c = torch.nn.Parameter(torch.zeros(4, device="cuda"))
        c.grad = torch.zeros(4, device="cuda")
        with pytest.raises(ValueError, match="CPU"):
            CPUAdam([c]).step()


def test_check_finite_skips_whole_step():
    ps = [torch.nn.Parameter(torch.randn(50)) for _ in range(3)]
    opt = CPUAdam(ps)
    for p in ps:
        p.grad = torch.randn(50)
    opt.step()
    before = [p.detach().clone() for p in ps]
    ps[2].grad[7] = float("inf")
    opt.step(check_finite=True)
    assert opt.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert all(opt.state[p]["step"] == 1 for p in ps)
    ps[2].grad[7] = 0.0
    opt.step(check_finite=True, grad_scale=8.0, clip_coef=0.5)
    assert not opt.last_step_skipped and all(opt.state[p]["step"] == 2 for p in ps)


def test_half_out_mapping_and_num_threads():
    p = torch.nn.Parameter(torch.randn(1000))
    out = torch.empty(1000, dtype=torch.bfloat16)
    opt = CPUAdam([p], num_threads=1)
    p.grad = torch.randn(1000)
    opt.step(half_out={p: out})
    assert torch.equal(out, p.detach().to(torch.bfloat16))


def _deepspeed_cpu_adam_built() -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return False
    try:
        d = _get_build_directory("cpu_adam", verbose=False)
    except Exception:
        return False
    return bool(glob.glob(os.path.join(d, "cpu_adam*.so")))


@pytest.mark.skipif(
    not _deepspeed_cpu_adam_built(), reason="DeepSpeed's cpu_adam op is not built (JIT takes ~60 s)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_deepspeed_cpu_adam(dtype):
    ds_adam = pytest.importorskip("deepspeed.ops.adam")
    torch.manual_seed(0)
    data = torch.randn(4099).to(dtype)
    a, b = torch.nn.Parameter(data.clone()), torch.nn.Parameter(data.clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.05)
    ds = ds_adam.DeepSpeedCPUAdam([b], lr=1e-2, weight_decay=0.05)
    run_pair(ours, [a], ds, [b], dtype=dtype)
    assert abs(a.float().norm() - b.float().norm()) <= a.float().norm() * 1e-2
    if dtype == torch.float32:
        assert rel_max_diff(a, b) <= 1e-5
