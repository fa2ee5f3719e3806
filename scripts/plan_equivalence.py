"""Whether two source trees plan the same: the chosen plan and its estimates, point by point.

    python scripts/plan_equivalence.py OTHER_TREE [--random 40] [--seed 0] [--json out.json]

OTHER_TREE is a checkout of another commit (e.g. `git archive <commit> | tar -x -C /tmp/base`);
this tree is the second. Each tree plans every point in a fresh process (its offloadpp first on
PYTHONPATH), as `offloadpp bench planner-scale` and `bench planner-properties` do, and the script
compares what came out: the plan (its repr, notes included but the count of candidates the
search replayed), the estimate of its step, the deferred (clipped) step's, and a window's two
schedules' estimates (Plan.window_s), each to --rtol relative; a point refused must be refused
by both with the same message. Exit status 1 if any point differs.

The points: docs/paper's profiles (scripts/planning_time.py's: GPT-3 13B b8-b128 and 175B b8-b32,
their b8 with G = 4, 13B b8-b48 on the data-sheet profile), issue 33's windows (175B b8 with
clipping and speculation off, docs/paper/ds_config_clip_g4.json; 13B b32 G = 4 on one SSD), and
--random points of `bench planner-properties`' sweep: profile i = random_profile(seed + i), a
model and a micro-batch, drawn from random.Random(--seed). CPU times are printed beside them
(process time; scripts/planning_time.py is the side-by-side timing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planning_time import PAPER, PAPER_HW, POINTS, resolve_paper_point  # noqa: E402

ONE_SSD_HW = os.path.join(PAPER, "rtx4090-1ssd.hardware.json")
PAPER_POINTS = POINTS + [
    (PAPER_HW, "175b", 8, "ds_config_clip_g4.json"),
    (ONE_SSD_HW, "13b", 32, "ds_config_g4.json"),
]
MODELS = ("gpt3-13b", "llama-7b")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
PROFILES = 32  # the long sweep's (`bench planner-properties --profiles 32`)


def random_points(seed: int, n: int) -> list[tuple[int, str, int]]:
    rng = random.Random(seed)
    return [(seed + rng.randrange(PROFILES), rng.choice(MODELS), rng.choice(BATCHES)) for _ in range(n)]


def _row(label: str, r, took: float) -> dict:
    p = r.plan
    d = r.deferred_estimate
    return {"point": label, "cpu_s": took, "plan": repr(p), "notes": list(p.notes), "step_s": r.estimate.step_s,
            "deferred_s": d.step_s if d is not None else None, "window_s": [list(x) for x in p.window_s]}  # fmt: skip


def worker(seed: int, n: int) -> None:
    """Plans every point with the offloadpp on PYTHONPATH; one JSON line per point on stdout."""
    from offloadpp.bench.planner_properties import plan_point, random_profile
    from offloadpp.planner import InfeasibleError

    for hw_path, name, batch, config in PAPER_POINTS:
        label = f"{os.path.basename(hw_path).split('.')[0]} {name.upper()} b{batch} {config}"
        try:
            r, cpu = resolve_paper_point(hw_path, name, batch, config)
        except InfeasibleError as e:
            print(json.dumps({"point": label, "refused": str(e)}), flush=True)
            continue
        print(json.dumps(_row(label, r, cpu)), flush=True)
    for profile, model, batch in random_points(seed, n):
        hw, dtype = random_profile(profile)
        label = f"profile {profile} {model} {dtype} b{batch}"
        p = plan_point(hw, model, batch, dtype)
        if p.step_s is None:
            print(json.dumps({"point": label, "refused": p.refused, "cpu_s": p.plan_cpu_s}), flush=True)
        else:
            print(json.dumps(_row(label, p.resolved, p.plan_cpu_s)), flush=True)


def _run(tree: str, seed: int, n: int) -> list[dict]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(seed), str(n)]
    out = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _close(a, b, rtol: float) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _counts_left_out(plan_repr: str) -> str:
    """A plan's repr but the search's note of how many candidates it replayed (a search that
    replays fewer to choose the same plan says so there: not a difference)."""
    return re.sub(r"best of \d+ candidates replayed, \d+ left out", "best of N candidates replayed, M left out",
                  plan_repr)  # fmt: skip


def differences(o: dict, t: dict, rtol: float) -> list[str]:
    """What differs between the other tree's row `o` and this tree's `t` of one point."""
    if "refused" in o or "refused" in t:
        return [] if o.get("refused") == t.get("refused") else ["refused by one tree only, or not alike"]
    out = []
    if _counts_left_out(o["plan"]) != _counts_left_out(t["plan"]):
        out.append("plan" if o["plan"].split("notes=")[0] != t["plan"].split("notes=")[0] else "plan notes")
    for k in ("step_s", "deferred_s"):
        if not _close(o[k], t[k], rtol):
            out.append(f"{k} {o[k]!r} / {t[k]!r}")
    ow, tw = dict(map(tuple, o["window_s"])), dict(map(tuple, t["window_s"]))
    if ow.keys() != tw.keys() or not all(_close(ow[k], tw[k], rtol) for k in ow):
        out.append(f"window_s {ow} / {tw}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", help="the other source tree (a checkout of another commit)")
    ap.add_argument("--random", type=int, default=40, help="points of the property sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other, this = _run(args.other, args.seed, args.random), _run(here, args.seed, args.random)
    print("| point | estimate s (other / this) | CPU s (other / this) | differences |")
    print("|---|---|---|---|")
    bad = 0
    rows = []
    for o, t in zip(other, this):
        diff = differences(o, t, args.rtol)
        bad += bool(diff)
        est = "refused" if "refused" in o else f"{o['step_s']:.6f} / {t.get('step_s', float('nan')):.6f}"
        cpu = f"{o.get('cpu_s', 0):.2f} / {t.get('cpu_s', 0):.2f}"
        print(f"| {o['point']} | {est} | {cpu} | {'; '.join(diff) or 'none'} |")
        rows.append({"point": o["point"], "other": o, "this": t, "differences": diff})
    print(f"{len(rows)} points, {bad} differ (rtol {args.rtol:g})")
    if len(other) != len(this):
        print(f"the trees planned {len(other)} and {len(this)} points")
        bad += 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"other": os.path.abspath(args.other), "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
