"""The `offloadpp` command: doctor, bench io|adam|..., and later profile, plan, demo.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this file only wires them up, importing a module when its command runs so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, help). Bench kinds are nested under `bench`.
COMMANDS = {
    "doctor": ("offloadpp.doctor", "check the build, SIMD level, I/O backends, torch/deepspeed, CUDA"),
}
BENCHES = {
    "io": ("offloadpp.bench.io", "SSD read/write GB/s: offloadpp vs fio vs DeepSpeed aio"),
    "adam": ("offloadpp.bench.adam", "CPU Adam step: offloadpp vs DeepSpeedCPUAdam vs torch fused AdamW"),
}


def _add(sub, name: str, module: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    mod = importlib.import_module(module)
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offloadpp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_)
    bench = sub.add_parser("bench", help="benchmarks (medians of repeats, peers measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        _add(bench_sub, name, module, help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
