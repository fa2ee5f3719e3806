"""Hugging Face Trainer and Accelerate, unchanged, on offloadpp's engine through
`offloadpp.patch_deepspeed()` and a ZeRO-Infinity config with the `offloadpp` block.

Each run is the same training with and without DeepSpeed: Trainer's own AdamW with its two param
groups (weight decay on matrices only), a linear warm-up schedule, max_grad_norm 1.0, gradient
accumulation 2 over an epoch of 7 micro-batches (so the last window is 1 micro-batch, ended by
Trainer rather than by the count). The weights must end within 1e-5 of the run without
DeepSpeed, with the training state on disk. Each run is a process of its own
(tests/hf_trainer_run.py: Trainer and Accelerate keep process-wide state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import compare_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
LR = 3e-3


def zero_infinity(nvme: Path) -> dict:
    nvme.mkdir(parents=True, exist_ok=True)
    off = {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "offload_param": dict(off, buffer_count=5, buffer_size=1e8),
            "offload_optimizer": dict(off),
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8},
        "offloadpp": {"enabled": True},
    }


def run(tmp: Path, name: str, **spec) -> tuple[dict, dict]:
    spec = {"out": str(tmp / name), "steps": 4, "gas": 2, "samples": 14, "deepspeed": None,
            "weights": str(tmp / f"{name}.pt"), **spec}  # fmt: skip
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(k, None)  # plain `python train.py`, as a user starts it
    # runner "offloadpp": under `python -m offloadpp run` (the unchanged script, patched by the runner)
    runner = ["-m", "offloadpp", "run"] if spec.get("runner") == "offloadpp" else []
    p = subprocess.run(
        [sys.executable, *runner, str(HERE / "hf_trainer_run.py"), str(tmp / f"{name}.json"), str(tmp / f"{name}.out")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((tmp / f"{name}.out").read_text()), torch.load(spec["weights"])


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_trainer_on_offloadpp_ends_with_the_weights_of_plain_trainer(tmp_path, model):
    plain, want = run(tmp_path, "plain", model=model)
    ours, got = run(tmp_path, "ours", model=model, deepspeed=zero_infinity(tmp_path / "nvme"))
    assert plain["engine"] != "OffloadppEngine" and ours["engine"] == "OffloadppEngine"
    assert ours["groups"] == 2 and ours["state_on_ssd"] and ours["disk_bytes"] > 0
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert compare_weights(got, want, lr=LR, steps=4) < 1e-5


def test_trainer_windows_run_vertically_and_end_with_the_weights_of_plain_trainer(tmp_path):
    """gradient_accumulation_steps 8, max_grad_norm 1.0, dropout 0.1, 22 micro-batches (windows
    of 8, 8 and a last one of 6 that Trainer ends), the config's offloadpp block asking for
    vertical windows: the unchanged Trainer runs each window whole
    (integrations/deepspeed/trainer_window.py), the first horizontally (it records the RNG
    tape), the next two vertically, and ends within 1e-5 of the plain Trainer."""
    ds = zero_infinity(tmp_path / "nvme")
    ds["offloadpp"]["accumulation"] = "vertical"
    spec = {"gas": 8, "steps": 3, "samples": 44, "dropout": 0.1}
    plain, want = run(tmp_path, "plain", model="gpt2", **spec)
    ours, got = run(tmp_path, "ours", model="gpt2", deepspeed=ds, runner="offloadpp", **spec)
    assert ours["engine"] == "OffloadppEngine" and ours["windows_vertical"] == [False, True, True]
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert compare_weights(got, want, lr=LR, steps=3) < 1e-5


def test_trainer_checkpoint_resume_and_save_model(tmp_path):
    ds = zero_infinity(tmp_path / "nvme")
    straight, want = run(tmp_path, "straight", model="gpt2", deepspeed=ds, save_steps=2,
                         save_model=str(tmp_path / "final"))  # fmt: skip
    ckpt = tmp_path / "straight" / "checkpoint-2"
    assert (ckpt / "latest").read_text() == "global_step2"
    ds2 = zero_infinity(tmp_path / "nvme2")  # a fresh swap directory: everything comes from the checkpoint
    _, got = run(tmp_path, "resumed", model="gpt2", deepspeed=ds2, resume=str(ckpt))
    assert max(((got[k] - want[k]).abs().max()).item() for k in want) == 0.0

    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"), local_files_only=True)
    assert compare_weights(loaded.state_dict(), want, lr=LR, steps=4) == 0.0
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_accelerate_loop_on_offloadpp_matches_plain_accelerate(tmp_path):
    plain, want = run(tmp_path, "plain", model="llama", loop="accelerate")
    ours, got = run(
        tmp_path, "ours", model="llama", loop="accelerate", deepspeed=zero_infinity(tmp_path / "nvme")
    )
    assert ours["engine"] == "OffloadppEngine"
    assert compare_weights(got, want, lr=LR, steps=4) < 1e-5


def test_trainer_with_the_configs_optimizer_and_scheduler_blocks(tmp_path):
    """The other way Trainer configs are written: optimizer and scheduler blocks with "auto"
    values, which Trainer fills; DeepSpeed's WarmupDecayLR then drives the engine's optimizer."""
    ds = zero_infinity(tmp_path / "nvme")
    ds["optimizer"] = {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    }
    ds["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                       "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_type": "linear"}}  # fmt: skip
    ours, _ = run(tmp_path, "ours", model="llama", deepspeed=ds)
    assert (
        ours["engine"] == "OffloadppEngine" and ours["scheduler"] == "WarmupDecayLR" and ours["groups"] == 1
    )
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = WarmupDecayLR(opt, total_num_steps=4, warmup_min_lr=0, warmup_max_lr=LR, warmup_num_steps=2,
                          warmup_type="linear")  # fmt: skip
    want = []
    for _ in range(4):  # the engine steps it with each optimizer step, before Trainer reads the lr
        sched.step()
        want.append(sched.get_last_lr()[0])
    assert ours["lrs"] == pytest.approx(want)


def _logits_of(folder: Path, kind: str) -> torch.Tensor:
    from hf_trainer_run import LOGITS_INPUT

    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    model = cls.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=LOGITS_INPUT).logits


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_save_model_streams_where_the_whole_state_dict_would_not_fit(tmp_path, loop):
    """Trainer.save_model and Accelerator.save_model on an offloadpp engine write the folder unit
    by unit; Accelerate's get_state_dict, which would build the whole dict, refuses naming them."""
    kind = "llama" if loop == "trainer" else "gpt2"
    out = tmp_path / "final"
    ours, _ = run(tmp_path, "ours", model=kind, loop=loop, deepspeed=zero_infinity(tmp_path / "nvme"),
                  save_model=str(out), small_memory=True)  # fmt: skip
    assert (
        ours["get_state_dict"].startswith("WeightsDoNotFitError")
        and "save_16bit_model(dir)" in ours["get_state_dict"]
    )
    if loop == "accelerate":  # max_shard_size 20KB: shards and an index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    assert torch.equal(_logits_of(out, kind), torch.tensor(ours["logits"]))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_trainer_with_lora_under_offloadpp_run_matches_plain_trainer(tmp_path, model):
    """peft's LoRA through Trainer under `python -m offloadpp run` with a ZeRO-Infinity config and
    the offloadpp block, 20 steps: the plain Trainer + peft run's weights within 1e-5, the frozen
    base unchanged; save_model writes the adapters, which PeftModel.from_pretrained loads
    (docs/frozen.md; tests/test_peft.py checks the base's swap files byte for byte)."""
    peft = pytest.importorskip("peft")
    from hf_trainer_run import build_model

    spec = {"model": model, "lora": True, "steps": 20, "gas": 1, "samples": 40}
    plain, want = run(tmp_path, "plain", **spec)
    ds = zero_infinity(tmp_path / "nvme")
    ours, got = run(
        tmp_path, "ours", runner="offloadpp", deepspeed=ds, save_model=str(tmp_path / "adapters"), **spec
    )
    assert ours["engine"] == "OffloadppEngine" and ours["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert compare_weights(got, want, lr=LR, steps=20) < 1e-5
    frozen = {k for k, v in got.items() if "lora_" not in k}
    assert all(torch.equal(got[k], want[k]) for k in frozen if "weight" in k or "bias" in k)
    loaded = peft.PeftModel.from_pretrained(build_model(model), str(tmp_path / "adapters"))
    lsd = loaded.state_dict()
    lora = [k for k in got if "lora_" in k]
    assert lora and all(torch.equal(lsd[k], got[k]) for k in lora)
