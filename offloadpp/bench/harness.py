"""Running plans for real, side by side, for the planner's accuracy and grid benchmarks.

Note: measuring on a shared machine. Step times here move with whatever else runs on the
cores and the disk. So every contender (one OffloadEngine per plan) and the model profile's
timing iterations run in one process, interleaved in blocks: each round runs `block` steps of
every contender in turn, each block between two timing iterations of the plain model; a block's
first step is not counted
(the engine's previous writes were drained before it, so it is faster than a steady step); the
store is drained between blocks so one contender's writes do not land in the next one's steps;
the order of the contenders rotates from round to round.
The model profile's per-unit times are medians over all rounds, so the prediction sees the
same load as the measurement.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from offloadpp.planner.model_profile import ModelProfile


@dataclass(frozen=True)
class GPT2Shape:
    n_layer: int
    n_embd: int
    n_head: int = 8
    vocab_size: int = 8192
    micro_batch: int = 1
    seq_len: int = 64

    @property
    def label(self) -> str:
        return f"gpt2 L{self.n_layer} d{self.n_embd} b{self.micro_batch}x{self.seq_len}"

    def hf_config(self) -> dict:
        return {"model_type": "gpt2", "n_layer": self.n_layer, "n_embd": self.n_embd, "n_head": self.n_head,
                "vocab_size": self.vocab_size, "n_positions": max(128, self.seq_len)}  # fmt: skip

    def build(self, seed: int = 0):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(**{k: v for k, v in self.hf_config().items() if k != "model_type"},
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(cfg)

    def batch(self, seed: int = 1):
        import torch

        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab_size, (self.micro_batch, self.seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}


@dataclass
class Contender:
    name: str
    plan: object  # offloadpp.planner.Plan
    engine: object = None
    times: list = field(default_factory=list)
    reports: list = field(default_factory=list)
    round_times: list = field(default_factory=list)  # per round of run_interleaved, the block's timed steps

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def make_engines(model, contenders: Sequence[Contender], root: str, *, ssd_gbps: tuple[float, float],
                 adam_threads: int = 1, gradient_clipping: float = 0.0, accumulation: int = 1) -> None:  # fmt: skip
    """One OffloadEngine per contender, each over its own copy of `model` and swap directory,
    running the contender's plan as it is (a plan without budgets gets its schedule's peaks)."""
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings, with_peak_budgets
    from offloadpp.runtime import OffloadEngine, RuntimeConfig

    for i, c in enumerate(contenders):
        d = os.path.join(root, f"c{i}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        settings = Settings(compute_dtype=c.plan.compute_dtype, adam_threads=adam_threads,
                            gradient_clipping=gradient_clipping, gradient_accumulation_steps=accumulation)  # fmt: skip
        cfg = RuntimeConfig(nvme_paths=[d], settings=settings, device=c.plan.device, log_every=0,
                            ssd_read_gbps=ssd_gbps[0], ssd_write_gbps=ssd_gbps[1])  # fmt: skip
        plan = c.plan if c.plan.budgets is not None else with_peak_budgets(c.plan)
        c.engine = OffloadEngine(copy.deepcopy(model), cfg, plan, hyper=AdamHyper(lr=1e-4))


def _engine_step(c: Contender, batch: dict, timed: bool) -> None:
    e = c.engine
    batch = {k: v.to(e.device.torch_device) for k, v in batch.items()}  # the plan's device (CUDA or CPU)
    t0 = time.perf_counter()
    e.backward(e(**batch).loss)
    r = e.step()
    dt = time.perf_counter() - t0
    if timed:
        c.times.append(dt)
        c.reports.append(r)


@dataclass
class Rounds:
    """What run_interleaved measured besides the contenders' steps: per round, the model profile
    (per-unit times from the plain model's iterations of that round) and the SSD GB/s probed."""

    profiles: list = field(default_factory=list)
    ssd_gbps: list = field(default_factory=list)  # mixed GB/s with compute and Adam beside it


WARMUP_STEPS = 2  # each contender's steps before the rounds (first steps allocate, read cold files)


def run_interleaved(
    contenders: Sequence[Contender],
    model,
    batch: dict,
    *,
    rounds: int = 6,
    block: int = 3,
    probe_dirs: Optional[Sequence[str]] = None,
    name: str = "",
    log=None,
) -> Rounds:
    """Runs every contender's engine `rounds` x `block` steps (the first of each block not
    counted), each block between two timing iterations of a plain copy of `model`, after
    WARMUP_STEPS steps of each."""
    from offloadpp.profiling.model import ModelProfiler

    say = log or (lambda msg: None)
    out = Rounds()
    with ModelProfiler(copy.deepcopy(model), batch, name=name, runtime_layout=True) as prof:
        prof.count()
        gemms = prof.profile().gemms
        for c in contenders:
            for _ in range(WARMUP_STEPS):
                _engine_step(c, batch, timed=False)
            c.engine.optimizer.finish()
            c.engine.store.wait_all()
        for r in range(rounds):
            order = list(contenders[r % len(contenders) :]) + list(contenders[: r % len(contenders)])
            for c in order:  # rotated: no contender always runs first after the probe
                prof.time(1)
                n0 = len(c.times)
                for s in range(block):
                    _engine_step(c, batch, timed=s > 0)
                c.round_times.append(c.times[n0:])
                c.engine.optimizer.finish()
                c.engine.store.wait_all()
                prof.time(1)  # and once after: the block's steps sit between two plain iterations
            out.profiles.append(prof.profile(last=2 * len(contenders)))
            if probe_dirs:
                out.ssd_gbps.append(probe_ssd(probe_dirs, gemms=gemms))
            say(
                f"  round {r + 1}/{rounds}: "
                + ", ".join(f"{c.name} {statistics.median(c.times):.3f}s" for c in contenders)
            )
    return out


def probe_ssd(dirs: Sequence[str], gemms=None, adam_threads: int = 1, total_bytes: int = 192 << 20) -> float:
    """A short mixed read+write GB/s probe with compute and Adam running beside it (the
    hardware profile's ssd_mixed_busy_gbps), between rounds of a benchmark."""
    from offloadpp.profiling.hardware import DEFAULT_GEMMS, Busy, measure_mixed_ssd

    return measure_mixed_ssd(dirs, tensor_bytes=12 << 20, total_bytes=total_bytes, repeats=1,
                             busy=Busy(gemms or DEFAULT_GEMMS, adam_threads))  # fmt: skip


def with_ssd(hw, mixed_busy_gbps: float):
    """The hardware profile with a probe's mixed-while-busy SSD rate."""
    return replace(hw, ssd_mixed_busy_gbps=mixed_busy_gbps)


def merge_profiles(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """The first profile's counts with each unit's median time over all profiles."""
    first = profiles[0]
    units = []
    for i, u in enumerate(first.units):
        f = statistics.median(p.units[i].forward_s for p in profiles)
        b = statistics.median(p.units[i].backward_s for p in profiles)
        units.append(replace(u, forward_s=f, backward_s=b))
    return replace(first, units=tuple(units))


def close_all(contenders: Sequence[Contender]) -> None:
    for c in contenders:
        if c.engine is not None:
            c.engine.close()
            c.engine = None


def quick_hardware(dirs: Sequence[str], log=None, total_bytes: int = 256 << 20, gemms=None):
    """A hardware profile measured now (no I/O grid), for benchmarks that predict and measure in
    one run; `gemms`: the model's GEMM shapes (FLOP/s and contention measured with them)."""
    from offloadpp.profiling.hardware import profile_hardware

    for d in dirs:
        os.makedirs(d, exist_ok=True)
    return profile_hardware(dirs, io_grid=False, total_bytes=total_bytes, log=log, gemms=gemms)


def rel_err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def fmt_ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def steady_reports(reports: list) -> list:
    """The steps of a run whose bytes are a steady step's: not the first (it reads the initial
    weights), nor, with deferred updates, the second (it applies the first's updates at their
    visits with the state the first step left in memory); the last where there are no more."""
    return reports[2:] if len(reports) > 2 else reports[-1:]


def steps_updates(reports) -> str:
    """How most of `reports` (StepReports) ran their updates (StepReport.updates): the way the
    cost model's figure set beside their bytes must replay ("" where there are none)."""
    import collections

    ways = collections.Counter(r.updates for r in reports if r is not None)
    return ways.most_common(1)[0][0] if ways else ""


def modelled_ssd_by_kind(runtime, hf_config: Optional[dict], updates: str = "", window: bool = False,
                         one_step: bool = False):  # fmt: skip
    """(the cost model's SSD bytes by kind for the plan `runtime` (an OffloadEngine) runs, where
    they come from), for a benchmark to print beside what the step measured. `updates`: how the
    measured steps ran theirs (steps_updates): a speculative plan's steps that deferred (they
    clipped) are set beside the replay of a deferred step, which moves other bytes under other
    kinds (the gradients through their home and back) than the step that validates the plan's
    own estimate replays. The engine's own estimate where its plan was made with profiles; else
    a replay of its plan with the analytic model profile and the cached hardware profile, or
    without one the rates the engine measured at start and DESIGN.md's figures for the rest: the
    bytes a replay moves follow the plan's schedule, not the rates. window: the steps were vertical
    windows (train_batch), replayed as the planner replays one (planner/vertical.py: the window's
    plan and model profile, one step). one_step: instead, one step of G = 1 with the same plan (its
    window's placements and policies, one micro-batch): what issue 33 holds a window's bytes to
    (at most 1.3x). ((), why) where no model profile can be made."""
    import os as _os

    from offloadpp.planner import HardwareProfile, PlanError, default_profile_path, estimate
    from offloadpp.planner.resolve import model_profile_for

    deferred = updates == "deferred" and runtime.plan.speculative
    predicted = None if one_step else runtime.predicted_for(updates, window)
    if predicted is not None and predicted.ssd_by_kind:
        return predicted.ssd_by_kind, "the plan's estimate" + (" of a deferred step" if deferred else "")
    plan, s = runtime.plan, runtime.settings
    try:
        model = model_profile_for(hf_config, plan.units, s)
    except PlanError as e:
        return (), f"no model profile: {e}"
    if _os.path.isfile(default_profile_path()):
        hw, src = (
            HardwareProfile.from_json(default_profile_path()),
            "a replay with the cached hardware profile",
        )
    else:
        cores = _os.cpu_count() or 1
        hw = HardwareProfile(
            device=plan.device, device_name="(bytes only)", cpu_cores=cores, ssd_read_gbps=runtime.ssd_read_gbps,
            ssd_write_gbps=runtime.ssd_write_gbps, h2d_gbps=20.0, d2h_gbps=20.0, memcpy_gbps=35.0,
            device_flops_per_s={s.compute_dtype: 85e9 * cores}, adam_params_per_s={cores: 1.2e9},
            host_memory_bytes=24 << 30, device_memory_bytes=24 << 30,
        )  # fmt: skip
        src = "a replay at the engine's measured SSD rates"
    micro = s.gradient_accumulation_steps
    if one_step and plan.vertical:
        from dataclasses import replace as _replace

        from offloadpp.planner.vertical import window_plan

        plan, micro = _replace(window_plan(plan), micro_batches=1), 1
        src += " of one step of G = 1 with the window's plan"
    elif window and plan.vertical:
        from offloadpp.planner.vertical import window_plan, window_profile

        plan, model, micro = window_plan(plan), window_profile(model, micro), 1
        src += " of the vertical window"
    est = estimate(plan, hw, model, adam_threads=s.adam_threads or 1, micro_batches=micro,
                   act_prefetch_units=s.activations.prefetch_units, deferred=deferred)  # fmt: skip
    return est.ssd_by_kind, src + (" (a deferred step)" if deferred else "")
