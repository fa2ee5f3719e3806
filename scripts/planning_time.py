"""Planning time of two source trees side by side: the resolve stage's CPU time per point, and
whether both trees plan the same (estimate and plan).

    python scripts/planning_time.py OTHER_TREE [--rounds 2] [--json out.json]

OTHER_TREE is a checkout of another commit (e.g. `git archive <commit> | tar -x -C /tmp/base`);
this tree is the second. Each round plans every point in a fresh process per tree, the trees
alternating, so both see the same load. Times are CPU (process) time: on a shared machine the
wall clock measures the neighbours. The points: GPT-3 13B b8-b128 and 175B b8-b32 on
docs/paper's profile (ds_config.json, fp16), their b8 with G = 4 (ds_config_g4.json), and 13B
b8-b48 on the data-sheet profile (docs/paper/rtx4090-datasheet.hardware.json), planned as
`offloadpp bench planner-scale` does (issue 36's bar: under 2 s for 13B and 175B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PAPER = os.path.join("docs", "paper")
PAPER_HW = os.path.join(PAPER, "rtx4090-12ssd.hardware.json")
DATASHEET_HW = os.path.join(PAPER, "rtx4090-datasheet.hardware.json")
POINTS = (
    [(PAPER_HW, "13b", b, "ds_config.json") for b in (8, 16, 32, 64, 128)]
    + [(PAPER_HW, "175b", b, "ds_config.json") for b in (8, 16, 32)]
    + [(PAPER_HW, "13b", 8, "ds_config_g4.json"), (PAPER_HW, "175b", 8, "ds_config_g4.json")]
    + [(DATASHEET_HW, "13b", b, "ds_config.json") for b in (8, 32, 48)]
)


def resolve_paper_point(hw_path: str, name: str, batch: int, config: str):
    """Plans one docs/paper point from nothing, as `offloadpp bench planner-scale` does (fp16,
    its sequence length): (the resolve result, its CPU seconds). Raises InfeasibleError where
    the point is refused. Imports offloadpp here: the workers run with a tree on PYTHONPATH."""
    import time

    from offloadpp.bench.planner_scale import SEQ_LEN, _settings
    from offloadpp.planner import HardwareProfile, analytic_profile, resolve
    from offloadpp.planner.peaks import clear_cache
    from offloadpp.planner.resolve import machine_for

    hw = HardwareProfile.from_json(hw_path)
    with open(os.path.join(PAPER, f"gpt3-{name}.config.json")) as f:
        cfg = json.load(f)
    prof = analytic_profile(cfg, micro_batch=batch, seq_len=SEQ_LEN, compute_dtype="fp16", name=name)
    settings = _settings(os.path.join(PAPER, config), "fp16", batch)
    clear_cache()  # from nothing, as `offloadpp plan` plans
    t0 = time.process_time()
    r = resolve(settings, prof.unit_specs(), machine_for(hw), hardware=hw, model=prof)
    return r, time.process_time() - t0


def worker() -> None:
    """Plans every point with the offloadpp on PYTHONPATH; one JSON line per point on stdout."""
    for hw_path, name, batch, config in POINTS:
        r, cpu = resolve_paper_point(hw_path, name, batch, config)
        p = r.plan
        plan = repr((p.placements, p.activations, p.prefetch_depth, p.optim_prefetch_depth, p.micro_batches))
        print(json.dumps({"point": _label(hw_path, name, batch, config), "cpu_s": cpu,
                          "step_s": r.estimate.step_s, "plan": plan}), flush=True)  # fmt: skip


def _label(hw_path: str, name: str, batch: int, config: str) -> str:
    g = " G=4" if "g4" in config else ""
    return f"{os.path.basename(hw_path).split('.')[0]} {name.upper()} b{batch}{g}"


def _run(tree: str) -> list[dict]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], cwd=here, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str]) -> int:
    if argv == ["--worker"]:
        worker()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", help="the other source tree (a checkout of another commit)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[list[dict]]] = {"other": [], "this": []}
    for _ in range(args.rounds):
        runs["other"].append(_run(args.other))
        runs["this"].append(_run(here))
    print("| point | estimate s (other / this) | same plan | CPU s, other | CPU s, this | this / other |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, first in enumerate(runs["other"][0]):
        o = [r[i] for r in runs["other"]]
        t = [r[i] for r in runs["this"]]
        oc, tc = statistics.median(x["cpu_s"] for x in o), statistics.median(x["cpu_s"] for x in t)
        same = all(x["plan"] == first["plan"] for x in o + t)  # (estimates shown beside it)
        rows.append({"point": first["point"], "step_s": [first["step_s"], t[0]["step_s"]], "same": same,
                     "cpu_s": [[x["cpu_s"] for x in o], [x["cpu_s"] for x in t]]})  # fmt: skip
        print(f"| {first['point']} | {first['step_s']:.4f} / {t[0]['step_s']:.4f} | {'yes' if same else 'no'} | "
              f"{oc:.2f} | {tc:.2f} | {tc / oc:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"other": os.path.abspath(args.other), "rounds": args.rounds, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
