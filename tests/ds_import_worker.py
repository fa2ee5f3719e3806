"""The ZeRO-Infinity side of tests/test_ds_import.py, in its own process (DeepSpeed's process
group and accelerator state are per process):

    python ds_import_worker.py SPEC.json OUT.pt

Trains a small GPT-2 or Llama on real DeepSpeed ZeRO-Infinity (ZeRO stage 3, parameters and
optimizer on NVMe) for `first` steps, saves a checkpoint (tag "step{first}") and goes on `then`
more steps: those losses and final weights are the reference an import into offloadpp must meet.
Then a fresh DeepSpeed engine on other weights loads the checkpoint back and trains the same
steps (`resumed`: DeepSpeed 0.19.8's own resume, which differs; test_ds_import.py's Note), and
the same steps run on plain PyTorch (`pytorch`: the check that ZeRO-Infinity's run is sound).
"""

from __future__ import annotations

import json
import os
import sys

import torch

# ZeRO-Infinity as both sides of a comparison read it: parameters and optimizer on NVMe, and the aio
# block. (stage3_max_reuse_distance 0: DeepSpeed's NVMe parameter swapping runs on a CPU-only
# machine only so, upstream issue 3062; buffer_size: its default, 1e8 elements, would allocate
# 2 GB of buffers for these models; sub_group_size: several ZeRO sub-groups, those of 1 MiB and
# more on NVMe and the rest in memory, as DeepSpeed splits them.) nvme_path: each engine's own.
ZERO_INFINITY = {
    "stage": 3,
    "stage3_max_reuse_distance": 0,
    "sub_group_size": 300000,
    "offload_param": {
        "device": "nvme",
        "nvme_path": None,
        "pin_memory": False,
        "buffer_count": 5,
        "buffer_size": 1e6,
    },
    "offload_optimizer": {"device": "nvme", "nvme_path": None, "pin_memory": False},
}
AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip


def on_nvme(config: dict, nvme: str) -> dict:
    """The run's DeepSpeed JSON (ZeRO-Infinity: offload_param and offload_optimizer on NVMe) with
    both swap folders at `nvme`: each engine, DeepSpeed's or offloadpp's, gets a folder of its own
    and otherwise the same JSON (test_ds_import.CONFIG)."""
    os.makedirs(nvme, exist_ok=True)
    cfg = json.loads(json.dumps(config))
    for block in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][block]["nvme_path"] = nvme
    return cfg


def tiny(kind: str, seed: int):
    """A GPT-2 or a Llama small enough for a test, whose embeddings (and Llama's head) reach
    DeepSpeed's least aio size, 1 MiB (GPT-2's 4096 x 64, Llama's 2048 x 128 fp32): ZeRO-Infinity
    keeps smaller tensors and sub-groups in memory, so with a smaller model nothing would go to NVMe.

    Note: the Llama's width. Every Llama parameter is a multiple of 128 values (512 bytes), so each
    starts 512-byte aligned in its ZeRO sub-group. DeepSpeed 0.19.8 reads a swapped gradient back
    from NVMe straight into its sub-group's buffer at that offset, and its O_DIRECT read into an
    address that is not 512-byte aligned reads nothing and reports success
    (test_ds_import.test_deepspeed_aio_reads_nothing_into_a_misaligned_buffer): at width 64 the
    RMSNorm weights (64 values, 256 bytes) put the untied head's gradient off by 256 bytes, and
    ZeRO-Infinity itself trained the head on zeros and another sub-group's stale gradient from its
    first step with lr > 0 (departing from PyTorch by 3.5e-3 at step 3, 1.4e-2 at step 5), so its run
    was no reference. GPT-2's only swapped gradient (its embedding's) starts its sub-group."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=4096,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=2048, max_position_embeddings=32,
                                   attention_dropout=0.0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 16), generator=g) for _ in range(n)]


def train(engine, data) -> list[float]:
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def pytorch(spec: dict) -> list[float]:
    """The same steps on plain PyTorch (torch.optim.AdamW, DeepSpeed's WarmupDecayLR class, the
    config's settings): ZeRO-Infinity's losses must meet these, or its run is no reference."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    cfg = spec["config"]
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["scheduler"]["type"] == "WarmupDecayLR", cfg
    assert not cfg.get("gradient_clipping") and cfg.get("gradient_accumulation_steps", 1) == 1, cfg
    model = tiny(spec["model"], 0)
    o = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])  # fmt: skip
    sched = WarmupDecayLR(opt, **cfg["scheduler"]["params"])
    losses = []
    for ids in batches(spec["first"] + spec["then"]):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def weights(engine) -> dict:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def main(spec_path: str, out: str) -> int:
    import deepspeed

    from offloadpp.integrations.deepspeed.build import _without_shm_comm

    with open(spec_path) as f:
        spec = json.load(f)
    with _without_shm_comm():  # (its shared-memory all-reduce op is minutes to build, and moot for one rank)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    first, then = spec["first"], spec["then"]
    data = batches(first + then)
    model = tiny(spec["model"], 0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=on_nvme(spec["config"], os.path.join(spec["dir"], "nvme-a")))  # fmt: skip
    before = train(engine, data[:first])
    engine.save_checkpoint(spec["ckpt"], tag=f"step{first}", client_state={"epoch": 3})
    lr_at_save = engine.get_lr()
    after = train(engine, data[first:])  # the run going on past its checkpoint
    final = weights(engine)
    engine.destroy()

    model = tiny(spec["model"], 123)  # other weights: all must come from the checkpoint
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=on_nvme(spec["config"], os.path.join(spec["dir"], "nvme-b")))  # fmt: skip
    path, client = engine.load_checkpoint(spec["ckpt"])
    assert path is not None and client["epoch"] == 3, (path, client)
    resumed = {
        "lr_at_load": engine.get_lr(),
        "losses": train(engine, data[first:]),
        "weights": weights(engine),
    }
    torch.save(
        {
            "before": before,
            "after": after,
            "weights": final,
            "lr_at_save": lr_at_save,
            "resumed": resumed,
            "pytorch": pytorch(spec),
        },
        out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
