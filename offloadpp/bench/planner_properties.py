"""The planner on machines it was not tuned to: properties checked over seeded random profiles.

    offloadpp bench planner-properties [--seed 0] [--profiles 32] [--models gpt3-13b,llama-7b]
        [--batches 1,2,4,8,16,32,64,128] [--more 1] [--json out.json]

Each profile is drawn at random within plausible ranges (`random_profile`: SSD read 3-100 GB/s
and write 1-60 GB/s over 1-16 drives, host<->device 8-64 GB/s, memcpy 8-80 GB/s, device memory
8-80 GiB, host memory 32-2048 GiB, device 20-1000 TFLOP/s, CPU Adam rates, fp16 or bf16) from
`random.Random(seed + i)`, so profile i is the same whatever else the run asks. For each profile
and model the resolve stage plans every micro-batch as `offloadpp plan --machine-from-hardware`
does (docs/paper/ds_config.json's settings, sequence 1024), and the properties are checked:

- batch: the time per token never grows by more than BATCH_SLACK when the micro-batch doubles,
  unless the larger one is refused (and a refused micro-batch is never followed by a planned
  larger one);
- more: at one micro-batch per (profile, model), `--more` of the resources (host memory,
  device memory, SSD, link, Adam; twice as much, the rest unchanged) each never make the estimate
  slower by more than MORE_SLACK, nor refuse what was planned;
- hand: the automatic plan is never more than HAND_SLACK slower than the best of the nine
  hand-written placements of `bench planner-grid` (planner_grid.hand_plans) on the same budgets,
  each with the default rule's activations for the room it leaves and with the automatic plan's
  own activations where they fit, all estimated by the same replay;
- time: planning a point takes under PLAN_S seconds of CPU time (process time: on a shared
  machine the wall clock measures the neighbours). The CPU time of the same planning moves with
  the machine (25% between two days), so each point also reports the replays it made
  (cost.replays_made): the planner's work, which only a change to the planner moves.

Every violation is printed with what reproduces it (the seed, the profile's index, model and
micro-batch); tests/test_planner_properties.py runs a small slice in the default test run and
pins each violation found on the way as a test of its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Optional

BATCH_SLACK = 0.05
MORE_SLACK = 0.01
HAND_SLACK = 0.05
PLAN_S = 2.0
SEQ_LEN = 1024
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
PAPER = os.path.join("docs", "paper")
CONFIG = os.path.join(PAPER, "ds_config.json")
# a 7B Llama shape (Llama-2 7B's config.json, the fields the analytic profile reads)
LLAMA_7B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}  # fmt: skip
RESOURCES = ("host memory", "device memory", "ssd", "link", "adam")
GiB = 1 << 30


def model_config(name: str) -> dict:
    """gpt3-13b (docs/paper), llama-7b; NAME@L: the same shape cut to L layers (the test's slice)."""
    base, _, layers = name.partition("@")
    if base == "llama-7b":
        cfg = dict(LLAMA_7B)
    elif base in ("gpt3-13b", "gpt3-175b"):
        with open(os.path.join(PAPER, f"{base}.config.json")) as f:
            cfg = json.load(f)
    else:
        raise ValueError(
            f"planner-properties: unknown model {name!r} (gpt3-13b, gpt3-175b, llama-7b, NAME@LAYERS)"
        )
    if layers:
        key = "n_layer" if "n_layer" in cfg else "num_hidden_layers"
        cfg[key] = int(layers)
    return cfg


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def random_profile(seed: int):
    """A CUDA machine's hardware profile drawn within the ranges of the module's docstring, and
    the compute dtype to plan it with. The aggregate SSD rates are at most the drives' sum."""
    from offloadpp.planner import HardwareProfile
    from offloadpp.planner.hardware import SsdProfile

    rng = random.Random(seed)
    n = rng.randint(1, 16)
    read = _log_uniform(rng, 3, 100)
    write = _log_uniform(rng, 1, 60)
    # each drive at least its share; the aggregate up to 100% of their sum (a PCIe root's ceiling)
    share = rng.uniform(1.0, 2.0)
    ssds = tuple(SsdProfile(f"/nvme{i}", read / n * share, write / n * share, 4 * 10**12) for i in range(n))
    link = _log_uniform(rng, 8, 64)
    flops = _log_uniform(rng, 20e12, 1000e12)
    cores = rng.choice((8, 16, 32, 48, 64, 128))
    per_thread = _log_uniform(rng, 0.1e9, 0.5e9)
    peak = min(per_thread * cores, _log_uniform(rng, 1e9, 20e9))
    adam = {1: per_thread, cores: max(per_thread, peak)}
    hw = HardwareProfile(
        device="cuda", device_name=f"random profile {seed}", cpu_cores=cores, ssd_read_gbps=read,
        ssd_write_gbps=write, h2d_gbps=link, d2h_gbps=link * rng.uniform(0.8, 1.0),
        memcpy_gbps=_log_uniform(rng, 8, 80),
        device_flops_per_s={"fp32": flops / 2, "bf16": flops, "fp16": flops},
        adam_params_per_s=adam, host_memory_bytes=int(_log_uniform(rng, 32, 2048) * GiB),
        device_memory_bytes=int(_log_uniform(rng, 8, 80) * GiB), ssds=ssds, ssd_latency_s=1e-4,
        io_issue_s=2e-5,
    )  # fmt: skip
    return hw, rng.choice(("fp16", "bf16"))


def more(hw, resource: str):
    """`hw` with twice as much of one resource, the rest unchanged."""
    if resource == "host memory":
        return replace(hw, host_memory_bytes=hw.host_memory_bytes * 2)
    if resource == "device memory":
        return replace(hw, device_memory_bytes=hw.device_memory_bytes * 2)
    if resource == "ssd":
        return replace(hw, ssd_read_gbps=hw.ssd_read_gbps * 2, ssd_write_gbps=hw.ssd_write_gbps * 2,
                       ssd_mixed_gbps=hw.ssd_mixed_gbps * 2, ssd_mixed_busy_gbps=hw.ssd_mixed_busy_gbps * 2,
                       ssds=tuple(replace(d, read_gbps=d.read_gbps * 2, write_gbps=d.write_gbps * 2)
                                  for d in hw.ssds))  # fmt: skip
    if resource == "link":
        return replace(hw, h2d_gbps=hw.h2d_gbps * 2, d2h_gbps=hw.d2h_gbps * 2)
    if resource == "adam":
        return replace(hw, adam_params_per_s={k: v * 2 for k, v in hw.adam_params_per_s.items()})
    raise ValueError(f"planner-properties: unknown resource {resource!r} ({', '.join(RESOURCES)})")


@dataclass
class Point:
    """One plan: a profile, a model, a micro-batch."""

    model: str
    micro_batch: int
    dtype: str
    step_s: Optional[float] = None  # None: refused
    refused: str = ""
    plan_cpu_s: float = 0.0
    replays: int = 0  # cost.replay calls planning it made (the slow SSD's included)
    resolved: object = field(default=None, repr=False)
    profile: object = field(default=None, repr=False)

    @property
    def per_token_s(self) -> float:
        return self.step_s / (self.micro_batch * SEQ_LEN)


def plan_point(hw, model: str, batch: int, dtype: str, config: str = CONFIG) -> Point:
    """The resolve stage's plan for one point, as `offloadpp plan --machine-from-hardware`."""
    from offloadpp.bench.planner_scale import _settings
    from offloadpp.planner import InfeasibleError, analytic_profile, resolve
    from offloadpp.planner.cost import replays_made
    from offloadpp.planner.peaks import clear_cache
    from offloadpp.planner.resolve import machine_for

    prof = analytic_profile(
        model_config(model), micro_batch=batch, seq_len=SEQ_LEN, compute_dtype=dtype, name=model
    )
    settings = _settings(config, dtype, batch)
    clear_cache()  # each point plans from nothing, as `offloadpp plan` does
    n0, t0 = replays_made(), time.process_time()
    try:
        r = resolve(settings, prof.unit_specs(), machine_for(hw), hardware=hw, model=prof)
    except InfeasibleError as e:
        return Point(model, batch, dtype, refused=str(e), plan_cpu_s=time.process_time() - t0,
                     replays=replays_made() - n0, profile=prof)  # fmt: skip
    took = time.process_time() - t0
    return Point(model, batch, dtype, r.estimate.step_s, plan_cpu_s=took, replays=replays_made() - n0, resolved=r,
                 profile=prof)  # fmt: skip


def batch_violations(points: list[Point]) -> list[str]:
    """Per-token time along doubling micro-batches (points sorted by micro-batch)."""
    out = []
    for a, b in zip(points, points[1:]):
        if b.micro_batch != 2 * a.micro_batch:
            continue
        if a.step_s is None and b.step_s is not None:
            out.append(f"b{a.micro_batch} refused but b{b.micro_batch} planned")
        elif (
            a.step_s is not None
            and b.step_s is not None
            and b.per_token_s > a.per_token_s * (1 + BATCH_SLACK)
        ):
            out.append(f"b{b.micro_batch} {b.per_token_s / a.per_token_s:.3f}x the time per token of b{a.micro_batch} "
                       f"({b.step_s:.3f} s against {a.step_s:.3f} s)")  # fmt: skip
    return out


def more_violation(base: Point, richer: Point, resource: str) -> Optional[str]:
    if base.step_s is None:
        return None
    if richer.step_s is None:
        return f"b{base.micro_batch}: twice the {resource} refuses what was planned ({richer.refused[:120]})"
    if richer.step_s > base.step_s * (1 + MORE_SLACK):
        return (f"b{base.micro_batch}: twice the {resource} makes the step {richer.step_s / base.step_s:.3f}x "
                f"({richer.step_s:.3f} s against {base.step_s:.3f} s)")  # fmt: skip
    return None


def hand_estimates(hw, point: Point) -> list[tuple[str, float]]:
    """The hand-written placements of `bench planner-grid` that fit the automatic plan's budgets,
    each with the best of its activations (the default rule's for its room, the automatic plan's
    where they fit), estimated as the automatic plan is (its settings, speculation included)."""
    from offloadpp.bench.planner_grid import hand_plans
    from offloadpp.planner.activations import need_bytes
    from offloadpp.planner.cost import estimate
    from offloadpp.planner.decide import activation_choice
    from offloadpp.planner.peaks import peak_bytes
    from offloadpp.planner.resolve import _request, machine_for
    from offloadpp.planner.search import act_planner
    from offloadpp.planner.spec import Budgets

    r = point.resolved
    auto = r.plan
    b = auto.budgets
    total = Budgets(b.device_bytes, b.host_bytes)
    machine = machine_for(hw)
    acts = act_planner(point.profile, _request(r.settings, total, machine), hw.device)
    own = dict(zip([u.name for u in auto.units], auto.activations))
    cap = (
        b.device_bytes - 1
        if r.settings.activations.budget_bytes is None
        else r.settings.activations.budget_bytes
    )
    out = []
    made = hand_plans(auto.units, total, settings=r.settings, device=hw.device, fit=False)
    for label, h in made:
        # (grafted on the automatic plan: its speculation, I/O settings, stripes and threads)
        hand = replace(auto, placements=h.placements, prefetch_depth=h.prefetch_depth,
                       optim_prefetch_depth=h.optim_prefetch_depth)  # fmt: skip
        dev, host = peak_bytes(hand)
        if dev > b.device_bytes or host > b.host_bytes:
            continue
        room = min(cap, b.device_bytes - dev)
        choices = []
        rule = activation_choice(acts, room)
        if rule is not None:
            choices.append(tuple(p for _, p in rule.policies))
        if need_bytes(acts.units, own) <= room:
            choices.append(tuple(auto.activations))
        best = math.inf
        for pol in choices:
            plan = replace(
                hand, activations=pol, budgets=Budgets(b.device_bytes, b.host_bytes, activation_bytes=room)
            )
            e = estimate(plan, hw, point.profile, adam_threads=r.settings.adam_threads,
                         micro_batches=r.settings.gradient_accumulation_steps,
                         act_prefetch_units=r.settings.activations.prefetch_units)  # fmt: skip
            best = min(best, e.step_s)
        if best < math.inf:
            out.append((label, best))
    return out


def hand_violation(hw, point: Point) -> Optional[str]:
    if point.step_s is None:
        return None
    hands = hand_estimates(hw, point)
    if not hands:
        return None
    label, best = min(hands, key=lambda h: h[1])
    if point.step_s > best * (1 + HAND_SLACK):
        return (f"b{point.micro_batch}: auto {point.step_s:.3f} s is {point.step_s / best:.3f}x the hand-written "
                f"{label!r} ({best:.3f} s)")  # fmt: skip
    return None


def time_violation(point: Point) -> Optional[str]:
    if point.plan_cpu_s > PLAN_S:
        return f"b{point.micro_batch}: planned in {point.plan_cpu_s:.2f} s of CPU (bar {PLAN_S:g} s)"
    return None


@dataclass
class Report:
    profiles: int = 0  # done
    points: int = 0
    planned: int = 0
    checks: dict = field(default_factory=lambda: {k: 0 for k in ("batch", "more", "hand", "time")})
    violations: list = field(default_factory=list)  # (property, seed, model, dtype, message)
    # every point planned or refused: (seed, model, dtype, micro-batch, estimate s or None, CPU s,
    # replays),
    # so a sweep's slowest points can be found and replanned alone (`--seed S --profiles 1`)
    times: list = field(default_factory=list)


def sweep(seed: int, profiles: int, models: list[str], batches: tuple[int, ...], n_more: int = 1,
          properties: tuple[str, ...] = ("batch", "more", "hand", "time"), log=None, after=None) -> Report:  # fmt: skip
    """Every property over `profiles` random profiles (seeds seed .. seed + profiles - 1);
    `after(report)` is called after each profile (a long sweep stopped early keeps what it did)."""
    rep = Report()
    for i in range(profiles):
        hw, dtype = random_profile(seed + i)
        rng = random.Random(f"more-{seed + i}")
        for model in models:
            pts = [plan_point(hw, model, b, dtype) for b in sorted(batches)]
            rep.points += len(pts)
            rep.times += [
                (seed + i, model, dtype, p.micro_batch, p.step_s, round(p.plan_cpu_s, 4), p.replays)
                for p in pts
            ]
            rep.planned += sum(p.step_s is not None for p in pts)

            def bad(prop: str, msg: Optional[str], _s=seed + i, _m=model, _d=dtype) -> None:
                if msg is not None:
                    rep.violations.append((prop, _s, _m, _d, msg))
                    if log:
                        log(f"VIOLATION {prop}: profile seed {_s}, {_m} {_d}: {msg}")

            if "batch" in properties:
                rep.checks["batch"] += len(pts) - 1
                for msg in batch_violations(pts):
                    bad("batch", msg)
            for p in pts:
                if "time" in properties:
                    rep.checks["time"] += 1
                    bad("time", time_violation(p))
                if "hand" in properties and p.step_s is not None:
                    rep.checks["hand"] += 1
                    bad("hand", hand_violation(hw, p))
            planned = [p for p in pts if p.step_s is not None]
            if "more" in properties and planned:
                p = rng.choice(planned)
                for resource in rng.sample(RESOURCES, min(n_more, len(RESOURCES))):
                    rep.checks["more"] += 1
                    bad(
                        "more",
                        more_violation(
                            p, plan_point(more(hw, resource), model, p.micro_batch, dtype), resource
                        ),
                    )
            if log:
                steps = ", ".join(f"b{p.micro_batch} {p.step_s:.2f}" if p.step_s else f"b{p.micro_batch} refused"
                                  for p in pts)  # fmt: skip
                log(f"profile {seed + i} ({dtype}) {model}: {steps}")
        rep.profiles += 1
        if after:
            after(rep)
    return rep


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="profile i is drawn from seed + i")
    p.add_argument("--profiles", type=int, default=32)
    p.add_argument(
        "--models", default="gpt3-13b,llama-7b", help="comma-separated (gpt3-13b, llama-7b, NAME@LAYERS)"
    )
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="micro-batches, comma-separated")
    p.add_argument("--more", type=int, default=1, help="resources doubled per profile and model")
    p.add_argument("--properties", default="batch,more,hand,time")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    models = args.models.split(",")
    batches = tuple(int(b) for b in args.batches.split(","))
    props = tuple(args.properties.split(","))

    def dump(rep: Report) -> None:
        if not args.json:
            return
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "args": {k: v for k, v in vars(args).items() if not callable(v)}, "profiles_done": rep.profiles, "points": rep.points,
                       "planned": rep.planned, "checks": rep.checks, "violations": rep.violations,
                       "times": rep.times,
                       "wall_s": time.perf_counter() - t0}, f, indent=2)  # fmt: skip

    rep = sweep(args.seed, args.profiles, models, batches, args.more, props,
                log=lambda m: print(m, file=sys.stderr, flush=True), after=dump)  # fmt: skip
    took = time.perf_counter() - t0
    print(f"{rep.points} points ({args.profiles} profiles x {len(models)} models x {len(batches)} micro-batches), "
          f"{rep.planned} planned; checks: " + ", ".join(f"{k} {v}" for k, v in rep.checks.items()) +
          f"; {len(rep.violations)} violations; {took:.0f} s")  # fmt: skip
    if rep.times:
        print(planning_summary(rep.times))
    for prop, s, m, dt, msg in rep.violations:
        print(f"  {prop}: seed {s} {m} {dt}: {msg}")
    return 1 if rep.violations else 0


def planning_summary(times: list) -> str:
    """The sweep's planning: its slowest point in CPU time and the one with the most replays (the
    margin to PLAN_S, and the work behind it: Report.times' rows)."""
    slow = max(times, key=lambda t: t[5])
    most = max(times, key=lambda t: t[6])
    edge = 0.85 * PLAN_S
    near = sum(t[5] > edge for t in times)
    return (f"planning: at most {slow[5]:.2f} s of CPU (profile {slow[0]} {slow[1]} b{slow[3]}; {slow[6]} replays), "
            f"{near} points over {edge:g} s; at most {most[6]} replays (profile {most[0]} {most[1]} b{most[3]}, "
            f"{most[5]:.2f} s); {sum(t[6] for t in times)} replays in all")  # fmt: skip
