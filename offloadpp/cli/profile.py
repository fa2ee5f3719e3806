"""`offloadpp profile`: measure this machine (and optionally a model) for the planner.

    offloadpp profile --dir /nvme0/swap [--dir /nvme1/swap] [--json hardware.json]
    offloadpp profile --dir /nvme0/swap --model gpt2-45m --model-json model.json

The hardware profile goes to --json, else to the cache the planner reads by default
(offloadpp.planner.default_profile_path()). With --model the model is profiled too (one
profiling iteration plus a few timed ones) and its GEMM shapes are used for the FLOP/s.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", action="append", dest="dirs", metavar="DIR", required=True,
                   help="swap directory to measure (repeatable: one per SSD); must exist")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the hardware profile here (default: the cache)")
    p.add_argument("--size-mb", type=int, default=256, help="MiB moved per SSD measurement (default 256)")
    p.add_argument("--no-io-grid", action="store_true", help="skip the block size / queue depth grid")
    p.add_argument(
        "--adam-threads", type=int, default=1, help="Adam threads the runtime will use (default 1)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="shorter timing loops (noisier numbers)")
    p.add_argument("--model", help="also profile this model: preset name, HF model dir or config.json")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="with --model (default: the preset's, else 1)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="with --model (default: the preset's, else 512)")
    p.add_argument("--model-json", metavar="PATH", help="with --model: write the model profile here")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from offloadpp.planner import default_profile_path
    from offloadpp.profiling.hardware import profile_hardware

    if args.threads:
        torch.set_num_threads(args.threads)
    model_profile = None
    if args.model:
        from transformers import AutoConfig, AutoModelForCausalLM

        from offloadpp.presets import hf_config_dict
        from offloadpp.profiling.model import profile_model

        cfg, preset = hf_config_dict(args.model)
        mb = args.micro_batch or (preset.micro_batch if preset else 1)
        seq = args.seq_len or (preset.seq_len if preset else 512)
        label = args.model
        cfg.pop("transformers_version", None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        ids = torch.randint(0, int(cfg.get("vocab_size", 256)), (mb, seq))
        _log(
            f"profiling model {label}: {sum(p.numel() for p in model.parameters()):,} params, batch {mb}x{seq}"
        )
        model_profile = profile_model(model, {"input_ids": ids, "labels": ids}, name=label)
        print(model_profile.describe())
        if args.model_json:
            model_profile.to_json(args.model_json)
            _log(f"model profile written to {args.model_json}")
        del model
    hw = profile_hardware(
        args.dirs,
        gemms=model_profile.gemms if model_profile is not None else None,
        total_bytes=args.size_mb << 20,
        io_grid=not args.no_io_grid,
        adam_threads=args.adam_threads,
        quick=args.quick,
        log=_log,
    )
    print(hw.describe())
    out = args.json or default_profile_path()
    hw.to_json(out)
    _log(f"hardware profile written to {out} ({hw.measure_s:.1f} s)")
    return 0
