"""`offloadpp run train.py ARGS`: an unchanged DeepSpeed, Trainer or Accelerate script on offloadpp.

Patches DeepSpeed (offloadpp.patch_deepspeed) and then runs the script as `python train.py ARGS`
would: as __main__, with sys.argv and sys.path[0] set the same way. Under a launcher:

    torchrun --nproc_per_node 1 -m offloadpp run train.py ARGS
    deepspeed --num_gpus 1 --module offloadpp run train.py ARGS

(the deepspeed launcher passes --local_rank=N before `run`; it is handed on to the script, where
the launcher would have put it). `-m package.module` runs a module instead of a file.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module, as python -m does")
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    from offloadpp.integrations.deepspeed import patch_deepspeed

    patch_deepspeed()
    script_args = list(getattr(args, "launcher_args", [])) + list(args.args)
    if args.module:
        sys.argv = [args.script, *script_args]
        runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        return 0
    if not os.path.isfile(args.script):
        print(f"offloadpp run: {args.script!r}: no such file", file=sys.stderr)
        return 2
    sys.argv = [args.script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")
    return 0
