"""The fused CPU Adam kernel (csrc/adam/) through offloadpp.optim's flat-buffer API.

Every SIMD variant (forced with OFFLOADPP_SIMD, read on every call) must give bit-identical
results, equal to torch's Adam/AdamW within 1e-6 relative; conversions round to nearest even.
"""

from __future__ import annotations

import functools
import math
import threading
import time

import pytest
import torch

from offloadpp import _C
from offloadpp.optim import (
    AdamHyper,
    AdamStep,
    adam_step_flat,
    adam_step_pieces,
    all_finite,
    bandwidth_floor,
    convert_,
    default_num_threads,
    kernel_isa,
    squared_norm,
    sum_parts_,
)

LEVELS = ["scalar", "avx2", "avx512"]
ORDER = {name: i for i, name in enumerate(LEVELS)}
HALF = [torch.bfloat16, torch.float16]
ALL = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture(params=LEVELS)
def simd(request, monkeypatch):
    """Forces one kernel variant; skips the ones this CPU lacks."""
    if ORDER[request.param] > ORDER[_C.detected_simd_level()]:
        pytest.skip(f"CPU lacks {request.param}")
    monkeypatch.setenv("OFFLOADPP_SIMD", request.param)
    assert kernel_isa() == request.param
    return request.param


def rel_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@functools.cache
def torch_reference(n, steps, *, adamw, wd, lr=1e-2, seed=0):
    """torch.optim.AdamW/Adam on fp32 params: (initial params, grads, final params, final state).
    Cached: shared by the SIMD variants; callers must not modify what it returns."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    ref = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=lr, weight_decay=wd)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    return p0, grads, ref.detach(), opt.state[ref]


@pytest.mark.parametrize("n", [1, 22, 1000, 1 << 20])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_fp32_matches_torch(simd, n, adamw):
    wd = 0.1
    p0, grads, ref, ref_state = torch_reference(n, 10, adamw=adamw, wd=wd)
    hyper = AdamHyper(lr=1e-2, weight_decay=wd, adamw_mode=adamw)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        assert adam_step_flat(p, g, m, v, AdamStep(step=step, hyper=hyper)) is True
    assert rel_max_diff(p, ref) <= 1e-6
    assert rel_max_diff(m, ref_state["exp_avg"]) <= 1e-6
    assert rel_max_diff(v, ref_state["exp_avg_sq"]) <= 1e-6


def test_no_bias_correction_and_betas():
    # bias_correction=False: torch has no switch; check against the formula in fp64.
    n = 999
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen)
    p64, m64, v64 = p.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    h = AdamHyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05, bias_correction=False)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        adam_step_flat(p, g, m, v, AdamStep(step=step, hyper=h))
        g64 = g.double()
        p64 = p64 * (1 - h.lr * h.weight_decay)
        m64 = h.beta1 * m64 + (1 - h.beta1) * g64
        v64 = h.beta2 * v64 + (1 - h.beta2) * g64 * g64
        p64 = p64 - h.lr * m64 / (v64.sqrt() + h.eps)
    assert rel_max_diff(p, p64) <= 1e-6


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 1000, 100_003])
def test_variants_threads_and_tails_bit_identical(n, monkeypatch):
    """All ISAs, thread counts and tail lengths run the same IEEE operations: equal bits."""
    results = []
    for level in LEVELS:
        if ORDER[level] > ORDER[_C.detected_simd_level()]:
            continue
        monkeypatch.setenv("OFFLOADPP_SIMD", level)
        for threads in (1, 2, 3):
            gen = torch.Generator().manual_seed(2)
            p = torch.randn(n, generator=gen).to(torch.bfloat16)
            m, v = torch.zeros(n), torch.zeros(n)
            out = torch.empty(n, dtype=torch.float16)
            h = AdamHyper(lr=1e-2, weight_decay=0.01, adamw_mode=False)
            for step in range(1, 4):
                g = torch.randn(n, generator=gen).to(torch.float16)
                adam_step_flat(
                    p,
                    g,
                    m,
                    v,
                    AdamStep(step=step, hyper=h, grad_scale=4.0, clip_coef=0.7, num_threads=threads),
                    half_out=out,
                )
            results.append((level, threads, [bits(t).clone() for t in (p, m, v, out)]))
    base = results[0][2]
    for level, threads, got in results[1:]:
        for name, a, b in zip(("params", "exp_avg", "exp_avg_sq", "half_out"), got, base):
            assert torch.equal(a, b), f"{name} differs for {level} x{threads} threads"


def emulate_half_params(p_half, grads, *, lr=1e-3, wd=0.0):
    """torch AdamW with fp32 states on a 16-bit param: read, step in fp32, round back each step."""
    master = p_half.float().requires_grad_()
    opt = torch.optim.AdamW([master], lr=lr, weight_decay=wd)
    cur = p_half.clone()
    for g in grads:
        with torch.no_grad():
            master.copy_(cur.float())
        master.grad = g.float()
        opt.step()
        cur = master.detach().to(p_half.dtype)
    return cur


@functools.cache
def half_case(dtype, gdtype, n):
    """Inputs and torch's result for test_half_params, shared by the SIMD variants (read-only)."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen).to(dtype)
    grads = [torch.randn(n, generator=gen).to(gdtype) for _ in range(10)]
    return p0, grads, emulate_half_params(p0, grads)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "n, gdtype",
    [(n, g) for n in (22, 64, 128, 1024) for g in ("param", *ALL)] + [(1 << 20, "param")],
    ids=lambda x: DT_IDS.get(x, str(x)),
)
def test_half_params(simd, dtype, gdtype, n):
    """DeepSpeed's sizes; grads in the params' dtype (as DeepSpeed) and, on the small sizes, in each dtype."""
    gdtype = dtype if gdtype == "param" else gdtype
    p0, grads, ref = half_case(dtype, gdtype, n)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        adam_step_flat(p, g, m, v, AdamStep(step=step, hyper=AdamHyper()))
    # DeepSpeed's tolerance (tests/unit/ops/adam/test_cpu_adam.py): param norms within 1% ...
    tol = p.float().norm().item() * 1e-2
    assert abs(p.float().norm().item() - ref.float().norm().item()) <= tol
    # ... and, tighter, every element within a couple of its own ulps of the emulation.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert ((p.float() - ref.float()).abs() <= 2 * ulp * ref.float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_half_states(simd, dtype):
    """fp32_optimizer_states=False: moments in the params' dtype track fp32 moments (5%, as DeepSpeed)."""
    n = 1024
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(n, generator=gen).to(dtype)
    pa, pb = base.clone(), base.clone()
    ma, va = torch.zeros(n), torch.zeros(n)
    mb, vb = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen).to(dtype)
        adam_step_flat(pa, g, ma, va, AdamStep(step=step, hyper=AdamHyper()))
        adam_step_flat(
            pb, g, mb, vb, AdamStep(step=step, hyper=AdamHyper(eps=1e-4 if dtype == torch.float16 else 1e-8))
        )
    assert abs(pa.float().norm() - pb.float().norm()) <= pa.float().norm() * 5e-2


