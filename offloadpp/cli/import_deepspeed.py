"""`offloadpp import-deepspeed`: a ZeRO-Infinity run's checkpoint as an offloadpp checkpoint.

    offloadpp import-deepspeed DS_CHECKPOINT_DIR OUT_DIR --config ds_config.json --model MODEL [--tag T]
        [--universal]

DS_CHECKPOINT_DIR is DeepSpeed's save_dir (its `latest` names the tag; --tag picks another) or a
tag folder; a ZeRO stage 3 checkpoint (parameters and optimizer on NVMe or not), converted by
DeepSpeed's own ds_to_universal, or with --universal a universal folder already converted (its
`latest_universal` names it). OUT_DIR receives OUT_DIR/TAG, an offloadpp checkpoint, and
OUT_DIR/latest; the training run then calls engine.load_checkpoint(OUT_DIR).

The offloadpp checkpoint is laid out in the units of the engine that will load it, so the command
builds that engine: --config is the run's DeepSpeed JSON (its offloadpp block and nvme paths: the
engine takes them for the time of the import) and --model the model (a preset name, a Hugging Face
model directory or its config.json), built under offloadpp.Init. What carries over and what
does not: integrations/deepspeed/ds_import.py, docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ds_checkpoint_dir", help="DeepSpeed's save_dir (with `latest`) or one tag folder of it")
    p.add_argument("out_dir", help="where the offloadpp checkpoint goes (OUT_DIR/TAG and OUT_DIR/latest)")
    p.add_argument("--tag", default=None, help="the DeepSpeed tag (default: the one `latest` names)")
    p.add_argument(
        "--config", required=True, help="the training run's DeepSpeed JSON, with its offloadpp block"
    )
    p.add_argument("--model", required=True, help="preset name, Hugging Face model directory, or config.json")
    p.add_argument("--universal", action="store_true", help="DS_CHECKPOINT_DIR is a universal checkpoint")


def run(args: argparse.Namespace) -> int:
    from offloadpp.integrations.deepspeed import initialize
    from offloadpp.integrations.deepspeed.ds_import import import_checkpoint
    from offloadpp.integrations.deepspeed.zero_init import Init
    from offloadpp.presets import hf_config_dict
    from offloadpp.runtime.checkpoint import CheckpointError

    try:
        with open(args.config) as f:
            cfg = json.load(f)
        hf, _ = hf_config_dict(args.model)
    except (OSError, ValueError) as e:
        print(f"offloadpp import-deepspeed: {e}", file=sys.stderr)
        return 2
    cfg.setdefault("offloadpp", {})["enabled"] = True
    cfg.setdefault("checkpoint", {}).pop("load_universal", None)  # (this command reads the folder itself)
    engine = None
    try:
        with Init(config=cfg):
            model = _model(hf)
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
        os.makedirs(args.out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="import-", dir=engine.runtime.store.dirs[0]) as work:
            tag = import_checkpoint(engine, args.ds_checkpoint_dir, args.tag, args.out_dir, work,
                                    universal=args.universal)  # fmt: skip
        print(
            f"wrote {os.path.join(args.out_dir, tag)} (engine.load_checkpoint({args.out_dir!r}) resumes it)"
        )
        return 0
    except CheckpointError as e:
        print(f"offloadpp import-deepspeed: {e}", file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.close()


def _model(config: dict):
    """The causal LM of a Hugging Face config dict (built under offloadpp.Init: on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg.pop("transformers_version", None)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
