"""The ZeRO-Infinity side of tests/test_ds_import.py, in its own process (DeepSpeed's process
group and accelerator state are per process):

    python ds_import_worker.py SPEC.json OUT.pt

Trains a tiny GPT-2 or Llama on real DeepSpeed ZeRO stage 3 with parameters and optimizer on
NVMe for `first` steps, saves a checkpoint (tag "step{first}"), then a fresh DeepSpeed engine in
a fresh model loads it back and trains `then` more steps: its losses and final weights are the
reference an import into offloadpp must meet.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def ds_config(spec: dict, nvme: str) -> dict:
    os.makedirs(nvme, exist_ok=True)
    cfg = json.loads(json.dumps(spec["config"]))
    if spec.get("offload", "nvme") == "nvme":
        off = {"device": "nvme", "nvme_path": nvme, "pin_memory": False}
        cfg["zero_optimization"]["offload_param"] = dict(off, buffer_count=5, buffer_size=1e6)
        cfg["zero_optimization"]["offload_optimizer"] = dict(off)
    else:  # (ZeRO-3 with the state in CPU memory: the same checkpoint format, without NVMe)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def tiny(kind: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=96,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=32,
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


def weights(engine) -> dict:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def main(spec_path: str, out: str) -> int:
    import deepspeed

    with open(spec_path) as f:
        spec = json.load(f)
    first, then = spec["first"], spec["then"]
    data = batches(first + then)
    model = tiny(spec["model"], 0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(spec, os.path.join(spec["dir"], "nvme-a")))  # fmt: skip
    before = train(engine, data[:first])
    engine.save_checkpoint(spec["ckpt"], tag=f"step{first}", client_state={"epoch": 3})
    engine.destroy()

    model = tiny(spec["model"], 123)  # other weights: all must come from the checkpoint
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(spec, os.path.join(spec["dir"], "nvme-b")))  # fmt: skip
    path, client = engine.load_checkpoint(spec["ckpt"])
    assert path is not None and client["epoch"] == 3, (path, client)
    lr_at_load = engine.get_lr()
    after = train(engine, data[first:])
    torch.save({"before": before, "after": after, "weights": weights(engine), "lr_at_load": lr_at_load}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