@pytest.mark.parametrize("out_dtype", HALF, ids=["bf16", "fp16"])
def test_half_out_is_rounded_updated_params(simd, out_dtype):
    n = 4099
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen) * 100
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.full((n,), float("nan"), dtype=out_dtype)
    adam_step_flat(p, torch.randn(n, generator=gen), m, v, AdamStep(step=1, hyper=AdamHyper()), half_out=out)
    assert torch.equal(bits(out), bits(p.to(out_dtype)))


def test_half_out_streamed_and_unaligned():
    # Large enough for non-temporal stores (auto mode), at an odd element offset.
    n = (4 << 20) + 37
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    buf = torch.empty(n + 1, dtype=torch.bfloat16)
    out = buf[1:]
    adam_step_flat(p, torch.randn(n, generator=gen), m, v, AdamStep(step=1, hyper=AdamHyper()), half_out=out)
    assert torch.equal(bits(out), bits(p.to(torch.bfloat16)))


def test_grad_scale_and_clip_coef_equal_prescaled_grads(simd):
    n = 5000
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1024
    scale, clip = 1024.0, 0.25
    a, b = p0.clone(), p0.clone()
    ma, va, mb, vb = (torch.zeros(n) for _ in range(4))
    h = AdamHyper(weight_decay=0.1)
    adam_step_flat(a, g, ma, va, AdamStep(step=1, hyper=h, grad_scale=scale, clip_coef=clip))
    # Power-of-two factors: pre-scaling is exact, so results are bit-identical.
    adam_step_flat(b, g * (clip / scale), mb, vb, AdamStep(step=1, hyper=h))
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb)


