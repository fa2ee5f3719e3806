"""`offloadpp export`: a checkpoint's weights as a Hugging Face folder, after the job.

    offloadpp export CHECKPOINT_DIR OUT_DIR [--tag T] [--dtype bf16|fp16|fp32] [--shard-size 5GB]

CHECKPOINT_DIR is save_checkpoint's save_dir (the tag `latest` names is taken unless --tag) or a
tag folder itself. OUT_DIR gets sharded safetensors (model-0000k-of-0000N.safetensors with
model.safetensors.index.json; one model.safetensors when it fits one shard) and the config.json
save_checkpoint kept, which from_pretrained loads. No model code and no training script: all
comes from the checkpoint's manifest; one unit's fp32 master in memory at a time, the bound
printed first and refused past --max-memory (runtime/checkpoint_weights.py). The same as a dict
in Python: offloadpp.get_fp32_state_dict_from_checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_dir", help="save_checkpoint's save_dir (with `latest`), or a tag folder")
    p.add_argument("out_dir", help="the Hugging Face folder to write")
    p.add_argument("--tag", help="the checkpoint's tag (default: the one `latest` names)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="the weights' dtype (default: each parameter's own, the model's, as save_pretrained writes)",
    )
    p.add_argument("--shard-size", default="5GB", help="the largest shard (save_pretrained's max_shard_size)")
    p.add_argument(
        "--max-memory",
        help="refuse when the export's memory bound passes this (e.g. 4GiB; default: the memory available)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from offloadpp.integrations.deepspeed.config import parse_bytes
    from offloadpp.runtime.checkpoint import CheckpointError
    from offloadpp.runtime.checkpoint_weights import DTYPES, WeightsDoNotFitError, export_checkpoint

    try:
        shard = parse_bytes(args.shard_size)
        limit = parse_bytes(args.max_memory) if args.max_memory else None
    except ValueError as e:
        print(f"offloadpp export: {e}", file=sys.stderr)
        return 2
    if shard <= 0:
        print(f"offloadpp export: --shard-size must be positive, got {args.shard_size!r}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    try:
        res = export_checkpoint(
            args.checkpoint_dir,
            args.out_dir,
            tag=args.tag,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            max_shard_bytes=shard,
            max_memory_bytes=limit,
            progress=not args.no_progress,
            say=lambda s: print(s, file=sys.stderr, flush=True),
        )
    except (CheckpointError, WeightsDoNotFitError) as e:
        print(f"offloadpp export: {e}", file=sys.stderr)
        return 1
    weights = [f for f in res.files if f.endswith((".safetensors", ".index.json"))]
    print(
        f"offloadpp export: wrote {res.nbytes / 1e9:.2f} GB of weights in {len(weights)} file(s)"
        f"{'' if res.config else ' (no config.json)'} to {args.out_dir} in {time.perf_counter() - t:.1f} s"
    )
    return 0
