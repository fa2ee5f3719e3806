"""The `offloadpp` command: doctor, profile, plan, run, export, import-deepspeed, and the benchmarks (bench ...).

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
Only the module of the command being run is imported: `--help` stays fast, and one broken
benchmark cannot take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, help). Bench kinds are nested under `bench`.
COMMANDS = {
    "doctor": ("offloadpp.cli.doctor", "check the build, SIMD level, I/O backends, torch/deepspeed, CUDA"),
    "profile": (
        "offloadpp.cli.profile",
        "measure SSD, copy, GEMM and CPU Adam speeds for the planner",
    ),
    "plan": ("offloadpp.cli.plan", "print the plan and its step-time estimate for a config and model"),
    "run": ("offloadpp.cli.run", "run an unchanged DeepSpeed / Trainer / Accelerate script on offloadpp"),
    "export": (
        "offloadpp.cli.export",
        "a checkpoint's weights as a Hugging Face folder (sharded safetensors, config.json), streamed",
    ),
    "import-deepspeed": (
        "offloadpp.cli.import_deepspeed",
        "a ZeRO-Infinity (ZeRO-3) checkpoint as an offloadpp checkpoint: master weights, moments, steps, scheduler",
    ),
}
BENCHES = {
    "io": ("offloadpp.bench.io", "SSD read/write GB/s: offloadpp vs fio vs DeepSpeed aio"),
    "adam": ("offloadpp.bench.adam", "CPU Adam step: offloadpp vs DeepSpeedCPUAdam vs torch fused AdamW"),
    "step": ("offloadpp.bench.step", "training step with state on SSD vs plain torch in memory"),
    "capacity": ("offloadpp.bench.capacity", "a model whose training state exceeds RAM, peak RSS measured"),
    "activations": (
        "offloadpp.bench.activations",
        "step time with activations kept, on host, on SSD, recomputed",
    ),
    "ab": ("offloadpp.bench.ab", "the same model under ZeRO-Infinity and offloadpp, side by side"),
    "dp": ("offloadpp.bench.dp", "one rank against several (data parallel): step time and bytes per rank"),
    "planner-accuracy": (
        "offloadpp.bench.planner_accuracy",
        "the cost model's predicted step against measured steps, several configurations",
    ),
    "planner-grid": (
        "offloadpp.bench.planner_grid",
        "the automatic plan against hand-written plans, measured",
    ),
    "device-budget": (
        "offloadpp.bench.device_budget",
        "a seeded sweep of small models: the runtime's device use within the plan's budget, no pool wait",
    ),
    "planner-scale": (
        "offloadpp.bench.planner_scale",
        "estimates and planning time for GPT-3 13B/175B on the paper machine's profile",
    ),
    "planner-properties": (
        "offloadpp.bench.planner_properties",
        "the planner's properties (micro-batch, more resources, hand-written plans, time) over random profiles",
    ),
}


def _add(sub, name: str, module: str, help_: str, load: bool) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    if load:
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of the one command named in argv loaded."""
    words = [a for a in argv if not a.startswith("-")]
    parser = argparse.ArgumentParser(prog="offloadpp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_, load=words[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks (medians of repeats, peers measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        _add(bench_sub, name, module, help_, load=words[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `deepspeed --module offloadpp run train.py` starts `python -m offloadpp --local_rank=N run
    # train.py`: the launcher's argument belongs to the script, where it would have gone.
    launcher = [a for a in argv if a.startswith(("--local_rank", "--local-rank"))]
    if launcher and "run" in argv and argv.index(launcher[-1]) < argv.index("run"):
        argv = [a for a in argv if a not in launcher]
    else:
        launcher = []
    args = build_parser(argv).parse_args(argv)
    args.launcher_args = launcher
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