@pytest.mark.parametrize("gdtype", ALL, ids=["g32", "g_bf16", "g16"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 17, 5_000, 99_999])
def test_check_finite_skips_update(simd, gdtype, bad, where):
    n = 100_000
    gen = torch.Generator().manual_seed(8)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(gdtype)
    g[where] = bad
    m, v = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    out = torch.zeros(n, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v, out)]
    ok = adam_step_flat(p, g, m, v, AdamStep(step=3, hyper=AdamHyper()), half_out=out, check_finite=True)
    assert ok is False
    for a, b in zip((p, m, v, out), before):
        assert torch.equal(bits(a), bits(b))
    g[where] = 1.0
    assert adam_step_flat(p, g, m, v, AdamStep(step=3, hyper=AdamHyper()), check_finite=True) is True
    assert not torch.equal(p, before[0])


def test_check_finite_sees_overflow_after_unscale():
    n = 1000
    p, g, m, v = torch.ones(n), torch.full((n,), 3e38), torch.zeros(n), torch.zeros(n)
    # 3e38 * 4 overflows fp32: the grads the update would use are not finite.
    assert (
        adam_step_flat(p, g, m, v, AdamStep(step=1, hyper=AdamHyper(), grad_scale=0.25), check_finite=True)
        is False
    )
    assert torch.equal(p, torch.ones(n))


@pytest.mark.parametrize("dtype", ALL, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 31, 1000, 300_001])
def test_squared_norm(simd, dtype, n):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, generator=gen).to(dtype)
    want = (x.double() ** 2).sum().item()
    assert math.isclose(squared_norm(x), want, rel_tol=1e-12)
    assert math.isclose(squared_norm(x, num_threads=1), want, rel_tol=1e-12)


def test_squared_norm_many_and_nonfinite(simd):
    gen = torch.Generator().manual_seed(10)
    xs = [
        torch.randn(n, generator=gen).to(dt)
        for n, dt in ((70_000, torch.float32), (3, torch.bfloat16), (100_000, torch.float16))
    ]
    want = sum((x.double() ** 2).sum().item() for x in xs)
    assert math.isclose(squared_norm(xs), want, rel_tol=1e-12)
    big = torch.full((10,), 3e38)  # squares overflow fp32, not the fp64 accumulator
    assert math.isclose(squared_norm(big), 10 * 3e38**2, rel_tol=1e-6)
    for bad, expect in ((float("inf"), math.inf), (float("nan"), None)):
        y = xs[2].clone()
        y[12_345] = bad
        got = squared_norm([xs[0], y])
        assert (got == expect) if expect is not None else math.isnan(got)
        assert not all_finite([xs[0], y])
    z = xs[0].clone()
    z[0], z[1] = float("inf"), float("nan")
    assert math.isnan(squared_norm(z))
    assert all_finite(xs) and all_finite(xs[0], mult=1e-3)
    assert squared_norm(torch.empty(0)) == 0.0


