"""One rank of a data-parallel run, started by tests/test_distributed.py under torchrun or the
deepspeed launcher. Trains a tiny GPT-2 on this rank's part of each global batch and writes what
the test compares into OUT: the weights (rank 0), and per rank its swap files' bytes and reports.

    torchrun --nproc_per_node 2 tests/dp_worker.py OUT --nvme DIR [--api runtime|deepspeed] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_common import GLOBAL_BATCH, LR, WD, global_batches, tiny_gpt2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--api", choices=("runtime", "deepspeed"), default="runtime")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--budgets", default="")  # "DEVICE,HOST" bytes: room to keep units resident
    ap.add_argument("--save", default="")  # checkpoint folder: save after the steps
    ap.add_argument("--load", default="")  # checkpoint folder: load before the steps
    ap.add_argument("--from-step", type=int, default=0)  # the global step the batches start at
    ap.add_argument(
        "--export", default=""
    )  # (deepspeed api) save_16bit_model there, sharded; then the whole dict
    ap.add_argument("--local_rank", type=int, default=None)  # (the deepspeed launcher passes it)
    # The script starts torch.distributed itself, before offloadpp.initialize (many do).
    ap.add_argument("--own-group", action="store_true")
    # Ranks other than 0 read checkpoint manifests 2 s late: a save whose commit does not wait
    # for every rank's reads has rank 0 rename the folder under them (issue 25's race, made sure).
    ap.add_argument("--slow-readers", action="store_true")
    # Rank 1 kills itself (SIGKILL) in step N, between its forward and backward, first writing
    # the time into OUT/died (no launcher agent: the survivors must notice on their own).
    ap.add_argument("--die-at", type=int, default=0)
    # (deepspeed api) checkpoints to each node's own disk: "checkpoint": {"use_node_local_storage": true}
    ap.add_argument("--node-local", action="store_true")
    ap.add_argument("--freeze", action="store_true")  # dp_common.tiny_gpt2's frozen parameters
    ap.add_argument("--lora", action="store_true")  # dp_common.tiny_gpt2's peft LoRA model
    # each step one window of --accum micro-batches, run vertically where the tape allows:
    # train_batch (deepspeed api) or train_window (runtime api)
    ap.add_argument("--window", action="store_true")
    ap.add_argument("--monitor", default="")  # (deepspeed api) DeepSpeed's csv_monitor into this folder
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = tiny_gpt2(freeze=args.freeze, lora=args.lora)
    if args.own_group:
        torch.distributed.init_process_group("gloo")
    if args.slow_readers and rank != 0:
        import time

        from offloadpp.runtime import checkpoint as ckpt

        real = ckpt.read_manifest
        ckpt.read_manifest = lambda path: (time.sleep(2), real(path))[1]
    if args.api == "deepspeed":
        import offloadpp

        micro = GLOBAL_BATCH // world // args.accum
        cfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": args.accum,
            "gradient_clipping": args.clip,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": args.nvme},
                "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme},
            },
            "offloadpp": {"enabled": True, "ssd_read_gbps": 2.0, "ssd_write_gbps": 2.0},
        }
        if args.window:
            cfg["offloadpp"]["accumulation"] = "vertical"
        if args.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if args.node_local:
            cfg["checkpoint"] = {"use_node_local_storage": True}
        if args.monitor:
            cfg["csv_monitor"] = {"enabled": True, "output_path": args.monitor, "job_name": "job"}
        engine, *_ = offloadpp.initialize(model=model, config=cfg)
        runtime = engine.runtime
    else:
        from offloadpp.assemble import assemble_engine
        from offloadpp.optim import AdamHyper
        from offloadpp.planner import Settings
        from offloadpp.runtime import RuntimeConfig

        budgets = {}
        if args.budgets:
            budgets = dict(
                zip(("device_budget_bytes", "host_budget_bytes"), map(int, args.budgets.split(",")))
            )
        if args.window:
            budgets["accumulation"] = "vertical"
        settings = Settings(gradient_clipping=args.clip, gradient_accumulation_steps=args.accum,
                            compute_dtype=args.dtype, **budgets)  # fmt: skip
        cfg = RuntimeConfig(nvme_paths=[args.nvme], settings=settings, device="cpu", ssd_read_gbps=2.0,
                            ssd_write_gbps=2.0, log_every=0)  # fmt: skip
        engine = runtime = assemble_engine(model, cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    assert runtime.dp is not None and runtime.dp.world == world, (runtime.dp, world)
    if args.load:
        (engine.load_checkpoint(args.load) if args.api == "deepspeed" else runtime.load_state(args.load))
    reports, vertical, losses = [], [], []  # losses: this rank's each step, the mean of its micro-batches'
    for batch in global_batches(args.from_step + args.steps)[args.from_step :]:
        mine = batch.chunk(world)[rank]  # this rank's part of the global batch
        losses.append(0.0)
        if args.window:
            mbs = [{"input_ids": x, "labels": x} for x in mine.chunk(args.accum)]
            if args.api == "deepspeed":
                losses[-1] = float(engine.train_batch(iter(mbs)))
                vertical.append(engine.last_window.vertical)
                reports.append(engine.last_report.as_dict())
            else:
                w = runtime.train_window(mbs)
                vertical.append(w.vertical)
                reports.append(w.report.as_dict())
            continue
        for x in mine.chunk(args.accum):
            loss = engine(input_ids=x, labels=x).loss
            losses[-1] += float(loss.detach()) / args.accum
            if args.die_at and rank == 1 and len(reports) + 1 == args.die_at:
                import signal
                import time

                with open(os.path.join(args.out, "died"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            engine.backward(loss)
            r = engine.step()
        reports.append(r.as_dict() if args.api == "runtime" else engine.last_report.as_dict())
    if args.save:
        if args.api == "deepspeed":
            engine.save_checkpoint(args.save, tag="t")
        else:
            if rank == 0:
                os.makedirs(args.save)
            runtime.dp.barrier()
            runtime.save_state(args.save)
    export = {}
    if args.export:
        from offloadpp.integrations.deepspeed import export as ds_export
        from offloadpp.runtime import export as rt_export

        rt_export.DEFAULT_SHARD_BYTES = 40_000  # more than one shard
        engine.save_16bit_model(args.export)
        if rank == 0:
            model.config.save_pretrained(args.export)
        if rank == 1:  # one rank short of memory: every rank must refuse (none may wait in a gather)
            ds_export.memory_available = lambda: 1
        try:
            engine._zero3_consolidated_16bit_state_dict()
            export["whole_dict"] = "built"
        except ds_export.WeightsDoNotFitError:
            export["whole_dict"] = "refused"
    sd = runtime.module.state_dict()  # a collective: every rank gathers every unit
    # where the launcher put this rank (scripts/multinode.sh names the simulated node)
    node = {"node": os.environ.get("OFFLOADPP_SIM_NODE"), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "group_rank": os.environ.get("GROUP_RANK"),
            # what the deepspeed launcher (launcher/launch.py) adds: this node's rank and ranks
            "cross_rank": os.environ.get("CROSS_RANK"), "local_size": os.environ.get("LOCAL_SIZE")}  # fmt: skip
    info = {"rank": rank, "world": world, **node, "disk_bytes": runtime.disk_bytes(), "plan_ssd_bytes": runtime.plan.ssd_bytes(),
            "reports": reports, "losses": losses, "global_step": runtime.global_step, **export, "vertical": vertical,
            "resident": [p.weights.value for p in runtime.plan.placements]}  # fmt: skip
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    if rank == 0:
        torch.save({k: v.clone() for k, v in sd.items()}, os.path.join(args.out, "weights.pt"))
    (engine.close() if args.api == "deepspeed" else runtime.close())


if __name__ == "__main__":
    main()
