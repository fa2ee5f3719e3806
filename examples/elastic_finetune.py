"""Elastic fine-tuning: a DeepSpeed script that survives a rank's death under torchrun's agent.

    torchrun --nproc_per_node 2 --max-restarts 3 examples/elastic_finetune.py \
        --deepspeed_config ds.json --save ckpt --steps 100 --save-every 10
    scripts/multinode.sh --nodes 2 --root /tmp/nodes --bind NVME --max-restarts 1 -- \
        examples/elastic_finetune.py --deepspeed_config ds.json --save /shared/ckpt

What elasticity asks of the script is one line: `engine.load_checkpoint(save_dir)` before the
loop (it returns (None, None) when there is no checkpoint yet, so the first start and every
restart run the same code). When a rank dies (kill -9, OOM, an I/O error) the others fail in
their next collective within seconds (gloo's connection to the dead rank closes; a rank that
hangs instead is cut off by the process group's timeout, DEEPSPEED_TIMEOUT minutes under
DeepSpeed's init_distributed), torchrun's agent sees its worker fail (--monitor-interval, 0.1 s),
stops the group on every node and starts it again, and every rank resumes from `latest`. The
step counter comes back with the checkpoint, and the batch of each step depends on that step
alone, so a run that was interrupted ends bit for bit where an uninterrupted one ends
(scripts/elastic_trials.py checks it, `make elastic-trials`).

Without --deepspeed_config a tiny GPT-2 trains with every array on SSD under --nvme.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import offloadpp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    p.add_argument(
        "--nvme", default=os.path.join("runs", "elastic", "nvme"), help="swap folder (no config given)"
    )
    p.add_argument(
        "--save", required=True, help="checkpoint folder (shared by every node, or see --node-local)"
    )
    p.add_argument("--node-local", action="store_true",
                   help="(no config given) checkpoints on each node's own disk at --save: checkpoint.use_node_local_storage")  # fmt: skip
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of the whole run")
    p.add_argument("--save-every", type=int, default=3, help="a checkpoint every this many steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per step over every rank")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the final weights go to OUT/weights.pt (rank 0)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def tiny_gpt2(seed: int):
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def default_config(args, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme},
        },
        "offloadpp": {"enabled": True, "ssd_read_gbps": 2.0, "ssd_write_gbps": 2.0},
        "checkpoint": {"use_node_local_storage": args.node_local},
    }


def batch_of(step: int, args) -> torch.Tensor:
    """The global batch of `step`: a function of the step alone, so a resumed run sees the
    batches an uninterrupted one sees (a real script seeds its sampler by epoch the same way)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    return torch.randint(0, 128, (args.batch, args.seq_len), generator=g)


def say(line: str) -> None:
    """One write per line: the ranks share the launcher's stdout, and print's two writes (the
    text, then the newline) of two ranks can interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    config = args.deepspeed_config or default_config(args, world)
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    engine, *_ = offloadpp.initialize(model=tiny_gpt2(args.seed), config=config)

    path, _ = engine.load_checkpoint(args.save)  # the one line elasticity needs
    start = engine.global_steps
    say(f"elastic: rank {rank} attempt {attempt} pid {os.getpid()} at step {start} "
        f"({'resumed from ' + path if path else 'fresh'}) t={time.time():.3f}")  # fmt: skip

    for step in range(start, args.steps):
        x = batch_of(step, args).chunk(world)[rank]  # this rank's part of the global batch
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        say(f"elastic: rank {rank} attempt {attempt} done step {step + 1} t={time.time():.3f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            engine.save_checkpoint(args.save, tag=f"step{step + 1}")

    state = engine.module_state_dict()  # a collective: every rank gathers every unit
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.clone() for k, v in state.items()}, os.path.join(args.out, "weights.pt"))
    engine.close()


if __name__ == "__main__":
    main()