@pytest.mark.parametrize("gdt", ALL, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("half", [None, torch.bfloat16], ids=["fp32", "half_out"])
def test_adam_step_pieces_takes_the_norm_as_squared_norm_does(simd, gdt, half):
    """The fused norm is bit for bit squared_norm of the same pieces (not just close: the runtime
    takes a unit's norm one way when it speculates and the other when it defers, and the clip
    coefficient must not differ), and the update is bit for bit adam_step_flat's."""
    gen = torch.Generator().manual_seed(11)
    n = 300_007
    cuts = [(0, 70_001), (70_001, 70_004), (90_000, 250_000), (250_000, n)]  # a gap: not updated
    p0, m0, v0 = (
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen) * 0.1,
        torch.rand(n, generator=gen),
    )
    grads = [(torch.randn(b - a, generator=gen) * 3).to(gdt) for a, b in cuts]
    h = AdamHyper(lr=1e-2, weight_decay=0.1)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    out = torch.zeros(n, dtype=half) if half is not None else None
    sq = adam_step_pieces(p, m, v, [(a, b, g) for (a, b), g in zip(cuts, grads)], AdamStep(step=4, hyper=h, grad_scale=2.0, clip_coef=0.5, num_threads=2), half_out=out)  # fmt: skip
    assert sq == squared_norm(grads) and sq == squared_norm(grads, num_threads=1)
    want_p, want_m, want_v = p0.clone(), m0.clone(), v0.clone()
    want_out = torch.zeros(n, dtype=half) if half is not None else None
    for (a, b), g in zip(cuts, grads):
        adam_step_flat(want_p[a:b], g, want_m[a:b], want_v[a:b], AdamStep(step=4, hyper=h, grad_scale=2.0, clip_coef=0.5, num_threads=1), half_out=want_out[a:b] if half is not None else None)  # fmt: skip
    assert torch.equal(p, want_p) and torch.equal(m, want_m) and torch.equal(v, want_v)
    assert torch.equal(p[70_004:90_000], p0[70_004:90_000])  # the gap is left alone
    if half is not None:
        assert torch.equal(out, want_out)
    assert adam_step_pieces(p, m, v, [], AdamStep(step=5, hyper=h)) == 0.0
    with pytest.raises(ValueError, match="pieces\\[0\\]"):
        adam_step_pieces(p, m, v, [(0, 10, grads[0])], AdamStep(step=5, hyper=h))


def _f32_patterns() -> torch.Tensor:
    """Every sign/exponent/high mantissa, with the low 16 bits at rounding ties and their
    neighbours for both bf16 (bit 15) and fp16 (bits 13..15), plus random patterns."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor(
        [0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF],
        dtype=torch.int64,
    )
    pats = (hi[:, None] | lows[None, :]).flatten()
    rnd = torch.randint(
        0, 1 << 32, (1 << 20,), generator=torch.Generator().manual_seed(11), dtype=torch.int64
    )
    pats = torch.cat([pats, rnd])
    return (pats - ((pats >= (1 << 31)).long() << 32)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_convert_round_to_nearest_even(simd, dtype):
    x = _f32_patterns()
    got = torch.empty(x.numel(), dtype=dtype)
    convert_(got, x)
    want = x.to(dtype)
    nan = x.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got)[~nan], bits(want)[~nan])
    if dtype == torch.bfloat16:
        assert (bits(got)[nan] == 0x7FC0).all()  # as torch's c10::BFloat16
    # and back: every 16-bit pattern widens exactly
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    wide = torch.empty(every.numel())
    convert_(wide, every)
    ref = every.float()
    assert torch.equal(wide.isnan(), ref.isnan())
    assert torch.equal(bits(wide)[~ref.isnan()], bits(ref)[~ref.isnan()])


def _sequential_sum(parts, dtype):
    """The window's sums as runtime/window_grads.py made them before the kernel: the first part
    upcast, each next one added into the fp32 sum in order, rounded once."""
    s = parts[0].to(torch.float32, copy=True)
    for g in parts[1:]:
        s.add_(g)
    return s.to(dtype)


@pytest.mark.parametrize("src", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("dst", ALL, ids=["fp32", "bf16", "fp16"])
def test_sum_parts_equals_the_sequential_fp32_sum_bit_for_bit(simd, src, dst):
    """Several outputs in one call, each with its own number of parts (one included) and a tail
    no vector covers; values whose sum differs by order and overflows fp16 for a few elements.
    A sum in 16 bits, a tree over the parts or a part dropped changes bits (checked below)."""
    g = torch.Generator().manual_seed(5)
    sizes, ks = (100_003, 37, 1, 4096), (8, 3, 2, 1)
    parts = [[(torch.randn(n, generator=g) * 3e4 * torch.rand(n, generator=g) ** 8).to(src) for _ in range(k)]
             for n, k in zip(sizes, ks)]  # fmt: skip
    outs = [torch.empty(n, dtype=dst) for n in sizes]
    sum_parts_(list(zip(outs, parts)))
    for out, ps in zip(outs, parts):
        want = _sequential_sum(ps, dst)
        both = ~want.isnan()
        assert torch.equal(out.isnan(), want.isnan())
        assert torch.equal(bits(out)[both], bits(want)[both])
    # (the reference tells the alternatives apart on these values)
    ps = parts[0]
    in_16 = functools.reduce(lambda a, b: a + b, ps).to(dst)
    tree = (
        (ps[0].float() + ps[1])
        + (ps[2].float() + ps[3])
        + ((ps[4].float() + ps[5]) + (ps[6].float() + ps[7]))
    )
    assert not torch.equal(bits(outs[0]), bits(in_16))
    assert not torch.equal(bits(outs[0]), bits(tree.to(dst)))
    assert not torch.equal(bits(outs[0]), bits(_sequential_sum(ps[:-1], dst)))


def test_sum_parts_checks_its_arguments():
    a, b = torch.ones(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16)
    out = torch.empty(8)
    with pytest.raises(ValueError, match=r"parts\[0\] is empty"):
        sum_parts_([(out, [])])
    with pytest.raises(ValueError, match=r"parts\[0\]\[1\] has dtype"):
        sum_parts_([(out, [a, b])])
    with pytest.raises(ValueError, match=r"parts\[0\]\[0\] has 4 elements"):
        sum_parts_([(out, [a[:4]])])
    with pytest.raises(ValueError, match="fewer sources than k"):
        _C.adam_sum([out.data_ptr(), 8, 2, a.data_ptr()], 1, 0)


def test_bandwidth_floor_runs():
    n = 100_003
    p, g, m, v = (torch.randn(n) for _ in range(4))
    out = torch.empty(n, dtype=torch.bfloat16)
    before = p.clone()
    bandwidth_floor(p, g, m, v, half_out=out)
    assert torch.equal(p, before) and torch.equal(out, p.to(torch.bfloat16))


def test_adam_hyper_validation():
    for field, value in (
        ("lr", -1.0),
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("eps", -1e-8),
        ("weight_decay", -1),
        ("lr", float("nan")),
    ):
        with pytest.raises(ValueError, match=field):
            AdamHyper(**{field: value})
    with pytest.raises(ValueError, match="extra"):
        AdamHyper(lrr=1.0)
    h = AdamHyper(lr=1)
    with pytest.raises(ValueError):
        h.lr = 2.0  # frozen


def test_bad_input_names_the_argument():
    n = 10
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    h = AdamHyper()
    cases = [
        (dict(grads=torch.zeros(n + 1)), "grads"),
        (dict(exp_avg=torch.zeros(n, dtype=torch.float64)), "exp_avg"),
        (dict(exp_avg_sq=torch.zeros(2 * n)[::2]), "exp_avg_sq"),
        (dict(params=torch.zeros(n, dtype=torch.int32)), "params"),
        (dict(exp_avg=torch.zeros(n, dtype=torch.bfloat16)), "exp_avg"),  # fp32 params need fp32 states
        (dict(half_out=torch.zeros(n)), "half_out"),
        (dict(half_out=torch.zeros(n - 1, dtype=torch.bfloat16)), "half_out"),
        (dict(step=0), "step"),
        (dict(step=1.5), "step"),
        (dict(grad_scale=0.0), "grad_scale"),
        (dict(clip_coef=float("inf")), "clip_coef"),
        (dict(num_threads=0), "num_threads"),
        (dict(hyper=dict(lr=1e-3)), "hyper"),
        (dict(grads=[0.0] * n), "grads"),
    ]
    if torch.cuda.is_available():
        cases.append((dict(grads=torch.zeros(n, device="cuda")), "grads"))
    for change, name in cases:
        kw = dict(params=p, grads=g, exp_avg=m, exp_avg_sq=v, step=1, hyper=h)
        kw.update(change)
        with pytest.raises(ValueError, match=name):
            bufs = [kw.pop(k) for k in ("params", "grads", "exp_avg", "exp_avg_sq")]
            how = AdamStep(
                **{
                    k: kw.pop(k)
                    for k in ("step", "hyper", "grad_scale", "clip_coef", "num_threads")
                    if k in kw
                }
            )
            adam_step_flat(*bufs, how, **kw)
    with pytest.raises(ValueError, match="tensor"):
        squared_norm(torch.zeros(4, dtype=torch.float64))


def test_native_checks_raise_value_error():
    # The bindings check what the kernels assume even when called directly.
    seg = [0, 0, 0, 0, 0, 16]
    with pytest.raises(ValueError, match="params of segment 0 is null"):
        _C.adam_step(seg, 0, 0, 0, 3, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1)
    p = torch.zeros(16)
    seg = [p.data_ptr()] * 4 + [0, 16]
    with pytest.raises(ValueError, match="beta2"):
        _C.adam_step(seg, 0, 0, 0, 3, 1e-3, 0.9, 1.0, 1e-8, 0.0, True, True, 1)
    with pytest.raises(ValueError, match="unsupported dtype combination"):
        _C.adam_step(seg, 0, 0, 1, 3, 1e-3, 0.9, 0.99, 1e-8, 0.0, True, True, 1)


def test_releases_the_gil():
    """The main thread keeps running Python while a step runs in another thread."""
    n = 1 << 24
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    span = {}

    def work():
        span["t0"] = time.perf_counter()
        for step in range(1, 4):
            adam_step_flat(p, g, m, v, AdamStep(step=step, hyper=AdamHyper(), num_threads=1))
        span["t1"] = time.perf_counter()

    t = threading.Thread(target=work)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    inside = [x for x in ticks if span["t0"] < x < span["t1"]]
    duration = span["t1"] - span["t0"]
    assert len(inside) > 100
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    assert max(gaps) < 0.5 * duration


def test_default_threads_is_the_affinity():
    import os

    assert default_num_threads() == len(os.sched_getaffinity(0))


def test_concurrent_calls_from_many_threads():
    """Calls from several Python threads share the pool and each gets its own exact result."""
    n = 300_001
    h = AdamHyper(weight_decay=0.1)
    gen = torch.Generator().manual_seed(12)
    inputs = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen)) for _ in range(4)]
    want = []
    for p0, g in inputs:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step in range(1, 4):
            adam_step_flat(p, g, m, v, AdamStep(step=step, hyper=h, num_threads=1))
        want.append(p)
    got = [None] * len(inputs)

    def work(i):
        p, m, v = inputs[i][0].clone(), torch.zeros(n), torch.zeros(n)
        for step in range(1, 4):
            adam_step_flat(p, inputs[i][1], m, v, AdamStep(step=step, hyper=h, num_threads=3))
        got[i] = p

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_squared_norm_independent_of_threads():
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(13))
    ref = squared_norm(x, num_threads=1)
    assert all(squared_norm(x, num_threads=t) == ref for t in (2, 3, 8))


def _child_step(tensors, queue):
    # No torch ops here: torch's own OpenMP runtime is not fork-safe once its threads exist.
    p, g, m, v = tensors
    adam_step_flat(p, g, m, v, AdamStep(step=1, hyper=AdamHyper(lr=0.5), num_threads=2))
    queue.put(float(p.numpy().astype("float64").sum()))


def test_works_in_a_forked_child():
    """The pool's threads do not survive fork(); a child must get a fresh pool, not hang."""
    import multiprocessing as mp

    n = 200_000
    p, g, m, v = torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    child_tensors = (torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n))
    adam_step_flat(
        p, g, m, v, AdamStep(step=1, hyper=AdamHyper(lr=0.5), num_threads=2)
    )  # pool threads exist now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child_step, args=(child_tensors, q))
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert q.get(timeout=5) == float(p.numpy().astype("float64").sum())


def _crc(t: torch.Tensor) -> int:
    return _C.crc32c(t.data_ptr(), t.numel() * t.element_size())


# (2.1M: a bf16 copy of 4 MiB or more is written with non-temporal stores, after an aligning head)
@pytest.mark.parametrize("n", [1, 17, 1000, 100_003, 2_100_001])
@pytest.mark.parametrize("pieces", [False, True], ids=["flat", "pieces"])
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "crc32"])
@pytest.mark.parametrize("half", [None, torch.bfloat16], ids=["fp32", "half_out"])
def test_crc_in_the_adam_pass_is_the_buffers_crc_and_changes_nothing(
    simd, n, pieces, fold, half, monkeypatch
):
    """The fused Adam's CRC-32Cs (csrc/adam/adam_kernel.h, the CRC Note) equal crc32c of the
    moments as read and of the master and moments as written, over the whole buffers (elements
    no call covered included), and the update is bit for bit the one without them; with the
    AVX-512 kernels' folding (VPCLMULQDQ, where the CPU has it) and without."""
    from offloadpp.optim.kernels import CRC_STREAMS, StateCrcs

    monkeypatch.setenv("OFFLOADPP_CRC_FOLD", "1" if fold else "0")

    gen = torch.Generator().manual_seed(n)
    p, m = torch.randn(n + 64, generator=gen), torch.randn(n + 64, generator=gen)
    v, g = torch.rand(n + 64, generator=gen), torch.randn(n + 64, generator=gen)
    how = AdamStep(3, AdamHyper(lr=1e-2, weight_decay=0.1), clip_coef=0.5)
    ref = [t.clone() for t in (p, m, v)]
    m_in, v_in = _crc(m), _crc(v)
    # two ranges with a gap between them and untouched elements at both ends
    ranges = [(3, 3 + n // 2), (5 + n // 2, n + 40)] if n > 1 else [(3, 4)]
    out = torch.zeros(n + 64, dtype=half) if half is not None else None
    ref_out = torch.zeros(n + 64, dtype=half) if half is not None else None
    crcs = StateCrcs(p, m, v, CRC_STREAMS)
    if pieces:
        adam_step_pieces(p, m, v, [(a, b, g[a:b]) for a, b in ranges], how, half_out=out, crcs=crcs)
    else:
        for a, b in ranges:
            o = out[a:b] if out is not None else None
            adam_step_flat(p[a:b], g[a:b], m[a:b], v[a:b], how, half_out=o, crcs=crcs)
    for a, b in ranges:
        o = ref_out[a:b] if ref_out is not None else None
        adam_step_flat(ref[0][a:b], g[a:b], ref[1][a:b], ref[2][a:b], how, half_out=o)
    for got, want in zip((p, m, v, out), ref + [ref_out]):
        assert got is None or torch.equal(bits(got), bits(want))
    assert [crcs.whole(s) for s in CRC_STREAMS] == [m_in, v_in, _crc(p), _crc(m), _crc(v)]
    only_out = StateCrcs(p, m, v, ["master_out"])
    adam_step_flat(p, g, m, v, how, crcs=only_out)
    assert only_out.whole("master_out") == _crc(p)
    with pytest.raises(ValueError, match="not asked for"):
        only_out.whole("exp_avg_in")


def test_crc32c_combine_joins_pieces():
    a, b = torch.randn(1001), torch.randn(77)
    assert _C.crc32c_combine(_crc(a), _crc(b), b.numel() * 4) == _crc(torch.cat([a, b]))
